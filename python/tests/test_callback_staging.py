"""The callback staging bound (wm_memory_config.callback_staging_limit) through the
Python binding: the ctypes mirrors of wm_config and its memory block must match the C layout, and
the kwarg must reach the library."""

import ctypes

import numpy as np
import pytest
from safetensors.numpy import save_file

from weight_manager import Manager, Result, WeightManagerError, _lib
from weight_manager._lib import LIB


def test_config_mirror_matches_the_c_layout():
    cfg = _lib.Config()
    LIB.wm_config_init(ctypes.byref(cfg))
    assert cfg.struct_size == ctypes.sizeof(_lib.Config)
    assert not cfg.memory  # NULL: the memory block's defaults
    mem = _lib.MemoryConfig()
    LIB.wm_memory_config_init(ctypes.byref(mem))
    assert mem.struct_size == ctypes.sizeof(_lib.MemoryConfig)
    assert mem.callback_staging_limit == 0  # 0: the 4 GiB default


def test_callback_tensors_over_the_limit_fail_before_staging(tmp_path):
    tensors = {"a": np.arange(3000, dtype=np.uint8), "b": np.arange(3000, dtype=np.uint8)}
    save_file(tensors, str(tmp_path / "model.safetensors"))
    (tmp_path / "version.yaml").write_text("step: 1\n")
    with Manager(model_dir=tmp_path, fallback_dir="", callback_staging_limit=4096) as m:
        # Atomic mode stages both at once: 6000 bytes, over 4096.
        with pytest.raises(WeightManagerError) as e:
            m.update(on_tensor=lambda name, arr: None)
        assert e.value.code == Result.ERR_OUT_OF_MEMORY
        assert "6000 bytes" in str(e.value), str(e.value)
        assert "callback_staging_limit of 4096 bytes" in str(e.value), str(e.value)
    with Manager(model_dir=tmp_path, fallback_dir="") as m:  # the 4 GiB default
        got = {}
        m.update(on_tensor=lambda name, arr: got.__setitem__(name, arr.copy()))
        np.testing.assert_array_equal(got["b"], tensors["b"])
