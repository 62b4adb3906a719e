/* The ring thread: the pumps' steady state off the event loop. Without it the loop wakes for every
 * few completions (the ring's eventfd), reaps them in C (ukv_reap_pumped), runs each moved pump's
 * Python handler, and does the same for the native copier's finished pump jobs: tens of µs of
 * loop time per wake-up, a few blocks each. With it, this thread waits in io_uring_enter for the
 * ring's completions and for the copier's pump jobs (a poll on the copier's eventfd for them, armed
 * on the same ring), and moves the pumps itself: the next read or write into a slot, the copy job,
 * the parked slots' turn. The loop is woken (its eventfd, `notify_fd`) only when it has something
 * to take (ukv_ring_take): a pump that handed slots back (a batch's end, or a more urgent waiter),
 * a completion of an op of its own (the Python pump's), or a failed submission.
 *
 * Every entry point that touches the ring or a pump holds the ring's lock (`mu`), so the loop's
 * submissions, slot hand-overs and reads of a pump's state never meet the thread half way; the
 * thread holds it while it handles one wake-up. Without SINGLE_ISSUER (both threads submit): the
 * ring is opened without it when the thread is to run (see _io/uring.py). */
#include "ukv.h"

#include <poll.h>
#include <signal.h>

enum { CTL_STOP = 0, CTL_COPIER = 1 };

/* Under the lock: an SQE of the thread's own (a poll on the copier's eventfd, or the stop NOP). */
static struct io_uring_sqe *ctl_sqe(struct ukv_ring *r, unsigned which) {
    struct io_uring_sqe *sqe = io_uring_get_sqe(&r->ring);
    if (!sqe && submit_retry(&r->ring) >= 0) sqe = io_uring_get_sqe(&r->ring);
    if (sqe) {
        io_uring_prep_nop(sqe);
        io_uring_sqe_set_data64(sqe, UKV_CTL_TAG | which);
    }
    return sqe;
}

static int arm_copier(struct ukv_ring *r) {
    struct io_uring_sqe *sqe = ctl_sqe(r, CTL_COPIER);
    if (!sqe) return -EBUSY;
    io_uring_prep_poll_add(sqe, r->copier_fd, POLLIN);
    io_uring_sqe_set_data64(sqe, UKV_CTL_TAG | CTL_COPIER);
    int ret = submit_retry(&r->ring);
    return ret < 0 ? ret : 0;
}

/* Under the lock: write the loop's eventfd if it has something to take and was not told yet. */
static void notify(struct ukv_ring *r) {
    if (r->notified || !ring_wants_loop(r)) return;
    r->notified = 1;
    r->notifies++;
    uint64_t one = 1;
    while (write(r->notify_fd, &one, sizeof one) < 0 && errno == EINTR) {}
}

/* Passes over completions that refills complete inside their own submission (page-cache hits) may
 * go on this many times per wake-up before the lock is let go. */
#define PASSES_MAX 8
/* A wake-up waits for up to a quarter of the pump I/Os in flight (at most WAIT_MAX), or WAIT_NS,
 * whichever comes first: woken for every completion, the thread queued a copy job per block
 * (GPU mode: a kernel launch and an event each) where the loop's reap had gathered several. */
#define WAIT_MAX 8
#define WAIT_NS 50000

/* Wait for completions without the lock (the loop submits meanwhile). EINTR, ETIME, or EBUSY with
 * completions the CQ could not take all end in the reap that follows. `idle`: the last wake-up
 * found nothing (a wait that timed out): wait for the first completion, however long (slow
 * completions, 2 MiB writes say, would otherwise wake the thread every WAIT_NS for nothing). */
static void wait_completions(struct ukv_ring *r, int idle) {
    unsigned inflight = __atomic_load_n(&r->io_inflight, __ATOMIC_RELAXED);
    unsigned want = inflight / 4 < WAIT_MAX ? inflight / 4 : WAIT_MAX;
    if (want > 1 && !idle && (r->features & IORING_FEAT_EXT_ARG)) {
        struct __kernel_timespec ts = {.tv_sec = 0, .tv_nsec = WAIT_NS};
        struct io_uring_getevents_arg arg = {.sigmask = 0, .sigmask_sz = _NSIG / 8, .ts = (uint64_t)(uintptr_t)&ts};
        syscall(__NR_io_uring_enter, r->ring.ring_fd, 0, want, IORING_ENTER_GETEVENTS | IORING_ENTER_EXT_ARG, &arg,
                sizeof arg);
        return;
    }
    syscall(__NR_io_uring_enter, r->ring.ring_fd, 0, 1, IORING_ENTER_GETEVENTS, NULL, 0);
}

static void *ring_main(void *arg) {
    struct ukv_ring *r = arg;
    pthread_setname_np(pthread_self(), "ukv-ring");
    struct ukv_job *jobs[UKV_TAKE_MAX];
    int idle = 0;
    for (;;) {
        wait_completions(r, idle);
        pthread_mutex_lock(&r->mu);
        r->wakeups++;
        unsigned ctl = 0, room = 1;
        uint64_t done = r->io_done, nout = r->nout;
        for (int pass = 0; pass < PASSES_MAX; pass++) {
            int more = 0, err = 0;
            room = r->out_cap - r->nout;
            r->nout += ring_reap(r, r->out_ud + r->nout, r->out_res + r->nout, room, &err, 0, &more, &ctl);
            if (err) r->submit_error = err;
            if (!more || r->nout == r->out_cap) break;
        }
        if ((ctl & (1u << CTL_COPIER)) && r->copier) {
            unsigned k;
            do {
                k = ukv_copier_take_owned(r->copier, UKV_TAKE_MAX, jobs);
                for (unsigned i = 0; i < k; i++) /* their blocks fail with EIO; the loop says why */
                    if (jobs[i]->rc && r->njob_fails < UKV_JOB_FAILS) {
                        r->job_rc[r->njob_fails] = jobs[i]->rc;
                        r->job_where[r->njob_fails++] = jobs[i]->where;
                    }
                int err = ring_collect_jobs(r, jobs, k);
                if (err) r->submit_error = err;
            } while (k == UKV_TAKE_MAX);
            int err = arm_copier(r);
            if (err) r->submit_error = err;
        }
        notify(r);
        idle = !ctl && r->io_done == done && r->nout == nout;
        int full = r->nout == r->out_cap;
        pthread_mutex_unlock(&r->mu);
        if (ctl & (1u << CTL_STOP)) break;
        if (full) usleep(50); /* (never while the loop keeps its ops within the CQ's size) */
    }
    return NULL;
}

/* Start the thread; the loop's eventfd `notify_fd` is written when it has something to take.
 * From then on only the thread reaps the CQ. 0 or -errno. */
int ukv_ring_thread_start(struct ukv_ring *r, int notify_fd) {
    pthread_mutex_lock(&r->mu);
    int rc = 0;
    if (r->threaded) rc = -EALREADY;
    if (!rc && !r->out_ud) {
        r->out_cap = r->cq_entries;
        r->out_ud = calloc(r->out_cap, sizeof *r->out_ud);
        r->out_res = calloc(r->out_cap, sizeof *r->out_res);
        if (!r->out_ud || !r->out_res) rc = -ENOMEM;
    }
    if (!rc) {
        r->notify_fd = notify_fd;
        if (r->copier) rc = arm_copier(r);
    }
    if (!rc) {
        rc = -pthread_create(&r->thread, NULL, ring_main, r);
        r->threaded = !rc;
    }
    pthread_mutex_unlock(&r->mu);
    return rc;
}

/* Stop the thread and wait for it (a NOP of its own wakes it). Nothing of the pumps may be in
 * flight any more. */
void ukv_ring_thread_stop(struct ukv_ring *r) {
    pthread_mutex_lock(&r->mu);
    int threaded = r->threaded;
    if (threaded && ctl_sqe(r, CTL_STOP)) submit_retry(&r->ring);
    pthread_mutex_unlock(&r->mu);
    if (!threaded) return;
    pthread_join(r->thread, NULL);
    pthread_mutex_lock(&r->mu);
    r->threaded = 0;
    pthread_mutex_unlock(&r->mu);
}

/* The thread takes the copier's pump jobs from now on (routed to their own eventfd: the loop's
 * collection then sees only the others). 0 or -errno. */
int ukv_ring_watch_copier(struct ukv_ring *r, struct ukv_copier *c) {
    int fd = ukv_copier_route_owned(c);
    if (fd < 0) return fd;
    pthread_mutex_lock(&r->mu);
    r->copier = c;
    r->copier_fd = fd;
    int rc = r->threaded ? arm_copier(r) : 0;
    pthread_mutex_unlock(&r->mu);
    return rc;
}

/* Before the copier is freed: the thread no longer touches it (its poll stays armed, harmless). */
void ukv_ring_unwatch_copier(struct ukv_ring *r) {
    pthread_mutex_lock(&r->mu);
    r->copier = NULL;
    r->copier_fd = -1;
    pthread_mutex_unlock(&r->mu);
}

/* What the loop takes when notify_fd says so: up to `max` completions of its own ops (as
 * ukv_reap_pumped returns them), the pumps that moved (each once), and the thread's last failed
 * submission (-errno, or 0). */
unsigned ukv_ring_take(struct ukv_ring *r, uint64_t *user_data, int32_t *res, unsigned max, int32_t *touched,
                       unsigned *ntouched, int *submit_error) {
    pthread_mutex_lock(&r->mu);
    unsigned n = r->nout < max ? r->nout : max;
    memcpy(user_data, r->out_ud, n * sizeof *user_data);
    memcpy(res, r->out_res, n * sizeof *res);
    r->nout -= n;
    if (r->nout) {
        memmove(r->out_ud, r->out_ud + n, r->nout * sizeof *r->out_ud);
        memmove(r->out_res, r->out_res + n, r->nout * sizeof *r->out_res);
    }
    take_touched(r, touched, ntouched);
    *submit_error = r->submit_error;
    r->submit_error = 0;
    r->notified = 0;
    pthread_mutex_unlock(&r->mu);
    return n;
}

/* The pump copy jobs that failed since the last call (at most UKV_JOB_FAILS of them): their
 * CUresult and where it failed (UKV_FAIL_*), into rcs and wheres. */
unsigned ukv_ring_take_job_fails(struct ukv_ring *r, int32_t *rcs, int32_t *wheres) {
    pthread_mutex_lock(&r->mu);
    unsigned n = r->njob_fails;
    memcpy(rcs, r->job_rc, n * sizeof *rcs);
    memcpy(wheres, r->job_where, n * sizeof *wheres);
    r->njob_fails = 0;
    pthread_mutex_unlock(&r->mu);
    return n;
}

/* The thread's wake-ups so far; *notifies: how many of them woke the loop. */
uint64_t ukv_ring_thread_wakeups(struct ukv_ring *r, uint64_t *notifies) {
    pthread_mutex_lock(&r->mu);
    uint64_t w = r->wakeups;
    *notifies = r->notifies;
    pthread_mutex_unlock(&r->mu);
    return w;
}
