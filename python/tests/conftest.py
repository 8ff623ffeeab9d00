import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import os

# The network tests run UCX over TCP on loopback (no RDMA hardware here).
os.environ.setdefault("UCX_TLS", "tcp")
