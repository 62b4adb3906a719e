"""The SGLang tests' set-up: the main suite's test helpers (tests/) importable."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
