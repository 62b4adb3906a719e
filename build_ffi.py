"""cffi (API mode) build of ``uring_kv._native_c`` from ``uring_kv/csrc/*.c``, liburing linked statically.

The helpers exist because cffi releases the GIL around every call: one call submits N SQEs, reaps N
CQEs or enqueues N copies, so the per-block cost in Python stays one tuple, not one C call per item.
The only logic here is :func:`find_liburing`, a pure function with its own test.

Run ``python build_ffi.py`` to build the extension in place (what the GPU machine does).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
from collections.abc import Callable, Mapping
from pathlib import Path

INSTALL_HINT = (
    "uring_kv: liburing headers (liburing.h) not found; install liburing-dev (Debian/Ubuntu) "
    "or liburing-devel (Fedora/RHEL), or set URING_KV_LIBURING to a prefix holding include/liburing.h"
)


def _lib_dirs(prefix: str) -> list[str]:
    multiarch = sysconfig.get_config_var("MULTIARCH") or "x86_64-linux-gnu"
    return [f"{prefix}/lib/{multiarch}", f"{prefix}/lib64", f"{prefix}/lib"]


def find_liburing(
    env: Mapping[str, str],
    pkg_config: Callable[[], tuple[str, str] | None],
    exists: Callable[[str], bool],
) -> tuple[str, str]:
    """Return ``(include_dir, path_to_liburing.a)``.

    Looks in ``$URING_KV_LIBURING`` first, then what pkg-config reports, then /usr and /usr/local.
    Raises ``SystemExit`` with one line naming the package to install when nothing complete is found.
    """
    candidates: list[tuple[str, list[str]]] = []
    prefix = env.get("URING_KV_LIBURING")
    if prefix:
        candidates.append((f"{prefix}/include", _lib_dirs(prefix)))
    found = pkg_config()
    if found is not None:
        candidates.append((found[0], [found[1]]))
    for sys_prefix in ("/usr", "/usr/local"):
        candidates.append((f"{sys_prefix}/include", _lib_dirs(sys_prefix)))
    headers_seen = False
    for include_dir, lib_dirs in candidates:
        if not exists(f"{include_dir}/liburing.h"):
            continue
        headers_seen = True
        for lib_dir in lib_dirs:
            archive = f"{lib_dir}/liburing.a"
            if exists(archive):
                return include_dir, archive
    if headers_seen:
        raise SystemExit("uring_kv: liburing.h found but no static liburing.a beside it; " + INSTALL_HINT[10:])
    raise SystemExit(INSTALL_HINT)


def liburing_version(pc_text: str) -> str | None:
    """The ``Version:`` of a liburing.pc file (liburing before 2.4 has no version macros)."""
    for line in pc_text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "Version" and value.strip():
            return value.strip()
    return None


def _archive_version(archive: str) -> str | None:
    pc = Path(archive).parent / "pkgconfig" / "liburing.pc"
    return liburing_version(pc.read_text()) if pc.exists() else None


def _pkg_config() -> tuple[str, str] | None:
    if shutil.which("pkg-config") is None:
        return None
    try:
        out = subprocess.run(
            ["pkg-config", "--variable=includedir", "--variable=libdir", "liburing"],
            capture_output=True, text=True, check=True,
        ).stdout.split()
    except subprocess.CalledProcessError:
        return None
    return (out[0], out[1]) if len(out) == 2 else None


CDEF = r"""
struct ukv_ring;
struct ukv_op {
    uint8_t opcode; uint8_t sqe_flags; uint16_t buf_index; int32_t fd;
    uint64_t addr; uint32_t len; uint64_t offset; uint64_t user_data;
};
#define UKV_OP_READ ...
#define UKV_OP_READ_FIXED ...
#define UKV_OP_WRITE ...
#define UKV_OP_WRITE_FIXED ...
#define UKV_OP_READV ...
#define UKV_OP_WRITEV ...
#define UKV_OP_NOP ...
#define IORING_SETUP_SINGLE_ISSUER ...
#define IORING_SETUP_DEFER_TASKRUN ...
#define IORING_SETUP_COOP_TASKRUN ...
#define IORING_SETUP_SUBMIT_ALL ...
#define IOSQE_ASYNC ...
#define IOSQE_FIXED_FILE ...
#define IORING_FEAT_NODROP ...
#define IORING_FEAT_FAST_POLL ...
#define IORING_FEAT_EXT_ARG ...
#define IORING_FEAT_NATIVE_WORKERS ...
#define IO_URING_VERSION_MAJOR ...
#define IO_URING_VERSION_MINOR ...

int ukv_ring_open(unsigned entries, unsigned cq_entries, unsigned flags, struct ukv_ring **out);
void ukv_ring_close(struct ukv_ring *r);
unsigned ukv_ring_info(struct ukv_ring *r, unsigned *flags, unsigned *features, unsigned *cq_entries);
int ukv_register_eventfd(struct ukv_ring *r, int fd);
int ukv_register_buffers(struct ukv_ring *r, const uint64_t *addrs, const uint64_t *lens, unsigned n);
int ukv_unregister_buffers(struct ukv_ring *r);
int ukv_register_files(struct ukv_ring *r, const int *fds, unsigned n);
int ukv_unregister_files(struct ukv_ring *r);
int ukv_iowq_max_workers(struct ukv_ring *r, unsigned *bounded, unsigned *unbounded);
int ukv_submit(struct ukv_ring *r, const struct ukv_op *ops, unsigned n);

struct ukv_pump {  /* only what Python reads (and nblocks, which keep_only() lowers); ukv_pump_new fills in the rest */
    int id, stop, klass;
    unsigned next, inflight, nreleased, nfailed, parked_empty, nblocks;
    uint32_t *released;
    uint32_t *failed;
    int32_t *fail_errno;
    ...;
};
struct ukv_copier;
struct ukv_pump *ukv_pump_new(int write, int fd, unsigned sqe_flags, int fixed_buffers, uint64_t stride,
                              unsigned ntensors, const uint64_t *bases, const uint64_t *block_bytes,
                              const uint64_t *slot_offsets, unsigned nblocks, const uint64_t *offsets,
                              const int64_t *cache, const int32_t *waiting, unsigned max_slots, int scatter,
                              struct ukv_copier *copier, const uint64_t *dev_slots, unsigned copy_blocks);
void ukv_pump_free(struct ukv_pump *p);
long ukv_check_blocks(const int64_t *v, unsigned n, int64_t limit, uint64_t *seen);
void ukv_scale(const int64_t *v, unsigned n, uint64_t factor, uint64_t *out);
long ukv_first_unset(const int64_t *v, unsigned n, const uint64_t *bits);
void ukv_mark(const int64_t *v, unsigned n, uint64_t *bits, int value);
#define UKV_MAX_PUMPS ...
#define UKV_PUMP_TAG ...
#define UKV_STAGED_MAX ...
int ukv_pump_attach(struct ukv_ring *r, struct ukv_pump *p);
void ukv_pump_detach(struct ukv_ring *r, struct ukv_pump *p);
int ukv_pump_add_slots(struct ukv_ring *r, struct ukv_pump *p, unsigned n, const uint32_t *slots,
                       const uint64_t *addrs, const int32_t *bufs);
void ukv_ring_pump_depth(struct ukv_ring *r, unsigned cap, int64_t store_aging_ns, unsigned prefetch_cap);
unsigned ukv_ring_pump_io(struct ukv_ring *r, unsigned *peak);
void ukv_ring_phases(struct ukv_ring *r, int reset, int64_t *out);
uint64_t ukv_ring_copied_late(const struct ukv_ring *r);
uint64_t ukv_ring_pump_done(const struct ukv_ring *r);
int ukv_reap_pumped(struct ukv_ring *r, uint64_t *user_data, int32_t *res, unsigned max, int32_t *touched,
                    unsigned *ntouched, int *submit_error, int64_t budget_ns, int *more);
void ukv_pump_state(struct ukv_ring *r, struct ukv_pump *p, uint32_t *out);
unsigned ukv_pump_take_released(struct ukv_ring *r, struct ukv_pump *p, uint32_t *out);
void ukv_pump_stop(struct ukv_ring *r, struct ukv_pump *p);
void ukv_pump_set_class(struct ukv_ring *r, struct ukv_pump *p, int klass);
int ukv_ring_thread_start(struct ukv_ring *r, int notify_fd);
void ukv_ring_thread_stop(struct ukv_ring *r);
unsigned ukv_ring_take(struct ukv_ring *r, uint64_t *user_data, int32_t *res, unsigned max, int32_t *touched,
                       unsigned *ntouched, int *submit_error);
uint64_t ukv_ring_thread_wakeups(struct ukv_ring *r, uint64_t *notifies);
unsigned ukv_ring_take_job_fails(struct ukv_ring *r, int32_t *rcs, int32_t *wheres);
#define UKV_JOB_FAILS ...

const char *ukv_liburing_version(void);
int ukv_dio_align(int fd, uint32_t *mem_align, uint32_t *offset_align);
int64_t ukv_ring_loop(int fd, int write, unsigned depth, uint64_t block_bytes,
                      const uint64_t *offsets, unsigned n, uint64_t buf_base, int fixed, int async,
                      unsigned ntensors, const uint64_t *bases, const uint64_t *row_bytes,
                      const int64_t *cache_blocks);
int ukv_check_identity(uint64_t *words, uint64_t rows, uint64_t row_words, const int64_t *numbers, int scrub);
unsigned ukv_fs_store_blocks(const char *const *tmp_paths, const char *const *dest_paths, const uint64_t *bufs,
                             unsigned n, uint64_t size, int o_direct, int *err);
unsigned ukv_fs_load_blocks(const char *const *paths, const uint64_t *bufs, unsigned n, uint64_t size, int o_direct,
                            int *err);

int ukv_host_copy(unsigned ntensors, const uint64_t *bases, const uint64_t *block_bytes,
                  const uint64_t *slot_offsets, int to_slot, unsigned nblocks,
                  const uint64_t *slot_addrs, const int64_t *gpu_blocks);
struct ukv_cuda_path { int32_t batch, batch_error; };
int ukv_cuda_load(void);
int ukv_cuda_batch_mode(void);
int ukv_cuda_copy(struct ukv_cuda_path *path, unsigned ntensors, const uint64_t *bases,
                  const uint64_t *block_bytes, const uint64_t *slot_offsets, int to_slot, unsigned nblocks,
                  const uint64_t *slot_addrs, const int64_t *gpu_blocks, uint64_t stream);
int ukv_cuda_ctx_current(uint64_t *ctx);
int ukv_cuda_ctx_use(uint64_t ctx);
int ukv_cuda_event_new(uint64_t ctx, uint64_t *event);
int ukv_cuda_event_free(uint64_t ctx, uint64_t event);
int ukv_cuda_order_after(uint64_t ctx, uint64_t caller, uint64_t event, const uint64_t *streams, unsigned nstreams);
int ukv_cuda_event_sync(uint64_t ctx, uint64_t event);
int ukv_cuda_event_query(uint64_t event);
int ukv_cuda_host_device_pointer(uint64_t ctx, uint64_t host, uint64_t *dev);
int ukv_cuda_copy_staged(uint64_t ctx, uint64_t func, uint64_t table, unsigned ntensors, uint64_t used_bytes,
                         int to_slot, unsigned nblocks, const uint64_t *slot_addrs, const uint64_t *dev_slots,
                         const int64_t *gpu_blocks, uint64_t stream, uint64_t done_event);
int ukv_cuda_copy_evented(struct ukv_cuda_path *path, uint64_t ctx, uint64_t done_event, unsigned ntensors,
                          const uint64_t *bases, const uint64_t *block_bytes, const uint64_t *slot_offsets,
                          int to_slot, unsigned nblocks, const uint64_t *slot_addrs, const int64_t *gpu_blocks,
                          uint64_t stream);

#define UKV_JOB_COPY 0
#define UKV_JOB_MARK 1
#define UKV_FAIL_ENQUEUE 1
#define UKV_FAIL_WAIT 2
int ukv_copier_new(int cuda, unsigned ntensors, const uint64_t *bases, const uint64_t *block_bytes,
                   const uint64_t *slot_offsets, uint64_t ctx, uint64_t func, uint64_t table, uint64_t used_bytes,
                   uint64_t stream_h2d, uint64_t stream_d2h, int64_t delay, uint64_t spin_func,
                   struct ukv_copier **out);
int ukv_copier_fd(struct ukv_copier *c);
void ukv_copier_fail_next(struct ukv_copier *c, int32_t rc, int32_t where);
void ukv_copier_poll(struct ukv_copier *c, int64_t ns);
int ukv_copier_put(struct ukv_copier *c, uint64_t token, int kind, int to_slot, unsigned n,
                   const uint64_t *slot_addrs, const uint64_t *dev_slots, const int64_t *gpu_blocks,
                   uint64_t event);
unsigned ukv_copier_done(struct ukv_copier *c, unsigned max, uint64_t *tokens, int32_t *rcs, int32_t *wheres,
                         int64_t *done_ns);
unsigned ukv_copier_owned_jobs(struct ukv_copier *c);
#define UKV_PHASES 12
void ukv_copier_phases(struct ukv_copier *c, int reset, int64_t *out);
unsigned ukv_ring_collect(struct ukv_ring *r, struct ukv_copier *c, unsigned max, uint64_t *tokens, int32_t *rcs,
                          int32_t *wheres, int64_t *done_ns, int32_t *touched, unsigned *ntouched, int *submit_error);
void ukv_copier_free(struct ukv_copier *c);
int ukv_ring_watch_copier(struct ukv_ring *r, struct ukv_copier *c);
void ukv_ring_unwatch_copier(struct ukv_ring *r);
"""

# The C side, one file per concern (see uring_kv/csrc/ukv.h), compiled into this one extension; the
# module's own source only includes the header that declares what CDEF names.
C_DIR = "uring_kv/csrc"
C_SOURCES = [f"{C_DIR}/{name}.c"
             for name in ("ring", "pump", "ringthread", "copier", "cuda", "ceiling", "identity", "fsfiles")]
SOURCE = '#include "ukv.h"\n'


def make_builder():  # type: ignore[no-untyped-def]
    from cffi import FFI

    include_dir, archive = find_liburing(os.environ, _pkg_config, os.path.exists)
    version = _archive_version(archive)
    builder = FFI()
    builder.cdef(CDEF)
    builder.set_source(
        "uring_kv._native_c",
        SOURCE,
        sources=C_SOURCES,  # relative to the project root, where setuptools and __main__ build
        define_macros=[("UKV_LIBURING_VERSION", f'"{version}"')] if version else [],
        include_dirs=[str(Path(__file__).resolve().parent / C_DIR), include_dir],
        extra_objects=[archive],
        libraries=["dl", "pthread"],
        extra_compile_args=["-O2", "-std=gnu11", "-Wall", "-Wno-unused-function"],
    )
    return builder


if __name__ == "__main__":
    root = Path(__file__).resolve().parent
    make_builder().compile(tmpdir=str(root), verbose=False)
    print("built", next(root.glob("uring_kv/_native_c*.so")), file=sys.stderr)
