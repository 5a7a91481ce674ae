#!/usr/bin/env bash
# Every tracked Python file passes flake8 (pyflakes: unused imports and names, undefined names;
# pycodestyle: layout), as .flake8 sets it up. Prints each finding as path:line:column code.
#   python.sh [REPO_ROOT]
set -euo pipefail
cd "${1:-$(dirname "$0")/../../..}"
mapfile -t files < <(git ls-files '*.py')
if ! /usr/bin/python3 -m flake8 "${files[@]}"; then
  echo "python.sh: flake8 found the above in ${#files[@]} files"
  exit 1
fi
echo "python.sh: ${#files[@]} files clean"
