#!/usr/bin/env bash
# Every library source (src/) passes clang-tidy 14 with .clang-tidy's checks (bugprone-*,
# performance-*), its own headers included. Prints each finding with its check's name.
#   tidy.sh REPO_ROOT BUILD_DIR [JOBS]
# clang-tidy reads BUILD_DIR/compile_commands.json, rewritten into BUILD_DIR/tidy/: without the
# precompiled header (gcc's, which clang cannot read; each file then parses only what it
# includes) and at -std=c++17, because clang 14 cannot compile libtorch 1.13's headers as C++20
# (it instantiates std::vector<c10::IValue>'s constexpr members while IValue is incomplete).
set -euo pipefail
root=$(cd "${1:?usage: tidy.sh REPO_ROOT BUILD_DIR [JOBS]}" && pwd)
build=$(cd "${2:?usage: tidy.sh REPO_ROOT BUILD_DIR [JOBS]}" && pwd)
# nproc without the tests' OMP_NUM_THREADS=1, which it would obey: the CPUs this process may use.
jobs=${3:-$(env -u OMP_NUM_THREADS -u OMP_THREAD_LIMIT nproc)}
if ! command -v clang-tidy >/dev/null || ! command -v run-clang-tidy >/dev/null; then
  echo "tidy.sh: SKIP: clang-tidy is not installed (scripts/install_deps.sh installs it)"
  exit 77
fi
major=$(clang-tidy --version | sed -nE 's/.*version ([0-9]+).*/\1/p')
if [[ $major != 14 ]]; then
  echo "tidy.sh: SKIP: clang-tidy $major is not the pinned 14 (its checks differ between majors)"
  exit 77
fi
[[ -f $build/compile_commands.json ]] || {
  echo "tidy.sh: expected $build/compile_commands.json (CMAKE_EXPORT_COMPILE_COMMANDS), got none"
  exit 1
}
mkdir -p "$build/tidy"
/usr/bin/python3 - "$build/compile_commands.json" "$build/tidy/compile_commands.json" "$root/src/" <<'PY'
import json, re, sys
source, target, src = sys.argv[1:]
entries = [e for e in json.load(open(source)) if e["file"].startswith(src)]
for e in entries:
    command = re.sub(r" -Winvalid-pch -include \S+cmake_pch\.hxx", "", e["command"])
    e["command"] = command.replace("-std=c++20", "-std=c++17").replace("-std=gnu++20", "-std=c++17")
if not entries:
    sys.exit(f"tidy.sh: expected sources of {src} in {source}, got none")
json.dump(entries, open(target, "w"), indent=1)
print(f"tidy.sh: {len(entries)} sources of {src}")
PY
log="$build/tidy/findings.txt"
status=0
# Every source the rewritten database lists (its own filter), whatever characters the path has.
run-clang-tidy -j "$jobs" -quiet -p "$build/tidy" >"$log" 2>&1 || status=$?
findings=$(sed 's/\x1b\[[0-9;]*m//g' "$log" | grep -E '^/.*: (warning|error): ' | sort -u || true)
if ((status != 0)) || [[ -n $findings ]]; then
  if [[ -n $findings ]]; then
    echo "$findings"
  else
    tail -n 40 "$log"
  fi
  echo "tidy.sh: clang-tidy found the above (whole output: $log)"
  exit 1
fi
echo "tidy.sh: clean"
