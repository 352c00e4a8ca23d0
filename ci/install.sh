#!/usr/bin/env bash
# Sourced by ci/test and ci/demo: makes .venv with keras_cct and everything its tests, demo and
# benchmarks need, on a fresh machine. Re-installs when pyproject.toml changed since the last
# install (a stamp in .venv). System part: PoCL, a CPU OpenCL platform (Debian's build: pip's
# pocl-binary-distribution cannot compile kernels on these CPUs).
set -euo pipefail

cct_install_system() {
  if ls /etc/OpenCL/vendors/pocl*.icd >/dev/null 2>&1; then return 0; fi
  local sudo=""
  if [ "$(id -u)" != 0 ]; then
    if command -v sudo >/dev/null 2>&1; then sudo="sudo"; else
      echo "ci/install: PoCL is missing and this user cannot apt-get install it;" \
           "OpenCL tests will be skipped (install pocl-opencl-icd)" >&2
      return 0
    fi
  fi
  echo "ci/install: installing PoCL (pocl-opencl-icd) with apt-get" >&2
  $sudo apt-get update -q >/dev/null
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -q --no-install-recommends \
    pocl-opencl-icd ocl-icd-libopencl1 >/dev/null
}

cct_install_python() {
  local stamp_file=.venv/.cct-install-stamp
  local stamp
  stamp=$(cat pyproject.toml ci/install.sh | sha256sum | cut -d' ' -f1)
  if [ -x .venv/bin/python ] && [ "$(cat "$stamp_file" 2>/dev/null)" = "$stamp" ]; then
    return 0
  fi
  echo "ci/install: installing keras_cct and its dependencies into .venv" >&2
  [ -x .venv/bin/python ] || python3 -m venv .venv
  .venv/bin/python -m pip install -q --upgrade pip
  # torch==2.13.0 is the CPU build (a plain 'torch' would pull a multi-GB CUDA build).
  .venv/bin/python -m pip install -q -e ".[all,test]" "jax[cpu]>=0.4.30" "torch==2.13.0"
  echo "$stamp" > "$stamp_file"
}

cct_install_system
cct_install_python
export PATH="$PWD/.venv/bin:$PATH"
export OCL_ICD_VENDORS="${OCL_ICD_VENDORS:-/etc/OpenCL/vendors}"
