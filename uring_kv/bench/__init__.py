"""``uring-kv bench``: uring_kv against what a user would run instead, and against the machine's limits.

Every method runs in the same process, on the same file, with the same random batches, and every
method's last batch is checked byte for byte: each 8-byte word of disk block ``d`` holds
``d << 32 | word``, so a block landing in the wrong place, torn or stale is caught. The event
loop's lag is sampled while each method runs.

The bench drives uring_kv through its public API only (``Engine``, ``Tuning``). One concern per
module, each importing only those before it:

- ``config``: :class:`~uring_kv.bench.config.BenchConfig`, the defaults, and what follows from
  them (measured batches per block size, uring_kv's staging slots through ``Tuning``);
- ``results``: a measured row, percentiles, the ratios between methods, the pooled loop lag;
- ``workload``: the caches, the file's identity pattern, the batches, and the byte checks;
- ``lagprobe``: the loop-lag probe (a process writing to a pipe the loop watches);
- ``measure``: the rotation of the methods over the batches, with the heap frozen;
- ``peers``: ports of vLLM's DiskBackend, a thread pool and KvikIO;
- ``ceilings``: the ring, copy, rows and PCIe ceilings, fio, and the ring's depth sweep;
- ``run``: one run over the block sizes and cases, to the JSON result;
- ``report``: the header, verdict, sizing advice, table and plot.

This package imports nothing on its own: ``import uring_kv.bench.config`` does not load torch.
"""
