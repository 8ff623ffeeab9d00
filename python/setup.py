"""`pip install ./python` builds the same wheel as `pip install .` from the
repository root: this runs the root setup.py (which resolves its paths
against the directory pip runs it in)."""

import runpy
from pathlib import Path

runpy.run_path(str(Path(__file__).resolve().parent.parent / "setup.py"), run_name="__main__")
