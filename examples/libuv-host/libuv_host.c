/* A host with its own libuv loop: Shoal's callbacks run when uv_poll sees sh_fd() readable, so
 * the loop never blocks on the engine and the engine never calls the host from another thread.
 *
 * Usage: libuv_host -m MODEL [--threads N] [--max-tokens T] PROMPT...
 * Submits every PROMPT at once (a timer also ticks every 100 ms to show the loop stays free),
 * prints each completion as it ends, and exits when all are over. */
#define _POSIX_C_SOURCE 200809L

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <shoal.h>
#include <uv.h>

typedef struct completion {
    uint64_t id;
    char *text; /* grown as tokens come */
    size_t len;
} completion;

typedef struct host {
    uv_loop_t *loop;
    uv_poll_t poll;    /* watches sh_fd */
    uv_timer_t ticker; /* shows the loop keeps running while the model works */
    sh_engine *eng;
    completion *c;
    int n, left, failed;
    long ticks;
} host;

static completion *find(host *h, uint64_t id)
{
    for (int i = 0; i < h->n; i++)
        if (h->c[i].id == id)
            return &h->c[i];
    return NULL;
}

static void on_token(void *user, uint64_t id, const sh_token_event *ev)
{
    completion *c = find((host *)user, id);
    if (!c || ev->text_len == 0)
        return;
    char *p = (char *)realloc(c->text, c->len + ev->text_len + 1);
    if (!p)
        return; /* keep what we have; the line is only printed */
    memcpy(p + c->len, ev->text, ev->text_len);
    c->len += ev->text_len;
    p[c->len] = '\0';
    c->text = p;
}

static void finish(host *h)
{
    if (--h->left > 0)
        return;
    /* Everything is over: stop watching, and let uv_run return once the handles are closed. */
    uv_poll_stop(&h->poll);
    uv_close((uv_handle_t *)&h->poll, NULL);
    uv_close((uv_handle_t *)&h->ticker, NULL);
}

static void on_done(void *user, uint64_t id, const sh_done_info *info)
{
    host *h = (host *)user;
    completion *c = find(h, id);
    static const char *const why[] = {"stop", "length", "cancel", "deadline", "tool_calls"};
    for (size_t i = 0; c && i < c->len; i++)
        if (c->text[i] == '\n')
            c->text[i] = ' '; /* one line per completion */
    printf("[%llu] (%s, %d prompt + %d completion tokens)%s\n", (unsigned long long)id,
           why[info->finish], info->prompt_tokens, info->completion_tokens,
           c && c->text ? c->text : "");
    finish(h);
}

static void on_error(void *user, uint64_t id, sh_err code, const char *message)
{
    host *h = (host *)user;
    fprintf(stderr, "libuv_host: request %llu failed: %s: %s\n", (unsigned long long)id,
            sh_strerror(code), message);
    h->failed++;
    finish(h);
}

/* sh_fd is readable: run what is due, without waiting. */
static void on_readable(uv_poll_t *p, int status, int events)
{
    host *h = (host *)p->data;
    (void)events;
    if (status < 0) {
        fprintf(stderr, "libuv_host: uv_poll: %s\n", uv_strerror(status));
        return;
    }
    sh_poll(h->eng, 0, NULL);
}

static void on_tick(uv_timer_t *t) { ((host *)t->data)->ticks++; }

int main(int argc, char **argv)
{
    const char *model = getenv("SHOAL_MODEL");
    int threads = 1, max_tokens = 32, first_prompt = argc;
    for (int i = 1; i < argc; i++) {
        if ((strcmp(argv[i], "-m") == 0) && i + 1 < argc) {
            model = argv[++i];
        } else if (strcmp(argv[i], "--threads") == 0 && i + 1 < argc) {
            threads = atoi(argv[++i]);
        } else if (strcmp(argv[i], "--max-tokens") == 0 && i + 1 < argc) {
            max_tokens = atoi(argv[++i]);
        } else if (argv[i][0] == '-') {
            fprintf(stderr, "libuv_host: unknown option '%s'\n", argv[i]);
            return 2;
        } else {
            first_prompt = i;
            break;
        }
    }
    if (!model || first_prompt >= argc) {
        fprintf(stderr, "usage: libuv_host -m MODEL [--threads N] [--max-tokens T] PROMPT...\n");
        return 2;
    }

    host h;
    memset(&h, 0, sizeof h);
    h.loop = uv_default_loop();
    sh_engine_opts o = sh_engine_opts_default();
    o.model_path = model;
    o.threads = threads;
    sh_error err;
    if (sh_engine_open(&o, &h.eng, &err) != SH_OK) {
        fprintf(stderr, "libuv_host: cannot open %s: %s\n", model, err.msg);
        return 1;
    }

    h.n = argc - first_prompt;
    h.c = (completion *)calloc((size_t)h.n, sizeof *h.c);
    if (!h.c) {
        sh_engine_close(h.eng);
        return 1;
    }
    sh_callbacks cb = {on_token, on_done, on_error};
    for (int i = 0; i < h.n; i++) {
        sh_request_opts r = sh_request_opts_default();
        r.prompt = argv[first_prompt + i];
        r.max_tokens = max_tokens;
        if (sh_submit(h.eng, &r, &cb, &h, &h.c[i].id, &err) != SH_OK) {
            fprintf(stderr, "libuv_host: submit '%s': %s\n", r.prompt, err.msg);
            h.failed++;
            continue;
        }
        h.left++;
    }

    if (h.left > 0) {
        int rc = uv_poll_init(h.loop, &h.poll, sh_fd(h.eng));
        if (rc == 0) {
            h.poll.data = &h;
            rc = uv_poll_start(&h.poll, UV_READABLE, on_readable);
        }
        if (rc != 0) {
            fprintf(stderr, "libuv_host: watching sh_fd: %s\n", uv_strerror(rc));
            h.failed++;
        } else {
            uv_timer_init(h.loop, &h.ticker);
            h.ticker.data = &h;
            uv_timer_start(&h.ticker, on_tick, 100, 100);
            uv_run(h.loop, UV_RUN_DEFAULT);
        }
    }
    printf("libuv_host: loop ticked %ld times while generating; %d failed\n", h.ticks, h.failed);
    sh_engine_close(h.eng);
    for (int i = 0; i < h.n; i++)
        free(h.c[i].text);
    free(h.c);
    uv_loop_close(h.loop);
    return h.failed ? 1 : 0;
}
