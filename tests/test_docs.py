"""The docs that can drift: the generated API reference and the README's two commands."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_api_reference_is_generated_from_current_docstrings() -> None:
    done = subprocess.run([sys.executable, "-P", str(ROOT / "tools" / "gen_api.py"), "--check"], cwd=ROOT,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, "docs/api.md is stale: run `python tools/gen_api.py`\n" + done.stderr


def test_readme_names_the_two_commands_and_ci_runs_the_test_one() -> None:
    readme = (ROOT / "README.md").read_text()
    assert "./dev bench" in readme and "./dev test" in readme
    assert "./dev test" in (ROOT / ".ci" / "run").read_text()
