#!/usr/bin/env bash
# The pip-installable package, end to end: builds the wheel from the
# repository root and from python/ (cargo inside pip, build dependencies from
# the package index), installs it into a fresh virtual environment outside the
# tree, and from a directory outside the tree, with WM_LIBRARY unset, runs a
# real update through the bundled library and the bundled `wm`; then, with
# the `ucx` extra installed (libucx-cu12, from the pip cache setup.sh filled),
# checks that the package and `wm` pick that UCX with WM_UCX_LIB unset.
# usage: tests/wheel/run.sh [BUILD_PYTHON]   (default: the project's .venv)
set -euo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
here="$root/tests/wheel"
build_python=${1:-"$root/.venv/bin/python"}
work=$(mktemp -d "${TMPDIR:-/tmp}/wm-wheel-test.XXXXXX")
trap 'rm -rf "$work"' EXIT
unset WM_LIBRARY

# The installed package must find the library in itself, not through these.
case "$work" in "$root"/*) echo "wheel test: $work is inside the tree" >&2; exit 1 ;; esac

build_wheel() { # SOURCE_DIR OUT_DIR
  # Reuses the tree's cargo target/ (the default for an in-tree build).
  "$build_python" -m pip wheel --no-deps --disable-pip-version-check -q "$1" -w "$2"
  local whl
  whl=$(ls "$2"/weight_manager-*.whl)
  # The library inside the package and `wm` among the scripts, or the wheel is useless.
  "$build_python" - "$whl" <<'PY'
import sys, zipfile
names = zipfile.ZipFile(sys.argv[1]).namelist()
missing = [n for n in ("weight_manager/libweight_manager.so", "weight_manager/__init__.py")
           if n not in names]
if not any(n.endswith(".data/scripts/wm") for n in names):
    missing.append("<name>.data/scripts/wm")
# The `ucx` extra brings a UCX new enough (setup.py: extras_require).
metadata = [n for n in names if n.endswith(".dist-info/METADATA")]
text = zipfile.ZipFile(sys.argv[1]).read(metadata[0]).decode() if metadata else ""
if "Requires-Dist: libucx-cu12>=1.14; extra == \"ucx\"" not in text:
    missing.append("the ucx extra (libucx-cu12>=1.14) in METADATA")
if missing:
    sys.exit(f"wheel test: {sys.argv[1]} lacks {missing}; it holds {names}")
PY
}

echo "wheel test: building the wheel from the repository root"
build_wheel "$root" "$work/dist"
echo "wheel test: building the wheel from python/"
build_wheel "$root/python" "$work/dist-python"

echo "wheel test: installing it into a fresh virtual environment"
python3 -m venv "$work/venv"
safetensors=$(grep -E '^safetensors==' "$root/python/requirements-test.txt")
"$work/venv/bin/python" -m pip install -q --disable-pip-version-check "$work"/dist/weight_manager-*.whl "$safetensors"

mkdir "$work/run"
cd "$work/run"
cargo_version=$(sed -n '/^\[package\]/,/^\[/s/^version *= *"\(.*\)"/\1/p' "$root/Cargo.toml")
"$work/venv/bin/python" "$here/check_install.py" "$work/run/snapshot" "$cargo_version"
"$work/venv/bin/wm" --version | grep -qF "$cargo_version" || { echo "wheel test: wm --version is not $cargo_version" >&2; exit 1; }
"$work/venv/bin/wm" inspect "$work/run/snapshot" > inspect.txt
grep -q "layer.w" inspect.txt || { echo "wheel test: wm inspect does not list layer.w:" >&2; cat inspect.txt >&2; exit 1; }
echo "wheel test: the [ucx] extra: the package and wm then run on the libucx-cu12 wheel's UCX"
libucx=$(grep -E '^libucx-cu12==' "$root/python/requirements-test.txt")
whl=$(ls "$work"/dist/weight_manager-*.whl)
"$work/venv/bin/python" -m pip install -q --disable-pip-version-check "$whl[ucx]" "$libucx"
(
  unset WM_UCX_LIB
  "$work/venv/bin/python" - "$work/venv" <<'PY'
import os, sys
import weight_manager  # noqa: F401  (sets WM_UCX_LIB at import)
got = os.environ.get("WM_UCX_LIB", "")
if not (got.startswith(sys.argv[1]) and got.endswith("libucx/lib/libucp.so.0")):
    sys.exit(f"wheel test: the package chose UCX {got!r}, not the libucx wheel's in {sys.argv[1]}")
PY
  # A closed port: the pull gets as far as connecting only on a UCX it accepts.
  out=$(UCX_TLS=tcp WM_NET_SECRET=wheel-test-secret-0123456789 "$work/venv/bin/wm" pull --net 127.0.0.1:9 2>&1 || true)
  case "$out" in
    *"no publisher answers"*) ;;
    *) echo "wheel test: wm did not run on the libucx wheel's UCX: $out" >&2; exit 1 ;;
  esac
)
echo "wheel test: OK"
