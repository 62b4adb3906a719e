"""What every ``uring-kv`` command's arguments share: the parser (one line on a bad option), the
help formatter, the argument types (sizes, counts, fractions) and the checks made after parsing (a
directory that takes a new file, enough free space), with :class:`UsageError` for what they refuse.
Each command defines its own arguments beside the code that runs it (``cli.py`` for the engine's,
``integrations/<framework>/bench.py`` for a framework's) with these."""

from __future__ import annotations

import argparse
import os
import tempfile
from collections.abc import Callable
from typing import NoReturn


class Parser(argparse.ArgumentParser):
    """Bad arguments: one line on stderr naming the option, exit status 2 (no usage dump)."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: {message.removeprefix('argument ')}\n")


class Defaults(argparse.ArgumentDefaultsHelpFormatter):
    """Each option's default in its help, except for flags (which have none to show)."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        return action.help if action.nargs == 0 else super()._get_help_string(action)


class UsageError(Exception):
    """A bad option found after parsing (a path, the free space, the device): exit status 2."""


def byte_size(text: str) -> int:
    units = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}
    clean = text.strip().lower().removesuffix("ib").removesuffix("b")
    try:
        value = int(float(clean[:-1]) * units[clean[-1]]) if clean and clean[-1] in units else int(clean)
    except (ValueError, OverflowError):
        raise argparse.ArgumentTypeError(f"expected a size such as 4096, 128K, 2M or 1G, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1 byte, got {text!r}")
    return value


def at_least(minimum: int) -> Callable[[str], int]:
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be >= {minimum}, got {value}")
        return value

    return parse


def fraction(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number between 0 and 1, got {text!r}") from None
    if not 0 <= value <= 1:
        raise argparse.ArgumentTypeError(f"must be between 0 and 1, got {value}")
    return value


def usable_directory(path: str | None) -> str:
    """``path`` (or the temp directory) once shown to exist and to take a new file."""
    directory = path or tempfile.gettempdir()
    if not os.path.isdir(directory):
        raise UsageError(f"--path: {directory} is not a directory" if os.path.exists(directory)
                         else f"--path: {directory} does not exist")
    try:
        with tempfile.TemporaryFile(dir=directory):
            pass
    except OSError as exc:
        raise UsageError(f"--path: cannot create a file in {directory}: {exc.strerror or exc}") from None
    return directory


def check_free_space(directory: str, needed: int) -> None:
    stats = os.statvfs(directory)
    free = stats.f_bavail * stats.f_frsize
    if free < needed:
        raise UsageError(f"--path: {directory} has {free / 2**20:.0f} MiB free, the run needs "
                         f"{needed / 2**20:.0f} MiB (make --size smaller or choose another --path)")


def check_multiples(option: str, sizes: list[int] | None, unit: int, why: str) -> None:
    """UsageError for the first of ``sizes`` (an option's values) that is not a multiple of
    ``unit``, saying ``why`` it must be (``--row-size 5000: vLLM's rows are whole pages (a
    multiple of 4096 bytes)``)."""
    for value in sizes or []:
        if value % unit:
            raise UsageError(f"{option} {value}: {why} (a multiple of {unit} bytes)")
