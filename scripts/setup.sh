#!/usr/bin/env bash
# Installs what the tests need on a fresh machine: cmake, Debian 12's UCX
# 1.13.1 (libucx0: only for the test that an old UCX is refused; the tests
# run on the libucx-cu12 wheel's UCX 1.22, see scripts/ucx_lib.sh),
# iproute2 (the network-namespace test), pkg-config as Debian packages, and
# a Python virtual environment in .venv with numpy, safetensors, pytest,
# PyTorch and libucx-cu12.
# Safe to run again: it skips what is already there.
set -euo pipefail
cd "$(dirname "$0")/.."

need_apt=()
command -v cmake >/dev/null 2>&1 || need_apt+=(cmake)
command -v c++ >/dev/null 2>&1 || need_apt+=(g++)
command -v nm >/dev/null 2>&1 || need_apt+=(binutils)
python3 -c 'import venv, ensurepip' >/dev/null 2>&1 || need_apt+=(python3-venv)
/sbin/ldconfig -p 2>/dev/null | grep -q 'libucp\.so\.0 ' || need_apt+=(libucx0)
command -v ip >/dev/null 2>&1 || need_apt+=(iproute2)
# pkg-config: the pkg-config consumer test builds a C engine with it alone.
command -v pkg-config >/dev/null 2>&1 || need_apt+=(pkg-config)
if [ ${#need_apt[@]} -gt 0 ]; then
  echo "setup: installing ${need_apt[*]}"
  SUDO=""
  [ "$(id -u)" -eq 0 ] || SUDO=sudo
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${need_apt[@]}" >/dev/null
fi

stamp=.venv/.requirements
if [ ! -f "$stamp" ] || ! cmp -s python/requirements-test.txt "$stamp"; then
  echo "setup: creating .venv with $(grep -v '^#' python/requirements-test.txt | tr '\n' ' ')"
  python3 -m venv .venv
  .venv/bin/python -m pip install -q --disable-pip-version-check -r python/requirements-test.txt
  cp python/requirements-test.txt "$stamp"
fi
