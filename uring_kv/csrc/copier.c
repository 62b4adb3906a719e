/* The native copier: the copy path's threads without Python. Per direction one submit thread takes
 * copy jobs from its queue and runs them (the staged CUDA copies and their event record, or host
 * memcpys in CPU mode); in CUDA mode one bridge thread waits for the oldest recorded event (the
 * events are BLOCKING_SYNC: it sleeps in the driver), sweeps the other fired ones, and moves them
 * to the done list. A job joins the done list when its copies are finished (or failed); the first
 * one to join an empty list writes the eventfd the loop watches, and the loop takes the whole list
 * with ukv_copier_done. No thread here ever takes the GIL, and every thread sleeps when idle.
 * Markers pass through a submit queue without work: done once every earlier job of that direction
 * has been enqueued on its stream (CUDA) or copied (host).
 *
 * Pumps (pump.c) queue jobs here too, as owned jobs (ukv_copier_put_owned: the pump and its slots
 * ride along) and take them back from the done list (ukv_copier_take). This file knows nothing of
 * pumps: the handshake is the small interface in ukv.h, and calls run one way only, pump.c to here. */
#include "ukv.h"

/* CPU mode's copies: move padded blocks between staging slots and every cache tensor (the host
 * copier's thread, inline calls on the loop, and this copier's jobs in CPU mode). */
int ukv_host_copy(unsigned ntensors, const uint64_t *bases, const uint64_t *block_bytes,
                  const uint64_t *slot_offsets, int to_slot, unsigned nblocks,
                  const uint64_t *slot_addrs, const int64_t *gpu_blocks) {
    for (unsigned b = 0; b < nblocks; b++)
        copy_block(ntensors, bases, block_bytes, slot_offsets, to_slot, slot_addrs[b], gpu_blocks[b]);
    return 0;
}

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
    struct ukv_fifo work[2], pending, done, done_owned; /* done_owned: once routed (ukv_copier_route_owned) */
    struct ukv_lane lanes[2];
    pthread_t submit[2], bridge;
    int started, stop_submit, stop_bridge, efd, owned_efd, cuda;
    int64_t delay; /* host: ns of sleep before each copy job; CUDA: GPU cycles of spin_func */
    uint64_t spin_func;
    int32_t fail_rc, fail_where; /* fault injection: the next copy job fails so */
    uint64_t *events;            /* CUDA: idle events for owned jobs (created as needed) */
    unsigned nevents, events_cap;
    unsigned owned_jobs;         /* owned jobs queued and not yet taken (atomic: put and taken by two threads) */
    int64_t phases[UKV_PHASES];  /* ukv_copier_phases, under the mutex */
    int64_t poll_ns;             /* how long a thread polls for its next job (or event) before it sleeps */
    uint64_t ctx, func, table, used_bytes, streams[2];
    unsigned ntensors;
    uint64_t *bases, *block_bytes, *slot_offsets; /* point into tables[] */
    uint64_t tables[];
};

/* Called with the mutex held: the job's copies are over; which eventfds must be written (1: efd, 2:
 * owned_efd), a list's first job waking its taker. An owned job's event goes back to the pool (it
 * has fired, or its job failed and the stream was waited for). */
static int finish(struct ukv_copier *c, struct ukv_job *j) {
    if (j->owner && j->event) {
        if (c->nevents == c->events_cap) {
            unsigned cap = c->events_cap ? 2 * c->events_cap : 64;
            uint64_t *grown = realloc(c->events, cap * sizeof *grown);
            if (grown) { c->events = grown; c->events_cap = cap; }
        }
        if (c->nevents < c->events_cap) c->events[c->nevents++] = j->event;
        else ukv_cuda_event_drop(j->event); /* no memory to keep it: this thread has the context current */
        j->event = 0;
    }
    j->done_ns = now_ns();
    if (j->kind == UKV_JOB_COPY && j->enqueued_ns) c->phases[6 * j->to_slot + 4] += j->done_ns - j->enqueued_ns;
    if (j->owner && c->owned_efd >= 0) {
        int wake = c->done_owned.head == NULL ? 2 : 0;
        fifo_push(&c->done_owned, j);
        return wake;
    }
    int wake = c->done.head == NULL;
    fifo_push(&c->done, j);
    return wake;
}

static void signal_fd(int fd) {
    uint64_t one = 1;
    ssize_t w;
    do w = write(fd, &one, sizeof one); while (w < 0 && errno == EINTR);
}

/* Write the eventfds `wake` names (finish's bits). */
static void wake_loop(struct ukv_copier *c, int wake) {
    if (wake & 1) signal_fd(c->efd);
    if (wake & 2) signal_fd(c->owned_efd);
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
            j->rc = ukv_cuda_ctx_use(c->ctx);
            if (!j->rc) j->rc = ukv_cuda_spin(c->spin_func, c->delay, stream);
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
    if (j->rc && c->cuda) ukv_cuda_stream_drain(stream);
}

static void *submit_main(void *arg) {
    struct ukv_lane *lane = arg;
    struct ukv_copier *c = lane->c;
    pthread_setname_np(pthread_self(), lane->to_slot ? "ukv-copy-d2h" : "ukv-copy-h2d");
    pthread_mutex_lock(&c->mu);
    for (;;) {
        struct ukv_job *j;
        if (!c->work[lane->to_slot].head && !c->stop_submit && c->poll_ns > 0) {
            /* Poll for the next job a while before sleeping: a cond wake-up costs tens of µs. */
            int64_t until = now_ns() + c->poll_ns;
            pthread_mutex_unlock(&c->mu);
            while (!__atomic_load_n(&c->work[lane->to_slot].head, __ATOMIC_ACQUIRE) &&
                   !__atomic_load_n(&c->stop_submit, __ATOMIC_ACQUIRE) && now_ns() < until) {}
            pthread_mutex_lock(&c->mu);
        }
        while (!(j = fifo_pop(&c->work[lane->to_slot])) && !c->stop_submit)
            pthread_cond_wait(&c->work_cv[lane->to_slot], &c->mu);
        if (!j) break;
        int32_t fail_rc = 0, fail_where = 0;
        if (j->kind == UKV_JOB_COPY && c->fail_rc) {
            fail_rc = c->fail_rc; fail_where = c->fail_where;
            c->fail_rc = 0;
        }
        int own_event = c->cuda && j->owner;
        if (own_event && c->nevents) j->event = c->events[--c->nevents];
        pthread_mutex_unlock(&c->mu);
        j->start_ns = now_ns();
        if (own_event && !j->event && (j->rc = ukv_cuda_event_new(c->ctx, &j->event))) {
            j->event = 0;
            j->where = UKV_FAIL_ENQUEUE;
        }
        run_job(c, j, fail_rc, fail_where);
        j->enqueued_ns = now_ns();
        pthread_mutex_lock(&c->mu);
        if (j->kind == UKV_JOB_COPY) {
            int64_t *ph = c->phases + 6 * j->to_slot;
            ph[0]++; ph[1] += j->n;
            ph[2] += j->start_ns - j->queued_ns;
            ph[3] += j->enqueued_ns - j->start_ns;
        }
        int wake;
        if (c->cuda && j->kind == UKV_JOB_COPY && !j->rc) {
            fifo_push(&c->pending, j);
            pthread_cond_signal(&c->bridge_cv);
        } else if ((wake = finish(c, j))) {
            wake_loop(c, wake);
        }
    }
    pthread_mutex_unlock(&c->mu);
    return NULL;
}

static void *bridge_main(void *arg) {
    struct ukv_copier *c = arg;
    pthread_setname_np(pthread_self(), "ukv-bridge");
    int rc = ukv_cuda_ctx_use(c->ctx);
    pthread_mutex_lock(&c->mu);
    for (;;) {
        while (!c->pending.head && !c->stop_bridge) pthread_cond_wait(&c->bridge_cv, &c->mu);
        struct ukv_job *head = c->pending.head;
        if (!head) break;
        int64_t poll = c->poll_ns;
        pthread_mutex_unlock(&c->mu);
        int wait_rc = rc; /* only this thread removes from pending */
        if (!rc) { /* polled first (no wake-up to wait for once it fires), then slept on */
            int64_t until = poll > 0 ? now_ns() + poll : 0;
            do wait_rc = ukv_cuda_event_query(head->event); while (wait_rc == 600 && until && now_ns() < until);
            if (wait_rc == 600) wait_rc = ukv_cuda_event_wait(head->event);
        }
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
            int q = ukv_cuda_event_query(j->event);
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
        if (wake) wake_loop(c, wake);
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
    if (cuda && !ukv_cuda_has_job_calls()) return -ENOSYS;
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
    c->owned_efd = -1;
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

/* The copier's threads poll for up to `ns` before they sleep: a submit thread with an empty queue
 * for its next job, the bridge (CUDA) for the oldest event to fire before it sleeps in the driver
 * until it does (a BLOCKING_SYNC wait returns tens of µs after the event on a VM). */
void ukv_copier_poll(struct ukv_copier *c, int64_t ns) {
    pthread_mutex_lock(&c->mu);
    c->poll_ns = ns;
    pthread_mutex_unlock(&c->mu);
}

/* Fault injection for tests: the next copy job is done as usual, then reported failed with `rc`. */
void ukv_copier_fail_next(struct ukv_copier *c, int32_t rc, int32_t where) {
    pthread_mutex_lock(&c->mu);
    c->fail_rc = rc; c->fail_where = where;
    pthread_mutex_unlock(&c->mu);
}

static struct ukv_job *job_new(uint64_t token, int kind, int to_slot, unsigned n, int tagged) {
    size_t words = 3 * (size_t)n + (tagged ? ((size_t)n + 1) / 2 : 0);
    struct ukv_job *j = malloc(sizeof *j + words * sizeof(uint64_t));
    if (!j) return NULL;
    memset(j, 0, sizeof *j);
    j->token = token; j->kind = kind; j->to_slot = !!to_slot; j->n = n;
    j->slot_addrs = j->data;
    j->dev_slots = j->data + n;
    j->gpu_blocks = (int64_t *)(j->data + 2 * (size_t)n);
    if (tagged) j->tags = (uint32_t *)(j->data + 3 * (size_t)n);
    return j;
}

void ukv_job_free(struct ukv_job *j) { free(j); }

static int job_queue(struct ukv_copier *c, struct ukv_job *j) {
    int to_slot = j->to_slot;
    j->queued_ns = now_ns();
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

static void fill(struct ukv_job *j, unsigned n, const uint64_t *slot_addrs, const uint64_t *dev_slots,
                 const int64_t *gpu_blocks) {
    if (!n) return;
    memcpy(j->slot_addrs, slot_addrs, n * sizeof(uint64_t));
    if (dev_slots) memcpy(j->dev_slots, dev_slots, n * sizeof(uint64_t));
    memcpy(j->gpu_blocks, gpu_blocks, n * sizeof(int64_t));
}

/* Queue a job (kind UKV_JOB_COPY with n blocks, or UKV_JOB_MARK with none). 0, -ENOMEM, or -EPIPE
 * once the copier is stopping. */
int ukv_copier_put(struct ukv_copier *c, uint64_t token, int kind, int to_slot, unsigned n,
                   const uint64_t *slot_addrs, const uint64_t *dev_slots, const int64_t *gpu_blocks,
                   uint64_t event) {
    struct ukv_job *j = job_new(token, kind, to_slot, n, 0);
    if (!j) return -ENOMEM;
    j->event = event;
    fill(j, n, slot_addrs, dev_slots, gpu_blocks);
    return job_queue(c, j);
}

/* Queue an owned copy job (see ukv.h): no event is given, CUDA mode takes one from the copier's own
 * pool; `owner` and the n `tags` come back with the job from ukv_copier_take. */
int ukv_copier_put_owned(struct ukv_copier *c, uint64_t token, int to_slot, unsigned n, const uint64_t *slot_addrs,
                         const uint64_t *dev_slots, const int64_t *gpu_blocks, void *owner, const uint32_t *tags) {
    struct ukv_job *j = job_new(token, UKV_JOB_COPY, to_slot, n, 1);
    if (!j) return -ENOMEM;
    fill(j, n, slot_addrs, dev_slots, gpu_blocks);
    memcpy(j->tags, tags, n * sizeof(uint32_t));
    j->owner = owner;
    __atomic_add_fetch(&c->owned_jobs, 1, __ATOMIC_RELAXED);
    int rc = job_queue(c, j);
    if (rc) __atomic_sub_fetch(&c->owned_jobs, 1, __ATOMIC_RELAXED);
    return rc;
}

void ukv_copier_phases(struct ukv_copier *c, int reset, int64_t *out) {
    pthread_mutex_lock(&c->mu);
    memcpy(out, c->phases, sizeof c->phases);
    if (reset) memset(c->phases, 0, sizeof c->phases);
    pthread_mutex_unlock(&c->mu);
}

/* Owned jobs queued and not yet taken. */
unsigned ukv_copier_owned_jobs(struct ukv_copier *c) { return __atomic_load_n(&c->owned_jobs, __ATOMIC_RELAXED); }

int ukv_copier_route_owned(struct ukv_copier *c) {
    pthread_mutex_lock(&c->mu);
    if (c->owned_efd < 0) {
        c->owned_efd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
        if (c->owned_efd < 0) {
            int e = -errno;
            pthread_mutex_unlock(&c->mu);
            return e;
        }
    }
    pthread_mutex_unlock(&c->mu);
    return c->owned_efd;
}

/* Move up to `max` finished jobs off `list` (signalled on `fd`), as ukv_copier_take describes. */
static unsigned take_from(struct ukv_copier *c, struct ukv_fifo *list, int fd, int wake, unsigned max,
                          struct ukv_job **out) {
    uint64_t count;
    while (read(fd, &count, sizeof count) < 0 && errno == EINTR) {}
    unsigned k = 0;
    pthread_mutex_lock(&c->mu);
    struct ukv_job *j;
    int64_t now = now_ns();
    while (k < max && (j = fifo_pop(list))) {
        out[k++] = j;
        if (j->kind == UKV_JOB_COPY) c->phases[6 * j->to_slot + 5] += now - j->done_ns;
    }
    if (list->head) wake_loop(c, wake); /* more than max: the taker comes back for the rest */
    pthread_mutex_unlock(&c->mu);
    unsigned owned = 0;
    for (unsigned i = 0; i < k; i++) owned += out[i]->owner != NULL;
    if (owned) __atomic_sub_fetch(&c->owned_jobs, owned, __ATOMIC_RELAXED);
    return k;
}

/* The owned jobs finished since routing (see ukv_copier_route_owned). */
unsigned ukv_copier_take_owned(struct ukv_copier *c, unsigned max, struct ukv_job **out) {
    return take_from(c, &c->done_owned, c->owned_efd, 2, max, out);
}

/* Move up to `max` finished jobs, oldest first, off the done list into `out`; the caller reads and
 * frees them (ukv_job_free). Clears the eventfd first, so a job finished after this call wakes the
 * loop again; with more than `max` finished, it is written again at once. */
unsigned ukv_copier_take(struct ukv_copier *c, unsigned max, struct ukv_job **out) {
    return take_from(c, &c->done, c->efd, 1, max, out);
}

/* For a loop with no owned jobs to hand on: take up to `max` finished jobs as token, result (0 or
 * a CUresult), where it failed (UKV_FAIL_*) and when it was seen finished (CLOCK_MONOTONIC ns). */
unsigned ukv_copier_done(struct ukv_copier *c, unsigned max, uint64_t *tokens, int32_t *rcs, int32_t *wheres,
                         int64_t *done_ns) {
    struct ukv_job *taken[UKV_TAKE_MAX];
    unsigned k = ukv_copier_take(c, max < UKV_TAKE_MAX ? max : UKV_TAKE_MAX, taken);
    for (unsigned i = 0; i < k; i++) {
        struct ukv_job *j = taken[i];
        tokens[i] = j->token; rcs[i] = j->rc; wheres[i] = j->where; done_ns[i] = j->done_ns;
        ukv_job_free(j);
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
    struct ukv_fifo *lists[] = {&c->work[0], &c->work[1], &c->pending, &c->done, &c->done_owned};
    for (unsigned i = 0; i < sizeof lists / sizeof *lists; i++) {
        struct ukv_job *j;
        while ((j = fifo_pop(lists[i]))) free(j);
    }
    if (c->nevents && ukv_cuda_ctx_use(c->ctx) == 0)
        for (unsigned i = 0; i < c->nevents; i++) ukv_cuda_event_drop(c->events[i]);
    free(c->events);
    if (c->efd >= 0) close(c->efd);
    if (c->owned_efd >= 0) close(c->owned_efd);
    pthread_cond_destroy(&c->work_cv[0]);
    pthread_cond_destroy(&c->work_cv[1]);
    pthread_cond_destroy(&c->bridge_cv);
    pthread_mutex_destroy(&c->mu);
    free(c);
}
