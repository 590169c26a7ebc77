/* Read-only memory mapping of a whole file. */
#include "runtime/file.h"

#include <errno.h>
#include <fcntl.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include "runtime/error.h"

sh_err sh__file_map(const char *path, int populate, sh_file_map *out, sh_error *e)
{
    memset(out, 0, sizeof *out);
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0)
        return sh__error_set(e, SH_EIO, "%s: cannot open: %s", path, strerror(errno));
    struct stat st;
    if (fstat(fd, &st) != 0) {
        int saved = errno;
        close(fd);
        return sh__error_set(e, SH_EIO, "%s: cannot stat: %s", path, strerror(saved));
    }
    if (!S_ISREG(st.st_mode)) {
        close(fd);
        return sh__error_set(e, SH_EINVAL, "%s: not a regular file", path);
    }
    if (st.st_size == 0) {
        close(fd);
        return SH_OK;
    }
    int flags = MAP_PRIVATE;
#ifdef MAP_POPULATE
    if (populate)
        flags |= MAP_POPULATE;
#else
    (void)populate;
#endif
    void *p = mmap(NULL, (size_t)st.st_size, PROT_READ, flags, fd, 0);
    int saved = errno;
    close(fd);
    if (p == MAP_FAILED)
        return sh__error_set(e, SH_EIO, "%s: cannot mmap: %s", path, strerror(saved));
    out->data = p;
    out->size = (size_t)st.st_size;
    return SH_OK;
}

void sh__file_unmap(sh_file_map *m)
{
    if (m && m->data)
        munmap((void *)m->data, m->size);
    if (m)
        memset(m, 0, sizeof *m);
}
