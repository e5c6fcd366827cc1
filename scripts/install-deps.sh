#!/usr/bin/env bash
# Installs attnkit's build and test dependencies from Debian's packages.
# Idempotent: installs only what is missing. Needs root (or sudo).
set -euo pipefail
pkgs=(build-essential cmake ninja-build pkg-config
      libgtest-dev libbenchmark-dev nlohmann-json3-dev libcli11-dev pybind11-dev libdnnl-dev
      libsimde-dev
      python3-dev python3-numpy python3-torch python3-matplotlib python3-pytest
      clang libclang-rt-14-dev clang-format
      libopenmpi-dev openmpi-bin python3-mpi4py)
missing=()
for p in "${pkgs[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if ((${#missing[@]})); then
  sudo_cmd=""
  [ "$(id -u)" -ne 0 ] && sudo_cmd="sudo"
  $sudo_cmd apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo_cmd apt-get install -y -qq --no-install-recommends "${missing[@]}"
fi
