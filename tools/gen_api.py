"""Write docs/api.md from the public docstrings: ``python tools/gen_api.py`` (a test checks it is current)."""

from __future__ import annotations

import inspect
import sys
from pathlib import Path
from typing import Any

import uring_kv
from uring_kv import metrics, sync, testing

PUBLIC: list[tuple[str, Any]] = [
    ("uring_kv.Engine", uring_kv.Engine),
    ("uring_kv.TransferHandle", uring_kv.TransferHandle),
    ("uring_kv.BlockIOError", uring_kv.BlockIOError),
    ("uring_kv.EngineClosedError", uring_kv.EngineClosedError),
    ("uring_kv.EngineBusyError", uring_kv.EngineBusyError),
    ("uring_kv.Prefetch", uring_kv.Prefetch),
    ("uring_kv.UringUnavailable", uring_kv.UringUnavailable),
    ("uring_kv.UringKVError", uring_kv.UringKVError),
    ("uring_kv.CacheLayout", uring_kv.CacheLayout),
    ("uring_kv.KeyStore", uring_kv.KeyStore),
    ("uring_kv.BlockStore", uring_kv.BlockStore),
    ("uring_kv.SyncStore", uring_kv.SyncStore),
    ("uring_kv.SyncBlockStore", uring_kv.SyncBlockStore),
    ("uring_kv.sync.LoopThread", sync.LoopThread),
    ("uring_kv.KeyMissingError", uring_kv.KeyMissingError),
    ("uring_kv.KeyIOError", uring_kv.KeyIOError),
    ("uring_kv.metrics.PrometheusCollector", metrics.PrometheusCollector),
    ("uring_kv.testing.soak", testing.soak),
    ("uring_kv.testing.fill", testing.fill),
    ("uring_kv.testing.identify", testing.identify),
    ("uring_kv.testing.id_caches", testing.id_caches),
]


def _doc(obj: Any) -> str:
    return inspect.cleandoc(obj.__doc__ or "(undocumented)")


def render() -> str:
    out = ["# API reference", "", "Generated from the docstrings by `tools/gen_api.py`; do not edit by hand.", ""]
    for name, obj in PUBLIC:
        try:
            signature = str(inspect.signature(obj))
        except (TypeError, ValueError):
            signature = ""
        out += [f"## `{name}{signature}`", "", _doc(obj), ""]
        if inspect.isclass(obj) and not issubclass(obj, BaseException):
            for member_name, member in inspect.getmembers(obj):
                if member_name.startswith("_") and member_name not in ("__await__",):
                    continue
                if not (inspect.isfunction(member) or isinstance(member, property)):
                    continue
                if member_name == "__await__" or not member.__doc__:
                    continue
                target = member.fget if isinstance(member, property) else member
                sig = "" if isinstance(member, property) else str(inspect.signature(target))
                out += [f"### `{member_name}{sig}`", "", _doc(member), ""]
    return "\n".join(out).rstrip() + "\n"


if __name__ == "__main__":
    target = Path(__file__).resolve().parent.parent / "docs" / "api.md"
    text = render()
    if "--check" in sys.argv:
        sys.exit(0 if target.read_text() == text else 1)
    target.write_text(text)
