"""The LMCache tests' set-up: LMCache's usage telemetry off (it would post to the network) before
anything imports lmcache."""

from __future__ import annotations

import os

os.environ["LMCACHE_TRACK_USAGE"] = "false"
os.environ["DO_NOT_TRACK"] = "1"
