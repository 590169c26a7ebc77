/* Helpers shared by the serving actors. */
#include "actors/actor_util.h"

#include <fcntl.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "base/error.h"

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
