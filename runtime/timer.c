/* Per-loop deadline min-heap behind one libuv timer, and actor timers on top of it. */
#include "runtime/timer.h"

#include "runtime/internal.h"

/* One libuv timer per loop, armed for the earliest deadline in the heap, instead of one handle
 * per request or actor timer: adding and cancelling a deadline is O(log n) in plain memory and
 * never touches libuv's handle lists, and shutdown has one handle per loop to close. */

static bool before(const sh__timer_node *a, const sh__timer_node *b)
{
    return a->due_ns < b->due_ns || (a->due_ns == b->due_ns && a->seq < b->seq);
}

static void set(sh__timer_heap *h, uint32_t i, sh__timer_node *n)
{
    h->v[i] = n;
    n->idx = i;
}

static void sift_up(sh__timer_heap *h, uint32_t i)
{
    sh__timer_node *n = h->v[i];
    while (i > 0) {
        uint32_t p = (i - 1) / 2;
        if (!before(n, h->v[p]))
            break;
        set(h, i, h->v[p]);
        i = p;
    }
    set(h, i, n);
}

static void sift_down(sh__timer_heap *h, uint32_t i)
{
    sh__timer_node *n = h->v[i];
    for (;;) {
        uint32_t c = 2 * i + 1;
        if (c >= h->n)
            break;
        if (c + 1 < h->n && before(h->v[c + 1], h->v[c]))
            c++;
        if (!before(h->v[c], n))
            break;
        set(h, i, h->v[c]);
        i = c;
    }
    set(h, i, n);
}

static void on_timer(uv_timer_t *t) { sh__timer_run_due(t->data); }

/* Arms the libuv timer for the heap's top, rounding up to whole milliseconds (libuv's
 * resolution) so a deadline never fires early. */
static void arm(struct sh__loop *l)
{
    sh__timer_heap *h = &l->heap;
    if (h->n == 0) {
        if (l->armed_due) {
            uv_timer_stop(&l->timer);
            l->armed_due = 0;
        }
        return;
    }
    uint64_t due = h->v[0]->due_ns;
    if (l->armed_due == due)
        return;
    uint64_t now = sh__rt_now();
    uint64_t ms = due > now ? (due - now + 999999u) / 1000000u : 0;
    uv_update_time(&l->uv); /* libuv measures the timeout from its cached "now" */
    uv_timer_start(&l->timer, on_timer, ms, 0);
    l->armed_due = due;
}

sh_err sh__timer_add(struct sh__loop *l, sh__timer_node *node, uint64_t due_ns)
{
    sh__timer_heap *h = &l->heap;
    if (h->n == h->cap) {
        uint32_t ncap = h->cap ? h->cap * 2 : 64;
        sh__timer_node **nv = sh__rt_realloc(l->rt, h->v, ncap * sizeof *nv);
        if (!nv)
            return SH_ENOMEM;
        h->v = nv;
        h->cap = ncap;
    }
    node->due_ns = due_ns;
    node->seq = ++h->seq;
    set(h, h->n++, node);
    sift_up(h, node->idx);
    if (h->v[0] == node)
        arm(l);
    return SH_OK;
}

void sh__timer_remove(struct sh__loop *l, sh__timer_node *node)
{
    sh__timer_heap *h = &l->heap;
    uint32_t i = node->idx;
    if (i == SH__TIMER_IDLE || i >= h->n || h->v[i] != node)
        return;
    node->idx = SH__TIMER_IDLE;
    h->n--;
    if (i != h->n) {
        set(h, i, h->v[h->n]);
        sift_down(h, i);
        sift_up(h, i);
    }
    if (i == 0)
        arm(l);
}

static void fire_actor_timer(struct sh__loop *l, sh__atimer *t)
{
    sh_actor_ctx *a = t->actor;
    uint64_t tag = t->tag;
    if (t->repeat_ms) {
        /* Re-queued before the call so that the member may stop its own timer. */
        if (sh__timer_add(l, &t->tn, sh__rt_now() + (uint64_t)t->repeat_ms * 1000000u) != SH_OK)
            t->repeat_ms = 0; /* out of memory: it becomes a one-shot */
    }
    if (!t->repeat_ms) {
        if (t->prev)
            t->prev->next = t->next;
        else
            a->timers = t->next;
        if (t->next)
            t->next->prev = t->prev;
        sh__rt_free(l->rt, t);
    }
    if (atomic_load(&a->life) != SH__ACTOR_RUNNING)
        return;
    sh__loop_busy_begin(l, a);
    a->vt->timer(a, a->state, tag);
    sh__loop_busy_end(l);
}

void sh__timer_run_due(struct sh__loop *l)
{
    sh__timer_heap *h = &l->heap;
    l->armed_due = 0;
    /* Half a millisecond of slack: libuv may wake a little before the ns deadline. */
    uint64_t now = sh__rt_now() + 500000u;
    while (h->n > 0 && h->v[0]->due_ns <= now) {
        sh__timer_node *n = h->v[0];
        sh__timer_remove(l, n);
        if (n->kind == SH__TIMER_KIND_SESSION)
            sh__session_fire(l, (sh__session *)n);
        else
            fire_actor_timer(l, (sh__atimer *)n);
    }
    arm(l);
}

void sh__timer_cancel_actor(struct sh__loop *l, sh_actor_ctx *a)
{
    while (a->timers) {
        sh__atimer *t = a->timers;
        a->timers = t->next;
        sh__timer_remove(l, &t->tn);
        sh__rt_free(l->rt, t);
    }
}

void sh__timer_heap_fini(struct sh__loop *l)
{
    sh__rt_free(l->rt, l->heap.v);
    l->heap.v = NULL;
    l->heap.n = l->heap.cap = 0;
}

sh_err sh_actor_timer_start(sh_actor_ctx *ctx, uint32_t ms, uint32_t repeat_ms, uint64_t tag,
                            uint64_t *id)
{
    if (!ctx->vt->timer)
        return SH_EINVAL;
    sh__atimer *t = sh__rt_alloc(ctx->rt, sizeof *t);
    if (!t)
        return SH_ENOMEM;
    t->tn.kind = SH__TIMER_KIND_ACTOR;
    t->tn.idx = SH__TIMER_IDLE;
    t->tag = tag;
    t->repeat_ms = repeat_ms;
    t->actor = ctx;
    /* Timer ids share the session counter: unique in the runtime, never 0. */
    t->id = atomic_fetch_add(&ctx->rt->next_session, 1) + 1;
    if (sh__timer_add(ctx->loop, &t->tn, sh__rt_now() + (uint64_t)ms * 1000000u) != SH_OK) {
        sh__rt_free(ctx->rt, t);
        return SH_ENOMEM;
    }
    t->next = ctx->timers;
    if (t->next)
        t->next->prev = t;
    ctx->timers = t;
    if (id)
        *id = t->id;
    return SH_OK;
}

sh_err sh_actor_timer_stop(sh_actor_ctx *ctx, uint64_t id)
{
    for (sh__atimer *t = ctx->timers; t; t = t->next) {
        if (t->id != id)
            continue;
        sh__timer_remove(ctx->loop, &t->tn);
        if (t->prev)
            t->prev->next = t->next;
        else
            ctx->timers = t->next;
        if (t->next)
            t->next->prev = t->prev;
        sh__rt_free(ctx->rt, t);
        return SH_OK;
    }
    return SH_ENOTFOUND;
}
