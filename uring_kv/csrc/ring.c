/* An io_uring instance (struct ukv_ring, in ukv.h): set-up, registrations and batched submit; the
 * liburing version linked and the statx DIO alignment query. Pumps (pump.c) run on the same ring. */
#include "ukv.h"

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
    r->notify_fd = r->stop_fd = r->copier_fd = -1;
    pthread_mutex_init(&r->mu, NULL);
    *out = r;
    return 0;
}

void ukv_ring_close(struct ukv_ring *r) {
    ukv_ring_thread_stop(r);
    io_uring_queue_exit(&r->ring);
    pthread_mutex_destroy(&r->mu);
    free(r->out_ud);
    free(r->out_res);
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

/* Queue and submit all n ops; when the SQ fills up, submit what is queued and go on.
 * Returns n, or -errno if the kernel refused a submission (then ops from the failing one on
 * may not have been submitted: the caller treats the ring as broken). */
int ukv_submit(struct ukv_ring *r, const struct ukv_op *ops, unsigned n) {
    int ret = 0;
    pthread_mutex_lock(&r->mu);
    for (unsigned i = 0; i < n;) {
        struct io_uring_sqe *sqe = io_uring_get_sqe(&r->ring);
        if (!sqe) {
            ret = submit_retry(&r->ring);
            if (ret < 0) break;
            continue;
        }
        prep(sqe, &ops[i++]);
    }
    if (ret >= 0) ret = submit_retry(&r->ring);
    pthread_mutex_unlock(&r->mu);
    return ret < 0 ? ret : (int)n;
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
