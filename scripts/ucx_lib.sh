#!/usr/bin/env bash
# Prints the path of the UCX the tests run against: libucp.so.0 of the
# libucx-cu12 wheel (UCX 1.22) that scripts/setup.sh installs into .venv.
# scripts/test.sh and .ci/run export it as WM_UCX_LIB; by hand:
#   export WM_UCX_LIB=$(bash scripts/ucx_lib.sh)
# The wheel's libraries find each other through their RPATH ($ORIGIN), so
# loading libucp by its full path is enough; its CUDA transport is skipped
# where there is no CUDA driver.
set -euo pipefail
cd "$(dirname "$0")/.."
.venv/bin/python - <<'PY'
import importlib.util, os, sys
spec = importlib.util.find_spec("libucx")
paths = [os.path.join(d, "lib", "libucp.so.0") for d in (spec.submodule_search_locations or [])] if spec else []
found = [p for p in paths if os.path.isfile(p)]
if not found:
    sys.exit("ucx_lib.sh: no libucx/lib/libucp.so.0 in .venv (run scripts/setup.sh)")
print(found[0])
PY
