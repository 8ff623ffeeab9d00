"""Builds the weight_manager wheel: the Python package (python/weight_manager),
the Rust shared library bundled inside it (weight_manager/libweight_manager.so,
loaded by ctypes) and the `wm` command (installed into the environment's bin).

The backend is setuptools-rust in its no-binding mode: cargo builds the cdylib
(`cargo rustc --lib --release --locked`) and `wm` (RustBin, `cargo build
--bin wm`), and setuptools packages both. Chosen over maturin because one
wheel must carry both a plain cdylib for ctypes and an executable, which
setuptools-rust does side by side; maturin builds one kind of binding per
wheel (pyo3, cffi, uniffi or bin), none of them a bare cdylib for ctypes. The version comes from Cargo.toml, the one source of truth.
python/setup.py runs this file so that `pip install ./python` builds the same
wheel.
"""

import atexit
import os
import re
import shutil
import tempfile
from pathlib import Path

from setuptools import setup
from setuptools.command.build_ext import build_ext
from setuptools.command.bdist_wheel import bdist_wheel
from setuptools_rust import Binding, RustBin, RustExtension

ROOT = Path(__file__).resolve().parent
LIBRARY = "weight_manager.libweight_manager"
CARGO_ARGS = ["--locked"]
# Cargo.toml's own crate types: setuptools-rust would otherwise pass
# `--crate-type cdylib` alone, a different build configuration of the same
# crate, and it and `cargo build` would rebuild the crate for each other.
LIBRARY_ARGS = [*CARGO_ARGS, "--crate-type", "cdylib,staticlib,rlib"]


def cargo_version() -> str:
    """The [package] version of Cargo.toml (no TOML parser on Python < 3.11)."""
    text = (ROOT / "Cargo.toml").read_text()
    package = re.search(r"^\[package\]\s*$(.*?)(?=^\[|\Z)", text, re.M | re.S)
    version = package and re.search(r'^version\s*=\s*"([^"]+)"', package.group(1), re.M)
    if not version:
        raise RuntimeError(f"no [package] version in {ROOT / 'Cargo.toml'}")
    return version.group(1)


def relative(path: Path) -> str:
    # setuptools wants paths relative to the directory it runs in (the root,
    # or python/ when built from there).
    return os.path.relpath(path, Path.cwd())


class BuildExt(build_ext):
    """Names the cdylib as the C library it is (libweight_manager.so), not as
    a CPython extension module (…cpython-311-x86_64-linux-gnu.so)."""

    def get_ext_filename(self, fullname):
        # Called with the full dotted name and, by get_ext_fullpath, with its last part.
        if fullname in (LIBRARY, LIBRARY.rsplit(".", 1)[1]):
            return os.path.join(*fullname.split(".")[:-1], "libweight_manager.so")
        return super().get_ext_filename(fullname)


class BdistWheel(bdist_wheel):
    """The library is loaded with ctypes, not as an extension module: one
    wheel serves every Python 3 on the platform (py3-none-<platform>)."""

    def get_tag(self):
        _, _, platform = super().get_tag()
        return "py3", "none", platform


def scratch_dir() -> str:
    """setuptools' build/ and egg-info go to a fresh temporary directory:
    build/ is CMake's here, and leftovers of an earlier build must not end up
    in the wheel."""
    path = tempfile.mkdtemp(prefix="weight_manager-setup-")
    atexit.register(shutil.rmtree, path, ignore_errors=True)
    return path


manifest = relative(ROOT / "Cargo.toml")
scratch = scratch_dir()
setup(
    name="weight_manager",
    version=cargo_version(),
    description="Swap new model weights into running inference engines (Python binding and the wm command)",
    license="Apache-2.0",
    python_requires=">=3.9",
    install_requires=["numpy"],
    # `pip install weight_manager[ucx]`: a current UCX (the libucx-cu12
    # wheel, 1.22 today) for the rdma and gdr paths, used by default once
    # installed (_lib.default_ucx). An extra, not a dependency: it is 43 MB
    # (140 MB installed) that IPC and snapshot users never load, and on RDMA
    # clusters the system's UCX is the one to use (the wheel is built without
    # InfiniBand verbs). The floor is the oldest UCX the library accepts.
    extras_require={"ucx": ["libucx-cu12>=1.14"]},
    package_dir={"": relative(ROOT / "python")},
    packages=["weight_manager"],
    rust_extensions=[
        RustExtension(LIBRARY, path=manifest, binding=Binding.NoBinding, args=LIBRARY_ARGS),
        RustBin("wm", path=relative(ROOT / "crates/wm/Cargo.toml"), args=["--bin", "wm", *CARGO_ARGS]),
    ],
    cmdclass={"build_ext": BuildExt, "bdist_wheel": BdistWheel},
    options={"build": {"build_base": scratch}, "egg_info": {"egg_base": scratch}},
    zip_safe=False,
)
