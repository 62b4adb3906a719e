/* The bench's ring and rows ceilings: what the disk gives through io_uring at the bench's depth, with
 * no Python and no copies, into one small buffer or straight into the cache rows (docs/performance.md,
 * "Ceilings"). */
#include "ukv.h"

/* n block I/Os at the given offsets, `depth` in flight, buffers at buf_base + slot * block_bytes
 * (registered when `fixed`; IOSQE_ASYNC on every SQE when `async`: the kernel's work goes to its
 * io-wq workers instead of running inside io_uring_enter on this thread, which on a RAM-backed file
 * is one thread copying every byte). With `ntensors` > 0 the I/Os move the cache rows instead of a
 * buffer, as the engine's pumps do where they read straight into the caches: I/O i is a readv
 * (writev) of one iovec per tensor t, row_bytes[t] bytes at bases[t] + cache_blocks[i] *
 * row_bytes[t] (buf_base and `fixed` unused). Returns elapsed ns or -errno (a failed or short I/O
 * included). */
int64_t ukv_ring_loop(int fd, int write, unsigned depth, uint64_t block_bytes,
                      const uint64_t *offsets, unsigned n, uint64_t buf_base, int fixed, int async,
                      unsigned ntensors, const uint64_t *bases, const uint64_t *row_bytes,
                      const int64_t *cache_blocks) {
    struct iovec *iovs = NULL;
    if (ntensors) {
        iovs = calloc((size_t)depth * ntensors, sizeof *iovs);
        if (!iovs) return -ENOMEM;
        fixed = 0;
    }
    struct io_uring ring;
    int ret = io_uring_queue_init(depth, &ring, 0);
    if (ret < 0) {
        free(iovs);
        return ret;
    }
    if (fixed) {
        struct iovec iov = {(void *)(uintptr_t)buf_base, block_bytes * depth};
        if (io_uring_register_buffers(&ring, &iov, 1) < 0) fixed = 0;
    }
    int64_t start = now_ns(), result = 0;
    unsigned issued = 0, done = 0, inflight = 0;
    unsigned *free_slots = calloc(depth, sizeof *free_slots);
    if (!free_slots) {
        free(iovs);
        io_uring_queue_exit(&ring);
        return -ENOMEM;
    }
    unsigned nfree = depth;
    for (unsigned i = 0; i < depth; i++) free_slots[i] = i;
    while (done < n) {
        while (issued < n && nfree > 0) {
            struct io_uring_sqe *sqe = io_uring_get_sqe(&ring);
            if (!sqe) break;
            unsigned slot = free_slots[--nfree];
            void *buf = (void *)(uintptr_t)(buf_base + (uint64_t)slot * block_bytes);
            struct iovec *iov = iovs ? iovs + (size_t)slot * ntensors : NULL;
            if (iov) row_iovecs(iov, ntensors, bases, row_bytes, cache_blocks[issued]);
            if (iov && write) io_uring_prep_writev(sqe, fd, iov, ntensors, offsets[issued]);
            else if (iov) io_uring_prep_readv(sqe, fd, iov, ntensors, offsets[issued]);
            else if (write && fixed) io_uring_prep_write_fixed(sqe, fd, buf, block_bytes, offsets[issued], 0);
            else if (write) io_uring_prep_write(sqe, fd, buf, block_bytes, offsets[issued]);
            else if (fixed) io_uring_prep_read_fixed(sqe, fd, buf, block_bytes, offsets[issued], 0);
            else io_uring_prep_read(sqe, fd, buf, block_bytes, offsets[issued]);
            io_uring_sqe_set_data64(sqe, slot);
            if (async) io_uring_sqe_set_flags(sqe, IOSQE_ASYNC);
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
    /* Never leave the loop with I/O in flight into the caller's buffer. SQEs a failed submit left in
     * the ring never reach the kernel (the ring's teardown drops them): they are not waited for. */
    inflight -= io_uring_sq_ready(&ring);
    while (inflight > 0) {
        struct io_uring_cqe *cqe;
        ret = io_uring_wait_cqe(&ring, &cqe);
        if (ret == -EINTR) continue;
        if (ret < 0) break;
        io_uring_cqe_seen(&ring, cqe);
        inflight--;
    }
    free(free_slots);
    free(iovs);
    io_uring_queue_exit(&ring);
    return result < 0 ? result : now_ns() - start;
}
