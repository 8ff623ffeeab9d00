"""Which UCX the package hands the library: the libucx-cu12 wheel's when it
is installed and WM_UCX_LIB is unset (the test environment has the wheel,
from requirements-test.txt), never overriding a WM_UCX_LIB the user set.
Each case imports the package in a fresh interpreter, as an application
would, since the choice is made once, at import."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from weight_manager import Result

PYTHON_DIR = str(Path(__file__).resolve().parents[1])
SHOW = "import os, weight_manager; print(os.environ.get('WM_UCX_LIB', ''))"


def ucx_lib_after_import(**env):
    base = {k: v for k, v in os.environ.items() if k != "WM_UCX_LIB"}
    out = subprocess.run([sys.executable, "-c", SHOW], env={**base, **env}, cwd=PYTHON_DIR,
                         capture_output=True, text=True, check=True)
    return out.stdout.strip()


def test_the_wheels_ucx_is_the_default():
    path = ucx_lib_after_import()
    assert path.endswith(os.path.join("libucx", "lib", "libucp.so.0")), path
    assert os.path.isfile(path)


def test_a_set_wm_ucx_lib_wins():
    assert ucx_lib_after_import(WM_UCX_LIB="libucp.so.0") == "libucp.so.0"


PUBLISH = """
import weight_manager as wm
try:
    with wm.Publisher(net="127.0.0.1:0", secret="python-test-secret-0123456789") as p:
        print("listening", p.address)
except wm.WeightManagerError as e:
    print("refused", int(e.code), e)
"""


def publish(**env):
    base = {k: v for k, v in os.environ.items() if k != "WM_UCX_LIB"}
    out = subprocess.run([sys.executable, "-c", PUBLISH], env={**base, **env}, cwd=PYTHON_DIR,
                         capture_output=True, text=True, check=True, timeout=60)
    return out.stdout.strip()


def test_a_network_publisher_runs_on_the_default_ucx():
    assert publish().startswith("listening 127.0.0.1:")


def test_an_old_system_ucx_is_refused_naming_the_fix():
    old = [p for p in ("/usr/lib/x86_64-linux-gnu/libucp.so.0", "/lib/x86_64-linux-gnu/libucp.so.0")
           if os.path.isfile(p)]
    if not old:
        pytest.skip("no system libucp.so.0")
    out = publish(WM_UCX_LIB=old[0])
    if out.startswith("listening"):
        pytest.skip(f"{old[0]} is 1.14 or newer")
    assert out.startswith(f"refused {int(Result.ERR_UNSUPPORTED)} "), out
    assert "older than 1.14.0" in out and "libucx-cu12" in out, out
