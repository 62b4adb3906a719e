/* Does a batch of reads take longer after idle time, and does the ring's set-up change that?
 *
 * Batches of random block reads at a fixed depth, each batch either right after the previous one
 * or after GAP_MS of sleep, through six ring set-ups, interleaved round by round:
 *   0  a fresh ring per batch, flags 0, io_uring_submit_and_wait  (the bench's ring ceiling)
 *   1  one ring for the run, flags 0, io_uring_submit_and_wait
 *   2  one ring, SINGLE_ISSUER|DEFER_TASKRUN, io_uring_submit_and_wait
 *   3  one ring, SINGLE_ISSUER|DEFER_TASKRUN, an eventfd waited on with epoll_wait, then
 *      io_uring_get_events (how uring_kv's event loop waits)
 *   4  as 3, every read with IOSQE_ASYNC (uring_kv's reads in GPU mode)
 *   5  one ring, flags 0, eventfd + epoll_wait
 * Registered buffers in every set-up, one slot per read in flight. Prints a table of medians
 * (batch time, time to the first completion) and the same as one JSON line.
 *
 *   cc -O2 -o ring_idle lab/ring_idle.c -luring
 *   ./ring_idle FILE [MIB=1024] [ROUNDS=20] [GAP_MS=100] [BLOCK_KIB=128] [DEPTH=32] [BATCH=256]
 *
 * FILE is written first (MIB of real data, so no read hits a hole) and removed at the end; it is
 * opened O_DIRECT, or buffered (said in the output) where the file system refuses O_DIRECT. */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <liburing.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <time.h>
#include <unistd.h>

#define NMODES 6
#define MAX_BATCHES 4096

static const char *const names[NMODES] = {
    "fresh ring, wait (ceiling)", "one ring, wait", "one ring, DEFER, wait",
    "one ring, DEFER, epoll", "one ring, DEFER, epoll, ASYNC", "one ring, epoll",
};

struct setup {
    struct io_uring ring;
    int efd, epfd, ready;
};

static struct setup setups[NMODES];
static char *buf;
static int fd;
static size_t block, nblocks;
static unsigned depth, batch_blocks;

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + (double)t.tv_nsec * 1e-9;
}

static int by_value(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

static int uses_epoll(int mode) { return mode >= 3; }
static int deferred(int mode) { return mode >= 2 && mode <= 4; }

static int setup_ring(int mode) {
    struct setup *s = &setups[mode];
    struct io_uring_params p;
    memset(&p, 0, sizeof p);
    if (deferred(mode)) p.flags = IORING_SETUP_SINGLE_ISSUER | IORING_SETUP_DEFER_TASKRUN;
    int ret = io_uring_queue_init_params(2 * depth, &s->ring, &p);
    if (ret < 0) return ret;
    struct iovec iov = {buf, block * depth};
    if ((ret = io_uring_register_buffers(&s->ring, &iov, 1)) < 0) return ret;
    if (uses_epoll(mode)) {
        struct epoll_event ev = {.events = EPOLLIN};
        s->efd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
        s->epfd = epoll_create1(EPOLL_CLOEXEC);
        ev.data.fd = s->efd;
        if (s->efd < 0 || s->epfd < 0 || epoll_ctl(s->epfd, EPOLL_CTL_ADD, s->efd, &ev) < 0) return -errno;
        if ((ret = io_uring_register_eventfd(&s->ring, s->efd)) < 0) return ret;
    }
    s->ready = 1;
    return 0;
}

static void wait_epoll(struct setup *s, int mode) {
    for (;;) {
        if (deferred(mode)) io_uring_get_events(&s->ring);
        if (io_uring_cq_ready(&s->ring)) return;
        struct epoll_event ev;
        uint64_t count;
        if (epoll_wait(s->epfd, &ev, 1, -1) == 1 && read(s->efd, &count, sizeof count) < 0 && errno != EAGAIN) {
            perror("read eventfd");
            exit(1);
        }
    }
}

/* One batch in `mode`: seconds from the first submission to the last completion; *first: to the first. */
static double run_batch(int mode, double *first) {
    struct setup *s = &setups[mode];
    int ret;
    if (mode == 0 && (ret = setup_ring(0)) < 0) {
        fprintf(stderr, "ring set-up: %s\n", strerror(-ret));
        exit(1);
    }
    unsigned *free_slots = malloc(depth * sizeof *free_slots), nfree = depth, issued = 0, done = 0;
    for (unsigned i = 0; i < depth; i++) free_slots[i] = i;
    double start = now();
    *first = -1;
    while (done < batch_blocks) {
        while (issued < batch_blocks && nfree) {
            struct io_uring_sqe *sqe = io_uring_get_sqe(&s->ring);
            unsigned slot = free_slots[--nfree];
            off_t offset = (off_t)((size_t)random() % nblocks * block);
            io_uring_prep_read_fixed(sqe, fd, buf + slot * block, (unsigned)block, offset, 0);
            if (mode == 4) sqe->flags |= IOSQE_ASYNC;
            io_uring_sqe_set_data64(sqe, slot);
            issued++;
        }
        if (uses_epoll(mode)) {
            io_uring_submit(&s->ring);
            wait_epoll(s, mode);
        } else {
            io_uring_submit_and_wait(&s->ring, 1);
        }
        unsigned head, seen = 0;
        struct io_uring_cqe *cqe;
        io_uring_for_each_cqe(&s->ring, head, cqe) {
            if (cqe->res != (int)block) {
                fprintf(stderr, "read returned %d, not %zu\n", cqe->res, block);
                exit(1);
            }
            free_slots[nfree++] = (unsigned)cqe->user_data;
            seen++;
        }
        io_uring_cq_advance(&s->ring, seen);
        done += seen;
        if (seen && *first < 0) *first = now() - start;
    }
    double elapsed = now() - start;
    free(free_slots);
    if (mode == 0) {
        io_uring_queue_exit(&s->ring);
        s->ready = 0;
    }
    return elapsed;
}

static double median(double *values, int n) {
    qsort(values, (size_t)n, sizeof *values, by_value);
    return n ? values[n / 2] : 0.0;
}

int main(int argc, char **argv) {
    if (argc < 2) {
        fprintf(stderr, "usage: %s FILE [MIB] [ROUNDS] [GAP_MS] [BLOCK_KIB] [DEPTH] [BATCH]\n", argv[0]);
        return 2;
    }
    size_t mib = argc > 2 ? strtoul(argv[2], NULL, 0) : 1024;
    int rounds = argc > 3 ? atoi(argv[3]) : 20;
    double gap_ms = argc > 4 ? atof(argv[4]) : 100;
    block = (argc > 5 ? strtoul(argv[5], NULL, 0) : 128) << 10;
    depth = argc > 6 ? (unsigned)atoi(argv[6]) : 32;
    batch_blocks = argc > 7 ? (unsigned)atoi(argv[7]) : 256;
    nblocks = (mib << 20) / block;
    if (rounds < 1 || rounds * NMODES >= MAX_BATCHES || !depth || !batch_blocks || !block || nblocks < depth) {
        fprintf(stderr, "bad arguments\n");
        return 2;
    }
    int direct = 1;
    fd = open(argv[1], O_RDWR | O_CREAT | O_TRUNC | O_DIRECT, 0600);
    if (fd < 0 && errno == EINVAL) {
        direct = 0;
        fd = open(argv[1], O_RDWR | O_CREAT | O_TRUNC, 0600);
    }
    if (fd < 0) {
        perror(argv[1]);
        return 1;
    }
    if (posix_memalign((void **)&buf, 4096, block * depth)) return 1;
    memset(buf, 7, block * depth);
    for (size_t b = 0; b < nblocks; b++)
        if (pwrite(fd, buf + (b % depth) * block, block, (off_t)(b * block)) != (ssize_t)block) {
            perror("pwrite");
            return 1;
        }
    fsync(fd);
    for (int m = 1; m < NMODES; m++) {
        int ret = setup_ring(m);
        if (ret < 0) {
            fprintf(stderr, "%s: %s\n", names[m], strerror(-ret));
            return 1;
        }
    }
    srandom(3);
    static double times[NMODES][2][MAX_BATCHES], firsts[NMODES][2][MAX_BATCHES];
    int counts[NMODES][2] = {{0}};
    /* Round 0 warms every set-up and is not counted; the order of (mode, gap) pairs rotates. */
    for (int r = 0; r <= rounds; r++)
        for (int k = 0; k < 2 * NMODES; k++) {
            int pair = (k + 5 * r) % (2 * NMODES), mode = pair / 2, gap = (pair + r) % 2;
            if (gap) usleep((useconds_t)(gap_ms * 1000));
            double first, elapsed = run_batch(mode, &first);
            if (!r) continue;
            int i = counts[mode][gap]++;
            times[mode][gap][i] = elapsed;
            firsts[mode][gap][i] = first;
        }
    printf("%zu KiB reads, depth %u, %u per batch, %s, %d rounds; medians, ms\n", block >> 10, depth, batch_blocks,
           direct ? "O_DIRECT" : "buffered (O_DIRECT refused)", rounds);
    printf("%-30s %10s %10s %8s %12s %12s\n", "set-up", "batch", "after gap", "ratio", "first", "after gap");
    char json[4096];
    int len = snprintf(json, sizeof json, "{\"block_bytes\": %zu, \"depth\": %u, \"batch\": %u, \"gap_ms\": %g, "
                       "\"direct\": %s, \"rounds\": %d, \"modes\": [", block, depth, batch_blocks, gap_ms,
                       direct ? "true" : "false", rounds);
    for (int m = 0; m < NMODES; m++) {
        double b0 = median(times[m][0], counts[m][0]) * 1e3, b1 = median(times[m][1], counts[m][1]) * 1e3;
        double f0 = median(firsts[m][0], counts[m][0]) * 1e3, f1 = median(firsts[m][1], counts[m][1]) * 1e3;
        printf("%-30s %10.3f %10.3f %8.3f %12.3f %12.3f\n", names[m], b0, b1, b1 / b0, f0, f1);
        len += snprintf(json + len, sizeof json - (size_t)len,
                        "%s{\"name\": \"%s\", \"batch_ms\": %.4f, \"batch_after_gap_ms\": %.4f, "
                        "\"first_ms\": %.4f, \"first_after_gap_ms\": %.4f}", m ? ", " : "", names[m], b0, b1, f0, f1);
    }
    printf("%s]}\n", json);
    for (int m = 1; m < NMODES; m++) io_uring_queue_exit(&setups[m].ring);
    close(fd);
    unlink(argv[1]);
    return 0;
}
