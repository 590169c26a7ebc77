/* Helpers shared by the serving actors. */
#include "actors/actor_util.h"

#include <fcntl.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "base/error.h"

/* ---- worker thread ---- */

static void worker_main(void *arg)
{
    sh_act_worker *w = arg;
    pthread_setname_np(pthread_self(), w->name);
    uv_mutex_lock(&w->mu);
    for (;;) {
        while (!w->stopping && w->len == 0)
            uv_cond_wait(&w->cv, &w->mu);
        if (w->stopping)
            break;
        struct sh_act_queued qe = w->q[w->head];
        w->head = (w->head + 1) % w->cap;
        w->len--;
        uv_mutex_unlock(&w->mu);
        w->run(w->user, qe.m, qe.us);
        sh_msg_free(qe.m);
        uv_mutex_lock(&w->mu);
    }
    uv_mutex_unlock(&w->mu);
}

sh_err sh__act_worker_start(sh_act_worker *w, const char *name, uint32_t cap,
                            void (*run)(void *user, const sh_msg *m, uint64_t arrived_us),
                            void *user, sh_error *e)
{
    memset(w, 0, sizeof *w);
    w->cap = cap > 0 ? cap : 16;
    w->q = malloc((size_t)w->cap * sizeof *w->q);
    if (!w->q)
        return sh__error_set(e, SH_ENOMEM, "out of memory");
    w->run = run;
    w->user = user;
    w->name = name;
    const char *what = NULL;
    int rv = 0;
    if ((rv = uv_mutex_init(&w->mu)) != 0) {
        what = "mutex";
    } else if ((rv = uv_cond_init(&w->cv)) != 0) {
        uv_mutex_destroy(&w->mu);
        what = "condition";
    } else if ((rv = uv_thread_create(&w->thread, worker_main, w)) != 0) {
        uv_cond_destroy(&w->cv);
        uv_mutex_destroy(&w->mu);
        what = "thread";
    }
    if (!what)
        return SH_OK;
    free(w->q);
    memset(w, 0, sizeof *w);
    return sh__error_set(e, SH_EIO, "%s: %s", what, uv_strerror(rv));
}

sh_err sh__act_worker_push(sh_act_worker *w, sh_msg *m)
{
    uv_mutex_lock(&w->mu);
    if (w->len == w->cap) {
        uint32_t cap = w->cap * 2;
        struct sh_act_queued *q = malloc((size_t)cap * sizeof *q);
        if (!q) {
            uv_mutex_unlock(&w->mu);
            return SH_ENOMEM;
        }
        for (uint32_t i = 0; i < w->len; i++)
            q[i] = w->q[(w->head + i) % w->cap];
        free(w->q);
        w->q = q;
        w->cap = cap;
        w->head = 0;
    }
    w->q[(w->head + w->len) % w->cap] = (struct sh_act_queued){m, sh__act_mono_us()};
    w->len++;
    uv_cond_signal(&w->cv);
    uv_mutex_unlock(&w->mu);
    return SH_OK;
}

void sh__act_worker_stop(sh_act_worker *w)
{
    uv_mutex_lock(&w->mu);
    w->stopping = true;
    uv_cond_broadcast(&w->cv);
    uv_mutex_unlock(&w->mu);
    uv_thread_join(&w->thread);
    for (; w->len > 0; w->len--) {
        sh_msg_free(w->q[w->head].m);
        w->head = (w->head + 1) % w->cap;
    }
    uv_cond_destroy(&w->cv);
    uv_mutex_destroy(&w->mu);
    free(w->q);
    w->q = NULL;
}

sh_err sh__act_decoder_init(sh_act_decoder *d, size_t arena_bytes)
{
    sh__msg_codec_init(&d->codec);
    d->mem = malloc(arena_bytes);
    if (!d->mem)
        return SH_ENOMEM;
    sh__proto_arena_init(&d->arena, d->mem, arena_bytes);
    return SH_OK;
}

void sh__act_decoder_fini(sh_act_decoder *d)
{
    free(d->mem);
    d->mem = NULL;
    sh__proto_arena_init(&d->arena, NULL, 0);
}

sh_err sh__act_decode(sh_act_decoder *d, const sh_msg *m, sh_proto_body *out, sh_error *e)
{
    size_t len = 0;
    const void *body = sh_msg_body(m, &len);
    sh__proto_arena_reset(&d->arena);
    return sh__proto_decode_body(&d->codec, sh_msg_header(m)->type, body, len, out, &d->arena, e);
}

sh_err sh__act_send(sh_runtime *rt, sh_addr src, sh_addr dst, uint32_t type, uint64_t trace_id,
                    const void *body, sh_error *e)
{
    sh_msg_hdr h = {.type = (sh_msg_type)type, .src = src, .dst = dst, .trace_id = trace_id};
    return sh_send_with(rt, &h, sh__proto_encode, body, e);
}

uint64_t sh__act_unix_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    return (uint64_t)ts.tv_sec * 1000u + (uint64_t)ts.tv_nsec / 1000000u;
}

uint64_t sh__act_mono_us(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000u + (uint64_t)ts.tv_nsec / 1000u;
}

uint64_t sh__act_rss_bytes(void)
{
    // statm's second field is the resident set in pages; read it with plain I/O (no stdio
    // buffer allocation on the heartbeat path).
    int fd = open("/proc/self/statm", O_RDONLY | O_CLOEXEC);
    if (fd < 0)
        return 0;
    char buf[128];
    ssize_t n = read(fd, buf, sizeof buf - 1);
    close(fd);
    if (n <= 0)
        return 0;
    buf[n] = 0;
    char *p = strchr(buf, ' ');
    if (!p)
        return 0;
    unsigned long long pages = strtoull(p + 1, NULL, 10);
    long page = sysconf(_SC_PAGESIZE);
    return (uint64_t)pages * (uint64_t)(page > 0 ? page : 4096);
}
