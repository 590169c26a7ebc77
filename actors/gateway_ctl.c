/* The gateway's drain (graceful shutdown), fail-stop and API-key reloads, commanded from another
 * thread. */
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "actors/gateway_int.h"
#include "runtime/actor_uv.h"

/* ---- drain and keys ----------------------------------------------------------------------- */

struct sh_gateway_ctl {
    pthread_mutex_t mu;
    uv_async_t *async; /* the running gateway's wakeup (NULL when none runs) */
    bool drain;        /* a drain was asked for */
    bool fail;         /* fail-stop: end every request now with fail_msg */
    char fail_msg[256];
    bool keys_new; /* keys holds a set the gateway has not taken yet */
    sh_openai_key *keys;
    int32_t n_keys;
    int drained; /* atomic: the drain finished */
};

/* The libuv handles of a gateway with a ctl; freed when both are closed (after stop). */
typedef struct gw_ctl_handles {
    uv_async_t async;
    uv_timer_t timer;
    int open;
} gw_ctl_handles;

/* A copy of keys in one block (the array, then the strings); NULL for none or no memory. */
sh_openai_key *sh__gateway_ctl_keys_copy(const sh_openai_key *keys, int32_t n)
{
    if (n <= 0)
        return NULL;
    size_t bytes = (size_t)n * sizeof *keys;
    for (int32_t i = 0; i < n; i++)
        bytes += strlen(keys[i].key) + 1;
    sh_openai_key *out = malloc(bytes);
    if (!out)
        return NULL;
    char *p = (char *)(out + n);
    for (int32_t i = 0; i < n; i++) {
        size_t l = strlen(keys[i].key) + 1;
        memcpy(p, keys[i].key, l);
        out[i] = (sh_openai_key){p, keys[i].priority, keys[i].admin};
        p += l;
    }
    return out;
}

sh_err sh__gateway_ctl_create(sh_gateway_ctl **out)
{
    *out = calloc(1, sizeof **out);
    if (!*out)
        return SH_ENOMEM;
    pthread_mutex_init(&(*out)->mu, NULL);
    return SH_OK;
}

void sh__gateway_ctl_destroy(sh_gateway_ctl *ctl)
{
    if (!ctl)
        return;
    pthread_mutex_destroy(&ctl->mu);
    free(ctl->keys);
    free(ctl);
}

void sh__gateway_ctl_drain(sh_gateway_ctl *ctl)
{
    pthread_mutex_lock(&ctl->mu);
    ctl->drain = true;
    if (ctl->async)
        uv_async_send(ctl->async);
    pthread_mutex_unlock(&ctl->mu);
}

void sh__gateway_ctl_fail(sh_gateway_ctl *ctl, const char *msg)
{
    pthread_mutex_lock(&ctl->mu);
    if (!ctl->fail)
        snprintf(ctl->fail_msg, sizeof ctl->fail_msg, "%s", msg);
    ctl->fail = true;
    ctl->drain = true;
    if (ctl->async)
        uv_async_send(ctl->async);
    pthread_mutex_unlock(&ctl->mu);
}

bool sh__gateway_ctl_drained(sh_gateway_ctl *ctl)
{
    return __atomic_load_n(&ctl->drained, __ATOMIC_ACQUIRE) != 0;
}

sh_err sh__gateway_ctl_set_keys(sh_gateway_ctl *ctl, const sh_openai_key *keys, int32_t n_keys)
{
    sh_openai_key *copy = sh__gateway_ctl_keys_copy(keys, n_keys);
    if (n_keys > 0 && !copy)
        return SH_ENOMEM;
    pthread_mutex_lock(&ctl->mu);
    sh_err rc = SH_ECLOSED;
    if (ctl->async) {
        free(ctl->keys);
        ctl->keys = copy;
        ctl->n_keys = n_keys;
        ctl->keys_new = true;
        copy = NULL;
        uv_async_send(ctl->async);
        rc = SH_OK;
    }
    pthread_mutex_unlock(&ctl->mu);
    free(copy);
    return rc;
}

static void drain_finish(gateway *g, const char *how)
{
    g->drained = true;
    if (g->hd)
        uv_timer_stop(&g->hd->timer);
    sh_actor_log(g->ctx, SH_LOG_LEVEL_INFO, "drained", "how=%s", how);
    if (g->a.ctl)
        __atomic_store_n(&g->a.ctl->drained, 1, __ATOMIC_RELEASE);
}

/* Every 20 ms while draining: done when no request is open; at the deadline the rest is ended
 * (with the ctl's failure message after a fail-stop). */
static void on_drain_tick(uv_timer_t *t)
{
    gateway *g = t->data;
    if (g->drained)
        return;
    if (sh_http_server_active(g->srv) == 0) {
        drain_finish(g, "every request finished");
        return;
    }
    if (uv_now(t->loop) < g->drain_deadline_ms)
        return;
    char fail_msg[256];
    pthread_mutex_lock(&g->a.ctl->mu);
    bool fail = g->a.ctl->fail;
    memcpy(fail_msg, g->a.ctl->fail_msg, sizeof fail_msg);
    pthread_mutex_unlock(&g->a.ctl->mu);
    int n = 0;
    sh__gateway_embed_end_all(g, fail ? fail_msg
                                      : "the server is shutting down and this request "
                                        "did not finish within the drain timeout");
    while (g->reqs) {
        gw_req *r = g->reqs;
        g->reqs = r->next;
        sh_proto_cancel c = {.req = r->id, .reason = {"shutting down", 13}};
        sh_error e = {0};
        sh__act_send(sh_actor_runtime(g->ctx), sh_actor_self(g->ctx), r->m->batcher, SH_MSG_CANCEL,
                     r->id, &c, &e);
        if (fail)
            sh__gateway_end_with_error(g, r, 503, "replica_failed", fail_msg);
        else
            sh__gateway_end_with_error(
                g, r, 503, "server_shutting_down",
                "the server is shutting down and this request did not finish within "
                "the drain timeout");
        sh__gateway_req_free(r);
        n++;
    }
    if (fail)
        sh_actor_log(g->ctx, SH_LOG_LEVEL_WARN, "failed", "ended=%d", n);
    else
        sh_actor_log(g->ctx, SH_LOG_LEVEL_WARN, "drain_timeout", "ended=%d timeout_ms=%u", n,
                     g->a.drain_timeout_ms);
    drain_finish(g, fail ? "fail-stop" : "deadline");
}

/* Starts draining, or after a fail-stop (fail) moves the deadline to now: every open request is
 * ended at once, also when a graceful drain was already under way. */
static void drain_start(gateway *g, bool fail)
{
    if (g->drained || (g->draining && !fail))
        return;
    uv_loop_t *loop = sh__actor_uv_loop(g->ctx);
    if (!g->draining) {
        g->draining = true;
        sh_http_server_drain(g->srv);
        sh_actor_log(g->ctx, SH_LOG_LEVEL_INFO, "draining", "requests=%u timeout_ms=%u fail=%d",
                     sh_http_server_active(g->srv), fail ? 0u : g->a.drain_timeout_ms, (int)fail);
    }
    g->drain_deadline_ms = uv_now(loop) + (fail ? 0 : g->a.drain_timeout_ms);
    on_drain_tick(&g->hd->timer);
    if (!g->drained)
        uv_timer_start(&g->hd->timer, on_drain_tick, 20, 20);
}

/* The ctl's wakeup: take new keys, start a drain. */
static void on_ctl(uv_async_t *a)
{
    gateway *g = a->data;
    sh_gateway_ctl *ctl = g->a.ctl;
    pthread_mutex_lock(&ctl->mu);
    bool drain = ctl->drain, fail = ctl->fail;
    sh_openai_key *keys = NULL;
    int32_t n_keys = 0;
    bool new_keys = ctl->keys_new;
    if (new_keys) {
        keys = ctl->keys;
        n_keys = ctl->n_keys;
        ctl->keys = NULL;
        ctl->n_keys = 0;
        ctl->keys_new = false;
    }
    pthread_mutex_unlock(&ctl->mu);
    if (new_keys) {
        free(g->keys);
        g->keys = keys;
        g->n_keys = n_keys;
        sh_actor_log(g->ctx, SH_LOG_LEVEL_INFO, "api_keys_reloaded", "keys=%d", (int)n_keys);
    }
    if (drain)
        drain_start(g, fail);
}

static void on_ctl_closed(uv_handle_t *h)
{
    gw_ctl_handles *hd = h->data; /* the gateway is gone by now: only hd is touched */
    if (--hd->open == 0)
        free(hd);
}

/* Registers g with its ctl (init). Returns SH_OK or SH_ENOMEM. */
sh_err sh__gateway_ctl_attach(gateway *g)
{
    sh_gateway_ctl *ctl = g->a.ctl;
    if (!ctl)
        return SH_OK;
    gw_ctl_handles *hd = calloc(1, sizeof *hd);
    if (!hd)
        return SH_ENOMEM;
    uv_loop_t *loop = sh__actor_uv_loop(g->ctx);
    uv_async_init(loop, &hd->async, on_ctl);
    uv_timer_init(loop, &hd->timer);
    hd->async.data = g;
    hd->timer.data = g;
    hd->open = 2;
    g->hd = hd;
    pthread_mutex_lock(&ctl->mu);
    ctl->async = &hd->async;
    if (ctl->drain) /* asked for before this gateway ran */
        uv_async_send(&hd->async);
    pthread_mutex_unlock(&ctl->mu);
    return SH_OK;
}

/* Unregisters g from its ctl and closes the handles (stop). */
void sh__gateway_ctl_detach(gateway *g)
{
    gw_ctl_handles *hd = g->hd;
    if (!hd)
        return;
    pthread_mutex_lock(&g->a.ctl->mu);
    g->a.ctl->async = NULL;
    pthread_mutex_unlock(&g->a.ctl->mu);
    hd->async.data = hd;
    hd->timer.data = hd;
    uv_close((uv_handle_t *)&hd->async, on_ctl_closed);
    uv_close((uv_handle_t *)&hd->timer, on_ctl_closed);
    g->hd = NULL;
}
