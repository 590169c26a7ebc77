/* Opening model, tokenizer and script files: regular files only, read whole or mapped. */
#include "base/file.h"

#include <errno.h>
#include <fcntl.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include "base/error.h"

static const char *kind_of(mode_t mode)
{
    if (S_ISDIR(mode))
        return "a directory";
    if (S_ISFIFO(mode))
        return "a FIFO";
    if (S_ISCHR(mode))
        return "a character device";
    if (S_ISBLK(mode))
        return "a block device";
    if (S_ISSOCK(mode))
        return "a socket";
    return "a special file";
}

/* A FIFO would block open() until a writer comes and read() for ever; a device (/dev/zero) maps
 * or reads without end. So the type is checked by name before anything is opened, and again on
 * the descriptor (opened non-blocking, so even a FIFO swapped in between cannot hang us). */
sh_err sh__file_open(const char *path, int *fd_out, uint64_t *size, sh_error *e)
{
    *fd_out = -1;
    *size = 0;
    struct stat st;
    if (stat(path, &st) != 0)
        return sh__error_set(e, SH_EIO, "%s: cannot open: %s", path, strerror(errno));
    if (!S_ISREG(st.st_mode))
        return sh__error_set(e, SH_EINVAL, "%s: not a regular file (%s)", path,
                             kind_of(st.st_mode));
    int fd = open(path, O_RDONLY | O_CLOEXEC | O_NONBLOCK | O_NOCTTY);
    if (fd < 0)
        return sh__error_set(e, SH_EIO, "%s: cannot open: %s", path, strerror(errno));
    if (fstat(fd, &st) != 0) {
        int saved = errno;
        close(fd);
        return sh__error_set(e, SH_EIO, "%s: cannot stat: %s", path, strerror(saved));
    }
    if (!S_ISREG(st.st_mode)) {
        close(fd);
        return sh__error_set(e, SH_EINVAL, "%s: not a regular file (%s)", path,
                             kind_of(st.st_mode));
    }
    int fl = fcntl(fd, F_GETFL);
    if (fl >= 0)
        (void)fcntl(fd, F_SETFL, fl & ~O_NONBLOCK);
    *fd_out = fd;
    *size = (uint64_t)st.st_size;
    return SH_OK;
}

sh_err sh__file_check(const char *path, sh_error *e)
{
    int fd;
    uint64_t size;
    sh_err err = sh__file_open(path, &fd, &size, e);
    if (!err)
        close(fd);
    return err;
}

sh_err sh__file_read_head(const char *path, void *buf, size_t cap, size_t *n, sh_error *e)
{
    *n = 0;
    int fd;
    uint64_t size;
    sh_err err = sh__file_open(path, &fd, &size, e);
    if (err)
        return err;
    while (*n < cap) {
        ssize_t k = read(fd, (char *)buf + *n, cap - *n);
        if (k < 0 && errno == EINTR)
            continue;
        if (k < 0) {
            int saved = errno;
            close(fd);
            return sh__error_set(e, SH_EIO, "%s: cannot read: %s", path, strerror(saved));
        }
        if (k == 0)
            break;
        *n += (size_t)k;
    }
    close(fd);
    return SH_OK;
}

sh_err sh__file_map(const char *path, int populate, sh_file_map *out, sh_error *e)
{
    memset(out, 0, sizeof *out);
    int fd;
    uint64_t size;
    sh_err err = sh__file_open(path, &fd, &size, e);
    if (err)
        return err;
    if (size == 0) {
        close(fd);
        return SH_OK;
    }
#if SIZE_MAX < UINT64_MAX
    if (size > (uint64_t)SIZE_MAX) {
        close(fd);
        return sh__error_set(e, SH_EIO, "%s: file of %llu bytes does not fit the address space",
                             path, (unsigned long long)size);
    }
#endif
    int flags = MAP_PRIVATE;
#ifdef MAP_POPULATE
    if (populate)
        flags |= MAP_POPULATE;
#else
    (void)populate;
#endif
    void *p = mmap(NULL, (size_t)size, PROT_READ, flags, fd, 0);
    int saved = errno;
    close(fd);
    if (p == MAP_FAILED)
        return sh__error_set(e, SH_EIO, "%s: cannot mmap: %s", path, strerror(saved));
    out->data = p;
    out->size = (size_t)size;
    return SH_OK;
}

void sh__file_unmap(sh_file_map *m)
{
    if (m && m->data)
        munmap((void *)m->data, m->size);
    if (m)
        memset(m, 0, sizeof *m);
}

void sh__file_drop(const void *p, size_t n)
{
    long ps = sysconf(_SC_PAGESIZE);
    if (!p || ps <= 0)
        return;
    uintptr_t page = (uintptr_t)ps, lo = ((uintptr_t)p + page - 1) & ~(page - 1);
    uintptr_t hi = ((uintptr_t)p + n) & ~(page - 1);
    if (hi > lo)
        (void)madvise((void *)lo, hi - lo, MADV_DONTNEED);
}
