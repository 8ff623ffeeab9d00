#!/usr/bin/env bash
# The GPU proof, on a machine with an NVIDIA GPU and driver but no package
# registry (and often no Rust toolchain).
#
#   scripts/gpu.sh pack   here, where cargo and pip work: build the GPU
#                         programs into gpu-kit/ (ignored by git; carry it)
#   scripts/gpu.sh        there: run every stage of the kit (or build
#                         first, when cargo and the crates are at hand)
#
# The kit holds compiled programs and libraries only: they load
# libcuda.so.1 (and UCX, NCCL) at run time. It carries the libraries of the
# libucx-cu13 wheel (UCX 1.22 built with CUDA, for gdr; WM_GPU_UCX_WHEEL
# names another wheel) and libweight_manager.so for the Python binding;
# the Python package itself travels with the working tree (python/).
#
# Stages (each runs even when an earlier one failed; the summary at the end
# names the failures and the exit status is 1 if any failed):
#   1. tests/gpu.rs: every path into device params, CUDA IPC between two
#      processes, library-owned clear/restore at identical addresses,
#      bad pointers and ordinals, the device page swap, rdma and gdr from
#      a `wm serve --net --gpu` trainer (WM_REQUIRE_GDR=1: gdr must run),
#      NCCL fan-out when two GPUs and NCCL are here;
#   2. tests/cuda.rs, tests/device_swap.rs, tests/fanout.rs (the NCCL
#      loader and meetings: WM_NCCL_LIB is pointed at the image's NCCL);
#   3. the FP8 quantizer against PyTorch's CUDA kernels, bit for bit
#      (the core crate's quant tests with WM_TEST_TORCH_DEVICE=cuda), and
#      its GPU kernels (compiled by NVRTC: WM_NVRTC_LIB is pointed at the
#      image's libnvrtc) against PyTorch's CPU reference bit for bit, then
#      tests/device_quant.rs: the kernels against the CPU quantizer, FP8
#      device params from a snapshot and from publishers, and GPU versions
#      quantized by their IPC publishers;
#   4. tests/device_deltas.rs: the GPU's XXH3-128 against the host's, and
#      deltas into device params from IPC and rdma publishers (in place on
#      the GPU, atomic through the host staging);
#   5. CUDA graphs across clear and update (python/tests/test_cuda_graphs.py);
#   6. `wm bench gpu`, `wm bench delta --gpu 0` (the update section:
#      deltas vs whole into device params) and `wm bench quant`'s update
#      section (FP8 over UCX and from a snapshot, on the host's many cores)
#      (WM_GPU_BENCH_GIB sets their size, 0 skips them).
# With $OUT set, the log goes to $OUT/gpu.log too. WM_GPU_ONLY (an extended
# regex) runs only the stages whose names it matches.
set -uo pipefail
cd "$(dirname "$0")/.."
kit=gpu-kit
ucx_wheel_default="libucx-cu13==1.22.0"

pack() {
    set -e
    rm -rf "$kit" && mkdir -p "$kit"
    local list
    cargo build --release --locked -p wm --features test-hooks
    cargo build --release --locked -p weight_manager --lib
    list=$(cargo test --release --locked --no-run --test gpu --test cuda --test device_swap --test fanout \
        --test device_quant --test device_deltas \
        --message-format=json 2>/dev/null |
        python3 -c 'import json,sys
for l in sys.stdin:
    m = json.loads(l)
    if m.get("reason") == "compiler-artifact" and m.get("executable") and m["target"]["kind"] == ["test"]:
        print(m["target"]["name"], m["executable"])')
    while read -r name exe; do
        cp "$exe" "$kit/test-$name"
    done <<<"$list"
    exe=$(cargo test --release --locked --no-run -p weight_manager_core --lib --message-format=json 2>/dev/null |
        python3 -c 'import json,sys
for l in sys.stdin:
    m = json.loads(l)
    if m.get("reason") == "compiler-artifact" and m.get("executable") and m["target"]["kind"] == ["lib"]:
        print(m["executable"])')
    cp "$exe" "$kit/test-core"
    cp target/release/wm target/release/libweight_manager.so "$kit/"
    # Debug info triples the size; the kit must fit the device's carry limit.
    if command -v strip >/dev/null; then strip --strip-debug "$kit"/*; fi
    pack_ucx
    ls -l "$kit"
    echo "gpu.sh pack: $(du -sh "$kit" | cut -f1) in $kit (the device's carry limit is 64 MiB)"
}

# The UCX libraries of the wheel (no static archives, tools or headers).
pack_ucx() {
    local tmp
    tmp=$(mktemp -d)
    if ! python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
        --implementation cp --platform manylinux_2_28_x86_64 -d "$tmp" \
        "${WM_GPU_UCX_WHEEL:-$ucx_wheel_default}"; then
        echo "gpu.sh: could not fetch the UCX wheel: the kit has no gdr" >&2
        rm -rf "$tmp"
        return 0
    fi
    mkdir -p "$kit/ucx"
    (cd "$kit/ucx" && unzip -q "$tmp"/*.whl 'libucx/lib/*.so.0' '*.libs/*' -x '*perftest*')
    rm -rf "$tmp"
}

failed=()
stage() {
    local name=$1
    shift
    # WM_GPU_ONLY (an extended regex): run only the stages it matches.
    if [ -n "${WM_GPU_ONLY:-}" ] && ! grep -qE -- "$WM_GPU_ONLY" <<<"$name"; then
        return 0
    fi
    echo
    echo "== $name"
    local t0=$SECONDS
    if "$@"; then
        echo "-- $name: passed ($((SECONDS - t0)) s)"
    else
        echo "-- $name: FAILED ($((SECONDS - t0)) s)"
        failed+=("$name")
    fi
}

graphs() {
    local py=${WM_PYTHON:-python3}
    PYTHONPATH="$PWD/python" WM_LIBRARY="$PWD/$kit/libweight_manager.so" \
        "$py" -m pytest -q -p no:cacheprovider python/tests/test_cuda_graphs.py -rs
}

# NVRTC: the PyTorch wheel's (nvidia-cuda-nvrtc), else the CUDA toolkit's.
nvrtc_lib() {
    "${WM_PYTHON:-python3}" - <<'PY' 2>/dev/null && return
import glob, os, sys
import nvidia
for d in nvidia.__path__:
    for p in sorted(glob.glob(os.path.join(d, "**", "libnvrtc.so*"), recursive=True)):
        if "builtins" not in p:
            print(p)
            sys.exit(0)
sys.exit(1)
PY
    ls /usr/local/cuda/lib64/libnvrtc.so* 2>/dev/null | grep -v builtins | head -1
}

nccl_lib() {
    "${WM_PYTHON:-python3}" - <<'PY' 2>/dev/null
import glob, os
import nvidia.nccl
for d in nvidia.nccl.__path__:
    for p in glob.glob(os.path.join(d, "lib", "libnccl.so*")):
        print(p)
        raise SystemExit
PY
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
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv 2>/dev/null
    if [ -f "$kit/ucx/libucx/lib/libucp.so.0" ]; then
        export WM_UCX_LIB="$PWD/$kit/ucx/libucx/lib/libucp.so.0" WM_REQUIRE_GDR=1
    fi
    local nccl
    nccl=$(nccl_lib)
    if [ -n "$nccl" ] && [ -z "${WM_NCCL_LIB:-}" ]; then export WM_NCCL_LIB="$nccl"; fi
    if [ -n "${WM_NCCL_LIB:-}" ]; then export WM_REQUIRE_NCCL=1; fi
    if [ -z "${WM_NVRTC_LIB:-}" ]; then
        WM_NVRTC_LIB=$(nvrtc_lib)
        export WM_NVRTC_LIB
    fi
    echo "WM_UCX_LIB=${WM_UCX_LIB:-} WM_NCCL_LIB=${WM_NCCL_LIB:-} WM_NVRTC_LIB=${WM_NVRTC_LIB:-}"
    export WM_BIN="$PWD/$kit/wm"
    stage "wm devices" "$kit/wm" devices
    stage "tests/gpu.rs" "$kit/test-gpu" --test-threads=1 --nocapture
    stage "tests/cuda.rs" "$kit/test-cuda" --test-threads=1
    stage "tests/device_swap.rs" "$kit/test-device_swap" --test-threads=1
    stage "tests/fanout.rs" "$kit/test-fanout" --test-threads=1 --nocapture
    stage "FP8 quantizer vs PyTorch CUDA" env WM_TEST_PYTHON="${WM_PYTHON:-python3}" \
        WM_TEST_TORCH_DEVICE=cuda CI=true "$kit/test-core" quant:: --test-threads=2
    stage "tests/device_quant.rs (FP8 kernels)" "$kit/test-device_quant" --test-threads=1 --nocapture
    stage "tests/device_deltas.rs (GPU deltas)" "$kit/test-device_deltas" --test-threads=1 --nocapture
    stage "CUDA graphs (python)" graphs
    local gib="${WM_GPU_BENCH_GIB:-4}"
    if [ "$gib" != 0 ]; then
        stage "wm bench gpu --gib $gib" env WM_PYTHON="${WM_PYTHON:-python3}" "$kit/wm" bench gpu --gib "$gib"
        stage "wm bench delta --gpu 0 --update-gib $gib" env UCX_TLS="${UCX_TLS:-tcp}" \
            "$kit/wm" bench delta --update-only --gpu 0 --update-gib "$gib" --runs 3
        stage "wm bench quant --update-gib $gib" env UCX_TLS="${UCX_TLS:-tcp}" \
            "$kit/wm" bench quant --gib 0 --update-gib "$gib" --runs 5
    fi
    echo
    if [ ${#failed[@]} -eq 0 ]; then
        echo "== GPU proof: every stage passed"
    else
        echo "== GPU proof: FAILED: ${failed[*]}"
        return 1
    fi
}

case "${1:-run}" in
    pack) pack ;;
    run)
        if [ -n "${OUT:-}" ]; then
            run 2>&1 | tee "$OUT/gpu.log"
        else
            run
        fi
        ;;
    *) echo "usage: scripts/gpu.sh [pack|run]" >&2; exit 2 ;;
esac
