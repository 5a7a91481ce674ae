#!/usr/bin/env bash
# Installs what the build and tests need from Debian 12, skipping what is already there.
set -euo pipefail

packages=(
  cmake ninja-build g++ ccache git
  libtorch-dev          # libtorch 1.13 with c10d and ProcessGroupGloo
  libgloo-dev           # Gloo headers needed by ProcessGroupGloo.hpp
  libopenblas0-pthread  # fast fp32 matmul (the reference BLAS is ~20x slower)
  libgtest-dev libgmock-dev
  libcli11-dev          # command-line flags of hp-run and the examples
  nlohmann-json3-dev    # JSON: trace files
  zlib1g-dev            # crc32 of checkpoint shards
  libssl-dev            # SHA-256 of the state digest (tests/tools/state_digest)
  gnuplot-nox           # bench/plot_sweep.sh
  python3-torch python3-dev pybind11-dev python3-pytest  # the Python package and its tests (/usr/bin/python3)
  flake8                # the Python linter (lint_python: pyflakes's checks)
  clang-format clang-tidy  # lint_format and lint_tidy (Debian 12's: version 14, which both pin)
  python3-venv python3-setuptools python3-wheel        # pip install of the package into a venv over Debian's torch
  iproute2              # ip netns / tc, for benchmarks over a rate-limited link
)

missing=()
for p in "${packages[@]}"; do
  if ! dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed"; then
    missing+=("$p")
  fi
done
if ((${#missing[@]} == 0)); then
  echo "install_deps: all ${#packages[@]} packages present"
  exit 0
fi
sudo=""
if [[ $(id -u) -ne 0 ]]; then sudo="sudo"; fi
echo "install_deps: installing ${missing[*]}"
$sudo apt-get update -qq
DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq "${missing[@]}"
