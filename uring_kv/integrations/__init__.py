"""Adapters that plug uring_kv into serving frameworks, one subpackage per framework (``vllm``,
``sglang``, ``lmcache``, ``mooncake``), and what every adapter shares: :mod:`.config` (the store
options, parsed and refused in one place, and the store they open).

A framework is imported only where its adapter is asked for: ``import uring_kv`` imports none of
them, and a framework's package names its adapter without importing it (:func:`lazy_exports`), so
its configuration path (``uring_kv.integrations.vllm``) and its bench's argument parser cost nothing
until used."""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from typing import Any


def lazy_exports(package: str, exports: Mapping[str, str]) -> Callable[[str], Any]:
    """A package's module ``__getattr__`` (PEP 562): ``exports`` maps a public name to the submodule
    that defines it, imported on first use (and then cached by Python's import system)."""

    def __getattr__(name: str) -> Any:
        module = exports.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        return getattr(importlib.import_module(f"{package}.{module}"), name)

    return __getattr__
