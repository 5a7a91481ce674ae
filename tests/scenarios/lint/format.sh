#!/usr/bin/env bash
# Every tracked C++ file is formatted as .clang-format says (clang-format 14, the version the
# file pins). Prints the files that are not and how to fix them.
#   format.sh [REPO_ROOT]
set -euo pipefail
cd "${1:-$(dirname "$0")/../../..}"
major=$(clang-format --version | sed -E 's/.*version ([0-9]+).*/\1/')
if [[ $major != 14 ]]; then
  echo "format.sh: SKIP: clang-format $major is not the pinned 14 (its output differs between majors)"
  exit 77
fi
bad=()
while IFS= read -r f; do
  clang-format --dry-run --Werror "$f" >/dev/null 2>&1 || bad+=("$f")
done < <(git ls-files '*.cpp' '*.h')
if ((${#bad[@]})); then
  printf 'format.sh: not formatted (run clang-format -i on them):\n'
  printf '  %s\n' "${bad[@]}"
  exit 1
fi
echo "format.sh: $(git ls-files '*.cpp' '*.h' | wc -l) files formatted"
