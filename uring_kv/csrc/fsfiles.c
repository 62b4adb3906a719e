/* The bench's port of the block I/O of vLLM's file-system tier (csrc/fs_io.cpp, as vLLM 0.33.0 and
 * 0.34.0 call it from vllm/v1/kv_offload/tiering/fs/io.py): one file per block, a batch of blocks per
 * call, the calls per block vLLM's and in its order. vLLM's extension releases the GIL for a whole
 * batch; cffi releases it around every call, so these run the same way. Used by bench/fs_tier.py. */
#include "ukv.h"

#include <sys/stat.h>

/* The parent directories of `path`, made where missing (std::filesystem::create_directories: one
 * stat when the parent exists, which is every store but a directory's first). 0 or an errno. */
static int parent_dirs(const char *path) {
    char dir[4096];
    size_t len = strlen(path);
    if (len >= sizeof dir) return ENAMETOOLONG;
    memcpy(dir, path, len + 1);
    char *slash = strrchr(dir, '/');
    if (!slash || slash == dir) return 0;
    *slash = '\0';
    struct stat st;
    if (stat(dir, &st) == 0) return S_ISDIR(st.st_mode) ? 0 : ENOTDIR;
    for (char *p = dir + 1; *p; p++) {
        if (*p != '/') continue;
        *p = '\0';
        if (mkdir(dir, 0777) != 0 && errno != EEXIST) return errno;
        *p = '/';
    }
    if (mkdir(dir, 0777) != 0 && errno != EEXIST) return errno;
    return 0;
}

/* vLLM's _store_block: nothing if the block's file exists; else write a temp file and rename it into
 * place. 0 or the errno of the failing step (the temp file removed). */
static int store_block(const char *tmp_path, const char *dest_path, const char *src, size_t size, int o_direct) {
    if (access(dest_path, F_OK) == 0) return 0;
    int err = parent_dirs(dest_path);
    if (err) return err;
    int fd = open(tmp_path, O_CREAT | O_EXCL | O_WRONLY | O_TRUNC | (o_direct ? O_DIRECT : 0), 0644);
    if (fd < 0) return errno;
    ssize_t written = write(fd, src, size);
    if (written < 0 || (size_t)written != size) {
        err = written < 0 ? errno : EIO;
        close(fd);
        unlink(tmp_path);
        return err;
    }
    if (close(fd) != 0 || rename(tmp_path, dest_path) != 0) {
        err = errno;
        unlink(tmp_path);
        return err;
    }
    return 0;
}

/* vLLM's _load_block: open, one read of the whole block, close; a short read removes the file (EIO). */
static int load_block(const char *path, char *dst, size_t size, int o_direct) {
    int fd = open(path, O_RDONLY | (o_direct ? O_DIRECT : 0), 0);
    if (fd < 0) return errno;
    ssize_t got = read(fd, dst, size);
    if (got < 0) {
        int err = errno;
        close(fd);
        return err;
    }
    close(fd);
    if ((size_t)got < size) {
        unlink(path);
        return EIO;
    }
    return 0;
}

unsigned ukv_fs_store_blocks(const char *const *tmp_paths, const char *const *dest_paths, const uint64_t *bufs,
                             unsigned n, uint64_t size, int o_direct, int *err) {
    *err = 0;
    for (unsigned i = 0; i < n; i++)
        if ((*err = store_block(tmp_paths[i], dest_paths[i], (const char *)(uintptr_t)bufs[i], size, o_direct)))
            return i;
    return n;
}

unsigned ukv_fs_load_blocks(const char *const *paths, const uint64_t *bufs, unsigned n, uint64_t size, int o_direct,
                            int *err) {
    *err = 0;
    for (unsigned i = 0; i < n; i++)
        if ((*err = load_block(paths[i], (char *)(uintptr_t)bufs[i], size, o_direct))) return i;
    return n;
}
