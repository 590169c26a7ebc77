/* Opening model, tokenizer and script files: regular files only, read whole or mapped. */
#include "base/file.h"

#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdio.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include "base/error.h"

/* The mappings sh__file_map made, for the SIGBUS guard: a fault inside one (its file was
 * truncated under us) is answered with zero pages instead of killing the process. Slots are
 * claimed by compare-and-swap and read by the handler without a lock. */
#define GUARD_MAX 64
static struct guard_slot {
    _Atomic uintptr_t lo, hi; /* [lo, hi) of the mapping; lo 0: free */
    char path[200];           /* written before lo is published */
} guards[GUARD_MAX];
static atomic_int guard_hits;  /* faults answered with zero pages */
static atomic_int guard_first; /* slot + 1 of the first mapping that faulted, or 0 */
static long guard_page;

static void guard_add(const void *p, size_t n, const char *path)
{
    for (int i = 0; i < GUARD_MAX; i++) {
        uintptr_t zero = 0;
        /* claim with a placeholder, fill in, then publish the range */
        if (atomic_compare_exchange_strong(&guards[i].lo, &zero, (uintptr_t)1)) {
            snprintf(guards[i].path, sizeof guards[i].path, "%s", path);
            atomic_store(&guards[i].hi, (uintptr_t)p + n);
            atomic_store(&guards[i].lo, (uintptr_t)p);
            return;
        }
    }
    /* more than GUARD_MAX live mappings: this one is not guarded (a truncation kills) */
}

static void guard_remove(const void *p)
{
    for (int i = 0; i < GUARD_MAX; i++)
        if (atomic_load(&guards[i].lo) == (uintptr_t)p) {
            atomic_store(&guards[i].hi, 0);
            atomic_store(&guards[i].lo, 0);
            return;
        }
}

/* Async-signal-safe: atomics, mmap, write. Inside a guarded mapping the pages from the faulting
 * one to the mapping's end become anonymous zero pages and the faulting access runs again; a
 * fault anywhere else gets the default action (the process dies, as without the guard). */
static void on_sigbus(int sig, siginfo_t *si, void *uc)
{
    (void)uc;
    uintptr_t a = (uintptr_t)si->si_addr, pg = (uintptr_t)guard_page;
    for (int i = 0; pg && i < GUARD_MAX; i++) {
        uintptr_t lo = atomic_load(&guards[i].lo), hi = atomic_load(&guards[i].hi);
        if (lo > 1 && a >= lo && a < hi) {
            uintptr_t from = a & ~(pg - 1), to = (hi + pg - 1) & ~(pg - 1);
            if (mmap((void *)from, to - from, PROT_READ, MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED,
                     -1, 0) == MAP_FAILED)
                break;
            int expect = 0;
            atomic_compare_exchange_strong(&guard_first, &expect, i + 1);
            if (atomic_fetch_add(&guard_hits, 1) == 0) {
                static const char msg[] = "shoal: a model file was truncated while mapped: its "
                                          "missing pages read as zeros; every step fails now\n";
                ssize_t w = write(2, msg, sizeof msg - 1);
                (void)w;
            }
            return;
        }
    }
    signal(sig, SIG_DFL); /* not ours: the access faults again, with the default action */
}

sh_err sh__file_guard_install(void)
{
    guard_page = sysconf(_SC_PAGESIZE);
    struct sigaction sa;
    memset(&sa, 0, sizeof sa);
    sa.sa_sigaction = on_sigbus;
    sa.sa_flags = SA_SIGINFO;
    sigemptyset(&sa.sa_mask);
    return guard_page > 0 && sigaction(SIGBUS, &sa, NULL) == 0 ? SH_OK : SH_EIO;
}

bool sh__file_damaged(char *path, size_t cap)
{
    int first = atomic_load(&guard_first);
    if (!first)
        return false;
    if (path && cap)
        snprintf(path, cap, "%s", guards[first - 1].path);
    return true;
}

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
    guard_add(p, (size_t)size, path);
    return SH_OK;
}

void sh__file_unmap(sh_file_map *m)
{
    if (m && m->data) {
        guard_remove(m->data);
        munmap((void *)m->data, m->size);
    }
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
    if (hi <= lo)
        return;
#ifdef MADV_NOHUGEPAGE
    /* The page cache may hold the file in 2 MiB folios, which a read fault maps whole when the
     * mapping allows huge pages: one read of a neighbour (a norm read every step) would bring the
     * dropped pages of its 2 MiB back. Marked no-huge, the range is its own VMA and faults around
     * it map 4 KiB pages. */
    (void)madvise((void *)lo, hi - lo, MADV_NOHUGEPAGE);
#endif
    (void)madvise((void *)lo, hi - lo, MADV_DONTNEED);
}
