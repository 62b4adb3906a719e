"""``vllm-fs``: a port of vLLM's file-system tier (``vllm/v1/kv_offload/tiering/fs/``, vLLM 0.33.0 and
0.34.0, identical in what is ported here) for ``uring-kv bench-mix``, on the same directory and the
same workload as uring_kv.

vLLM's, kept as it is:

* ``DualQueueThreadPool`` (``thread_pool.py``): a load deque and a store deque under one condition
  variable; 16 load-priority threads that take from the load deque first and from the store deque
  when it is empty, 16 store-priority threads the other way round (``FileSystemTierManager``'s
  ``n_read_threads`` / ``n_write_threads`` defaults); a job is one task (``submit_load`` and
  ``submit_store`` enqueue ``n_tasks=1``), run whole by one thread; ``JobState`` counts it done.
* The manager's side (``manager.py``): the paths and offsets computed when a job is submitted, one
  file per block under ``<root>/<model>_<digest>_r0/<hhh>/<hh>_g0/<hash>.bin`` (``file_mapper.py``),
  O_DIRECT where ``probe_o_direct`` (``io.py``) finds it works in that directory.
* Per block, vLLM's C extension (``csrc/fs_io.cpp``, called through ``io.py``'s
  ``batch_load_block`` / ``batch_store_block``) in ``csrc/fsfiles.c``: load = open, one read of the
  whole block into the primary row, close; store = nothing if the file exists, else the parent
  directories, a temp file (O_EXCL, the thread's random suffix), one write, close, rename; the GIL
  released for the whole batch. What ``io.py`` does in Python around that call on the worker (a
  bounds check and a memoryview slice per block, under the GIL) is left out: the rows' addresses
  are passed instead, which can only make the port faster than vLLM.

What the bench adds around it, never inside a job: a finished job is handed to the loop as soon as
the pool records it (vLLM's scheduler polls ``get_finished()`` once a step, which would add up to a
step to every latency), and the caller takes its time there, as it does uring_kv's; and, since vLLM
never rewrites a block file (a store of a key whose file exists does nothing), a store writes each
block under a new key and the file of the key it replaces is removed afterwards by one cleaner
thread (vLLM leaves eviction to whoever manages the directory), so that the store flood writes as
many bytes as uring_kv's.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import mmap
import os
import queue
import random
import shutil
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any

from uring_kv._native import fs_load_blocks, fs_store_blocks

# FileSystemTierManager's defaults (vLLM 0.33.0, 0.34.0)
READ_THREADS = 16
WRITE_THREADS = 16

Task = Callable[[], None]


class _JobState:
    """thread_pool.py's ``JobState``: a job's tasks counted done under a lock."""

    __slots__ = ("completed", "job_id", "lock", "n_tasks", "success", "transfer_time")

    def __init__(self, job_id: int, n_tasks: int) -> None:
        self.job_id = job_id
        self.n_tasks = n_tasks
        self.completed = 0
        self.success = True
        self.transfer_time = 0.0
        self.lock = threading.Lock()

    def task_done(self, success: bool, transfer_time: float) -> tuple[bool, bool, float]:
        with self.lock:
            self.completed += 1
            self.transfer_time += transfer_time
            if not success:
                self.success = False
            return self.completed == self.n_tasks, self.success, self.transfer_time


class DualQueueThreadPool:
    """thread_pool.py's pool: load-priority threads drain the load queue first, then the store queue;
    store-priority threads the reverse; one condition variable for both queues. ``on_finished`` is
    called (on the worker) once a finished job is in the finished queue, which the bench reads
    then instead of once a scheduler step."""

    def __init__(self, n_read_threads: int, n_write_threads: int, on_finished: Callable[[], None]) -> None:
        self._load_q: deque[tuple[Task, _JobState]] = deque()
        self._store_q: deque[tuple[Task, _JobState]] = deque()
        self._condition = threading.Condition(threading.Lock())
        self._stop = False
        self._finished_q: deque[tuple[int, bool, float]] = deque()
        self._inflight_jobs = 0
        self._on_finished = on_finished
        self._threads = [threading.Thread(target=self._worker, args=(load_priority,), daemon=True,
                                          name=f"bench_fs_{'l' if load_priority else 's'}{i}")
                         for load_priority, count in ((True, n_read_threads), (False, n_write_threads))
                         for i in range(count)]
        for thread in self._threads:
            thread.start()

    def enqueue_load(self, job_id: int, n_tasks: int, tasks: list[Task]) -> None:
        self._enqueue(self._load_q, job_id, n_tasks, tasks)

    def enqueue_store(self, job_id: int, n_tasks: int, tasks: list[Task]) -> None:
        self._enqueue(self._store_q, job_id, n_tasks, tasks)

    def _enqueue(self, into: deque[tuple[Task, _JobState]], job_id: int, n_tasks: int, tasks: list[Task]) -> None:
        state = _JobState(job_id, n_tasks)
        with self._condition:
            self._inflight_jobs += 1
            for task in tasks:
                into.append((task, state))
            self._condition.notify(n_tasks)

    def get_finished(self) -> list[tuple[int, bool, float]]:
        """(job id, success, transfer seconds) of each job finished since the last call."""
        jobs = []
        while self._finished_q:
            jobs.append(self._finished_q.popleft())
        return jobs

    def shutdown(self) -> None:
        with self._condition:
            self._stop = True
            self._load_q.clear()
            self._store_q.clear()
            self._inflight_jobs = 0
            self._condition.notify_all()
        for thread in self._threads:
            thread.join()

    def _worker(self, load_priority: bool) -> None:
        while True:
            with self._condition:
                self._condition.wait_for(lambda: self._stop or bool(self._load_q) or bool(self._store_q))
                if self._stop:
                    return
                primary = self._load_q if load_priority else self._store_q
                secondary = self._store_q if load_priority else self._load_q
                task, state = primary.popleft() if primary else secondary.popleft()
            start_time = time.monotonic()
            try:
                task()
                job_finished, success, total_time = state.task_done(True, time.monotonic() - start_time)
            except Exception:
                job_finished, success, total_time = state.task_done(False, time.monotonic() - start_time)
            if job_finished:
                with self._condition:
                    self._finished_q.append((state.job_id, success, total_time))
                    self._inflight_jobs -= 1
                    self._condition.notify_all()
                self._on_finished()


def probe_o_direct(directory: str) -> bool:
    """io.py's ``probe_o_direct``: one aligned page written with O_DIRECT in ``directory``."""
    path = os.path.join(directory, f".o_direct_probe_{random.randint(0, 2**63 - 1)}.tmp")
    page = mmap.mmap(-1, mmap.PAGESIZE)
    try:
        fd = os.open(path, os.O_CREAT | os.O_WRONLY | os.O_TRUNC | os.O_DIRECT, 0o644)
        try:
            os.write(fd, page)
        finally:
            os.close(fd)
        return True
    except OSError:
        return False
    finally:
        page.close()
        if os.path.exists(path):
            os.remove(path)


_thread_local = threading.local()


def _tmp_suffix() -> str:
    """io.py's ``_get_tmp_suffix``: a random suffix per thread for temp files."""
    try:
        suffix: str = _thread_local.tmp_suffix
    except AttributeError:
        suffix = _thread_local.tmp_suffix = f"_{random.randint(0, 2**63 - 1)}.tmp"
    return suffix


class FsTier:
    """The fs tier over ``rows`` (a primary region: row r at ``base_addr + r * block_bytes``) in a fresh
    directory under ``root``, driven from an asyncio loop: ``load``/``store`` submit one job and return the
    ``time.perf_counter()`` at which the loop learnt it had finished. Keys are integers (the block hash is
    their sha256, a 64-digit name as vLLM's); the bench's ``FsTierMethod`` turns disk blocks into keys."""

    def __init__(self, root: str, block_bytes: int, base_addr: int) -> None:
        self.root = root
        self.block_bytes = block_bytes
        self.base_addr = base_addr
        digest = hashlib.sha256(f"bench-mix {block_bytes}".encode()).hexdigest()[:16]
        base_path = os.path.join(root, f"bench_{digest}")
        os.makedirs(base_path, exist_ok=True)
        self.files = f"{base_path}_r0"
        self.o_direct = probe_o_direct(base_path)
        self._loop = asyncio.get_running_loop()
        self._waiting: dict[int, asyncio.Future[None]] = {}
        self._next_job = 0
        self._collect_queued = threading.Event()
        self.pool = DualQueueThreadPool(READ_THREADS, WRITE_THREADS, self._wake)

    def path(self, key: int) -> str:
        """file_mapper.py's ``get_file_name``: ``<base>_r<rank>/<hhh>/<hh>_g<group>/<hash>.bin``."""
        hash_hex = hashlib.sha256(key.to_bytes(8, "little")).hexdigest()
        return f"{self.files}/{hash_hex[:3]}/{hash_hex[3:5]}_g0/{hash_hex}.bin"

    def _submit(self, store: bool, keys: list[int], rows: list[int]) -> asyncio.Future[None]:
        job_id, self._next_job = self._next_job, self._next_job + 1
        paths = [self.path(key) for key in keys]
        addrs = [self.base_addr + row * self.block_bytes for row in rows]
        size, o_direct = self.block_bytes, self.o_direct
        if store:
            def task() -> None:
                fs_store_blocks([path + _tmp_suffix() for path in paths], paths, addrs, size, o_direct)
        else:
            def task() -> None:
                fs_load_blocks(paths, addrs, size, o_direct)
        done = self._waiting[job_id] = self._loop.create_future()
        (self.pool.enqueue_store if store else self.pool.enqueue_load)(job_id, 1, [task])
        return done

    async def load(self, keys: list[int], rows: list[int]) -> float:
        """Key i's file into row ``rows[i]``; the time it finished. OSError if it failed."""
        await self._submit(False, keys, rows)
        return time.perf_counter()

    async def store(self, rows: list[int], keys: list[int]) -> float:
        """Row ``rows[i]`` into key i's file; the time it finished. OSError if it failed."""
        await self._submit(True, keys, rows)
        return time.perf_counter()

    def _wake(self) -> None:
        # on a worker: one loop callback per burst of finished jobs
        if not self._collect_queued.is_set():
            self._collect_queued.set()
            self._loop.call_soon_threadsafe(self._collect)

    def _collect(self) -> None:
        self._collect_queued.clear()
        for job_id, success, _transfer in self.pool.get_finished():
            done = self._waiting.pop(job_id)
            if done.done():
                continue
            if success:
                done.set_result(None)
            else:
                done.set_exception(OSError(f"fs tier job {job_id} failed"))

    def close(self) -> None:
        self.pool.shutdown()
        shutil.rmtree(self.files, ignore_errors=True)
        shutil.rmtree(self.files.removesuffix("_r0"), ignore_errors=True)


class FsTierMethod:
    """``bench-mix``'s ``vllm-fs`` method: disk block ``d`` is key ``generation << 32 | d``; a store
    writes its blocks under the next generation and, once done, hands the files of the generation it
    replaced to the cleaner thread."""

    name = "vllm-fs"
    rule = "dual queue 16+16"  # load-priority and store-priority threads

    def __init__(self, tier: FsTier) -> None:
        self.tier = tier
        self._generation: dict[int, int] = {}
        self._next_generation = 1
        self._stale: queue.SimpleQueue[str | None] = queue.SimpleQueue()
        self._cleaner = threading.Thread(target=self._clean, name="bench_fs_cleaner", daemon=True)
        self._cleaner.start()

    @property
    def facts(self) -> dict[str, Any]:
        return {"o_direct": self.tier.o_direct, "read_threads": READ_THREADS, "write_threads": WRITE_THREADS,
                "files": "one per block"}

    def _key(self, disk_block: int, generation: int) -> int:
        return generation << 32 | disk_block

    async def load(self, disk_blocks: list[int], rows: list[int]) -> float:
        return await self.tier.load([self._key(d, self._generation.get(d, 0)) for d in disk_blocks], rows)

    async def prefetch(self, disk_blocks: list[int], rows: list[int]) -> float:
        """vLLM's tier has no prefetch class: a prefetch is a load on the load-priority queue."""
        return await self.load(disk_blocks, rows)

    async def store(self, rows: list[int], disk_blocks: list[int]) -> float:
        generation, self._next_generation = self._next_generation, self._next_generation + 1
        done = await self.tier.store(rows, [self._key(d, generation) for d in disk_blocks])
        for disk_block in disk_blocks:
            old = self._generation.get(disk_block)
            self._generation[disk_block] = generation
            if old is not None:
                self._stale.put(self.tier.path(self._key(disk_block, old)))
        return done

    def _clean(self) -> None:
        while (path := self._stale.get()) is not None:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)

    async def close(self) -> None:
        self._stale.put(None)
        await asyncio.to_thread(self._cleaner.join)
        self.tier.close()
