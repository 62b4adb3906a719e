"""The LMCache tests' set-up: LMCache's usage telemetry off (it would post to the network) before
anything imports lmcache; the main suite's test helpers (tests/) importable."""

from __future__ import annotations

import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

os.environ["LMCACHE_TRACK_USAGE"] = "false"
os.environ["DO_NOT_TRACK"] = "1"
