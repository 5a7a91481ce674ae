#!/usr/bin/env bash
# Every HP_* environment variable the code reads is in the table of docs/environment.md: C++
# getenv("HP_...") / env("HP_..."), Python os.environ / os.getenv, and shell ${HP_...}.
#   environment_table.sh [REPO_ROOT]
set -euo pipefail
cd "${1:-$(dirname "$0")/../../..}"
read_vars=$(git grep -h -o -E '(getenv|env)\("HP_[A-Z0-9_]+"|environ(\.get)?[[(]"HP_[A-Z0-9_]+"|\$\{HP_[A-Z0-9_]+' \
  -- '*.cpp' '*.h' '*.py' '*.sh' | grep -o -E 'HP_[A-Z0-9_]+' | sort -u)
missing=()
for v in $read_vars; do
  grep -q "\`$v\`" docs/environment.md || missing+=("$v")
done
if ((${#missing[@]})); then
  echo "environment_table.sh: read by the code but missing from docs/environment.md: ${missing[*]}"
  exit 1
fi
echo "environment_table.sh: all $(echo "$read_vars" | wc -w) HP_* variables the code reads are documented"
