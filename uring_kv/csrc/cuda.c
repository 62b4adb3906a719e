/* The CUDA driver: entry points resolved at run time (dlopen), so the module never links libcuda.
 * Block copies (batched, per piece, or staged: one copy per block and a kernel), contexts and
 * events; and the calls the native copier's threads make (copier.c). */
#include "ukv.h"

/* The types mirror cuda.h (CUDA 12.8+) for the few fields used; CUdeviceptr is 64-bit, enums are int. */
typedef int (*memcpy_htod_fn)(uint64_t dst, const void *src, size_t n, void *stream);
typedef int (*memcpy_dtoh_fn)(void *dst, uint64_t src, size_t n, void *stream);
typedef struct { int type; int id; } ukv_mem_location;
typedef struct { int src_access_order; ukv_mem_location src_hint, dst_hint; unsigned flags; } ukv_memcpy_attributes;
typedef int (*batch_v2_fn)(uint64_t *dsts, uint64_t *srcs, size_t *sizes, size_t count, ukv_memcpy_attributes *attrs,
                           size_t *attr_idxs, size_t num_attrs, void *stream);
typedef int (*batch_v1_fn)(uint64_t *dsts, uint64_t *srcs, size_t *sizes, size_t count, ukv_memcpy_attributes *attrs,
                           size_t *attr_idxs, size_t num_attrs, size_t *fail_idx, void *stream);
enum { UKV_LOC_DEVICE = 1, UKV_LOC_HOST = 2, UKV_ORDER_STREAM = 1 };

typedef int (*event_create_fn)(uint64_t *event, unsigned flags);
typedef int (*event_fn)(uint64_t event);
typedef int (*event_record_fn)(uint64_t event, void *stream);
typedef int (*launch_fn)(uint64_t func, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by, unsigned bz,
                         unsigned shared, void *stream, void **params, void **extra);
typedef int (*ctx_get_fn)(uint64_t *ctx);
typedef int (*ctx_set_fn)(uint64_t ctx);
typedef int (*stream_wait_fn)(void *stream, uint64_t event, unsigned flags);
typedef int (*host_dev_ptr_fn)(uint64_t *dev, void *host, unsigned flags);
enum { UKV_EVENT_BLOCKING_SYNC = 0x1, UKV_EVENT_DISABLE_TIMING = 0x2 };

static event_create_fn p_event_create;
static event_fn p_event_destroy, p_event_sync, p_event_query;
static event_record_fn p_event_record;
static launch_fn p_launch;
static ctx_get_fn p_ctx_get;
static ctx_set_fn p_ctx_set;
static stream_wait_fn p_stream_wait;
static event_fn p_stream_sync; /* cuStreamSynchronize: CUstream is a pointer, passed as uint64_t */
static host_dev_ptr_fn p_host_dev_ptr;
static memcpy_htod_fn p_htod;
static memcpy_dtoh_fn p_dtoh;
static batch_v2_fn p_batch_v2;
static batch_v1_fn p_batch_v1;

int ukv_cuda_load(void) {
    if (p_htod && p_dtoh) return 0;
    void *lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_GLOBAL | RTLD_NOLOAD);
    if (!lib) lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_GLOBAL);
    if (!lib) return -ENOENT;
    p_htod = (memcpy_htod_fn)dlsym(lib, "cuMemcpyHtoDAsync_v2");
    p_dtoh = (memcpy_dtoh_fn)dlsym(lib, "cuMemcpyDtoHAsync_v2");
    p_batch_v2 = (batch_v2_fn)dlsym(lib, "cuMemcpyBatchAsync_v2");
    if (!p_batch_v2) p_batch_v1 = (batch_v1_fn)dlsym(lib, "cuMemcpyBatchAsync");
    p_event_create = (event_create_fn)dlsym(lib, "cuEventCreate");
    p_event_destroy = (event_fn)dlsym(lib, "cuEventDestroy_v2");
    p_event_sync = (event_fn)dlsym(lib, "cuEventSynchronize");
    p_event_query = (event_fn)dlsym(lib, "cuEventQuery");
    p_event_record = (event_record_fn)dlsym(lib, "cuEventRecord");
    p_launch = (launch_fn)dlsym(lib, "cuLaunchKernel");
    p_ctx_get = (ctx_get_fn)dlsym(lib, "cuCtxGetCurrent");
    p_ctx_set = (ctx_set_fn)dlsym(lib, "cuCtxSetCurrent");
    p_stream_sync = (event_fn)dlsym(lib, "cuStreamSynchronize");
    p_stream_wait = (stream_wait_fn)dlsym(lib, "cuStreamWaitEvent");
    p_host_dev_ptr = (host_dev_ptr_fn)dlsym(lib, "cuMemHostGetDevicePointer_v2");
    int events = p_event_create && p_event_destroy && p_event_sync && p_event_query && p_event_record &&
                 p_ctx_get && p_ctx_set && p_stream_wait;
    return p_htod && p_dtoh && events ? 0 : -ENOSYS;
}

/* The batched call this driver has: 2: cuMemcpyBatchAsync_v2 (CUDA 13), 1: cuMemcpyBatchAsync
 * (12.8/12.9), 0: none (per-copy calls only). */
int ukv_cuda_batch_mode(void) { return p_batch_v2 ? 2 : p_batch_v1 ? 1 : 0; }

static int copy_one_by_one(size_t n, const uint64_t *dsts, const uint64_t *srcs, const size_t *sizes, int to_host,
                           void *stream) {
    for (size_t i = 0; i < n; i++) {
        int rc = to_host ? p_dtoh((void *)(uintptr_t)dsts[i], srcs[i], sizes[i], stream)
                         : p_htod(dsts[i], (const void *)(uintptr_t)srcs[i], sizes[i], stream);
        if (rc) return rc;
    }
    return 0;
}

/* Enqueue the copies of nblocks blocks (every tensor) on `stream`, the way `path` (the caller's,
 * one per copier) says: one batched driver call when path->batch is set and the driver has
 * cuMemcpyBatchAsync, else one call per tensor and block. A refused batch call is kept in
 * path->batch_error, and that path's copies go one by one from then on. Returns 0 or the CUresult. */
int ukv_cuda_copy(struct ukv_cuda_path *path, unsigned ntensors, const uint64_t *bases,
                  const uint64_t *block_bytes, const uint64_t *slot_offsets, int to_slot, unsigned nblocks,
                  const uint64_t *slot_addrs, const int64_t *gpu_blocks, uint64_t stream) {
    void *s = (void *)(uintptr_t)stream;
    size_t n = (size_t)ntensors * nblocks;
    uint64_t *dsts = malloc(n * sizeof *dsts), *srcs = malloc(n * sizeof *srcs);
    size_t *sizes = malloc(n * sizeof *sizes);
    if (!dsts || !srcs || !sizes) { free(dsts); free(srcs); free(sizes); return 2; /* CUDA_ERROR_OUT_OF_MEMORY */ }
    size_t k = 0;
    for (unsigned b = 0; b < nblocks; b++) {
        for (unsigned t = 0; t < ntensors; t++, k++) {
            uint64_t dev = bases[t] + (uint64_t)gpu_blocks[b] * block_bytes[t];
            uint64_t host = slot_addrs[b] + slot_offsets[t];
            dsts[k] = to_slot ? host : dev;
            srcs[k] = to_slot ? dev : host;
            sizes[k] = block_bytes[t];
        }
    }
    int rc = -1, mode = path->batch && !path->batch_error ? ukv_cuda_batch_mode() : 0;
    if (mode) {
        ukv_memcpy_attributes attr;
        memset(&attr, 0, sizeof attr);
        attr.src_access_order = UKV_ORDER_STREAM;
        attr.src_hint.type = to_slot ? UKV_LOC_DEVICE : UKV_LOC_HOST;
        attr.dst_hint.type = to_slot ? UKV_LOC_HOST : UKV_LOC_DEVICE;
        size_t attr_idx = 0, fail_idx = 0;
        rc = mode == 2 ? p_batch_v2(dsts, srcs, sizes, n, &attr, &attr_idx, 1, s)
                       : p_batch_v1(dsts, srcs, sizes, n, &attr, &attr_idx, 1, &fail_idx, s);
        /* A refused batch may have enqueued some copies; redoing them all moves the same bytes again. */
        if (rc) path->batch_error = rc;
    }
    if (rc) rc = copy_one_by_one(n, dsts, srcs, sizes, to_slot, s);
    free(dsts); free(srcs); free(sizes);
    return rc;
}

/* Events and contexts through the driver, so that one copy call from Python is one C call: make
 * the engine's context current on this thread (a no-op when it is), enqueue the copies, record
 * `done_event`. (The caller's ordering is put into the copy streams when a batch is called.) */
int ukv_cuda_ctx_current(uint64_t *ctx) { return p_ctx_get(ctx); }

static int use_ctx(uint64_t ctx) {
    uint64_t current = 0;
    int rc = p_ctx_get(&current);
    if (rc == 0 && current != ctx) rc = p_ctx_set(ctx);
    return rc;
}

/* Make `ctx` current on the calling thread (a worker about to use the driver directly). */
int ukv_cuda_ctx_use(uint64_t ctx) { return use_ctx(ctx); }

/* Calls made on the caller's own threads (the event loop's) borrow `ctx` for the call and then
 * give the thread back the context it had: the CUDA runtime takes a thread's current device from
 * its current context, so leaving ours there would move the caller's current device. */
static int borrow_ctx(uint64_t ctx, uint64_t *prev) {
    *prev = ctx;
    int rc = p_ctx_get(prev);
    if (rc) *prev = ctx;
    else if (*prev != ctx) rc = p_ctx_set(ctx);
    return rc;
}

static int give_back_ctx(uint64_t ctx, uint64_t prev, int rc) {
    if (prev != ctx) {
        int back = p_ctx_set(prev);
        if (!rc) rc = back;
    }
    return rc;
}

int ukv_cuda_event_new(uint64_t ctx, uint64_t *event) {
    uint64_t prev;
    int rc = borrow_ctx(ctx, &prev);
    if (!rc) rc = p_event_create(event, UKV_EVENT_BLOCKING_SYNC | UKV_EVENT_DISABLE_TIMING);
    return give_back_ctx(ctx, prev, rc);
}

int ukv_cuda_event_free(uint64_t ctx, uint64_t event) {
    uint64_t prev;
    int rc = borrow_ctx(ctx, &prev);
    if (!rc) rc = p_event_destroy(event);
    return give_back_ctx(ctx, prev, rc);
}

/* Order `nstreams` streams after the work on `caller`: record `event` there, then make each stream
 * wait for it. A stream waits for the record current when it is told to wait, so one event serves
 * every batch. `caller` 0 is the legacy default stream of `ctx`, which is why the context is
 * borrowed for the call. */
int ukv_cuda_order_after(uint64_t ctx, uint64_t caller, uint64_t event, const uint64_t *streams, unsigned nstreams) {
    uint64_t prev;
    int rc = borrow_ctx(ctx, &prev);
    if (!rc) rc = p_event_record(event, (void *)(uintptr_t)caller);
    for (unsigned i = 0; i < nstreams && !rc; i++) rc = p_stream_wait((void *)(uintptr_t)streams[i], event, 0);
    return give_back_ctx(ctx, prev, rc);
}

/* Blocks (sleeping in the driver: the events are BLOCKING_SYNC) until the event has fired. */
int ukv_cuda_event_sync(uint64_t ctx, uint64_t event) {
    int rc = use_ctx(ctx);
    return rc ? rc : p_event_sync(event);
}

/* The device's address of pinned host memory at `host` (registered or allocated by CUDA, mapped:
 * cudaHostRegister's default on a 64-bit system), for kernels that read and write it over the bus. */
int ukv_cuda_host_device_pointer(uint64_t ctx, uint64_t host, uint64_t *dev) {
    if (!p_host_dev_ptr) return 999; /* CUDA_ERROR_UNKNOWN: the driver has no such call */
    uint64_t prev;
    int rc = borrow_ctx(ctx, &prev);
    if (!rc) rc = p_host_dev_ptr(dev, (void *)(uintptr_t)host, 0);
    return give_back_ctx(ctx, prev, rc);
}

/* 0: fired; 600 (CUDA_ERROR_NOT_READY): not yet; anything else: an error. */
int ukv_cuda_event_query(uint64_t event) { return p_event_query(event); }

int ukv_cuda_copy_evented(struct ukv_cuda_path *path, uint64_t ctx, uint64_t done_event, unsigned ntensors,
                          const uint64_t *bases, const uint64_t *block_bytes, const uint64_t *slot_offsets,
                          int to_slot, unsigned nblocks, const uint64_t *slot_addrs, const int64_t *gpu_blocks,
                          uint64_t stream) {
    void *s = (void *)(uintptr_t)stream;
    int rc = use_ctx(ctx);
    if (!rc) rc = ukv_cuda_copy(path, ntensors, bases, block_bytes, slot_offsets, to_slot, nblocks, slot_addrs,
                                gpu_blocks, stream);
    if (!rc) rc = p_event_record(done_event, s);
    return rc;
}

/* The staged path: one copy per block between the host slot and its device staging slot (the
 * whole block, all tensors), and one scatter/gather kernel that moves every tensor's piece between
 * the device staging slot and the cache tensors. 1 + 1/nblocks driver calls per block instead of
 * one per tensor. With `used_bytes` 0 there is no device staging (the mapped path): `dev_slots`
 * are the host slots' device addresses, and the kernel alone moves the pieces over the bus, one
 * driver call per UKV_STAGED_MAX blocks. _cuda.py's kernel source takes UKV_STAGED_MAX (ukv.h)
 * through cffi; its struct UkvBlocks must match struct ukv_blocks. */
struct ukv_blocks { uint64_t staging[UKV_STAGED_MAX]; int64_t gpu[UKV_STAGED_MAX]; };

int ukv_cuda_copy_staged(uint64_t ctx, uint64_t func, uint64_t table, unsigned ntensors, uint64_t used_bytes,
                         int to_slot, unsigned nblocks, const uint64_t *slot_addrs, const uint64_t *dev_slots,
                         const int64_t *gpu_blocks, uint64_t stream, uint64_t done_event) {
    void *s = (void *)(uintptr_t)stream;
    if (!p_launch) return 999; /* CUDA_ERROR_UNKNOWN: the driver has no cuLaunchKernel */
    int rc = use_ctx(ctx);
    for (unsigned first = 0; !rc && first < nblocks; first += UKV_STAGED_MAX) {
        unsigned n = nblocks - first < UKV_STAGED_MAX ? nblocks - first : UKV_STAGED_MAX;
        struct ukv_blocks b;
        memset(&b, 0, sizeof b);
        for (unsigned i = 0; i < n; i++) {
            b.staging[i] = dev_slots[first + i];
            b.gpu[i] = gpu_blocks[first + i];
        }
        int direction = to_slot;
        void *params[] = {&table, &b, &direction};
        if (!to_slot && used_bytes)
            for (unsigned i = 0; !rc && i < n; i++)
                rc = p_htod(dev_slots[first + i], (const void *)(uintptr_t)slot_addrs[first + i], used_bytes, s);
        if (!rc) rc = p_launch(func, ntensors, n, 1, 256, 1, 1, 0, s, params, NULL);
        if (to_slot && used_bytes)
            for (unsigned i = 0; !rc && i < n; i++)
                rc = p_dtoh((void *)(uintptr_t)slot_addrs[first + i], dev_slots[first + i], used_bytes, s);
    }
    if (!rc) rc = p_event_record(done_event, s);
    return rc;
}

/* The driver calls of the native copier's threads (copier.c), each in the thread's current context.
 * Whether the driver has what a CUDA copier's threads call: */
int ukv_cuda_has_job_calls(void) { return p_launch && p_event_sync && p_event_query; }

/* Launch the waiting kernel `func` (tests' slowed copies) for `cycles` GPU clock cycles. */
int ukv_cuda_spin(uint64_t func, int64_t cycles, uint64_t stream) {
    long long arg = cycles;
    void *params[] = {&arg};
    return p_launch(func, 1, 1, 1, 1, 1, 1, 0, (void *)(uintptr_t)stream, params, NULL);
}

/* Sleep in the driver until `event` (BLOCKING_SYNC) has fired. */
int ukv_cuda_event_wait(uint64_t event) { return p_event_sync(event); }

void ukv_cuda_event_drop(uint64_t event) { p_event_destroy(event); }

/* Wait for everything on `stream` (a failed job's partly enqueued copies), when the driver can. */
void ukv_cuda_stream_drain(uint64_t stream) {
    if (p_stream_sync) p_stream_sync(stream);
}
