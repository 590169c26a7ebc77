/* Lock-free MPSC mailbox (Vyukov's intrusive queue) and the per-runtime message buffer pool. */
#include "runtime/mailbox.h"

#include <stdlib.h>
#include <string.h>

#include "runtime/internal.h"

void sh__mailbox_init(sh__mailbox *q)
{
    atomic_store_explicit(&q->stub.next, NULL, memory_order_relaxed);
    atomic_store_explicit(&q->head, &q->stub, memory_order_relaxed);
    q->tail = &q->stub;
}

void sh__mailbox_push(sh__mailbox *q, sh__mpsc_node *n)
{
    atomic_store_explicit(&n->next, NULL, memory_order_relaxed);
    sh__mpsc_node *prev = atomic_exchange_explicit(&q->head, n, memory_order_acq_rel);
    /* Sequentially consistent so that a consumer that clears its "scheduled" flag and then looks
     * again is guaranteed to see this link when our later flag exchange saw the flag still set
     * (runtime/loop.c relies on it). */
    atomic_store_explicit(&prev->next, n, memory_order_seq_cst);
}

sh__mpsc_node *sh__mailbox_pop(sh__mailbox *q)
{
    sh__mpsc_node *tail = q->tail;
    sh__mpsc_node *next = atomic_load_explicit(&tail->next, memory_order_acquire);
    if (tail == &q->stub) {
        if (!next)
            return NULL;
        q->tail = next;
        tail = next;
        next = atomic_load_explicit(&next->next, memory_order_acquire);
    }
    if (next) {
        q->tail = next;
        return tail;
    }
    /* tail is the last linked node. If a producer has swapped head but not linked yet, wait for
     * it to wake us; otherwise re-insert the stub behind tail so tail can be handed out. */
    if (tail != atomic_load_explicit(&q->head, memory_order_acquire))
        return NULL;
    sh__mailbox_push(q, &q->stub);
    next = atomic_load_explicit(&tail->next, memory_order_acquire);
    if (next) {
        q->tail = next;
        return tail;
    }
    return NULL;
}

bool sh__mailbox_ready(sh__mailbox *q)
{
    sh__mpsc_node *tail = q->tail;
    if (atomic_load_explicit(&tail->next, memory_order_seq_cst))
        return true;
    /* A lone real node at tail is poppable once head still points at it; when head has moved
     * on, its producer is mid-push and will wake the consumer itself. */
    return tail != &q->stub && atomic_load_explicit(&q->head, memory_order_seq_cst) == tail;
}

/* Pooled blocks hold the message header and a small frame in one allocation. */
#define BLOCK_SIZE (sizeof(sh_msg) + SH__MAILBOX_SMALL_FRAME)

/* The smallest kept large block holding cap bytes and at most twice that; NULL when none. */
static sh_msg *big_get(sh_runtime *rt, size_t cap)
{
    if (cap < SH__MAILBOX_BIG_MIN)
        return NULL;
    uv_mutex_lock(&rt->pool_mu);
    sh_msg **best = NULL;
    for (sh_msg **pp = &rt->big_free; *pp; pp = &(*pp)->pool_next)
        if ((*pp)->cap >= cap && (*pp)->cap / 2 <= cap && (!best || (*pp)->cap < (*best)->cap))
            best = pp;
    sh_msg *m = NULL;
    if (best) {
        m = *best;
        *best = m->pool_next;
        rt->big_n--;
        rt->big_bytes -= m->cap;
    }
    uv_mutex_unlock(&rt->pool_mu);
    if (m) {
        size_t kept = m->cap;
        memset(m, 0, sizeof *m);
        m->cap = kept;
    }
    return m;
}

sh_msg *sh__mailbox_msg_alloc(sh_runtime *rt, size_t cap)
{
    sh_msg *m = NULL;
    if (cap <= SH__MAILBOX_SMALL_FRAME) {
        uv_mutex_lock(&rt->pool_mu);
        m = rt->pool_free;
        if (m) {
            rt->pool_free = m->pool_next;
            rt->pool_n--;
        }
        uv_mutex_unlock(&rt->pool_mu);
        if (m) {
            sh_counter_add(rt->m.pool_hits, 1);
        } else {
            sh_counter_add(rt->m.pool_misses, 1);
            m = sh__rt_alloc(rt, BLOCK_SIZE);
            if (!m)
                return NULL;
        }
        memset(m, 0, sizeof *m);
        m->flags = SH__MSG_POOLED;
        m->cap = SH__MAILBOX_SMALL_FRAME;
    } else if (cap <= SH__MAILBOX_MID_FRAME) {
        uv_mutex_lock(&rt->pool_mu);
        m = rt->mid_free;
        if (m) {
            rt->mid_free = m->pool_next;
            rt->mid_n--;
        }
        uv_mutex_unlock(&rt->pool_mu);
        if (m) {
            sh_counter_add(rt->m.pool_hits, 1);
        } else {
            sh_counter_add(rt->m.pool_misses, 1);
            m = sh__rt_realloc(rt, NULL, sizeof(sh_msg) + SH__MAILBOX_MID_FRAME);
            if (!m)
                return NULL;
        }
        memset(m, 0, sizeof *m);
        m->flags = SH__MSG_MID;
        m->cap = SH__MAILBOX_MID_FRAME;
    } else {
        m = big_get(rt, cap);
        if (m) {
            sh_counter_add(rt->m.pool_hits, 1);
        } else {
            sh_counter_add(rt->m.pool_misses, 1);
            /* Not zeroed: the frame is written over in full, and calloc would touch every page. */
            m = sh__rt_realloc(rt, NULL, sizeof(sh_msg) + cap);
            if (!m)
                return NULL;
            memset(m, 0, sizeof *m);
            m->cap = cap;
        }
        if (m->cap >= SH__MAILBOX_BIG_MIN)
            m->flags = SH__MSG_BIG;
    }
    m->rt = rt;
    m->data = (uint8_t *)(m + 1);
    atomic_fetch_add_explicit(&rt->msgs_live, 1, memory_order_relaxed);
    return m;
}

sh_msg *sh__mailbox_msg_adopt(sh_runtime *rt, uint8_t *data, size_t len, size_t cap)
{
    sh_msg *m = sh__rt_alloc(rt, sizeof *m);
    if (!m)
        return NULL;
    sh__rt_adopted(rt); /* data is freed through sh__rt_free with the message */
    m->rt = rt;
    m->data = data;
    m->len = len;
    m->cap = cap;
    m->flags = SH__MSG_EXTDATA;
    atomic_fetch_add_explicit(&rt->msgs_live, 1, memory_order_relaxed);
    return m;
}

sh_msg *sh__mailbox_msg_wrap(sh_runtime *rt, uint8_t *data, size_t len, const sh_frame_owner *owner)
{
    sh_msg *m = sh__mailbox_msg_alloc(rt, 0); /* a header block from the pool; data unused */
    if (!m)
        return NULL;
    m->data = data;
    m->len = len;
    m->cap = len;
    m->owner = *owner;
    m->flags |= SH__MSG_OWNED;
    return m;
}

void sh__mailbox_msg_disown(sh_msg *m)
{
    m->flags &= ~(uint32_t)SH__MSG_OWNED;
    m->data = NULL;
    m->len = 0;
}

void sh__mailbox_msg_release(sh_msg *m)
{
    sh_runtime *rt = m->rt;
    atomic_fetch_sub_explicit(&rt->msgs_live, 1, memory_order_relaxed);
    if (m->flags & SH__MSG_EXTDATA)
        sh__rt_free(rt, m->data);
    if (m->flags & SH__MSG_OWNED)
        m->owner.release(m->owner.ctx, m->owner.handle);
    if (m->flags & SH__MSG_BIG) {
        uv_mutex_lock(&rt->pool_mu);
        if (rt->big_n < SH__MAILBOX_BIG_MAX && rt->big_bytes + m->cap <= SH__MAILBOX_BIG_BYTES) {
            m->pool_next = rt->big_free;
            rt->big_free = m;
            rt->big_n++;
            rt->big_bytes += m->cap;
            m = NULL;
        }
        uv_mutex_unlock(&rt->pool_mu);
        sh__rt_free(rt, m);
        return;
    }
    if (m->flags & SH__MSG_MID) {
        uv_mutex_lock(&rt->pool_mu);
        if (rt->mid_n < SH__MAILBOX_MID_MAX) {
            m->pool_next = rt->mid_free;
            rt->mid_free = m;
            rt->mid_n++;
            m = NULL;
        }
        uv_mutex_unlock(&rt->pool_mu);
        sh__rt_free(rt, m);
        return;
    }
    if (m->flags & SH__MSG_POOLED) {
        uv_mutex_lock(&rt->pool_mu);
        if (rt->pool_n < SH__MAILBOX_POOL_MAX) {
            m->pool_next = rt->pool_free;
            rt->pool_free = m;
            rt->pool_n++;
            m = NULL;
        }
        uv_mutex_unlock(&rt->pool_mu);
    }
    sh__rt_free(rt, m);
}

void sh__mailbox_pool_fini(sh_runtime *rt)
{
    sh_msg *m = rt->pool_free;
    while (m) {
        sh_msg *next = m->pool_next;
        sh__rt_free(rt, m);
        m = next;
    }
    rt->pool_free = NULL;
    rt->pool_n = 0;
    for (m = rt->mid_free; m;) {
        sh_msg *next = m->pool_next;
        sh__rt_free(rt, m);
        m = next;
    }
    rt->mid_free = NULL;
    rt->mid_n = 0;
    for (m = rt->big_free; m;) {
        sh_msg *next = m->pool_next;
        sh__rt_free(rt, m);
        m = next;
    }
    rt->big_free = NULL;
    rt->big_n = 0;
    rt->big_bytes = 0;
}
