"""The event loop's lag while a bench method runs: :class:`LagTicker`, fed by a probe process that
writes its clock into a pipe the loop watches, as a socket wakes a server's loop."""

from __future__ import annotations

import asyncio
import os
import struct
import sys
import time
from collections.abc import Callable


class _Prober:
    """A child process that writes its CLOCK_MONOTONIC time (8 bytes) into a pipe every
    ``period`` seconds, for the life of this process. Being another process, its own late wake-ups
    and its need for a GIL never show as the loop's lag: a sample is taken from the time it wrote."""

    _CODE = (
        "import os, struct, sys, time\n"
        "fd, period = int(sys.argv[1]), float(sys.argv[2])\n"
        "due = time.monotonic()\n"
        "while True:\n"
        "    due += period\n"
        "    wait = due - time.monotonic()\n"
        "    if wait > 0:\n"
        "        time.sleep(wait)\n"
        "    else:\n"
        "        due = time.monotonic()\n"
        "    try:\n"
        "        os.write(fd, struct.pack('d', time.monotonic()))\n"
        "    except OSError:\n"  # the reading end is gone: this process has exited
        "        break\n"
    )
    _shared: _Prober | None = None

    def __init__(self, period: float) -> None:
        import subprocess

        self.fd, write_fd = os.pipe()
        os.set_blocking(self.fd, False)
        try:
            self._child = subprocess.Popen([sys.executable, "-c", self._CODE, str(write_fd), str(period)],
                                           pass_fds=(write_fd,), stdin=subprocess.DEVNULL)
        finally:
            os.close(write_fd)
        self._pending = b""
        import select

        select.select([self.fd], [], [], 10.0)  # up once it has written (an interpreter starts in ~50 ms)

    @classmethod
    def shared(cls, period: float) -> _Prober:
        if cls._shared is None:
            cls._shared = cls(period)
            import atexit

            atexit.register(cls._shared.close)
        return cls._shared

    def drain(self) -> list[float]:
        """The send times of every sample written since the last call."""
        while True:
            try:
                chunk = os.read(self.fd, 4096)
            except BlockingIOError:
                break
            if not chunk:
                break
            self._pending += chunk
        whole = len(self._pending) // 8 * 8
        sent = [value for (value,) in struct.iter_unpack("d", self._pending[:whole])]
        self._pending = self._pending[whole:]
        return sent

    def close(self) -> None:
        os.close(self.fd)
        self._child.wait(timeout=5)


class LagTicker:
    """The event loop's responsiveness while a method runs, sampled every millisecond two ways.

    ``samples`` (the "lag" columns): another process writes its clock into a pipe the loop watches
    (``add_reader``, as a socket wakes a server's loop), every 1 ms; a sample is how long after the
    write the loop ran the reader callback. It counts every way the loop can be kept from running:
    a long callback, a wait for the GIL, the loop thread not being scheduled; and nothing else (the
    writer's own scheduling delays are its own, taken out by stamping the time it wrote).

    ``timer_samples``: how late a task's ``asyncio.sleep(0.001)`` wakes up. asyncio passes epoll
    a timeout in whole milliseconds, rounded up, so a loop woken by I/O part-way through a tick
    sleeps up to ~1 ms past the timer even when it has nothing to do; this measures that rounding
    as much as any stall, and is kept for comparison (JSON only).
    """

    PERIOD = 0.001

    def __init__(self, label: str = "", watch: Callable[[str, str, list[float], float], None] | None = None) -> None:
        """``watch`` (diagnostics, may change): ``watch(event, label, sent, now)`` on the loop:
        ``"enter"`` and ``"exit"`` around the measured method, and ``"samples"`` each time the
        loop reads the probe, with the CLOCK_MONOTONIC times the samples were written and read."""
        self.label, self._watch = label, watch
        self.samples: list[float] = []
        self.timer_samples: list[float] = []
        self._task: asyncio.Task[None] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._prober = _Prober.shared(self.PERIOD)

    async def _timer(self) -> None:
        while True:
            start = time.perf_counter()
            await asyncio.sleep(self.PERIOD)
            self.timer_samples.append(max(0.0, time.perf_counter() - start - self.PERIOD))

    def _on_probe(self) -> None:
        now = time.monotonic()
        sent = self._prober.drain()
        self.samples.extend(max(0.0, now - written) for written in sent)
        if self._watch is not None:
            self._watch("samples", self.label, sent, now)

    def __enter__(self) -> LagTicker:
        self._loop = asyncio.get_running_loop()
        self._prober.drain()  # written while nobody measured
        self._loop.add_reader(self._prober.fd, self._on_probe)
        self._task = self._loop.create_task(self._timer())
        if self._watch is not None:
            self._watch("enter", self.label, [], time.monotonic())
        return self

    def __exit__(self, *exc: object) -> None:
        assert self._task is not None and self._loop is not None
        self._task.cancel()
        self._loop.remove_reader(self._prober.fd)
        if self._watch is not None:
            self._watch("exit", self.label, [], time.monotonic())

