/* A stand-in for libcuda.so.1 with the entry points uring_kv resolves: every call is appended to
 * the file named by FAKE_CUDA_LOG with the thread's current context at that moment, so a test on a
 * machine without a GPU can check which driver calls uring_kv makes, in what order, and in which
 * context. cuEventRecord on the stream 0xbad fails (CUDA_ERROR_LAUNCH_FAILED, 719). */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>

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
int cuEventSynchronize(uint64_t event) { logf_("sync", event, 0); return 0; }
int cuEventQuery(uint64_t event) { (void)event; return 0; }
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
    (void)dst; (void)src; (void)n; (void)stream;
    return 0;
}
int cuMemcpyDtoHAsync_v2(void *dst, uint64_t src, size_t n, void *stream) {
    (void)dst; (void)src; (void)n; (void)stream;
    return 0;
}
