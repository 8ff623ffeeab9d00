"""Atomic updates through the Python binding: library-owned params take
each update by a page swap, so arrays the engine holds (and their
addresses) see the new bytes; with and without kept atomic staging, and
after a clear."""

from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import save_file

from weight_manager import Manager, State


def model(seed: int) -> dict:
    rng = np.random.default_rng(seed)
    return {
        # 3 MiB: several pages, not a multiple of 2 MiB.
        "big": rng.standard_normal((3 << 18,)).astype(np.float32),
        "small": rng.standard_normal((7,)).astype(np.float32),
    }


def snapshot(d: Path, tensors: dict, step: int) -> Path:
    d.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(d / "model_state.tp0.0.safetensors"))
    (d / "version.yaml").write_text(f"step: {step}\n")
    return d


@pytest.mark.parametrize("keep", [True, False])
def test_library_owned_params_keep_their_arrays_across_atomic_updates(tmp_path, keep):
    versions = [snapshot(tmp_path / f"v{s}", model(s), s) for s in (1, 2, 3)]
    with Manager(fallback_dir="", keep_atomic_staging=keep) as m:
        arrays = {n: m.allocate(n, t.dtype, t.shape) for n, t in model(1).items()}
        addresses = {n: a.ctypes.data for n, a in arrays.items()}
        for step, d in zip((1, 2), versions):
            m.update(d)
            for n, t in model(step).items():
                np.testing.assert_array_equal(arrays[n], t)
        m.clear()
        assert m.status().state == State.CLEARED
        m.update(versions[2])
        for n, t in model(3).items():
            np.testing.assert_array_equal(arrays[n], t)
        assert {n: a.ctypes.data for n, a in arrays.items()} == addresses
        assert m.status().version == "3"


def test_swap_device_params_leaves_host_params_as_they_were(tmp_path):
    # The device page swap touches only library-owned device params: with
    # none (and here no GPU), atomic updates of host params are unchanged.
    d = snapshot(tmp_path / "v1", model(1), 1)
    with Manager(fallback_dir="", swap_device_params=True) as m:
        arrays = {n: m.allocate(n, t.dtype, t.shape) for n, t in model(1).items()}
        m.update(d)
        for n, t in model(1).items():
            np.testing.assert_array_equal(arrays[n], t)
        assert m.status().state == State.NORMAL
