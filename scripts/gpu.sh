#!/usr/bin/env bash
# The GPU suite, on a machine with an NVIDIA GPU and driver but no package
# registry (and often no Rust toolchain).
#
#   scripts/gpu.sh pack   here, where cargo works: build the GPU test
#                         programs into gpu-kit/ (ignored by git; carry it)
#   scripts/gpu.sh        there: run the kit (or build first, when cargo and
#                         the crates are at hand)
#
# The kit holds compiled programs only: they load libcuda.so.1 (and UCX,
# when present) at run time, so nothing else needs to travel. Runs the GPU
# test suite (tests/gpu.rs: every path into device params, CUDA IPC between
# two processes, library-owned clear/restore at identical addresses, bad
# pointers and ordinals, the device page swap, NCCL fan-out when two GPUs
# and NCCL are here), the stub-driver checks (tests/cuda.rs), the device
# page swap's failure ordering on a test-only driver (tests/device_swap.rs),
# the NCCL loader and meetings
# (tests/fanout.rs), `wm
# devices`, and the GPU benchmark (`wm bench gpu`; WM_GPU_BENCH_GIB sets its
# size, 0 skips it).
set -euo pipefail
cd "$(dirname "$0")/.."
kit=gpu-kit

pack() {
    rm -rf "$kit" && mkdir -p "$kit"
    local list
    list=$(cargo test --release --locked --no-run --test gpu --test cuda --test device_swap --test fanout \
        --message-format=json 2>/dev/null |
        python3 -c 'import json,sys
for l in sys.stdin:
    m = json.loads(l)
    if m.get("reason") == "compiler-artifact" and m.get("executable") and m["target"]["kind"] == ["test"]:
        print(m["target"]["name"], m["executable"])')
    while read -r name exe; do
        cp "$exe" "$kit/test-$name"
    done <<<"$list"
    cargo build --release --locked --bin wm
    cp target/release/wm "$kit/wm"
    # Debug info triples the size; the kit must fit the device's carry limit.
    if command -v strip >/dev/null; then strip --strip-debug "$kit"/*; fi
    ls -l "$kit"
}

run() {
    if [ ! -x "$kit/test-gpu" ]; then
        command -v cargo >/dev/null || {
            echo "gpu.sh: no $kit/ and no cargo: run 'scripts/gpu.sh pack' on a build machine and carry $kit/" >&2
            exit 2
        }
        pack
    fi
    nvidia-smi -L 2>/dev/null || echo "(nvidia-smi not found)"
    echo "== wm devices"
    "$kit/wm" devices
    # tests/cuda.rs finds the wm binary next to itself when WM_BIN is set.
    echo "== tests/gpu.rs"
    WM_BIN="$PWD/$kit/wm" "$kit/test-gpu" --test-threads=1 --nocapture
    echo "== tests/cuda.rs"
    WM_BIN="$PWD/$kit/wm" "$kit/test-cuda" --test-threads=1
    echo "== tests/device_swap.rs"
    "$kit/test-device_swap" --test-threads=1
    echo "== tests/fanout.rs"
    "$kit/test-fanout" --test-threads=1
    echo "== GPU suite passed"
    local gib="${WM_GPU_BENCH_GIB:-4}"
    if [ "$gib" != 0 ]; then
        echo "== wm bench gpu --gib $gib"
        "$kit/wm" bench gpu --gib "$gib"
    fi
}

case "${1:-run}" in
    pack) pack ;;
    run) run ;;
    *) echo "usage: scripts/gpu.sh [pack|run]" >&2; exit 2 ;;
esac
