/* The shared-memory transport's segment (SH_COLL_SHM): its layout, the named segment's creation
 * by rank 0 and opening by the others (a missing, half-made or stale one waited out), and the
 * in-process group's memory. */
#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "base/error.h"
#include "runtime/coll_shm_int.h"

static uint64_t now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec;
}

size_t sh__coll_shm_seg_bytes(int32_t size, size_t max_bytes, size_t *slot_stride)
{
    *slot_stride = 0;
    if (max_bytes > SIZE_MAX / 4 / SH_COLL_MAX_RANKS)
        return 0;
    size_t stride = sh__coll_shm_round_up(max_bytes, SH__COLL_SHM_ALIGN);
    *slot_stride = stride;
    return sh__coll_shm_round_up(sizeof(sh__coll_shm_hdr), SH__COLL_SHM_ALIGN) +
           (size_t)size * sizeof(sh__coll_shm_ctl) + 2 * (size_t)size * stride + stride;
}

void sh__coll_shm_seg_layout(sh__coll_shm *s, int32_t size, size_t max_bytes)
{
    size_t stride;
    s->total = sh__coll_shm_seg_bytes(size, max_bytes, &stride);
    s->slot_stride = stride;
    s->hdr = (sh__coll_shm_hdr *)s->base;
    s->ctl = (sh__coll_shm_ctl *)(s->base + sh__coll_shm_round_up(sizeof(sh__coll_shm_hdr),
                                                                  SH__COLL_SHM_ALIGN));
    s->slots = (unsigned char *)(s->ctl + size);
    s->result = (float *)(s->slots + 2 * (size_t)size * stride);
}

bool sh__coll_shm_seg_pid_dead(int32_t pid)
{
    if (pid <= 0)
        return false;
    if (kill(pid, 0) != 0)
        return errno == ESRCH;
    char path[64], buf[256];
    snprintf(path, sizeof path, "/proc/%d/stat", (int)pid);
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0)
        return errno == ENOENT;
    ssize_t n = read(fd, buf, sizeof buf - 1);
    close(fd);
    if (n <= 0)
        return false;
    buf[n] = 0;
    const char *p = strrchr(buf, ')'); /* "pid (comm) S ..." */
    return p && (p[2] == 'Z' || p[2] == 'X');
}

/* Fills a fresh header, the magic last (release): a peer that sees the magic sees the rest. */
static void hdr_init(sh__coll_shm_hdr *h, int32_t size, uint32_t epoch, size_t max_bytes,
                     size_t total)
{
    h->version = SH__COLL_SHM_VERSION;
    h->epoch = epoch;
    h->size = size;
    h->creator_pid = (int32_t)getpid();
    h->max_bytes = max_bytes;
    h->total = total;
    atomic_store(&h->bell, 0);
    atomic_store(&h->waiters, 0);
    atomic_store_explicit(&h->magic, SH__COLL_SHM_MAGIC, memory_order_release);
}

static void sleep_ms(int ms)
{
    struct timespec ts = {.tv_sec = 0, .tv_nsec = (long)ms * 1000000};
    nanosleep(&ts, NULL);
}

sh_err sh__coll_shm_seg_create(sh__coll_shm *s, const sh_coll *c, sh_error *e)
{
    size_t stride;
    size_t total = sh__coll_shm_seg_bytes(c->size, c->max_bytes, &stride);
    if (total == 0)
        return sh__error_set(e, SH_EINVAL, "coll: max_bytes %zu is too large", c->max_bytes);
    int fd = -1;
    for (int tries = 0; fd < 0; tries++) {
        if (shm_unlink(s->name) != 0 && errno != ENOENT)
            return sh__error_set(e, SH_EIO, "coll: shm_unlink %s: %s", s->name, strerror(errno));
        fd = shm_open(s->name, O_RDWR | O_CREAT | O_EXCL | O_CLOEXEC, 0600);
        if (fd < 0 && (errno != EEXIST || tries >= 100))
            return sh__error_set(e, SH_EIO, "coll: shm_open %s: %s", s->name, strerror(errno));
    }
    /* Reserve every page now: a write into a tmpfs page that cannot be allocated later would
     * be a SIGBUS in the middle of a call, not an error. */
    int fa = posix_fallocate(fd, 0, (off_t)total);
    if (fa != 0 && fa != EOPNOTSUPP && fa != EINVAL) {
        close(fd);
        shm_unlink(s->name);
        return sh__error_set(e, SH_EIO, "coll: reserving %zu bytes for %s: %s", total, s->name,
                             strerror(fa));
    }
    struct stat st;
    if (ftruncate(fd, (off_t)total) != 0 || fstat(fd, &st) != 0) {
        sh_err rc = sh__error_set(e, SH_EIO, "coll: sizing %s to %zu bytes: %s", s->name, total,
                                  strerror(errno));
        close(fd);
        shm_unlink(s->name);
        return rc;
    }
    void *p = mmap(NULL, total, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    close(fd);
    if (p == MAP_FAILED) {
        shm_unlink(s->name);
        return sh__error_set(e, SH_EIO, "coll: mmap of %s (%zu bytes): %s", s->name, total,
                             strerror(errno));
    }
    s->base = p;
    s->ino = st.st_ino;
    s->dev = st.st_dev;
    sh__coll_shm_seg_layout(s, c->size, c->max_bytes);
    hdr_init(s->hdr, c->size, c->epoch, c->max_bytes, total);
    return SH_OK;
}

sh_err sh__coll_shm_seg_open(sh__coll_shm *s, const sh_coll *c, uint64_t deadline, sh_error *e)
{
    size_t stride;
    size_t total = sh__coll_shm_seg_bytes(c->size, c->max_bytes, &stride);
    if (total == 0)
        return sh__error_set(e, SH_EINVAL, "coll: max_bytes %zu is too large", c->max_bytes);
    char why[160] = "it does not exist";
    for (;;) {
        int fd = shm_open(s->name, O_RDWR | O_CLOEXEC, 0);
        if (fd < 0 && errno != ENOENT)
            return sh__error_set(e, SH_EIO, "coll: shm_open %s: %s", s->name, strerror(errno));
        struct stat st;
        if (fd >= 0 && fstat(fd, &st) == 0 && (size_t)st.st_size >= sizeof(sh__coll_shm_hdr)) {
            sh__coll_shm_hdr *h =
                mmap(NULL, sizeof(sh__coll_shm_hdr), PROT_READ, MAP_SHARED, fd, 0);
            if (h == MAP_FAILED) {
                close(fd);
                return sh__error_set(e, SH_EIO, "coll: mmap of %s: %s", s->name, strerror(errno));
            }
            uint64_t magic = atomic_load_explicit(&h->magic, memory_order_acquire);
            sh__coll_shm_hdr hv;
            memcpy(&hv, h, sizeof hv);
            munmap(h, sizeof(sh__coll_shm_hdr));
            sh_err rc = SH_OK;
            if (magic != SH__COLL_SHM_MAGIC)
                snprintf(why, sizeof why, "it is not initialised");
            else if (sh__coll_shm_seg_pid_dead(hv.creator_pid))
                snprintf(why, sizeof why, "it is left over from a dead run (creator pid %d)",
                         (int)hv.creator_pid);
            else if (hv.epoch < c->epoch)
                snprintf(why, sizeof why, "it holds epoch %u, older than this rank's %u",
                         (unsigned)hv.epoch, (unsigned)c->epoch);
            else if (hv.epoch > c->epoch)
                rc = sh__error_set(e, SH_EPROTO,
                                   "coll: rank %d: segment %s holds epoch %u, newer than this "
                                   "rank's epoch %u",
                                   (int)c->rank, s->name, (unsigned)hv.epoch, (unsigned)c->epoch);
            else if (hv.version != SH__COLL_SHM_VERSION)
                rc = sh__error_set(e, SH_EPROTO, "coll: segment %s has version %u, not %u", s->name,
                                   (unsigned)hv.version, SH__COLL_SHM_VERSION);
            else if (hv.size != c->size)
                rc = sh__error_set(e, SH_EINVAL,
                                   "coll: rank %d: segment %s is for a group of %d ranks, this "
                                   "rank's group has %d",
                                   (int)c->rank, s->name, (int)hv.size, (int)c->size);
            else if (hv.max_bytes != c->max_bytes)
                rc = sh__error_set(e, SH_EINVAL,
                                   "coll: rank %d: segment %s has max_bytes %llu, this rank's "
                                   "is %zu",
                                   (int)c->rank, s->name, (unsigned long long)hv.max_bytes,
                                   c->max_bytes);
            else if ((size_t)st.st_size < total || hv.total != total)
                rc = sh__error_set(e, SH_EPROTO, "coll: segment %s is %lld bytes, expected %zu",
                                   s->name, (long long)st.st_size, total);
            else {
                void *p = mmap(NULL, total, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
                close(fd);
                if (p == MAP_FAILED)
                    return sh__error_set(e, SH_EIO, "coll: mmap of %s (%zu bytes): %s", s->name,
                                         total, strerror(errno));
                s->base = p;
                s->ino = st.st_ino;
                s->dev = st.st_dev;
                sh__coll_shm_seg_layout(s, c->size, c->max_bytes);
                /* A segment whose rank 0 has left, or where this rank's block is taken, belongs
                 * to a finished incarnation of the same epoch: rank 0 replaces it. */
                uint32_t st0 = atomic_load(&s->ctl[0].state);
                uint32_t mine = atomic_load(&s->ctl[c->rank].state);
                if (st0 != SH__COLL_SHM_CLOSED && st0 != SH__COLL_SHM_BROKEN &&
                    mine == SH__COLL_SHM_FREE)
                    return SH_OK;
                if (mine != SH__COLL_SHM_FREE)
                    snprintf(why, sizeof why, "rank %d has already joined it", (int)c->rank);
                else
                    snprintf(why, sizeof why,
                             "it is left over from a finished group (its rank 0 "
                             "left)");
                munmap(p, total);
                s->base = NULL;
                fd = -1;
            }
            if (rc) {
                close(fd);
                return rc;
            }
        } else if (fd >= 0) {
            snprintf(why, sizeof why, "it is not sized yet");
        }
        if (fd >= 0)
            close(fd);
        if (now_ns() >= deadline)
            return sh__error_set(e, SH_ETIMEDOUT,
                                 "coll: rank %d: segment %s not ready within %d ms: %s",
                                 (int)c->rank, s->name, (int)c->timeout_ms, why);
        sleep_ms(1);
    }
}

void sh__coll_shm_seg_close(sh__coll_shm *s, bool unlink)
{
    if (unlink) {
        int fd = shm_open(s->name, O_RDONLY, 0);
        if (fd >= 0) {
            struct stat st;
            if (fstat(fd, &st) == 0 && st.st_ino == s->ino && st.st_dev == s->dev)
                shm_unlink(s->name);
            close(fd);
        }
    }
    munmap(s->base, s->total);
    s->base = NULL;
}

sh_err sh_coll_inproc_create(int32_t size, size_t max_bytes, sh_coll_inproc **out, sh_error *e)
{
    if (!out)
        return sh__error_set(e, SH_EINVAL, "coll: out is NULL");
    *out = NULL;
    if (size < 1 || size > SH_COLL_MAX_RANKS)
        return sh__error_set(e, SH_EINVAL, "coll: group size %d outside 1..%d", (int)size,
                             SH_COLL_MAX_RANKS);
    if (max_bytes == 0)
        return sh__error_set(e, SH_EINVAL, "coll: max_bytes is 0");
    size_t stride;
    size_t total = sh__coll_shm_seg_bytes(size, max_bytes, &stride);
    if (total == 0)
        return sh__error_set(e, SH_EINVAL, "coll: max_bytes %zu is too large", max_bytes);
    sh_coll_inproc *g = calloc(1, sizeof *g);
    if (!g)
        return sh__error_set(e, SH_ENOMEM, "coll: out of memory");
    void *p = mmap(NULL, total, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED) {
        free(g);
        return sh__error_set(e, SH_ENOMEM, "coll: mapping %zu bytes for the group: %s", total,
                             strerror(errno));
    }
    g->size = size;
    g->max_bytes = max_bytes;
    g->base = p;
    g->total = total;
    hdr_init((sh__coll_shm_hdr *)p, size, 0, max_bytes, total);
    *out = g;
    return SH_OK;
}

void sh_coll_inproc_destroy(sh_coll_inproc *g)
{
    if (!g)
        return;
    munmap(g->base, g->total);
    free(g);
}
