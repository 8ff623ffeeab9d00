"""Run by tests/wheel/run.sh with the fresh environment's python, from outside
the tree and without WM_LIBRARY: the installed package loads the library
bundled in it and updates a param from a safetensors snapshot.
usage: check_install.py SNAPSHOT_DIR CARGO_VERSION"""

import importlib.metadata
import sys
from pathlib import Path

import numpy as np
from safetensors.numpy import save_file

import weight_manager
from weight_manager import Manager, _lib

snapshot, cargo_version = Path(sys.argv[1]), sys.argv[2]
package_dir = Path(weight_manager.__file__).resolve().parent
loaded = Path(_lib.LIB._name).resolve()
assert loaded == package_dir / "libweight_manager.so", f"loaded {loaded}, not the copy bundled in {package_dir}"
assert Path(sys.prefix) in package_dir.parents, f"{package_dir} is not inside the environment {sys.prefix}"

versions = {"Cargo.toml": cargo_version, "package metadata": importlib.metadata.version("weight_manager"),
            "library": weight_manager.version()}
assert len(set(versions.values())) == 1, f"versions disagree: {versions}"

w = np.arange(64 * 32, dtype=np.float32).reshape(64, 32) * 0.5
snapshot.mkdir()
save_file({"layer.w": w}, str(snapshot / "model_state.tp0.0.safetensors"))
(snapshot / "version.yaml").write_text("step: 7\n")

with Manager(model_dir=snapshot, fallback_dir="") as m:
    param = np.zeros_like(w)
    m.register("layer.w", param)
    stats = m.update()
    assert (stats.version, stats.tensors, stats.bytes) == ("7", 1, w.nbytes), stats
    assert param.tobytes() == w.tobytes(), "the registered param does not hold the snapshot's bytes"
print(f"wheel test: {loaded} updated layer.w to version {stats.version} ({stats.bytes} bytes)")
