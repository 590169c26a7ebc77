/* Control loops: one libuv loop and thread each, running ready actors a bounded turn at a time. */
#include <pthread.h>
#include <stdio.h>

#include "base/error.h"
#include "runtime/internal.h"

/* How a loop runs actors. A sender pushes into the actor's mailbox and then "schedules" it: the
 * first to flip a->scheduled from 0 to 1 pushes the actor into its loop's run queue (another
 * MPSC queue) and wakes the loop with uv_async_send, which libuv coalesces. The loop pops a
 * snapshot of the run queue (a round) and gives each actor one turn of at most max_turns
 * messages, so a flooding actor cannot starve the others on its loop. An actor with messages
 * left goes back into the run queue; one with none clears `scheduled` and looks at its mailbox
 * once more, since a sender that found the flag still set relied on the loop to see its message.
 *
 * While a round runs, `in_round` tells senders that the loop will look at its run queue again
 * before sleeping, so they skip the uv_async_send (an eventfd write). After a few rounds the loop
 * yields to libuv (timers, I/O) by waking itself. */

#define MAX_ROUNDS 8

static void on_close(uv_handle_t *h)
{
    struct sh__loop *l = h->data;
    atomic_fetch_sub(&l->rt->handles_live, 1);
}

void sh__loop_busy_begin(struct sh__loop *l, const sh_actor_ctx *a)
{
    atomic_store_explicit(&l->busy_vt, a->vt, memory_order_relaxed);
    atomic_store_explicit(&l->busy_id, a->id, memory_order_relaxed);
    atomic_fetch_add_explicit(&l->busy_seq, 1, memory_order_release);
    atomic_store_explicit(&l->busy_since, sh__rt_now(), memory_order_release);
}

void sh__loop_busy_end(struct sh__loop *l)
{
    atomic_store_explicit(&l->busy_since, 0, memory_order_release);
}

void sh__loop_schedule(sh_actor_ctx *a)
{
    if (atomic_exchange(&a->scheduled, 1) != 0)
        return;
    struct sh__loop *l = a->loop;
    sh__actor_retain(a); /* the run queue's reference */
    sh__mailbox_push(&l->runq, &a->sched_node);
    if (!atomic_load(&l->in_round))
        uv_async_send(&l->async);
}

static void deliver(struct sh__loop *l, sh_actor_ctx *a, sh_msg *m)
{
    sh_runtime *rt = l->rt;
    int64_t depth = atomic_fetch_sub(&a->depth, 1) - 1;
    if (depth < (int64_t)rt->mailbox_warn / 2 &&
        atomic_load_explicit(&a->overloaded, memory_order_relaxed))
        atomic_store(&a->overloaded, 0); /* re-arms the warning: hysteresis of half */
    if (m->env.hdr.session != 0 && !(m->flags & SH__MSG_TIMEOUT) &&
        sh__session_match_msg(l, a, m) == SH__SESSION_MATCH_LATE) {
        sh_counter_add(rt->m.late, 1);
        sh__log_emit(&rt->log, SH_LOG_LEVEL_DEBUG, a->vt->name, a->id, "late_reply",
                     "session=%llu type=%s", (unsigned long long)m->env.hdr.session,
                     sh__msg_type_name((uint64_t)m->env.hdr.type));
        sh__mailbox_msg_release(m);
        return;
    }
    sh__loop_busy_begin(l, a);
    sh_msg_fate fate = a->vt->handle(a, a->state, m);
    sh__loop_busy_end(l);
    l->handled++;
    atomic_store_explicit(&l->handled_pub, l->handled, memory_order_relaxed);
    if (fate != SH_MSG_FATE_KEPT)
        sh__mailbox_msg_release(m);
}

static void run_init(struct sh__loop *l, sh_actor_ctx *a)
{
    sh_err err = SH_OK;
    if (a->vt->init) {
        sh__loop_busy_begin(l, a);
        err = a->vt->init(a, a->state, a->init_arg);
        sh__loop_busy_end(l);
    }
    a->init_arg = NULL;
    int expect = SH__ACTOR_INIT;
    if (err) {
        sh__log_emit(&l->rt->log, SH_LOG_LEVEL_ERROR, a->vt->name, a->id, "actor_init_failed",
                     "error=\"%s\"", sh_strerror(err));
        atomic_compare_exchange_strong(&a->life, &expect, SH__ACTOR_STOPPING);
        return;
    }
    a->inited = true;
    /* Fails when a stop arrived during init: the actor then stops, with its stop member. */
    atomic_compare_exchange_strong(&a->life, &expect, SH__ACTOR_RUNNING);
}

/* One turn of actor a; consumes or passes on the run queue's reference. */
static void run_actor(struct sh__loop *l, sh_actor_ctx *a)
{
    if (atomic_load(&a->life) == SH__ACTOR_INIT)
        run_init(l, a);
    uint32_t n = 0;
    bool more = false;
    while (atomic_load_explicit(&a->life, memory_order_relaxed) == SH__ACTOR_RUNNING) {
        if (n == l->rt->max_turns) {
            more = true;
            break;
        }
        sh__mpsc_node *node = sh__mailbox_pop(&a->mbox);
        if (!node)
            break;
        deliver(l, a, (sh_msg *)node);
        n++;
    }
    int life = atomic_load(&a->life);
    if (life == SH__ACTOR_STOPPING) {
        sh__actor_finish(l, a);
        life = SH__ACTOR_STOPPED;
    } else if (life == SH__ACTOR_STOPPED) {
        sh__actor_drain(a, SH_ECLOSED); /* a sender raced with the stop */
    }
    if (more && life == SH__ACTOR_RUNNING) {
        sh__mailbox_push(&l->runq, &a->sched_node); /* keeps `scheduled` and the reference */
        return;
    }
    atomic_store(&a->scheduled, 0);
    if ((sh__mailbox_ready(&a->mbox) || atomic_load(&a->life) == SH__ACTOR_STOPPING) &&
        atomic_exchange(&a->scheduled, 1) == 0) {
        sh__mailbox_push(&l->runq, &a->sched_node);
        return;
    }
    sh__actor_release(a);
}

static void run_round(struct sh__loop *l)
{
    sh_actor_ctx *first = NULL, **tailp = &first;
    sh__mpsc_node *n;
    while ((n = sh__mailbox_pop(&l->runq)) != NULL) {
        sh_actor_ctx *a = (sh_actor_ctx *)n;
        a->run_next = NULL;
        *tailp = a;
        tailp = &a->run_next;
    }
    while (first) {
        sh_actor_ctx *a = first;
        first = a->run_next;
        run_actor(l, a);
    }
}

static void on_async(uv_async_t *h)
{
    struct sh__loop *l = h->data;
    bool again = false;
    for (int round = 0; round < MAX_ROUNDS; round++) {
        atomic_store(&l->in_round, 1);
        run_round(l);
        atomic_store(&l->in_round, 0);
        again = sh__mailbox_ready(&l->runq);
        if (!again)
            break;
    }
    if (again)
        uv_async_send(&l->async); /* let timers and I/O run, then continue */
    if (atomic_load(&l->quit)) {
        /* Destroy sets quit only after every actor is gone, so nothing is left to run. */
        if (!uv_is_closing((uv_handle_t *)&l->async)) {
            uv_close((uv_handle_t *)&l->async, on_close);
            uv_close((uv_handle_t *)&l->timer, on_close);
        }
    }
}

sh_err sh__loop_init(sh_runtime *rt, struct sh__loop *l, uint32_t index, sh_error *e)
{
    l->rt = rt;
    l->index = index;
    sh__mailbox_init(&l->runq);
    int rc = uv_loop_init(&l->uv);
    if (rc)
        return sh__error_set(e, SH_EIO, "loop %u: uv_loop_init: %s", (unsigned)index,
                             uv_strerror(rc));
    l->uv_ok = true;
    if ((rc = uv_async_init(&l->uv, &l->async, on_async)) != 0)
        return sh__error_set(e, SH_EIO, "loop %u: uv_async_init: %s", (unsigned)index,
                             uv_strerror(rc));
    l->async.data = l;
    l->async_ok = true;
    atomic_fetch_add(&rt->handles_live, 1);
    uv_timer_init(&l->uv, &l->timer); /* cannot fail */
    l->timer.data = l;
    l->timer_ok = true;
    atomic_fetch_add(&rt->handles_live, 1);
    return SH_OK;
}

static void loop_main(void *arg)
{
    struct sh__loop *l = arg;
    char name[16]; /* named for ps and /proc/PID/task/TID/comm */
    snprintf(name, sizeof name, "shoal-loop-%u", (unsigned)l->index);
    pthread_setname_np(pthread_self(), name);
    uv_run(&l->uv, UV_RUN_DEFAULT);
}

sh_err sh__loop_start(struct sh__loop *l, sh_error *e)
{
    int rc = sh__rt_thread_create(l->rt, &l->thread, loop_main, l);
    if (rc)
        return sh__error_set(e, SH_EIO, "loop %u: uv_thread_create: %s", (unsigned)l->index,
                             uv_strerror(rc));
    l->thread_ok = true;
    atomic_fetch_add(&l->rt->threads_live, 1);
    return SH_OK;
}

void sh__loop_stop_join(struct sh__loop *l)
{
    if (l->thread_ok) {
        atomic_store(&l->quit, 1);
        uv_async_send(&l->async);
        uv_thread_join(&l->thread);
        l->thread_ok = false;
        atomic_fetch_sub(&l->rt->threads_live, 1);
    } else if (l->uv_ok) {
        /* Never started (create failed later): close the handles on this thread. */
        if (l->async_ok)
            uv_close((uv_handle_t *)&l->async, on_close);
        if (l->timer_ok)
            uv_close((uv_handle_t *)&l->timer, on_close);
        uv_run(&l->uv, UV_RUN_DEFAULT);
    }
    l->async_ok = l->timer_ok = false;
    if (l->uv_ok) {
        sh__timer_heap_fini(l);
        sh__session_map_fini(l);
        if (uv_loop_close(&l->uv) != 0)
            sh__log_emit(&l->rt->log, SH_LOG_LEVEL_ERROR, NULL, 0, "loop_close_busy", "loop=%u",
                         (unsigned)l->index);
        l->uv_ok = false;
    }
}
