/* A stand-in for libcuda.so.1 with the entry points uring_kv resolves: every call is appended to
 * the file named by FAKE_CUDA_LOG with the thread's current context at that moment, so a test on a
 * machine without a GPU can check which driver calls uring_kv makes, in what order, and in which
 * context. cuEventRecord on the stream 0xbad fails (CUDA_ERROR_LAUNCH_FAILED, 719); a batched copy
 * on the stream 0xba7 is refused (CUDA_ERROR_INVALID_VALUE, 1).
 *
 * Events 0x1000-0x1fff fire only when the test says so (fake_fire): until then cuEventQuery answers
 * CUDA_ERROR_NOT_READY (600) and cuEventSynchronize waits. Every other event has always fired. */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

static int fired[0x1000];

static int held(uint64_t event) {
    return event >= 0x1000 && event < 0x2000 && !__atomic_load_n(&fired[event - 0x1000], __ATOMIC_ACQUIRE);
}

void fake_fire(uint64_t event) {
    if (event >= 0x1000 && event < 0x2000) __atomic_store_n(&fired[event - 0x1000], 1, __ATOMIC_RELEASE);
}

static __thread uint64_t current;

static void logf_(const char *call, uint64_t a, uint64_t b) {
    const char *path = getenv("FAKE_CUDA_LOG");
    FILE *f = path ? fopen(path, "a") : NULL;
    if (!f) return;
    fprintf(f, "%s %#llx %#llx ctx=%#llx\n", call, (unsigned long long)a, (unsigned long long)b,
            (unsigned long long)current);
    fclose(f);
}

int cuCtxGetCurrent(uint64_t *ctx) { *ctx = current; return 0; }
int cuCtxSetCurrent(uint64_t ctx) { logf_("set", ctx, 0); current = ctx; return 0; }
int cuEventCreate(uint64_t *event, unsigned flags) {
    static uint64_t next = 0xe0;
    *event = next++;
    logf_("create", *event, flags);
    return 0;
}
int cuEventDestroy_v2(uint64_t event) { logf_("destroy", event, 0); return 0; }
int cuEventSynchronize(uint64_t event) {
    logf_("sync", event, 0);
    struct timespec pause = {0, 100000};
    while (held(event)) nanosleep(&pause, NULL);
    return 0;
}
int cuEventQuery(uint64_t event) { return held(event) ? 600 : 0; }
int cuEventRecord(uint64_t event, void *stream) {
    logf_("record", event, (uint64_t)(uintptr_t)stream);
    return (uintptr_t)stream == 0xbad ? 719 : 0;
}
int cuStreamWaitEvent(void *stream, uint64_t event, unsigned flags) {
    (void)flags;
    logf_("wait", (uint64_t)(uintptr_t)stream, event);
    return 0;
}
int cuStreamSynchronize(uint64_t stream) { logf_("stream_sync", stream, 0); return 0; }
int cuMemcpyHtoDAsync_v2(uint64_t dst, const void *src, size_t n, void *stream) {
    (void)src; (void)n;
    logf_("htod", dst, (uint64_t)(uintptr_t)stream);
    return 0;
}
int cuMemcpyDtoHAsync_v2(void *dst, uint64_t src, size_t n, void *stream) {
    (void)dst; (void)n;
    logf_("dtoh", src, (uint64_t)(uintptr_t)stream);
    return 0;
}
int cuMemcpyBatchAsync_v2(uint64_t *dsts, uint64_t *srcs, size_t *sizes, size_t count, void *attrs,
                          size_t *attr_idxs, size_t num_attrs, void *stream) {
    (void)dsts; (void)srcs; (void)sizes; (void)attrs; (void)attr_idxs; (void)num_attrs;
    logf_("batch", count, (uint64_t)(uintptr_t)stream);
    return (uintptr_t)stream == 0xba7 ? 1 : 0;
}
int cuLaunchKernel(uint64_t func, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by, unsigned bz,
                   unsigned shmem, void *stream, void **params, void **extra) {
    (void)gx; (void)gy; (void)gz; (void)bx; (void)by; (void)bz; (void)shmem; (void)params; (void)extra;
    logf_("launch", func, (uint64_t)(uintptr_t)stream);
    return 0;
}
