/* uring_kv's C side, compiled into one extension by build_ffi.py (cffi API mode), liburing linked
 * statically. This header declares what the extension exposes (build_ffi.py's cdef mirrors it) and
 * the little its files share. One file per concern:
 *
 *   ring.c     an io_uring instance: set-up, registrations, batched submit; liburing's version and
 *              the statx DIO alignment
 *   pump.c     pumps: batches run in C on a ring (I/O, memcpys or copy jobs, refills), the pumped
 *              reap and the collection of their finished copy jobs; the block-array helpers that
 *              prepare and check their input
 *   ringthread.c  the ring thread: a C thread that waits for the ring's completions and the
 *              copier's pump jobs and moves the pumps, telling the loop only when a pump hands
 *              slots back or an op of its own completes
 *   copier.c   the native copier: submit threads and a bridge running copy jobs without the GIL;
 *              host memcpys of blocks. It knows nothing of pumps: they queue owned jobs and take
 *              them back through the interface below ("copier.c"), so calls go one way, pump.c to
 *              copier.c, and no two files call each other
 *   cuda.c     the CUDA driver, resolved at run time: block copies (batched, per piece, staged),
 *              contexts and events
 *   ceiling.c  the bench's disk ceiling: block I/Os in a C loop, no Python
 *   identity.c the benches' check (and scrub) of the identity pattern in the rows they loaded
 *   fsfiles.c  the bench's port of vLLM's fs tier block I/O: a file per block, a batch per call
 *
 * Every function batches a loop that would otherwise cost one Python->C call per item: submit N
 * SQEs, reap N CQEs, enqueue N copies. Errors are returned as -errno (or a CUresult for the CUDA
 * functions); turning them into exceptions is the Python side's job. */
#ifndef UKV_H
#define UKV_H

#ifndef _GNU_SOURCE
#define _GNU_SOURCE
#endif
#include <dlfcn.h>
#include <errno.h>
#include <fcntl.h>
#include <linux/stat.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <sys/uio.h>
#include <time.h>
#include <unistd.h>

#include <pthread.h>
#include <sys/eventfd.h>

#include <liburing.h>

#ifndef IO_URING_VERSION_MAJOR /* liburing before 2.4 has no version macros */
#define IO_URING_VERSION_MAJOR 0
#define IO_URING_VERSION_MINOR 0
#endif
#ifndef IORING_SETUP_SINGLE_ISSUER
#define IORING_SETUP_SINGLE_ISSUER (1U << 12)
#endif
#ifndef IORING_SETUP_DEFER_TASKRUN
#define IORING_SETUP_DEFER_TASKRUN (1U << 13)
#endif

/* ---- ring.c ------------------------------------------------------------------------------------ */

enum { UKV_OP_READ, UKV_OP_READ_FIXED, UKV_OP_WRITE, UKV_OP_WRITE_FIXED, UKV_OP_READV, UKV_OP_WRITEV,
       UKV_OP_NOP };

struct ukv_op {
    uint8_t opcode; uint8_t sqe_flags; uint16_t buf_index; int32_t fd;
    uint64_t addr; uint32_t len; uint64_t offset; uint64_t user_data;
};

struct ukv_pump;
#define UKV_MAX_PUMPS 256
#define UKV_PUMP_TAG (1ULL << 63)
#define UKV_LATER_MAX 256 /* loads' memcpys one reap pass may put off (pump_complete) */
#define UKV_CTL_TAG (1ULL << 62) /* user_data of the ring thread's own polls (ringthread.c) */
#define UKV_JOB_FAILS 16 /* failed pump copy jobs the ring thread keeps for the loop to report */

struct ukv_ring {
    struct io_uring ring;
    unsigned flags, features, cq_entries;
    struct ukv_pump *pumps[UKV_MAX_PUMPS]; /* attached pumps, by id (see ukv_pump_attach) */
    unsigned io_cap;      /* most pump I/Os in flight at once (0: no limit), see ukv_ring_pump_depth */
    unsigned io_inflight; /* pump I/Os in flight */
    unsigned io_peak;     /* the most there ever were */
    unsigned nparked;     /* pumps' slots waiting for room under io_cap */
    uint64_t park_clock;  /* slots parked so far: their turn for room (ukv_pump.park_seq) */
    int64_t store_aging_ns; /* a store's pump that started no I/O for this long takes the next room (0: never) */
    unsigned prefetch_cap; /* while a demand load's pump runs, prefetches start I/O only below this (0: no cap) */
    int pump_hi;          /* pump ids in use lie below this */
    unsigned copies_due;  /* pumps' slots whose copy is due, not yet queued as a job */
    int32_t touched[UKV_MAX_PUMPS]; /* pumps that moved in this call, each once */
    unsigned ntouched;
    uint64_t copied_late; /* loads' memcpys done after the refills of the same reap pass (copy_later) */
    uint64_t io_done;     /* pump I/Os completed so far */
    /* Every entry point below that touches the ring or a pump holds `mu`: uncontended unless the
     * ring thread runs (ringthread.c), which moves the pumps while the loop submits and reads. */
    pthread_mutex_t mu;
    int threaded;         /* the ring thread runs: it alone reaps the CQ */
    pthread_t thread;
    int notify_fd, stop_fd; /* the loop's eventfd (written when it has something to take); the thread's stop */
    int notified;         /* notify_fd written since the loop last took (ukv_ring_take) */
    struct ukv_copier *copier; /* whose pump jobs the thread collects (ukv_ring_watch_copier), or NULL */
    int copier_fd;        /* that copier's eventfd for pump jobs */
    uint64_t *out_ud;     /* completions of ops not of pumps, reaped by the thread for the loop */
    int32_t *out_res;
    unsigned nout, out_cap;
    int submit_error;     /* the thread's last failed submission (-errno), for the loop */
    int32_t job_rc[UKV_JOB_FAILS], job_where[UKV_JOB_FAILS]; /* pump copy jobs that failed, for the loop */
    unsigned njob_fails;
    uint64_t wakeups, notifies; /* the thread's wake-ups, and the loop's */
    /* Where pumps' slots spend their time (ukv_ring_phases): I/Os submitted -> completed, and
     * copies due -> their job collected (copier pumps only), counts and ns summed. */
    uint64_t io_timed, copies_timed;
    int64_t io_ns, copy_ns;
};

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
const char *ukv_liburing_version(void);
int ukv_dio_align(int fd, uint32_t *mem_align, uint32_t *offset_align);

static inline int submit_retry(struct io_uring *ring) {
    int ret;
    do { ret = io_uring_submit(ring); } while (ret == -EINTR);
    return ret;
}

static inline int64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000LL + ts.tv_nsec;
}

/* ---- pump.c (struct ukv_pump is described there) ----------------------------------------------- */

struct ukv_copier;
struct ukv_job;

struct ukv_pump {
    int id, write, fd, fixed_buffers;
    unsigned sqe_flags;
    uint64_t stride;
    unsigned ntensors;
    const uint64_t *bases, *block_bytes, *slot_offsets;
    unsigned nblocks;
    const uint64_t *offsets;   /* file offset of each block */
    const int64_t *cache;      /* cache block of each block */
    const int32_t *waiting;    /* waiting for a slot: [0] demand loads, [1] prefetches, [2] stores */
    int klass;                 /* its class: 0 demand load, 1 prefetch, 2 store (room and slots go to
                                * the lower first); Python may lower it while the pump runs */
    unsigned max_slots;        /* slots are named by their index in the pool, below this */
    uint64_t expect;           /* bytes each read or write moves: the stride, or the block's pieces */
    struct iovec *slot_iov;    /* scatter loads: each slot's iovecs (ntensors each), else NULL */
    uint64_t *slot_addr;
    int32_t *slot_buf;         /* registered-buffer index, or -1 */
    int32_t *slot_block;       /* block in the slot, or -1 */
    unsigned next;             /* blocks started */
    unsigned inflight;         /* slots held (each carrying a block, or parked for I/O room) */
    int stop, touched;
    uint32_t *released;        /* slots handed back since Python last looked */
    unsigned nreleased;
    uint32_t *failed;          /* blocks that failed, with their errno */
    int32_t *fail_errno;
    unsigned nfailed;
    struct ukv_copier *copier; /* copies go to its threads (NULL: memcpy in the reap) */
    const uint64_t *dev_slots; /* CUDA: the device staging slot of each pool slot, else NULL */
    unsigned copy_blocks;      /* most blocks per copy job */
    uint8_t *state;            /* SLOT_* of each slot */
    uint32_t *copy_q;          /* slots whose copy is due, not yet queued as a job */
    unsigned ncopy;
    uint32_t *parked;          /* held slots waiting for I/O room, a ring buffer from park_head */
    unsigned park_head, nparked;
    uint64_t *park_seq;        /* of each parked slot: the ring's park_clock when it parked */
    int64_t *since;            /* of each slot: when its I/O was submitted or its copy fell due (ns) */
    unsigned parked_empty;     /* of those, slots with no block yet (a load's next read) */
    int64_t progressed_ns;     /* when it last started an I/O, or was made: a store's age for room */
};

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
/* A pump's state for the loop, read under the ring's lock: out[0] blocks started, [1] slots held,
 * [2] of them parked without a block, [3] stopped, [4] slots handed back and not yet taken. */
void ukv_pump_state(struct ukv_ring *r, struct ukv_pump *p, uint32_t *out);
unsigned ukv_pump_take_released(struct ukv_ring *r, struct ukv_pump *p, uint32_t *out);
void ukv_pump_stop(struct ukv_ring *r, struct ukv_pump *p);
void ukv_pump_set_class(struct ukv_ring *r, struct ukv_pump *p, int klass);
/* pump.c's side of the ring thread: what one wake-up does (under the lock) */
unsigned ring_reap(struct ukv_ring *r, uint64_t *user_data, int32_t *res, unsigned max, int *submit_error,
                   int64_t budget_ns, int *more, unsigned *ctl);
int ring_collect_jobs(struct ukv_ring *r, struct ukv_job **jobs, unsigned k);
void take_touched(struct ukv_ring *r, int32_t *touched, unsigned *ntouched);
int ring_wants_loop(const struct ukv_ring *r);
unsigned ukv_ring_collect(struct ukv_ring *r, struct ukv_copier *c, unsigned max, uint64_t *tokens, int32_t *rcs,
                          int32_t *wheres, int64_t *done_ns, int32_t *touched, unsigned *ntouched, int *submit_error);

/* ---- ringthread.c ------------------------------------------------------------------------------ */

int ukv_ring_thread_start(struct ukv_ring *r, int notify_fd);
void ukv_ring_thread_stop(struct ukv_ring *r);
int ukv_ring_watch_copier(struct ukv_ring *r, struct ukv_copier *c);
void ukv_ring_unwatch_copier(struct ukv_ring *r);
unsigned ukv_ring_take(struct ukv_ring *r, uint64_t *user_data, int32_t *res, unsigned max, int32_t *touched,
                       unsigned *ntouched, int *submit_error);
uint64_t ukv_ring_thread_wakeups(struct ukv_ring *r, uint64_t *notifies);
unsigned ukv_ring_take_job_fails(struct ukv_ring *r, int32_t *rcs, int32_t *wheres);

/* The iovecs of one block's I/O straight into or out of the cache rows, one per tensor: row_bytes[t]
 * bytes of tensor t at row cache_block (the pumps' scatter path and the bench's rows ceiling). */
static inline void row_iovecs(struct iovec *iov, unsigned ntensors, const uint64_t *bases, const uint64_t *row_bytes,
                              int64_t cache_block) {
    for (unsigned t = 0; t < ntensors; t++) {
        iov[t].iov_base = (void *)(uintptr_t)(bases[t] + (uint64_t)cache_block * row_bytes[t]);
        iov[t].iov_len = row_bytes[t];
    }
}

/* Move one padded block between a staging slot and every cache tensor (the memcpys of pumps and of
 * the host copier). */
static inline void copy_block(unsigned ntensors, const uint64_t *bases, const uint64_t *block_bytes,
                              const uint64_t *slot_offsets, int to_slot, uint64_t slot_addr, int64_t cache_block) {
    for (unsigned t = 0; t < ntensors; t++) {
        char *cache = (char *)(uintptr_t)(bases[t] + (uint64_t)cache_block * block_bytes[t]);
        char *slot = (char *)(uintptr_t)(slot_addr + slot_offsets[t]);
        if (to_slot) memcpy(slot, cache, block_bytes[t]);
        else memcpy(cache, slot, block_bytes[t]);
    }
}

/* ---- copier.c ---------------------------------------------------------------------------------- */

enum { UKV_JOB_COPY = 0, UKV_JOB_MARK = 1 };
enum { UKV_FAIL_ENQUEUE = 1, UKV_FAIL_WAIT = 2 };
#define UKV_TAKE_MAX 256 /* most finished jobs one ukv_copier_done call takes */

/* A copy job. Its taker reads the finished ones it got from ukv_copier_take (token, rc, where,
 * done_ns; for an owned job `owner` and its n `tags`) and frees each with ukv_job_free. */
struct ukv_job {
    struct ukv_job *next;
    uint64_t token, event;
    int64_t done_ns;
    int64_t queued_ns, start_ns, enqueued_ns; /* put; taken by its submit thread; its copies enqueued */
    int32_t kind, to_slot, rc, where;
    unsigned n;
    uint64_t *slot_addrs, *dev_slots;
    int64_t *gpu_blocks;
    void *owner;   /* an owned job's (a pump's), else NULL: its event comes from the copier's own pool */
    uint32_t *tags; /* an owned job's, one per block (a pump's slots) */
    uint64_t data[];
};

int ukv_host_copy(unsigned ntensors, const uint64_t *bases, const uint64_t *block_bytes,
                  const uint64_t *slot_offsets, int to_slot, unsigned nblocks,
                  const uint64_t *slot_addrs, const int64_t *gpu_blocks);
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
/* The copy jobs' phases since the last reset, per direction d (0: to the caches, 1: to the slots),
 * out[6 d + i]: i = 0 jobs, 1 blocks, then ns summed: 2 queued -> taken by the submit thread,
 * 3 enqueueing (driver calls, or the memcpys in host mode), 4 enqueued -> seen done (the GPU and
 * the bridge), 5 done -> taken by the loop or the ring thread. */
#define UKV_PHASES 12
void ukv_copier_phases(struct ukv_copier *c, int reset, int64_t *out);
void ukv_copier_free(struct ukv_copier *c);

/* The pumps' side of the copier (pump.c calls these, the copier calls nothing of pump.c): an owned
 * job carries its owner and a tag per block back to whoever takes it from the done list. */
int ukv_copier_put_owned(struct ukv_copier *c, uint64_t token, int to_slot, unsigned n, const uint64_t *slot_addrs,
                         const uint64_t *dev_slots, const int64_t *gpu_blocks, void *owner, const uint32_t *tags);
unsigned ukv_copier_take(struct ukv_copier *c, unsigned max, struct ukv_job **out);
void ukv_job_free(struct ukv_job *j);
/* Owned jobs from now on finish on a list of their own, signalled on the eventfd returned (made on
 * the first call; -errno), and taken with ukv_copier_take_owned: the ring thread's. */
int ukv_copier_route_owned(struct ukv_copier *c);
unsigned ukv_copier_take_owned(struct ukv_copier *c, unsigned max, struct ukv_job **out);

/* ---- cuda.c ------------------------------------------------------------------------------------ */

/* Blocks one launch of the staged path's kernel moves. _cuda.py's kernel source takes it from here
 * (through cffi); its struct UkvBlocks must match struct ukv_blocks in cuda.c. */
#define UKV_STAGED_MAX 8

/* How one copier's per-piece copies go: `batch` 1: through the driver's batched call when it has one,
 * 0: one call per piece; `batch_error`: the CUresult of the first batch call the driver refused (0:
 * none), after which they go one by one. */
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

/* For copier.c's threads: the driver calls they make, each in the thread's current context. */
int ukv_cuda_has_job_calls(void);
int ukv_cuda_spin(uint64_t func, int64_t cycles, uint64_t stream);
int ukv_cuda_event_wait(uint64_t event);
void ukv_cuda_event_drop(uint64_t event);
void ukv_cuda_stream_drain(uint64_t stream);

/* ---- ceiling.c --------------------------------------------------------------------------------- */

int64_t ukv_ring_loop(int fd, int write, unsigned depth, uint64_t block_bytes,
                      const uint64_t *offsets, unsigned n, uint64_t buf_base, int fixed, int async,
                      unsigned ntensors, const uint64_t *bases, const uint64_t *row_bytes,
                      const int64_t *cache_blocks);

/* ---- identity.c -------------------------------------------------------------------------------- */

int ukv_check_identity(uint64_t *words, uint64_t rows, uint64_t row_words, const int64_t *numbers, int scrub);

/* ---- fsfiles.c --------------------------------------------------------------------------------- */

/* Each returns the blocks done before the first failure (n: all), its errno in *err (0: none). */
unsigned ukv_fs_store_blocks(const char *const *tmp_paths, const char *const *dest_paths, const uint64_t *bufs,
                             unsigned n, uint64_t size, int o_direct, int *err);
unsigned ukv_fs_load_blocks(const char *const *paths, const uint64_t *bufs, unsigned n, uint64_t size, int o_direct,
                            int *err);

#endif
