"""Reading the numeric ``URING_KV_*`` knobs, with errors that name the variable and its value."""

from __future__ import annotations

import os


def env_count(name: str, default: int, what: str = "a count") -> int:
    """``$name`` as a whole number >= 0 (``default`` when unset); ValueError for anything else."""
    raw = os.environ.get(name)
    if raw is None:
        return default
    if not raw.strip().isdigit():
        raise ValueError(f"{name} must be {what} >= 0, got {raw!r}")
    return int(raw)
