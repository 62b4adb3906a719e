/* C helpers for uring_kv, compiled by build_ffi.py (cffi API mode), liburing linked statically.
 *
 * Every function here batches a loop that would otherwise cost one Python->C call per item:
 * submit N SQEs, reap N CQEs, enqueue N copies. Errors are returned as -errno (or a CUresult for
 * the CUDA helpers); turning them into exceptions is the Python side's job. */
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

struct ukv_ring {
    struct io_uring ring;
    unsigned flags, features, cq_entries;
    struct ukv_pump *pumps[UKV_MAX_PUMPS]; /* attached pumps, by id (see ukv_pump_attach) */
    unsigned io_cap;      /* most pump I/Os in flight at once (0: no limit), see ukv_ring_pump_depth */
    unsigned io_inflight; /* pump I/Os in flight */
    unsigned io_peak;     /* the most there ever were */
    unsigned nparked;     /* pumps' slots waiting for room under io_cap */
    unsigned copies_due;  /* pumps' slots whose copy is due, not yet queued as a job */
    int32_t touched[UKV_MAX_PUMPS]; /* pumps that moved in this call, each once */
    unsigned ntouched;
    uint64_t copied_late; /* loads' memcpys done after the refills of the same reap pass (copy_later) */
};

int ukv_ring_open(unsigned entries, unsigned cq_entries, unsigned flags, struct ukv_ring **out) {
    struct ukv_ring *r = calloc(1, sizeof *r);
    if (!r) return -ENOMEM;
    struct io_uring_params p;
    memset(&p, 0, sizeof p);
    p.flags = flags | IORING_SETUP_CQSIZE;
    p.cq_entries = cq_entries;
    int ret = io_uring_queue_init_params(entries, &r->ring, &p);
    if (ret < 0) { free(r); return ret; }
    r->flags = p.flags;
    r->features = p.features;
    r->cq_entries = p.cq_entries;
    *out = r;
    return 0;
}

void ukv_ring_close(struct ukv_ring *r) {
    io_uring_queue_exit(&r->ring);
    free(r);
}

unsigned ukv_ring_info(struct ukv_ring *r, unsigned *flags, unsigned *features, unsigned *cq_entries) {
    *flags = r->flags; *features = r->features; *cq_entries = r->cq_entries;
    return r->ring.sq.ring_entries;
}

int ukv_register_eventfd(struct ukv_ring *r, int fd) { return io_uring_register_eventfd(&r->ring, fd); }

int ukv_register_buffers(struct ukv_ring *r, const uint64_t *addrs, const uint64_t *lens, unsigned n) {
    struct iovec *iov = calloc(n ? n : 1, sizeof *iov);
    if (!iov) return -ENOMEM;
    for (unsigned i = 0; i < n; i++) { iov[i].iov_base = (void *)(uintptr_t)addrs[i]; iov[i].iov_len = lens[i]; }
    int ret = io_uring_register_buffers(&r->ring, iov, n);
    free(iov);
    return ret;
}

int ukv_unregister_buffers(struct ukv_ring *r) { return io_uring_unregister_buffers(&r->ring); }
int ukv_register_files(struct ukv_ring *r, const int *fds, unsigned n) { return io_uring_register_files(&r->ring, fds, n); }
int ukv_unregister_files(struct ukv_ring *r) { return io_uring_unregister_files(&r->ring); }
/* Cap the ring's io-wq workers (bounded: regular file I/O; unbounded: the rest; 0 keeps a value);
 * the previous caps come back in the same places. 0 or -errno (-EINVAL before 5.15). */
int ukv_iowq_max_workers(struct ukv_ring *r, unsigned *bounded, unsigned *unbounded) {
    unsigned values[2] = {*bounded, *unbounded};
    int rc = io_uring_register_iowq_max_workers(&r->ring, values);
    *bounded = values[0];
    *unbounded = values[1];
    return rc;
}

static void prep(struct io_uring_sqe *sqe, const struct ukv_op *op) {
    void *addr = (void *)(uintptr_t)op->addr;
    switch (op->opcode) {
    case UKV_OP_READ: io_uring_prep_read(sqe, op->fd, addr, op->len, op->offset); break;
    case UKV_OP_READ_FIXED: io_uring_prep_read_fixed(sqe, op->fd, addr, op->len, op->offset, op->buf_index); break;
    case UKV_OP_WRITE: io_uring_prep_write(sqe, op->fd, addr, op->len, op->offset); break;
    case UKV_OP_WRITE_FIXED: io_uring_prep_write_fixed(sqe, op->fd, addr, op->len, op->offset, op->buf_index); break;
    case UKV_OP_READV: io_uring_prep_readv(sqe, op->fd, (const struct iovec *)addr, op->len, op->offset); break;
    case UKV_OP_WRITEV: io_uring_prep_writev(sqe, op->fd, (const struct iovec *)addr, op->len, op->offset); break;
    default: io_uring_prep_nop(sqe); break;
    }
    sqe->flags |= op->sqe_flags;
    io_uring_sqe_set_data64(sqe, op->user_data);
}

static int submit_retry(struct io_uring *ring) {
    int ret;
    do { ret = io_uring_submit(ring); } while (ret == -EINTR);
    return ret;
}

/* Queue and submit all n ops; when the SQ fills up, submit what is queued and go on.
 * Returns n, or -errno if the kernel refused a submission (then ops from the failing one on
 * may not have been submitted: the caller treats the ring as broken). */
int ukv_submit(struct ukv_ring *r, const struct ukv_op *ops, unsigned n) {
    for (unsigned i = 0; i < n;) {
        struct io_uring_sqe *sqe = io_uring_get_sqe(&r->ring);
        if (!sqe) {
            int ret = submit_retry(&r->ring);
            if (ret < 0) return ret;
            continue;
        }
        prep(sqe, &ops[i++]);
    }
    int ret = submit_retry(&r->ring);
    return ret < 0 ? ret : (int)n;
}

/* ------------------------------------------------------------------------------------------------
 * Pumps: a batch run in C. Python hands a pump the batch's blocks (file offset, cache block) and,
 * as it acquires them, staging slots. Each slot carries one block at a time: for a load, read into
 * the slot, then (on the CQE) copy the slot into every cache tensor; for a store, copy the tensors
 * into the slot, then write it. When a slot's block is done the pump starts the next block in the
 * same slot, unless the batch is stopped, finished, or another batch waits for a slot (`waiting`:
 * the pool's waiter counts, loads first); then the slot is handed back to Python, which releases
 * its lease. So a slot is only ever released after the last user of it (the kernel's read/write
 * and the copy) is done, exactly as in the Python path, with no Python per block.
 *
 * The copies are memcpys inside the reap (small CPU-mode blocks), or, given a native copier, copy
 * jobs for its threads (CUDA, or large host blocks): the reap queues a job for the slots whose
 * reads completed, and the loop's collection of finished jobs (ukv_copier_done with the ring)
 * moves those slots on: the next block, or back to Python. Under a ring-wide cap on pump I/Os
 * (the engine's io_depth, below its slot count) a slot whose next step is an I/O waits, parked,
 * for room; loads' pumps get room first. */
enum { SLOT_FREE = 0, SLOT_IDLE, SLOT_IO, SLOT_COPY }; /* IDLE: held, parked for I/O room */

struct ukv_copier;
static int copier_put_pump(struct ukv_copier *c, struct ukv_pump *p, const uint32_t *slots, unsigned n);
static void pump_flush(struct ukv_ring *r, struct ukv_pump *p);

struct ukv_pump {
    int id, write, fd, fixed_buffers;
    unsigned sqe_flags;
    uint64_t stride;
    unsigned ntensors;
    const uint64_t *bases, *block_bytes, *slot_offsets;
    unsigned nblocks;
    const uint64_t *offsets;   /* file offset of each block */
    const int64_t *cache;      /* cache block of each block */
    const int32_t *waiting;    /* [0]: loads waiting for a slot, [1]: stores waiting */
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
    unsigned parked_empty;     /* of those, slots with no block yet (a load's next read) */
};

static void copy_block(unsigned ntensors, const uint64_t *bases, const uint64_t *block_bytes,
                       const uint64_t *slot_offsets, int to_slot, uint64_t slot_addr, int64_t cache_block) {
    for (unsigned t = 0; t < ntensors; t++) {
        char *cache = (char *)(uintptr_t)(bases[t] + (uint64_t)cache_block * block_bytes[t]);
        char *slot = (char *)(uintptr_t)(slot_addr + slot_offsets[t]);
        if (to_slot) memcpy(slot, cache, block_bytes[t]);
        else memcpy(cache, slot, block_bytes[t]);
    }
}

/* A pump for nblocks blocks and slots below max_slots, its own arrays in the same allocation (free
 * with ukv_pump_free); offsets, cache, the tensor table and `waiting` belong to the caller and must
 * outlive it. `scatter` (loads only): read each block straight into its cache pieces (one READV,
 * an iovec per tensor) instead of into the slot and then memcpy; the slot then only stands for
 * a place in the queue depth. `copier` (or NULL): copies go to its threads as jobs of at most
 * `copy_blocks` blocks; `dev_slots` (CUDA, or NULL) and `copier` belong to the caller too. NULL
 * when out of memory. */
struct ukv_pump *ukv_pump_new(int write, int fd, unsigned sqe_flags, int fixed_buffers, uint64_t stride,
                              unsigned ntensors, const uint64_t *bases, const uint64_t *block_bytes,
                              const uint64_t *slot_offsets, unsigned nblocks, const uint64_t *offsets,
                              const int64_t *cache, const int32_t *waiting, unsigned max_slots, int scatter,
                              struct ukv_copier *copier, const uint64_t *dev_slots, unsigned copy_blocks) {
    size_t slots = max_slots ? max_slots : 1, blocks = nblocks ? nblocks : 1;
    size_t iovs = scatter && !write ? slots * ntensors : 0;
    struct ukv_pump *p = calloc(1, sizeof *p + slots * sizeof(uint64_t) + iovs * sizeof(struct iovec) +
                                       slots * (2 * sizeof(int32_t) + 3 * sizeof(uint32_t) + 1) +
                                       blocks * (sizeof(uint32_t) + sizeof(int32_t)));
    if (!p) return NULL;
    p->id = -1; p->write = write; p->fd = fd; p->sqe_flags = sqe_flags; p->fixed_buffers = fixed_buffers;
    p->stride = stride; p->ntensors = ntensors; p->bases = bases; p->block_bytes = block_bytes;
    p->slot_offsets = slot_offsets; p->nblocks = nblocks; p->offsets = offsets; p->cache = cache;
    p->waiting = waiting; p->max_slots = max_slots;
    p->slot_addr = (uint64_t *)(p + 1); /* the 8-byte arrays first, then the 4-byte ones */
    p->slot_iov = iovs ? (struct iovec *)(p->slot_addr + slots) : NULL;
    p->slot_buf = (int32_t *)((char *)(p->slot_addr + slots) + iovs * sizeof(struct iovec));
    p->slot_block = p->slot_buf + slots;
    p->released = (uint32_t *)(p->slot_block + slots);
    p->failed = p->released + slots;
    p->fail_errno = (int32_t *)(p->failed + blocks);
    p->copy_q = (uint32_t *)(p->fail_errno + blocks);
    p->parked = p->copy_q + slots;
    p->state = (uint8_t *)(p->parked + slots);
    p->copier = copier; p->dev_slots = dev_slots; p->copy_blocks = copy_blocks ? copy_blocks : 1;
    p->expect = stride;
    if (p->slot_iov) {
        p->expect = 0;
        for (unsigned t = 0; t < ntensors; t++) p->expect += block_bytes[t];
    }
    for (unsigned s = 0; s < max_slots; s++) p->slot_block[s] = -1;
    return p;
}

void ukv_pump_free(struct ukv_pump *p) { free(p); }

/* -1 when every v[i] lies in [0, limit) and, given `seen` (a zeroed bitmap of at least `limit` bits,
 * left zeroed), no value repeats; else the first position that breaks a rule. */
long ukv_check_blocks(const int64_t *v, unsigned n, int64_t limit, uint64_t *seen) {
    long bad = -1;
    unsigned i;
    for (i = 0; i < n; i++) {
        if (v[i] < 0 || v[i] >= limit) { bad = (long)i; break; }
        if (seen) {
            uint64_t bit = 1ULL << (v[i] & 63), *word = &seen[v[i] >> 6];
            if (*word & bit) { bad = (long)i; break; }
            *word |= bit;
        }
    }
    if (seen)
        for (unsigned j = 0; j < i; j++) seen[v[j] >> 6] = 0; /* only this call's bits were set */
    return bad;
}

/* -1 when the bit of every v[i] is set in `bits`; else the first position whose bit is clear
 * (the stored-blocks check of a load: one pass, no Python per block). */
long ukv_first_unset(const int64_t *v, unsigned n, const uint64_t *bits) {
    for (unsigned i = 0; i < n; i++)
        if (!(bits[v[i] >> 6] & (1ULL << (v[i] & 63)))) return (long)i;
    return -1;
}

/* Set (value != 0) or clear the bit of each v[i]. */
void ukv_mark(const int64_t *v, unsigned n, uint64_t *bits, int value) {
    for (unsigned i = 0; i < n; i++) {
        uint64_t bit = 1ULL << (v[i] & 63);
        if (value) bits[v[i] >> 6] |= bit; else bits[v[i] >> 6] &= ~bit;
    }
}

/* out[i] = v[i] * factor (the file offsets of blocks). */
void ukv_scale(const int64_t *v, unsigned n, uint64_t factor, uint64_t *out) {
    for (unsigned i = 0; i < n; i++) out[i] = (uint64_t)v[i] * factor;
}

int ukv_pump_attach(struct ukv_ring *r, struct ukv_pump *p) {
    for (int id = 0; id < UKV_MAX_PUMPS; id++) {
        if (!r->pumps[id]) {
            r->pumps[id] = p;
            p->id = id;
            return id;
        }
    }
    return -EBUSY;
}

void ukv_pump_detach(struct ukv_ring *r, struct ukv_pump *p) {
    if (p->id >= 0 && p->id < UKV_MAX_PUMPS && r->pumps[p->id] == p) r->pumps[p->id] = NULL;
    p->id = -1;
}

/* The attached pump a tagged user_data or job token names (UKV_PUMP_TAG | id << 32 | slot), or NULL. */
static struct ukv_pump *tagged_pump(const struct ukv_ring *r, uint64_t tag) {
    unsigned id = (unsigned)((tag >> 32) & 0x7fffffff);
    return id < UKV_MAX_PUMPS ? r->pumps[id] : NULL;
}

static struct io_uring_sqe *get_sqe(struct ukv_ring *r) {
    struct io_uring_sqe *sqe = io_uring_get_sqe(&r->ring);
    if (!sqe && submit_retry(&r->ring) >= 0) sqe = io_uring_get_sqe(&r->ring);
    return sqe;
}

static int ring_has_room(const struct ukv_ring *r) { return !r->io_cap || r->io_inflight < r->io_cap; }

static void touch(struct ukv_ring *r, struct ukv_pump *p) {
    if (!p->touched) {
        p->touched = 1;
        r->touched[r->ntouched++] = p->id;
    }
}

/* Queue the I/O of the block in slot s: a read into the slot, or a write of it. 0 or -EBUSY. */
static int pump_io(struct ukv_ring *r, struct ukv_pump *p, unsigned s) {
    struct io_uring_sqe *sqe = get_sqe(r);
    if (!sqe) return -EBUSY;
    unsigned b = (unsigned)p->slot_block[s];
    void *slot = (void *)(uintptr_t)p->slot_addr[s];
    int buf = p->fixed_buffers ? p->slot_buf[s] : -1;
    if (p->slot_iov) {
        struct iovec *iov = p->slot_iov + (size_t)s * p->ntensors;
        for (unsigned t = 0; t < p->ntensors; t++) {
            iov[t].iov_base = (void *)(uintptr_t)(p->bases[t] + (uint64_t)p->cache[b] * p->block_bytes[t]);
            iov[t].iov_len = p->block_bytes[t];
        }
        io_uring_prep_readv(sqe, p->fd, iov, p->ntensors, p->offsets[b]);
    } else if (p->write && buf >= 0) io_uring_prep_write_fixed(sqe, p->fd, slot, p->stride, p->offsets[b], buf);
    else if (p->write) io_uring_prep_write(sqe, p->fd, slot, p->stride, p->offsets[b]);
    else if (buf >= 0) io_uring_prep_read_fixed(sqe, p->fd, slot, p->stride, p->offsets[b], buf);
    else io_uring_prep_read(sqe, p->fd, slot, p->stride, p->offsets[b]);
    sqe->flags |= p->sqe_flags;
    io_uring_sqe_set_data64(sqe, UKV_PUMP_TAG | ((uint64_t)p->id << 32) | s);
    p->state[s] = SLOT_IO;
    if (++r->io_inflight > r->io_peak) r->io_peak = r->io_inflight;
    return 0;
}

static void pump_park(struct ukv_ring *r, struct ukv_pump *p, unsigned s) {
    p->state[s] = SLOT_IDLE;
    if (p->slot_block[s] < 0) p->parked_empty++;
    p->parked[(p->park_head + p->nparked++) % p->max_slots] = s;
    r->nparked++;
}

static void pump_due_copy(struct ukv_ring *r, struct ukv_pump *p, unsigned s) {
    p->state[s] = SLOT_COPY;
    p->copy_q[p->ncopy++] = s;
    r->copies_due++;
}

/* Start the pump's next block in the idle slot s it holds: a store with a copier first queues the
 * block's copy into the slot; anything else starts the block's I/O (after a memcpy into the slot
 * for a store without one), or parks the slot while the ring is at its cap. 0, or -EBUSY when no
 * SQE could be had (nothing started). */
static int pump_begin(struct ukv_ring *r, struct ukv_pump *p, unsigned s) {
    int copy_first = p->write && p->copier;
    if (!copy_first && !ring_has_room(r)) {
        pump_park(r, p, s);
        return 0;
    }
    unsigned b = p->next++;
    p->slot_block[s] = (int32_t)b;
    if (copy_first) {
        pump_due_copy(r, p, s);
        return 0;
    }
    if (p->write) copy_block(p->ntensors, p->bases, p->block_bytes, p->slot_offsets, 1, p->slot_addr[s], p->cache[b]);
    if (pump_io(r, p, s) == 0) return 0;
    p->next--;
    p->slot_block[s] = -1;
    return -EBUSY;
}

static int pump_may_refill(const struct ukv_pump *p) {
    if (p->stop || p->next >= p->nblocks) return 0;
    if (p->waiting && (p->waiting[0] || (p->write && p->waiting[1]))) return 0; /* let the waiter have it */
    return 1;
}

static void pump_release(struct ukv_pump *p, unsigned s) {
    p->slot_block[s] = -1;
    p->state[s] = SLOT_FREE;
    p->inflight--;
    p->released[p->nreleased++] = s;
}

static void pump_failed(struct ukv_pump *p, unsigned s, int err) {
    p->failed[p->nfailed] = (uint32_t)p->slot_block[s];
    p->fail_errno[p->nfailed++] = err;
}

/* Slot s is done with its block: the next one, or back to Python. */
static void pump_next_or_release(struct ukv_ring *r, struct ukv_pump *p, unsigned s) {
    p->slot_block[s] = -1;
    p->state[s] = SLOT_IDLE;
    if (pump_may_refill(p) && pump_begin(r, p, s) == 0) return;
    pump_release(p, s);
}

/* Give the pump n more slots (slots[i]: the pool's index of the slot, below max_slots) and start a
 * block in each (while blocks are left); queues their copies and submits. Returns how many slots
 * it kept, -EINVAL for a slot it holds already, or -errno when the submission failed. */
int ukv_pump_add_slots(struct ukv_ring *r, struct ukv_pump *p, unsigned n, const uint32_t *slots,
                       const uint64_t *addrs, const int32_t *bufs) {
    int kept = 0;
    for (unsigned i = 0; i < n; i++) {
        unsigned s = slots[i];
        if (s >= p->max_slots || p->state[s] != SLOT_FREE) return -EINVAL; /* not a slot it may be given */
        p->slot_addr[s] = addrs[i];
        p->slot_buf[s] = bufs[i];
        p->inflight++;
        p->state[s] = SLOT_IDLE;
        if (!p->stop && p->next < p->nblocks && pump_begin(r, p, s) == 0) kept++;
        else pump_release(p, s);
    }
    if (p->ncopy) pump_flush(r, p);
    int ret = submit_retry(&r->ring);
    return ret < 0 ? ret : kept;
}

/* The memcpys pump_complete put off, once the refills are submitted; each slot then takes
 * the pump's next block (room permitting, else it parks: the spare slot of the next round). */
static void copy_later(struct ukv_ring *r, const uint64_t *later, unsigned nlater) {
    for (unsigned i = 0; i < nlater; i++) {
        struct ukv_pump *p = r->pumps[later[i] >> 32];
        unsigned s = (unsigned)later[i];
        if (!p || p->state[s] != SLOT_COPY) continue; /* never while Python keeps the pump attached */
        copy_block(p->ntensors, p->bases, p->block_bytes, p->slot_offsets, 0, p->slot_addr[s], p->cache[p->slot_block[s]]);
        r->copied_late++;
        pump_next_or_release(r, p, s);
    }
}

/* A pump I/O's CQE. A load's memcpy in the reap is put off (queued in `later`, the slot SLOT_COPY
 * until copy_later runs) while a parked slot can take this one's room: the refills then go out
 * before the loop copies the blocks that just completed. */
static void pump_complete(struct ukv_ring *r, struct ukv_pump *p, unsigned s, int32_t res, uint64_t *later,
                          unsigned *nlater) {
    if (s >= p->max_slots || p->state[s] != SLOT_IO) return; /* not ours: never while Python keeps it attached */
    r->io_inflight--;
    if ((uint64_t)(int64_t)res != p->expect) {
        pump_failed(p, s, res < 0 ? -res : EIO);
    } else if (!p->write && !p->slot_iov) {
        if (p->copier) {
            pump_due_copy(r, p, s);
            return;
        }
        if (*nlater < r->nparked && *nlater < UKV_LATER_MAX) {
            p->state[s] = SLOT_COPY;
            later[(*nlater)++] = ((uint64_t)p->id << 32) | s;
            return;
        }
        copy_block(p->ntensors, p->bases, p->block_bytes, p->slot_offsets, 0, p->slot_addr[s], p->cache[p->slot_block[s]]);
    }
    pump_next_or_release(r, p, s);
}

/* A store's block is in slot s (its copy is done): write it, or park the slot while the ring is at
 * its cap. */
static void pump_write(struct ukv_ring *r, struct ukv_pump *p, unsigned s) {
    if (!ring_has_room(r)) {
        pump_park(r, p, s);
        return;
    }
    if (pump_io(r, p, s) == 0) return;
    pump_failed(p, s, EBUSY);
    pump_next_or_release(r, p, s);
}

/* A copy job of the slot's block is over (rc: 0, or why it failed). */
static void pump_copied(struct ukv_ring *r, struct ukv_pump *p, unsigned s, int rc) {
    if (s >= p->max_slots || p->state[s] != SLOT_COPY) return;
    if (!rc && p->write) {
        pump_write(r, p, s);
        return;
    }
    if (rc) pump_failed(p, s, EIO);
    pump_next_or_release(r, p, s);
}

/* Queue the pump's due copies as copy jobs. A job the copier refuses (no memory, or stopping)
 * fails its blocks, and their slots go back to Python. */
static void pump_flush(struct ukv_ring *r, struct ukv_pump *p) {
    r->copies_due -= p->ncopy;
    for (unsigned first = 0; first < p->ncopy; first += p->copy_blocks) {
        unsigned n = p->ncopy - first < p->copy_blocks ? p->ncopy - first : p->copy_blocks;
        if (copier_put_pump(p->copier, p, p->copy_q + first, n) == 0) continue;
        for (unsigned i = 0; i < n; i++) {
            unsigned s = p->copy_q[first + i];
            pump_failed(p, s, EIO);
            pump_release(p, s);
        }
    }
    p->ncopy = 0;
}

/* Parked slots take the room there is, loads' pumps first; then every due copy is queued. Pumps
 * that moved are marked touched. */
static void pumps_settle(struct ukv_ring *r) {
    for (int write = 0; write < 2 && r->nparked && ring_has_room(r); write++) {
        for (int id = 0; id < UKV_MAX_PUMPS && ring_has_room(r); id++) {
            struct ukv_pump *p = r->pumps[id];
            if (!p || p->write != write || !p->nparked) continue;
            touch(r, p);
            while (p->nparked && ring_has_room(r)) {
                unsigned s = p->parked[p->park_head];
                p->park_head = (p->park_head + 1) % p->max_slots;
                p->nparked--;
                r->nparked--;
                if (p->slot_block[s] >= 0) { /* a store's block, copied into the slot (there is room) */
                    pump_write(r, p, s);
                    continue;
                }
                p->parked_empty--;
                if (!(pump_may_refill(p) && pump_begin(r, p, s) == 0)) pump_release(p, s);
            }
        }
    }
    for (int id = 0; id < UKV_MAX_PUMPS && r->copies_due; id++) {
        struct ukv_pump *p = r->pumps[id];
        if (p && p->ncopy) {
            touch(r, p);
            pump_flush(r, p);
        }
    }
}

/* Hand the caller the pumps touched since ntouched was last cleared, and clear their marks. */
static void take_touched(struct ukv_ring *r, int32_t *touched, unsigned *ntouched) {
    for (unsigned i = 0; i < r->ntouched; i++) {
        touched[i] = r->touched[i];
        r->pumps[r->touched[i]]->touched = 0;
    }
    *ntouched = r->ntouched;
    r->ntouched = 0;
}

/* Pump I/Os in flight at once on this ring: at most `cap` (0: no limit). */
void ukv_ring_pump_depth(struct ukv_ring *r, unsigned cap) { r->io_cap = cap; }

/* How many loads' memcpys a reap has put off until after its refills were submitted (copy_later). */
uint64_t ukv_ring_copied_late(const struct ukv_ring *r) { return r->copied_late; }

/* Pump I/Os in flight now; *peak: the most there ever were at once. */
unsigned ukv_ring_pump_io(struct ukv_ring *r, unsigned *peak) {
    *peak = r->io_peak;
    return r->io_inflight;
}

static int64_t now_ns(void);

/* Drain the CQ: up to max completions are returned, those of pump ops are handled here instead
 * (copy or queue the copy, refill the slot or hand it back). With DEFER_TASKRUN, completions are only posted when this
 * (the submitting) thread asks for them, hence io_uring_get_events first.
 * The refills are submitted before returning (*submit_error = -errno if that failed; they stay
 * queued in the SQ for the next submission). Reads and writes that the kernel completes inside the
 * submission (page-cache hits without IOSQE_ASYNC) are in the CQ when it returns: while a pass
 * refilled something and finds such completions, another pass runs, until `budget_ns` has gone by
 * (0: one pass); then *more = 1 and the caller must call again soon (from a later loop turn). The
 * budget also ends a pass early, checked after each pump completion: a pass over a full CQ of
 * memcpy pumps would otherwise copy every slot's block on the loop thread (32 × 128 KiB took
 * 1.2 ms on the CPU machine); the completions left stay in the CQ for the next call.
 * `touched` receives the ids of the pumps that moved (each once). Returns the count of returned
 * completions. */
int ukv_reap_pumped(struct ukv_ring *r, uint64_t *user_data, int32_t *res, unsigned max, int32_t *touched,
                    unsigned *ntouched, int *submit_error, int64_t budget_ns, int *more) {
    if (r->flags & IORING_SETUP_DEFER_TASKRUN) io_uring_get_events(&r->ring);
    struct io_uring_cqe *cqes[256];
    unsigned total = 0;
    int64_t deadline = budget_ns > 0 ? now_ns() + budget_ns : 0;
    *submit_error = 0;
    *more = 0;
    int out_of_time = 0;
    uint64_t later[UKV_LATER_MAX];
    for (;;) {
        unsigned pumped = 0, nlater = 0;
        while (!out_of_time) {
            unsigned want = max - total < 256 ? max - total : 256;
            if (!want) break;
            unsigned got = io_uring_peek_batch_cqe(&r->ring, cqes, want);
            if (!got) break;
            unsigned seen = 0;
            while (seen < got && !out_of_time) {
                struct io_uring_cqe *cqe = cqes[seen++];
                uint64_t ud = cqe->user_data;
                if (ud & UKV_PUMP_TAG) {
                    struct ukv_pump *p = tagged_pump(r, ud);
                    if (!p) continue;
                    pump_complete(r, p, (unsigned)(ud & 0xffffffffu), cqe->res, later, &nlater);
                    pumped++;
                    touch(r, p);
                    out_of_time = deadline && now_ns() >= deadline;
                    continue;
                }
                user_data[total] = ud;
                res[total++] = cqe->res;
            }
            io_uring_cq_advance(&r->ring, seen);
        }
        if (!pumped) break;
        if (nlater) {
            /* Parked slots take the room these completions left, and their reads go out before
             * the loop copies the completed blocks (~0.1 ms for 32 blocks of 16 KiB here). */
            pumps_settle(r);
            int ret = submit_retry(&r->ring);
            if (ret < 0) *submit_error = ret;
            copy_later(r, later, nlater);
        }
        pumps_settle(r);
        int ret = submit_retry(&r->ring);
        if (ret < 0) {
            *submit_error = ret;
            *more = out_of_time && io_uring_cq_ready(&r->ring); /* completions left behind still need a reap */
            break;
        }
        if (out_of_time && io_uring_cq_ready(&r->ring)) {
            *more = 1;
            break;
        }
        if (total >= max || !io_uring_cq_ready(&r->ring)) break; /* nothing completed inline */
        if (!deadline || now_ns() >= deadline) {
            *more = 1;
            break;
        }
    }
    take_touched(r, touched, ntouched);
    return (int)total;
}

/* The liburing version the module was linked with: from its pkg-config file at build time, else the
 * header's macros (2.4+), else empty. */
const char *ukv_liburing_version(void) {
#if defined(UKV_LIBURING_VERSION)
    return UKV_LIBURING_VERSION;
#else
    return "";
#endif
}

/* 1 with the alignments filled in, 0 when the kernel or filesystem does not report them. */
int ukv_dio_align(int fd, uint32_t *mem_align, uint32_t *offset_align) {
#ifdef STATX_DIOALIGN
    struct statx stx;
    memset(&stx, 0, sizeof stx);
    if (syscall(SYS_statx, fd, "", AT_EMPTY_PATH, STATX_DIOALIGN, &stx) != 0) return -errno;
    if (!(stx.stx_mask & STATX_DIOALIGN) || stx.stx_dio_offset_align == 0) return 0;
    *mem_align = stx.stx_dio_mem_align;
    *offset_align = stx.stx_dio_offset_align;
    return 1;
#else
    (void)fd; (void)mem_align; (void)offset_align;
    return 0;
#endif
}

static int64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000LL + ts.tv_nsec;
}

/* The disk ceiling: n block I/Os at the given offsets, `depth` in flight, buffers at
 * buf_base + slot * block_bytes (registered when `fixed`), no Python anywhere. Returns elapsed ns
 * or -errno (a failed or short I/O included). */
int64_t ukv_ring_loop(int fd, int write, unsigned depth, uint64_t block_bytes,
                      const uint64_t *offsets, unsigned n, uint64_t buf_base, int fixed) {
    struct io_uring ring;
    int ret = io_uring_queue_init(depth, &ring, 0);
    if (ret < 0) return ret;
    if (fixed) {
        struct iovec iov = {(void *)(uintptr_t)buf_base, block_bytes * depth};
        if (io_uring_register_buffers(&ring, &iov, 1) < 0) fixed = 0;
    }
    int64_t start = now_ns(), result = 0;
    unsigned issued = 0, done = 0, inflight = 0;
    unsigned *free_slots = calloc(depth, sizeof *free_slots);
    unsigned nfree = depth;
    for (unsigned i = 0; i < depth; i++) free_slots[i] = i;
    while (done < n) {
        while (issued < n && nfree > 0) {
            struct io_uring_sqe *sqe = io_uring_get_sqe(&ring);
            if (!sqe) break;
            unsigned slot = free_slots[--nfree];
            void *buf = (void *)(uintptr_t)(buf_base + (uint64_t)slot * block_bytes);
            if (write && fixed) io_uring_prep_write_fixed(sqe, fd, buf, block_bytes, offsets[issued], 0);
            else if (write) io_uring_prep_write(sqe, fd, buf, block_bytes, offsets[issued]);
            else if (fixed) io_uring_prep_read_fixed(sqe, fd, buf, block_bytes, offsets[issued], 0);
            else io_uring_prep_read(sqe, fd, buf, block_bytes, offsets[issued]);
            io_uring_sqe_set_data64(sqe, slot);
            issued++; inflight++;
        }
        struct io_uring_cqe *cqe;
        ret = io_uring_submit_and_wait(&ring, 1);
        if (ret < 0 && ret != -EINTR) { result = ret; break; }
        unsigned head, seen = 0;
        io_uring_for_each_cqe(&ring, head, cqe) {
            if (cqe->res < 0) result = cqe->res;
            else if ((uint64_t)cqe->res != block_bytes) result = -EIO;
            free_slots[nfree++] = (unsigned)cqe->user_data;
            seen++;
        }
        io_uring_cq_advance(&ring, seen);
        done += seen; inflight -= seen;
        if (result < 0) break;
    }
    /* Never leave the loop with I/O in flight into the caller's buffer. */
    while (inflight > 0) {
        struct io_uring_cqe *cqe;
        if (io_uring_wait_cqe(&ring, &cqe) < 0) break;
        io_uring_cqe_seen(&ring, cqe);
        inflight--;
    }
    free(free_slots);
    io_uring_queue_exit(&ring);
    return result < 0 ? result : now_ns() - start;
}

/* CPU-mode copier: move one padded block between a staging slot and every cache tensor. */
int ukv_host_copy(unsigned ntensors, const uint64_t *bases, const uint64_t *block_bytes,
                  const uint64_t *slot_offsets, int to_slot, unsigned nblocks,
                  const uint64_t *slot_addrs, const int64_t *gpu_blocks) {
    for (unsigned b = 0; b < nblocks; b++)
        copy_block(ntensors, bases, block_bytes, slot_offsets, to_slot, slot_addrs[b], gpu_blocks[b]);
    return 0;
}

/* CUDA driver entry points, resolved at run time so the module never links libcuda. The types
 * mirror cuda.h (CUDA 12.8+) for the few fields used; CUdeviceptr is 64-bit, enums are int. */
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
enum { UKV_EVENT_BLOCKING_SYNC = 0x1, UKV_EVENT_DISABLE_TIMING = 0x2 };

static event_create_fn p_event_create;
static event_fn p_event_destroy, p_event_sync, p_event_query;
static event_record_fn p_event_record;
static launch_fn p_launch;
static ctx_get_fn p_ctx_get;
static ctx_set_fn p_ctx_set;
static stream_wait_fn p_stream_wait;
static event_fn p_stream_sync; /* cuStreamSynchronize: CUstream is a pointer, passed as uint64_t */
static memcpy_htod_fn p_htod;
static memcpy_dtoh_fn p_dtoh;
static batch_v2_fn p_batch_v2;
static batch_v1_fn p_batch_v1;
static int use_batch = 1;      /* policy switch, set from Python */
static int batch_failed_rc = 0; /* first error the batch call returned; then per-copy from there on */

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
    int events = p_event_create && p_event_destroy && p_event_sync && p_event_query && p_event_record &&
                 p_ctx_get && p_ctx_set && p_stream_wait;
    return p_htod && p_dtoh && events ? 0 : -ENOSYS;
}

/* 2: cuMemcpyBatchAsync_v2 (CUDA 13), 1: cuMemcpyBatchAsync (12.8/12.9), 0: per-copy calls only. */
int ukv_cuda_batch_mode(int enable) {
    if (enable >= 0) use_batch = enable;
    if (!use_batch || batch_failed_rc) return 0;
    return p_batch_v2 ? 2 : p_batch_v1 ? 1 : 0;
}

int ukv_cuda_batch_error(void) { return batch_failed_rc; }

static int copy_one_by_one(size_t n, const uint64_t *dsts, const uint64_t *srcs, const size_t *sizes, int to_host,
                           void *stream) {
    for (size_t i = 0; i < n; i++) {
        int rc = to_host ? p_dtoh((void *)(uintptr_t)dsts[i], srcs[i], sizes[i], stream)
                         : p_htod(dsts[i], (const void *)(uintptr_t)srcs[i], sizes[i], stream);
        if (rc) return rc;
    }
    return 0;
}

/* Enqueue the copies of nblocks blocks (every tensor) on `stream`: one batched driver call when the
 * driver has cuMemcpyBatchAsync, else one call per tensor and block. Returns 0 or the CUresult. */
int ukv_cuda_copy(unsigned ntensors, const uint64_t *bases, const uint64_t *block_bytes,
                  const uint64_t *slot_offsets, int to_slot, unsigned nblocks,
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
    int rc = -1, mode = ukv_cuda_batch_mode(-1);
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
        if (rc) batch_failed_rc = rc;
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

/* 0: fired; 600 (CUDA_ERROR_NOT_READY): not yet; anything else: an error. */
int ukv_cuda_event_query(uint64_t event) { return p_event_query(event); }

int ukv_cuda_copy_evented(uint64_t ctx, uint64_t done_event, unsigned ntensors,
                          const uint64_t *bases, const uint64_t *block_bytes, const uint64_t *slot_offsets,
                          int to_slot, unsigned nblocks, const uint64_t *slot_addrs, const int64_t *gpu_blocks,
                          uint64_t stream) {
    void *s = (void *)(uintptr_t)stream;
    int rc = use_ctx(ctx);
    if (!rc) rc = ukv_cuda_copy(ntensors, bases, block_bytes, slot_offsets, to_slot, nblocks, slot_addrs, gpu_blocks,
                                stream);
    if (!rc) rc = p_event_record(done_event, s);
    return rc;
}

/* The staged path: one copy per block between the host slot and its device staging slot (the
 * whole block, all tensors), and one scatter/gather kernel that moves every tensor's piece between
 * the device staging slot and the cache tensors. 1 + 1/nblocks driver calls per block instead of
 * one per tensor. _copy.py's kernel source takes UKV_STAGED_MAX from here (through cffi); its struct
 * UkvBlocks must match struct ukv_blocks. */
#define UKV_STAGED_MAX 8
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
        if (!to_slot)
            for (unsigned i = 0; !rc && i < n; i++)
                rc = p_htod(dev_slots[first + i], (const void *)(uintptr_t)slot_addrs[first + i], used_bytes, s);
        if (!rc) rc = p_launch(func, ntensors, n, 1, 256, 1, 1, 0, s, params, NULL);
        if (to_slot)
            for (unsigned i = 0; !rc && i < n; i++)
                rc = p_dtoh((void *)(uintptr_t)slot_addrs[first + i], dev_slots[first + i], used_bytes, s);
    }
    if (!rc) rc = p_event_record(done_event, s);
    return rc;
}

/* The native copier: the copy path's threads without Python. Per direction one submit thread takes
 * copy jobs from its queue and runs them (the staged CUDA copies and their event record, or host
 * memcpys in CPU mode); in CUDA mode one bridge thread waits for the oldest recorded event (the
 * events are BLOCKING_SYNC: it sleeps in the driver), sweeps the other fired ones, and moves them
 * to the done list. A job joins the done list when its copies are finished (or failed); the first
 * one to join an empty list writes the eventfd the loop watches, and the loop takes the whole list
 * with ukv_copier_done. No thread here ever takes the GIL, and every thread sleeps when idle.
 * Markers pass through a submit queue without work: done once every earlier job of that direction
 * has been enqueued on its stream (CUDA) or copied (host). */
enum { UKV_JOB_COPY = 0, UKV_JOB_MARK = 1 };
enum { UKV_FAIL_ENQUEUE = 1, UKV_FAIL_WAIT = 2 };

struct ukv_job {
    struct ukv_job *next;
    uint64_t token, event;
    int64_t done_ns;
    int32_t kind, to_slot, rc, where;
    unsigned n;
    uint64_t *slot_addrs, *dev_slots;
    int64_t *gpu_blocks;
    struct ukv_pump *pump; /* a pump's job: its slots, and an event from the copier's own pool */
    uint32_t *slots;
    uint64_t data[];
};

struct ukv_fifo { struct ukv_job *head, *tail; };

static void fifo_push(struct ukv_fifo *f, struct ukv_job *j) {
    j->next = NULL;
    if (f->tail) f->tail->next = j; else f->head = j;
    f->tail = j;
}

static struct ukv_job *fifo_pop(struct ukv_fifo *f) {
    struct ukv_job *j = f->head;
    if (j && !(f->head = j->next)) f->tail = NULL;
    return j;
}

struct ukv_copier;
struct ukv_lane { struct ukv_copier *c; int to_slot; };

struct ukv_copier {
    pthread_mutex_t mu;
    pthread_cond_t work_cv[2], bridge_cv;
    struct ukv_fifo work[2], pending, done;
    struct ukv_lane lanes[2];
    pthread_t submit[2], bridge;
    int started, stop_submit, stop_bridge, efd, cuda;
    int64_t delay; /* host: ns of sleep before each copy job; CUDA: GPU cycles of spin_func */
    uint64_t spin_func;
    int32_t fail_rc, fail_where; /* fault injection: the next copy job fails so */
    uint64_t *events;            /* CUDA: idle events for pump jobs (created as needed) */
    unsigned nevents, events_cap;
    unsigned pump_jobs;          /* pumps' jobs queued and not yet collected (loop thread only) */
    uint64_t ctx, func, table, used_bytes, streams[2];
    unsigned ntensors;
    uint64_t *bases, *block_bytes, *slot_offsets; /* point into tables[] */
    uint64_t tables[];
};

/* Called with the mutex held: the job's copies are over; 1 if the loop must be woken. A pump job's
 * event goes back to the pool (it has fired, or its job failed and the stream was waited for). */
static int finish(struct ukv_copier *c, struct ukv_job *j) {
    if (j->pump && j->event) {
        if (c->nevents == c->events_cap) {
            unsigned cap = c->events_cap ? 2 * c->events_cap : 64;
            uint64_t *grown = realloc(c->events, cap * sizeof *grown);
            if (grown) { c->events = grown; c->events_cap = cap; }
        }
        if (c->nevents < c->events_cap) c->events[c->nevents++] = j->event;
        else p_event_destroy(j->event); /* no memory to keep it: this thread has the context current */
        j->event = 0;
    }
    int wake = c->done.head == NULL;
    j->done_ns = now_ns();
    fifo_push(&c->done, j);
    return wake;
}

static void wake_loop(struct ukv_copier *c) {
    uint64_t one = 1;
    ssize_t w;
    do w = write(c->efd, &one, sizeof one); while (w < 0 && errno == EINTR);
}

/* Runs a copy job (markers have nothing to run). `fail_rc` (fault injection, else 0): the job is
 * done as usual, then reported failed with it. A failed CUDA job waits for its stream first: some of
 * its copies may be on it, and they must be over before its slots move on. */
static void run_job(struct ukv_copier *c, struct ukv_job *j, int32_t fail_rc, int32_t fail_where) {
    if (j->kind != UKV_JOB_COPY) return;
    uint64_t stream = c->streams[j->to_slot];
    if (!c->cuda) {
        if (c->delay > 0) {
            struct timespec ts = {c->delay / 1000000000LL, c->delay % 1000000000LL};
            while (nanosleep(&ts, &ts) && errno == EINTR) {}
        }
        ukv_host_copy(c->ntensors, c->bases, c->block_bytes, c->slot_offsets, j->to_slot, j->n, j->slot_addrs,
                      j->gpu_blocks);
    } else {
        if (!j->rc && c->delay > 0 && c->spin_func) { /* tests: the copies wait behind a kernel that only waits */
            long long cycles = c->delay;
            void *params[] = {&cycles};
            j->rc = use_ctx(c->ctx);
            if (!j->rc) j->rc = p_launch(c->spin_func, 1, 1, 1, 1, 1, 1, 0, (void *)(uintptr_t)stream, params, NULL);
        }
        if (!j->rc)
            j->rc = ukv_cuda_copy_staged(c->ctx, c->func, c->table, c->ntensors, c->used_bytes, j->to_slot, j->n,
                                         j->slot_addrs, j->dev_slots, j->gpu_blocks, stream, j->event);
        if (j->rc) j->where = UKV_FAIL_ENQUEUE;
    }
    if (!j->rc && fail_rc) {
        j->rc = fail_rc;
        j->where = fail_where;
    }
    if (j->rc && c->cuda && p_stream_sync) p_stream_sync(stream);
}

static void *submit_main(void *arg) {
    struct ukv_lane *lane = arg;
    struct ukv_copier *c = lane->c;
    pthread_setname_np(pthread_self(), lane->to_slot ? "ukv-copy-d2h" : "ukv-copy-h2d");
    pthread_mutex_lock(&c->mu);
    for (;;) {
        struct ukv_job *j;
        while (!(j = fifo_pop(&c->work[lane->to_slot])) && !c->stop_submit)
            pthread_cond_wait(&c->work_cv[lane->to_slot], &c->mu);
        if (!j) break;
        int32_t fail_rc = 0, fail_where = 0;
        if (j->kind == UKV_JOB_COPY && c->fail_rc) {
            fail_rc = c->fail_rc; fail_where = c->fail_where;
            c->fail_rc = 0;
        }
        int own_event = c->cuda && j->pump;
        if (own_event && c->nevents) j->event = c->events[--c->nevents];
        pthread_mutex_unlock(&c->mu);
        if (own_event && !j->event && (j->rc = ukv_cuda_event_new(c->ctx, &j->event))) {
            j->event = 0;
            j->where = UKV_FAIL_ENQUEUE;
        }
        run_job(c, j, fail_rc, fail_where);
        pthread_mutex_lock(&c->mu);
        if (c->cuda && j->kind == UKV_JOB_COPY && !j->rc) {
            fifo_push(&c->pending, j);
            pthread_cond_signal(&c->bridge_cv);
        } else if (finish(c, j)) {
            wake_loop(c);
        }
    }
    pthread_mutex_unlock(&c->mu);
    return NULL;
}

static void *bridge_main(void *arg) {
    struct ukv_copier *c = arg;
    pthread_setname_np(pthread_self(), "ukv-bridge");
    int rc = use_ctx(c->ctx);
    pthread_mutex_lock(&c->mu);
    for (;;) {
        while (!c->pending.head && !c->stop_bridge) pthread_cond_wait(&c->bridge_cv, &c->mu);
        struct ukv_job *head = c->pending.head;
        if (!head) break;
        pthread_mutex_unlock(&c->mu);
        int wait_rc = rc ? rc : p_event_sync(head->event); /* only this thread removes from pending */
        pthread_mutex_lock(&c->mu);
        fifo_pop(&c->pending);
        if (wait_rc) { head->rc = wait_rc; head->where = UKV_FAIL_WAIT; }
        /* Every other job whose event has fired goes too; the rest keep their order, ahead of jobs
         * queued meanwhile. The events are asked without the lock: a driver call each, and the loop
         * thread takes this lock to queue jobs and collect them (a wait for it puts that thread to
         * sleep, and waking it costs more than the lock saves). */
        struct ukv_fifo rest = c->pending, fired = {NULL, NULL}, kept = {NULL, NULL};
        c->pending.head = c->pending.tail = NULL;
        pthread_mutex_unlock(&c->mu);
        struct ukv_job *j;
        while ((j = fifo_pop(&rest))) {
            int q = p_event_query(j->event);
            if (q == 600) { fifo_push(&kept, j); continue; } /* CUDA_ERROR_NOT_READY */
            if (q) { j->rc = q; j->where = UKV_FAIL_WAIT; }
            fifo_push(&fired, j);
        }
        pthread_mutex_lock(&c->mu);
        int wake = finish(c, head);
        while ((j = fifo_pop(&fired))) wake |= finish(c, j);
        if (kept.head) {
            kept.tail->next = c->pending.head;
            if (!c->pending.head) c->pending.tail = kept.tail;
            c->pending.head = kept.head;
        }
        if (wake) wake_loop(c);
    }
    pthread_mutex_unlock(&c->mu);
    return NULL;
}

void ukv_copier_free(struct ukv_copier *c);

/* cuda: 0 = host memcpys (ctx, func, table, used_bytes, streams and spin_func unused). Returns 0 or -errno. */
int ukv_copier_new(int cuda, unsigned ntensors, const uint64_t *bases, const uint64_t *block_bytes,
                   const uint64_t *slot_offsets, uint64_t ctx, uint64_t func, uint64_t table, uint64_t used_bytes,
                   uint64_t stream_h2d, uint64_t stream_d2h, int64_t delay, uint64_t spin_func,
                   struct ukv_copier **out) {
    if (cuda && (!p_launch || !p_event_sync || !p_event_query)) return -ENOSYS;
    struct ukv_copier *c = calloc(1, sizeof *c + 3 * (size_t)ntensors * sizeof(uint64_t));
    if (!c) return -ENOMEM;
    c->bases = c->tables;
    c->block_bytes = c->tables + ntensors;
    c->slot_offsets = c->tables + 2 * (size_t)ntensors;
    memcpy(c->bases, bases, ntensors * sizeof(uint64_t));
    memcpy(c->block_bytes, block_bytes, ntensors * sizeof(uint64_t));
    memcpy(c->slot_offsets, slot_offsets, ntensors * sizeof(uint64_t));
    c->ntensors = ntensors;
    c->cuda = cuda;
    c->ctx = ctx; c->func = func; c->table = table; c->used_bytes = used_bytes;
    c->streams[0] = stream_h2d; c->streams[1] = stream_d2h;
    c->delay = delay;
    c->spin_func = spin_func;
    /* Adaptive: a thread that finds the lock taken spins a little before it sleeps. Every hold is
     * a few list operations, and the loop thread takes it in its reap and collection: put to sleep,
     * it waits for a wake-up (tenths of a ms on a virtual machine) instead of a few µs. */
    pthread_mutexattr_t attr;
    pthread_mutexattr_init(&attr);
    pthread_mutexattr_settype(&attr, PTHREAD_MUTEX_ADAPTIVE_NP);
    pthread_mutex_init(&c->mu, &attr);
    pthread_mutexattr_destroy(&attr);
    pthread_cond_init(&c->work_cv[0], NULL);
    pthread_cond_init(&c->work_cv[1], NULL);
    pthread_cond_init(&c->bridge_cv, NULL);
    c->efd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
    if (c->efd < 0) { int e = -errno; ukv_copier_free(c); return e; }
    for (int d = 0; d < 2; d++) {
        c->lanes[d].c = c;
        c->lanes[d].to_slot = d;
        int e = pthread_create(&c->submit[d], NULL, submit_main, &c->lanes[d]);
        if (e) { ukv_copier_free(c); return -e; }
        c->started |= 1 << d;
    }
    if (cuda) {
        int e = pthread_create(&c->bridge, NULL, bridge_main, c);
        if (e) { ukv_copier_free(c); return -e; }
        c->started |= 4;
    }
    *out = c;
    return 0;
}

int ukv_copier_fd(struct ukv_copier *c) { return c->efd; }

/* Fault injection for tests: the next copy job is done as usual, then reported failed with `rc`. */
void ukv_copier_fail_next(struct ukv_copier *c, int32_t rc, int32_t where) {
    pthread_mutex_lock(&c->mu);
    c->fail_rc = rc; c->fail_where = where;
    pthread_mutex_unlock(&c->mu);
}

static struct ukv_job *job_new(uint64_t token, int kind, int to_slot, unsigned n, int pump) {
    size_t words = 3 * (size_t)n + (pump ? ((size_t)n + 1) / 2 : 0);
    struct ukv_job *j = malloc(sizeof *j + words * sizeof(uint64_t));
    if (!j) return NULL;
    memset(j, 0, sizeof *j);
    j->token = token; j->kind = kind; j->to_slot = !!to_slot; j->n = n;
    j->slot_addrs = j->data;
    j->dev_slots = j->data + n;
    j->gpu_blocks = (int64_t *)(j->data + 2 * (size_t)n);
    if (pump) j->slots = (uint32_t *)(j->data + 3 * (size_t)n);
    return j;
}

static int job_queue(struct ukv_copier *c, struct ukv_job *j) {
    int to_slot = j->to_slot;
    pthread_mutex_lock(&c->mu);
    int stopping = c->stop_submit;
    if (!stopping) fifo_push(&c->work[to_slot], j);
    pthread_mutex_unlock(&c->mu);
    if (stopping) { free(j); return -EPIPE; }
    /* Signalled after the unlock, so the woken thread does not wait for the lock at once; the
     * thread re-checks its queue under the lock before it waits, so no job is missed. */
    pthread_cond_signal(&c->work_cv[to_slot]);
    return 0;
}

/* Queue a job (kind UKV_JOB_COPY with n blocks, or UKV_JOB_MARK with none). 0, -ENOMEM, or -EPIPE
 * once the copier is stopping. */
int ukv_copier_put(struct ukv_copier *c, uint64_t token, int kind, int to_slot, unsigned n,
                   const uint64_t *slot_addrs, const uint64_t *dev_slots, const int64_t *gpu_blocks,
                   uint64_t event) {
    struct ukv_job *j = job_new(token, kind, to_slot, n, 0);
    if (!j) return -ENOMEM;
    j->event = event;
    if (n) {
        memcpy(j->slot_addrs, slot_addrs, n * sizeof(uint64_t));
        if (dev_slots) memcpy(j->dev_slots, dev_slots, n * sizeof(uint64_t));
        memcpy(j->gpu_blocks, gpu_blocks, n * sizeof(int64_t));
    }
    return job_queue(c, j);
}

/* A pump's copy job for the blocks in `slots` (H2D after reads for a load, D2H before writes for a
 * store). Its token is UKV_PUMP_TAG | pump id << 32: the loop hands it back to the pump. */
static int copier_put_pump(struct ukv_copier *c, struct ukv_pump *p, const uint32_t *slots, unsigned n) {
    struct ukv_job *j = job_new(UKV_PUMP_TAG | ((uint64_t)p->id << 32), UKV_JOB_COPY, p->write, n, 1);
    if (!j) return -ENOMEM;
    j->pump = p;
    c->pump_jobs++;
    for (unsigned i = 0; i < n; i++) {
        unsigned s = slots[i];
        j->slots[i] = s;
        j->slot_addrs[i] = p->slot_addr[s];
        j->dev_slots[i] = p->dev_slots ? p->dev_slots[s] : 0;
        j->gpu_blocks[i] = p->cache[p->slot_block[s]];
    }
    int rc = job_queue(c, j);
    if (rc) c->pump_jobs--;
    return rc;
}

/* Pumps' copy jobs queued and not yet collected. */
unsigned ukv_copier_pump_jobs(struct ukv_copier *c) { return c->pump_jobs; }

/* Take up to `max` finished jobs, oldest first: token, result (0 or a CUresult), where it failed
 * (UKV_FAIL_*), and when it was seen finished (CLOCK_MONOTONIC ns). Clears the eventfd first, so a
 * job finished after this call wakes the loop again. Pumps' jobs (token with UKV_PUMP_TAG) are
 * handled here, on `r` (the ring of the pumps, or NULL when there are none): their slots move on
 * (the next block's I/O or copy, or back to Python), the refills are submitted (*submit_error =
 * -errno if that failed) and the pumps that moved are in `touched` (*ntouched of them). */
unsigned ukv_copier_done(struct ukv_copier *c, struct ukv_ring *r, unsigned max, uint64_t *tokens, int32_t *rcs,
                         int32_t *wheres, int64_t *done_ns, int32_t *touched, unsigned *ntouched,
                         int *submit_error) {
    uint64_t count;
    while (read(c->efd, &count, sizeof count) < 0 && errno == EINTR) {}
    struct ukv_fifo taken = {NULL, NULL};
    unsigned k = 0;
    pthread_mutex_lock(&c->mu);
    struct ukv_job *j;
    while (k < max && (j = fifo_pop(&c->done))) {
        fifo_push(&taken, j);
        k++;
    }
    if (c->done.head) wake_loop(c); /* more than max: the loop comes back for the rest */
    pthread_mutex_unlock(&c->mu);
    if (r) { /* (without a ring, ntouched and submit_error may be NULL) */
        *ntouched = 0;
        *submit_error = 0;
    }
    int pumped = 0;
    for (unsigned i = 0; (j = fifo_pop(&taken)); i++) {
        tokens[i] = j->token; rcs[i] = j->rc; wheres[i] = j->where; done_ns[i] = j->done_ns;
        if (j->pump) c->pump_jobs--;
        /* (a pump holds a job's slots until the job is collected, so it is still attached) */
        if (j->pump && r && tagged_pump(r, j->token) == j->pump) {
            for (unsigned b = 0; b < j->n; b++) pump_copied(r, j->pump, j->slots[b], j->rc);
            touch(r, j->pump);
            pumped = 1;
        }
        free(j);
    }
    if (pumped) {
        pumps_settle(r);
        int ret = submit_retry(&r->ring);
        if (ret < 0) *submit_error = ret;
        take_touched(r, touched, ntouched);
    }
    return k;
}

/* Runs every queued job, waits for every recorded event, then stops the threads (blocking). */
static void copier_stop(struct ukv_copier *c) {
    pthread_mutex_lock(&c->mu);
    c->stop_submit = 1;
    pthread_cond_broadcast(&c->work_cv[0]);
    pthread_cond_broadcast(&c->work_cv[1]);
    pthread_mutex_unlock(&c->mu);
    for (int d = 0; d < 2; d++)
        if (c->started & (1 << d)) pthread_join(c->submit[d], NULL);
    pthread_mutex_lock(&c->mu);
    c->stop_bridge = 1;
    pthread_cond_broadcast(&c->bridge_cv);
    pthread_mutex_unlock(&c->mu);
    if (c->started & 4) pthread_join(c->bridge, NULL);
    c->started = 0;
}

void ukv_copier_free(struct ukv_copier *c) {
    if (!c) return;
    copier_stop(c);
    struct ukv_fifo *lists[] = {&c->work[0], &c->work[1], &c->pending, &c->done};
    for (unsigned i = 0; i < sizeof lists / sizeof *lists; i++) {
        struct ukv_job *j;
        while ((j = fifo_pop(lists[i]))) free(j);
    }
    if (c->nevents && use_ctx(c->ctx) == 0)
        for (unsigned i = 0; i < c->nevents; i++) p_event_destroy(c->events[i]);
    free(c->events);
    if (c->efd >= 0) close(c->efd);
    pthread_cond_destroy(&c->work_cv[0]);
    pthread_cond_destroy(&c->work_cv[1]);
    pthread_cond_destroy(&c->bridge_cv);
    pthread_mutex_destroy(&c->mu);
    free(c);
}
