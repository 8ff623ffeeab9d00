#!/usr/bin/env bash
# Runs every test: Rust (unit + integration, header checks), C through
# CMake/ctest (plain, then AddressSanitizer + UBSan; with the pkg-config
# consumer), Python (pytest), and the pip-installable wheel.
# Installs what it needs first (scripts/setup.sh).
set -euo pipefail
cd "$(dirname "$0")/.."
root=$PWD
jobs=$(nproc 2>/dev/null || echo 2)

bash scripts/setup.sh

# No RDMA hardware here: the network tests run UCX over TCP on loopback.
export UCX_TLS=tcp
# Every network test (Rust, C, Python) runs against the libucx-cu12 wheel's
# UCX 1.22 in .venv; a WM_UCX_LIB already set (another UCX) wins.
WM_UCX_LIB=${WM_UCX_LIB:-$(bash scripts/ucx_lib.sh)}
export WM_UCX_LIB
echo "== UCX: $WM_UCX_LIB"

echo "== Rust tests"
# The integration tests drive `wm` (its own crate, so cargo does not build
# it for them): built first, with the test hooks they use.
cargo build --release --locked -p wm --features test-hooks
cargo test --release --locked

echo "== C tests (ctest)"
cmake -S . -B build -DWM_CARGO_TARGET_DIR="$root/target" >/dev/null
cmake --build build -j "$jobs"
ctest --test-dir build --output-on-failure -j "$jobs"

echo "== C tests with AddressSanitizer (ctest)"
cmake -S . -B build-asan -DWM_ASAN=ON -DWM_CARGO_TARGET_DIR="$root/target" >/dev/null
cmake --build build-asan -j "$jobs"
# UCX's memory-event hooks patch mmap/munmap, which breaks LeakSanitizer's
# exit-time scan; the sanitized run turns them off (the library does not need them).
UCX_MEM_EVENTS=no ctest --test-dir build-asan --output-on-failure -j "$jobs"

echo "== Python tests (pytest)"
WM_LIBRARY="$root/target/release/libweight_manager.so" .venv/bin/python -m pytest -q python/tests

echo "== Python package: wheel built with pip, installed into a fresh venv (tests/wheel/run.sh)"
bash tests/wheel/run.sh "$root/.venv/bin/python"

echo "== all tests passed"
