/* Pumps: a batch run in C. Python hands a pump the batch's blocks (file offset, cache block) and,
 * as it acquires them, staging slots. Each slot carries one block at a time: for a load, read into
 * the slot, then (on the CQE) copy the slot into every cache tensor; for a store, copy the tensors
 * into the slot, then write it. When a slot's block is done the pump starts the next block in the
 * same slot, unless the batch is stopped, finished, or a batch of its class or a more urgent one
 * waits for a slot (`waiting`: the pool's waiter counts per class: demand loads, prefetches,
 * stores); then the slot is handed back to Python, which releases
 * its lease. So a slot is only ever released after the last user of it (the kernel's read/write
 * and the copy) is done, exactly as in the Python path, with no Python per block.
 *
 * The copies are memcpys inside the reap (small CPU-mode blocks), or, given a native copier, copy
 * jobs for its threads (CUDA, or large host blocks): the reap queues a job for the slots whose
 * reads completed (ukv_copier_put_owned), and the loop's collection of finished jobs
 * (ukv_ring_collect, which takes them from the copier) moves those slots on: the next block, or
 * back to Python. Under a ring-wide cap on pump I/Os
 * (the engine's io_depth, below its slot count) a slot whose next step is an I/O waits, parked,
 * for room; by class (`klass`: demand loads, then prefetches, then stores), then in the order they
 * parked (a prefetch's, while a demand load's pump runs, only below the ring's prefetch cap),
 * except that a store whose pump has started no I/O for the ring's store aging (since it was
 * made, or its last I/O) goes first, its slot starting its block even while more urgent calls
 * wait for slots (else the slot would go back to them, and the store to the end of the line).
 * The struct is in ukv.h (cffi reads and writes some of its fields). */
#include "ukv.h"

enum { SLOT_FREE = 0, SLOT_IDLE, SLOT_IO, SLOT_COPY }; /* IDLE: held, parked for I/O room */

static void pump_flush(struct ukv_ring *r, struct ukv_pump *p);
static void pumps_settle(struct ukv_ring *r);

/* A pump for nblocks blocks and slots below max_slots, its own arrays in the same allocation (free
 * with ukv_pump_free); offsets, cache, the tensor table and `waiting` belong to the caller and must
 * outlive it. `scatter`: read each block straight into its cache pieces (a load: one READV, an
 * iovec per tensor) instead of into the slot and then memcpy, or write it straight from them (a
 * store: one WRITEV) instead of a memcpy into the slot first; the slot then only stands for a
 * place in the queue depth. `copier` (or NULL): copies go to its threads as jobs of at most
 * `copy_blocks` blocks; `dev_slots` (CUDA, or NULL) and `copier` belong to the caller too. NULL
 * when out of memory. */
struct ukv_pump *ukv_pump_new(int write, int fd, unsigned sqe_flags, int fixed_buffers, uint64_t stride,
                              unsigned ntensors, const uint64_t *bases, const uint64_t *block_bytes,
                              const uint64_t *slot_offsets, unsigned nblocks, const uint64_t *offsets,
                              const int64_t *cache, const int32_t *waiting, unsigned max_slots, int scatter,
                              struct ukv_copier *copier, const uint64_t *dev_slots, unsigned copy_blocks) {
    size_t slots = max_slots ? max_slots : 1, blocks = nblocks ? nblocks : 1;
    size_t iovs = scatter ? slots * ntensors : 0;
    struct ukv_pump *p = calloc(1, sizeof *p + 3 * slots * sizeof(uint64_t) + iovs * sizeof(struct iovec) +
                                       slots * (2 * sizeof(int32_t) + 3 * sizeof(uint32_t) + 1) +
                                       blocks * (sizeof(uint32_t) + sizeof(int32_t)));
    if (!p) return NULL;
    p->id = -1; p->write = write; p->fd = fd; p->sqe_flags = sqe_flags; p->fixed_buffers = fixed_buffers;
    p->stride = stride; p->ntensors = ntensors; p->bases = bases; p->block_bytes = block_bytes;
    p->slot_offsets = slot_offsets; p->nblocks = nblocks; p->offsets = offsets; p->cache = cache;
    p->waiting = waiting; p->max_slots = max_slots;
    p->klass = write ? 2 : 0;
    p->slot_addr = (uint64_t *)(p + 1); /* the 8-byte arrays first, then the 4-byte ones */
    p->park_seq = p->slot_addr + slots;
    p->since = (int64_t *)(p->park_seq + slots);
    p->slot_iov = iovs ? (struct iovec *)(p->since + slots) : NULL;
    p->slot_buf = (int32_t *)((char *)(p->since + slots) + iovs * sizeof(struct iovec));
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
    p->progressed_ns = now_ns();
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
    int ret = -EBUSY;
    pthread_mutex_lock(&r->mu);
    for (int id = 0; id < UKV_MAX_PUMPS; id++) {
        if (!r->pumps[id]) {
            r->pumps[id] = p;
            p->id = id;
            if (id >= r->pump_hi) r->pump_hi = id + 1;
            ret = id;
            break;
        }
    }
    pthread_mutex_unlock(&r->mu);
    return ret;
}

void ukv_pump_detach(struct ukv_ring *r, struct ukv_pump *p) {
    pthread_mutex_lock(&r->mu);
    if (p->id >= 0 && p->id < UKV_MAX_PUMPS && r->pumps[p->id] == p) {
        if (p->touched) { /* off the list of pumps that moved (the ring thread's, not yet taken) */
            unsigned k = 0;
            for (unsigned i = 0; i < r->ntouched; i++)
                if (r->touched[i] != p->id) r->touched[k++] = r->touched[i];
            r->ntouched = k;
            p->touched = 0;
        }
        r->pumps[p->id] = NULL;
    }
    p->id = -1;
    pthread_mutex_unlock(&r->mu);
}

void ukv_pump_state(struct ukv_ring *r, struct ukv_pump *p, uint32_t *out) {
    pthread_mutex_lock(&r->mu);
    out[0] = p->next; out[1] = p->inflight; out[2] = p->parked_empty; out[3] = (uint32_t)p->stop;
    out[4] = p->nreleased;
    pthread_mutex_unlock(&r->mu);
}

/* The slots handed back since the last call (at most max_slots of them), into out. */
unsigned ukv_pump_take_released(struct ukv_ring *r, struct ukv_pump *p, uint32_t *out) {
    pthread_mutex_lock(&r->mu);
    unsigned n = p->nreleased;
    if (n) memcpy(out, p->released, n * sizeof *out);
    p->nreleased = 0;
    pthread_mutex_unlock(&r->mu);
    return n;
}

void ukv_pump_stop(struct ukv_ring *r, struct ukv_pump *p) {
    pthread_mutex_lock(&r->mu);
    p->stop = 1;
    pthread_mutex_unlock(&r->mu);
}

void ukv_pump_set_class(struct ukv_ring *r, struct ukv_pump *p, int klass) {
    pthread_mutex_lock(&r->mu);
    p->klass = klass;
    pthread_mutex_unlock(&r->mu);
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

/* A demand load's pump holds slots (a block in each, or parked for room), or has blocks to start
 * and is not stopped (Python stops a pump once every block has a slot, or the call is cancelled). */
static int demand_runs(const struct ukv_ring *r) {
    for (int id = 0; id < r->pump_hi; id++) {
        const struct ukv_pump *p = r->pumps[id];
        if (p && p->klass == 0 && (p->inflight || (!p->stop && p->next < p->nblocks))) return 1;
    }
    return 0;
}

/* Room for an I/O of a pump of class `klass`: under the depth, and for a prefetch while a demand
 * load's pump runs, under the prefetch cap too (the kernel then holds few reads for a demand read
 * to queue behind). */
static int room_for(const struct ukv_ring *r, int klass) {
    return ring_has_room(r) &&
           (klass != 1 || !r->prefetch_cap || r->io_inflight < r->prefetch_cap || !demand_runs(r));
}

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
        row_iovecs(iov, p->ntensors, p->bases, p->block_bytes, p->cache[b]);
        if (p->write) io_uring_prep_writev(sqe, p->fd, iov, p->ntensors, p->offsets[b]);
        else io_uring_prep_readv(sqe, p->fd, iov, p->ntensors, p->offsets[b]);
    } else if (p->write && buf >= 0) io_uring_prep_write_fixed(sqe, p->fd, slot, p->stride, p->offsets[b], buf);
    else if (p->write) io_uring_prep_write(sqe, p->fd, slot, p->stride, p->offsets[b]);
    else if (buf >= 0) io_uring_prep_read_fixed(sqe, p->fd, slot, p->stride, p->offsets[b], buf);
    else io_uring_prep_read(sqe, p->fd, slot, p->stride, p->offsets[b]);
    sqe->flags |= p->sqe_flags;
    io_uring_sqe_set_data64(sqe, UKV_PUMP_TAG | ((uint64_t)p->id << 32) | s);
    p->state[s] = SLOT_IO;
    p->since[s] = p->progressed_ns = now_ns();
    if (++r->io_inflight > r->io_peak) r->io_peak = r->io_inflight;
    return 0;
}

static void pump_park(struct ukv_ring *r, struct ukv_pump *p, unsigned s) {
    p->state[s] = SLOT_IDLE;
    if (p->slot_block[s] < 0) p->parked_empty++;
    p->parked[(p->park_head + p->nparked++) % p->max_slots] = s;
    p->park_seq[s] = r->park_clock++;
    r->nparked++;
}

static void pump_due_copy(struct ukv_ring *r, struct ukv_pump *p, unsigned s) {
    p->state[s] = SLOT_COPY;
    p->since[s] = now_ns();
    p->copy_q[p->ncopy++] = s;
    r->copies_due++;
}

/* Room for an I/O of pump p now (room_for its class), and no parked slot waiting for it first,
 * unless `queued` (the slot is the one whose turn it is): a refill never overtakes another batch's
 * parked slot, whose turn next_parked decides (by class, store aging and the prefetch cap). */
static int io_may_start(const struct ukv_ring *r, const struct ukv_pump *p, int queued) {
    return room_for(r, p->klass) && (queued || !r->nparked);
}

/* Start the pump's next block in the idle slot s it holds: a store with a copier (not writing from
 * the caches) first queues the block's copy into the slot; anything else starts the block's I/O
 * (after a memcpy into the slot for a store with neither), or parks the slot while there is no
 * room (io_may_start). 0, or -EBUSY when no SQE could be had (nothing started). */
static int pump_begin(struct ukv_ring *r, struct ukv_pump *p, unsigned s, int queued) {
    int copy_first = p->write && p->copier && !p->slot_iov;
    if (!copy_first && !io_may_start(r, p, queued)) {
        pump_park(r, p, s);
        return 0;
    }
    unsigned b = p->next++;
    p->slot_block[s] = (int32_t)b;
    if (copy_first) {
        pump_due_copy(r, p, s);
        return 0;
    }
    if (p->write && !p->slot_iov)
        copy_block(p->ntensors, p->bases, p->block_bytes, p->slot_offsets, 1, p->slot_addr[s], p->cache[b]);
    if (pump_io(r, p, s) == 0) return 0;
    p->next--;
    p->slot_block[s] = -1;
    return -EBUSY;
}

static int pump_may_refill(const struct ukv_pump *p) {
    if (p->stop || p->next >= p->nblocks) return 0;
    if (p->waiting) /* let a waiter of its class or a lower one have it (Python writes the counts) */
        for (int k = 0; k <= p->klass; k++)
            if (__atomic_load_n(&p->waiting[k], __ATOMIC_RELAXED)) return 0;
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
    if (pump_may_refill(p) && pump_begin(r, p, s, 0) == 0) return;
    pump_release(p, s);
}

/* Give the pump n more slots (slots[i]: the pool's index of the slot, below max_slots) and start a
 * block in each (while blocks are left); queues their copies and submits. Returns how many slots
 * it kept, -EINVAL for a slot it holds already, or -errno when the submission failed. */
int ukv_pump_add_slots(struct ukv_ring *r, struct ukv_pump *p, unsigned n, const uint32_t *slots,
                       const uint64_t *addrs, const int32_t *bufs) {
    int kept = 0;
    pthread_mutex_lock(&r->mu);
    for (unsigned i = 0; i < n; i++) {
        unsigned s = slots[i];
        if (s >= p->max_slots || p->state[s] != SLOT_FREE) { /* not a slot it may be given */
            pthread_mutex_unlock(&r->mu);
            return -EINVAL;
        }
        p->slot_addr[s] = addrs[i];
        p->slot_buf[s] = bufs[i];
        p->inflight++;
        p->state[s] = SLOT_IDLE;
        if (!p->stop && p->next < p->nblocks && pump_begin(r, p, s, 0) == 0) kept++;
        else pump_release(p, s);
    }
    if (p->ncopy) pump_flush(r, p);
    if (p->klass == 0 && p->nparked && r->prefetch_cap) /* parked behind prefetches the cap holds back */
        pumps_settle(r);
    int ret = submit_retry(&r->ring);
    pthread_mutex_unlock(&r->mu);
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
    r->io_done++;
    r->io_timed++;
    r->io_ns += now_ns() - p->since[s];
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

/* A store's block is in slot s (its copy is done): write it, or park the slot while there is no
 * room (io_may_start). */
static void pump_write(struct ukv_ring *r, struct ukv_pump *p, unsigned s, int queued) {
    if (!io_may_start(r, p, queued)) {
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
    r->copies_timed++;
    r->copy_ns += now_ns() - p->since[s];
    if (!rc && p->write) {
        pump_write(r, p, s, 0);
        return;
    }
    if (rc) pump_failed(p, s, EIO);
    pump_next_or_release(r, p, s);
}

/* Queue a copy job of the n slots' blocks (H2D after reads for a load, D2H before writes for a
 * store), owned by the pump and tagged with the slots. Its token is UKV_PUMP_TAG | pump id << 32:
 * the ring's collection hands it back to the pump. 0 or -errno. */
static int pump_put_job(struct ukv_pump *p, const uint32_t *slots, unsigned n) {
    uint64_t addrs[n], dev[n];
    int64_t cache[n];
    for (unsigned i = 0; i < n; i++) {
        unsigned s = slots[i];
        addrs[i] = p->slot_addr[s];
        dev[i] = p->dev_slots ? p->dev_slots[s] : 0;
        cache[i] = p->cache[p->slot_block[s]];
    }
    return ukv_copier_put_owned(p->copier, UKV_PUMP_TAG | ((uint64_t)p->id << 32), p->write, n, addrs, dev, cache,
                                p, slots);
}

/* Queue the pump's due copies as copy jobs. A job the copier refuses (no memory, or stopping)
 * fails its blocks, and their slots go back to Python. */
static void pump_flush(struct ukv_ring *r, struct ukv_pump *p) {
    r->copies_due -= p->ncopy;
    for (unsigned first = 0; first < p->ncopy; first += p->copy_blocks) {
        unsigned n = p->ncopy - first < p->copy_blocks ? p->ncopy - first : p->copy_blocks;
        if (pump_put_job(p, p->copy_q + first, n) == 0) continue;
        for (unsigned i = 0; i < n; i++) {
            unsigned s = p->copy_q[first + i];
            pump_failed(p, s, EIO);
            pump_release(p, s);
        }
    }
    p->ncopy = 0;
}

/* The pump whose first parked slot's turn is next, among those that may start an I/O now (room
 * permitting; prefetches not while the prefetch cap holds them back): a store's pump that
 * has started no I/O for store_aging_ns or more (the one whose slot parked first), else by class
 * (demand loads' pumps, then prefetches', then stores'), then the order in which the slots parked.
 * NULL when no attached pump has one; *aged says whether the store's was picked for its age. */
static struct ukv_pump *next_parked(const struct ukv_ring *r, int *aged_out) {
    struct ukv_pump *next = NULL, *aged = NULL;
    int prefetches = room_for(r, 1);
    int64_t aged_before = r->store_aging_ns ? now_ns() - r->store_aging_ns : INT64_MIN;
    for (int id = 0; id < r->pump_hi; id++) {
        struct ukv_pump *p = r->pumps[id];
        if (!p || !p->nparked || (p->klass == 1 && !prefetches)) continue;
        unsigned first = p->parked[p->park_head];
        if (p->klass == 2 && p->progressed_ns <= aged_before &&
            (!aged || p->park_seq[first] < aged->park_seq[aged->parked[aged->park_head]]))
            aged = p;
        if (!next || p->klass < next->klass ||
            (p->klass == next->klass && p->park_seq[first] < next->park_seq[next->parked[next->park_head]]))
            next = p;
    }
    *aged_out = aged != NULL;
    return aged ? aged : next;
}

/* Parked slots take the room there is, in turn (next_parked); then every due copy is queued. Pumps
 * that moved are marked touched. */
static void pumps_settle(struct ukv_ring *r) {
    while (r->nparked && ring_has_room(r)) {
        int aged;
        struct ukv_pump *p = next_parked(r, &aged);
        if (!p) break;
        touch(r, p);
        unsigned s = p->parked[p->park_head];
        p->park_head = (p->park_head + 1) % p->max_slots;
        p->nparked--;
        r->nparked--;
        if (p->slot_block[s] >= 0) { /* a store's block, copied into the slot (there is room) */
            pump_write(r, p, s, 1);
            continue;
        }
        p->parked_empty--;
        /* an aged store's slot starts its block though more urgent calls wait for slots */
        int go = aged ? !p->stop && p->next < p->nblocks : pump_may_refill(p);
        if (aged) p->progressed_ns = now_ns(); /* served: the next room by class again (a copy first is no I/O) */
        if (!(go && pump_begin(r, p, s, 1) == 0)) pump_release(p, s);
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
void take_touched(struct ukv_ring *r, int32_t *touched, unsigned *ntouched) {
    for (unsigned i = 0; i < r->ntouched; i++) {
        touched[i] = r->touched[i];
        r->pumps[r->touched[i]]->touched = 0;
    }
    *ntouched = r->ntouched;
    r->ntouched = 0;
}

/* Pump I/Os in flight at once on this ring: at most `cap` (0: no limit); a store's pump that has
 * started no I/O for `store_aging_ns` (0: no aging) takes the next room before any load's; while a
 * demand load's pump runs, prefetches start I/O only below `prefetch_cap` pump I/Os (0: no cap). */
void ukv_ring_pump_depth(struct ukv_ring *r, unsigned cap, int64_t store_aging_ns, unsigned prefetch_cap) {
    pthread_mutex_lock(&r->mu);
    r->io_cap = cap;
    r->store_aging_ns = store_aging_ns;
    r->prefetch_cap = prefetch_cap;
    pthread_mutex_unlock(&r->mu);
}

/* How many loads' memcpys a reap has put off until after its refills were submitted (copy_later). */
uint64_t ukv_ring_copied_late(const struct ukv_ring *r) { return r->copied_late; }

/* Pump I/Os completed so far (their CQEs handled here). */
uint64_t ukv_ring_pump_done(const struct ukv_ring *r) { return r->io_done; }

/* Where the pumps' slots spent their time since the last reset: out[0] I/Os completed, [1] their ns
 * from submission to completion summed; [2] copy jobs' blocks collected, [3] their ns from the copy
 * falling due (the read done, or the store's block started) to the job's collection summed. */
void ukv_ring_phases(struct ukv_ring *r, int reset, int64_t *out) {
    pthread_mutex_lock(&r->mu);
    out[0] = (int64_t)r->io_timed; out[1] = r->io_ns;
    out[2] = (int64_t)r->copies_timed; out[3] = r->copy_ns;
    if (reset) { r->io_timed = r->copies_timed = 0; r->io_ns = r->copy_ns = 0; }
    pthread_mutex_unlock(&r->mu);
}

/* Pump I/Os in flight now; *peak: the most there ever were at once. */
unsigned ukv_ring_pump_io(struct ukv_ring *r, unsigned *peak) {
    *peak = r->io_peak;
    return r->io_inflight;
}

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
    unsigned ctl = 0;
    pthread_mutex_lock(&r->mu);
    if (r->flags & IORING_SETUP_DEFER_TASKRUN) io_uring_get_events(&r->ring);
    unsigned total = ring_reap(r, user_data, res, max, submit_error, budget_ns, more, &ctl);
    take_touched(r, touched, ntouched);
    pthread_mutex_unlock(&r->mu);
    return (int)total;
}

/* ukv_reap_pumped's work, under the lock, leaving the pumps that moved marked: also the ring
 * thread's. The completions of the ring thread's own polls (UKV_CTL_TAG | n) set bit n of *ctl. */
unsigned ring_reap(struct ukv_ring *r, uint64_t *user_data, int32_t *res, unsigned max, int *submit_error,
                   int64_t budget_ns, int *more, unsigned *ctl) {
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
                if (ud & UKV_CTL_TAG) {
                    *ctl |= 1u << (ud & 7);
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
    return total;
}

/* A pump's copy job, taken from the copier (`token` names the pump it was queued for): its slots
 * move on (rc: 0, or why the job failed). 0 when `p` is no longer the pump attached under that
 * token (a pump holds a job's slots until the job is collected, so this does not happen while
 * Python keeps it attached). */
static int pump_job_done(struct ukv_ring *r, struct ukv_pump *p, uint64_t token, const uint32_t *slots, unsigned n,
                         int rc) {
    if (tagged_pump(r, token) != p) return 0;
    for (unsigned b = 0; b < n; b++) pump_copied(r, p, slots[b], rc);
    touch(r, p);
    return 1;
}

/* Take up to `max` finished jobs from the copier, oldest first, as token, result (0 or a CUresult),
 * where it failed (UKV_FAIL_*) and when it was seen finished (CLOCK_MONOTONIC ns). Pumps' jobs
 * (owned, token with UKV_PUMP_TAG) are handled here: their slots move on (the next block's I/O or
 * copy, or back to Python), the parked slots take the room there is, due copies are queued, the
 * refills are submitted (*submit_error = -errno if that failed) and the pumps that moved are in
 * `touched` (*ntouched of them). */
unsigned ukv_ring_collect(struct ukv_ring *r, struct ukv_copier *c, unsigned max, uint64_t *tokens, int32_t *rcs,
                          int32_t *wheres, int64_t *done_ns, int32_t *touched, unsigned *ntouched, int *submit_error) {
    struct ukv_job *taken[UKV_TAKE_MAX];
    unsigned k = ukv_copier_take(c, max < UKV_TAKE_MAX ? max : UKV_TAKE_MAX, taken);
    *ntouched = 0;
    *submit_error = 0;
    for (unsigned i = 0; i < k; i++) {
        struct ukv_job *j = taken[i];
        tokens[i] = j->token; rcs[i] = j->rc; wheres[i] = j->where; done_ns[i] = j->done_ns;
    }
    pthread_mutex_lock(&r->mu);
    *submit_error = ring_collect_jobs(r, taken, k);
    if (r->ntouched && !r->threaded) take_touched(r, touched, ntouched); /* (threaded: the loop takes them) */
    pthread_mutex_unlock(&r->mu);
    return k;
}

/* Under the lock: the pumps' jobs among the k taken move their slots on (the parked slots then take
 * the room there is, due copies are queued, the refills submitted: 0 or the submission's -errno);
 * every job is freed. */
int ring_collect_jobs(struct ukv_ring *r, struct ukv_job **jobs, unsigned k) {
    int pumped = 0;
    for (unsigned i = 0; i < k; i++) {
        struct ukv_job *j = jobs[i];
        if (j->owner && pump_job_done(r, j->owner, j->token, j->tags, j->n, j->rc)) pumped = 1;
        ukv_job_free(j);
    }
    if (!pumped) return 0;
    pumps_settle(r);
    int ret = submit_retry(&r->ring);
    return ret < 0 ? ret : 0;
}

/* Whether the loop has something to take: completions of its own ops, a failed submission, or a
 * pump that moved and handed slots back. */
int ring_wants_loop(const struct ukv_ring *r) {
    if (r->nout || r->submit_error || r->njob_fails) return 1;
    for (unsigned i = 0; i < r->ntouched; i++)
        if (r->pumps[r->touched[i]]->nreleased) return 1;
    return 0;
}
