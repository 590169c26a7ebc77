/* The fault-injection layer: seeded per-link decisions in the filter hook, a delay timer thread. */
#include <stdatomic.h>
#include <stdbool.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include <uv.h>

#include "base/error.h"
#include "runtime/fault_agent.h"
#include "runtime/internal.h"
#include "runtime/msg.h"
#include "shoal/fault.h"

#define RULES_MAX 256

typedef struct rule {
    sh_fault_rule r;
    uint64_t id;
    uint64_t expires_ms; /* 0: never */
    uint32_t matched;    /* messages that matched, for r.count */
} rule;

/* One link's generator: xoshiro256** state and the link's message count. */
typedef struct flink {
    uint32_t to;
    uint64_t s[4];
    uint64_t seq;
} flink;

typedef struct held {
    uint64_t due_ms;
    uint64_t order; /* FIFO among equal due times */
    sh_msg *m;
} held;

struct sh_fault {
    sh_runtime *rt;
    uint32_t self;
    uint64_t seed;
    sh_transport_hooks next;
    bool has_next;
    sh_fault_log_fn log_fn;
    void *log_ud;
    uv_mutex_t mu; /* everything below */
    rule *rules;   /* (n_rules) */
    size_t n_rules;
    _Atomic size_t n_active; /* n_rules, read without the lock by the fast path */
    uint64_t next_id;
    flink *links; /* (n_links) */
    size_t n_links, cap_links;
    held *heap; /* (n_held) min-heap on (due_ms, order), capacity max_held */
    uint32_t n_held, max_held;
    uint64_t order;
    bool stop;
    uv_cond_t cv;
    uv_thread_t thread;
    _Atomic int busy; /* threads inside a hook; destroy waits for zero */
    sh_fault_stats st;
    sh_transport_hooks hooks;
    sh__fault_agent *agent;    /* fault_agent.c; NULL until spawned */
    struct sh_fault *reg_next; /* the layers of every runtime (sh__fault_decide_rt) */
};

/* Every live layer, for the frames that leave a node outside its transport (sh__fault_decide_rt):
 * a layer is listed by create and unlisted by destroy before it is freed. */
static uv_once_t reg_once = UV_ONCE_INIT;
static uv_mutex_t reg_mu;
static sh_fault *reg_head;

static void reg_init(void) { uv_mutex_init(&reg_mu); }

static uint64_t mono_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000u + (uint64_t)ts.tv_nsec / 1000000u;
}

/* ---- Generator: splitmix64 to seed, xoshiro256** to draw -------------------------------- */

static uint64_t splitmix64(uint64_t *x)
{
    uint64_t z = (*x += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

static uint64_t rotl(uint64_t x, int k) { return (x << k) | (x >> (64 - k)); }

static uint64_t next_u64(flink *l)
{
    uint64_t *s = l->s;
    uint64_t r = rotl(s[1] * 5, 7) * 9, t = s[1] << 17;
    s[2] ^= s[0];
    s[3] ^= s[1];
    s[1] ^= s[2];
    s[0] ^= s[3];
    s[2] ^= t;
    s[3] = rotl(s[3], 45);
    return r;
}

/* Uniform in [0, 1) from the top 53 bits. */
static double next_unit(flink *l) { return (double)(next_u64(l) >> 11) * 0x1.0p-53; }

static void link_seed(flink *l, uint64_t seed, uint32_t from)
{
    uint64_t x = seed ^ (((uint64_t)from << 32 | l->to) * 0xd1342543de82ef95ull);
    for (int i = 0; i < 4; i++)
        l->s[i] = splitmix64(&x);
    l->seq = 0;
}

static flink *link_get(sh_fault *f, uint32_t to)
{
    for (size_t i = 0; i < f->n_links; i++)
        if (f->links[i].to == to)
            return &f->links[i];
    if (f->n_links == f->cap_links) {
        size_t cap = f->cap_links ? f->cap_links * 2 : 8;
        flink *nl = realloc(f->links, cap * sizeof *nl);
        if (!nl)
            return NULL;
        f->links = nl;
        f->cap_links = cap;
    }
    flink *l = &f->links[f->n_links++];
    l->to = to;
    link_seed(l, f->seed, f->self);
    return l;
}

/* ---- Rules ------------------------------------------------------------------------------ */

static bool in_set(const uint32_t *set, uint32_t n, uint32_t node)
{
    if (n == 0)
        return true;
    for (uint32_t i = 0; i < n; i++)
        if (set[i] == node)
            return true;
    return false;
}

static bool rule_matches(const sh_fault_rule *r, uint32_t from, uint32_t to, uint32_t type)
{
    if (r->type && r->type != type)
        return false;
    if (r->action == SH_FAULT_ACTION_PARTITION)
        return (in_set(r->from, r->n_from, from) && in_set(r->to, r->n_to, to)) ||
               (in_set(r->from, r->n_from, to) && in_set(r->to, r->n_to, from));
    return in_set(r->from, r->n_from, from) && in_set(r->to, r->n_to, to);
}

static void expire_locked(sh_fault *f, uint64_t now)
{
    size_t w = 0;
    for (size_t i = 0; i < f->n_rules; i++)
        if (!f->rules[i].expires_ms || f->rules[i].expires_ms > now)
            f->rules[w++] = f->rules[i];
    f->n_rules = w;
    atomic_store(&f->n_active, w);
}

sh_err sh__fault_rule_check(const sh_fault_rule *r, sh_error *e)
{
    if ((unsigned)r->action > SH_FAULT_ACTION_PARTITION)
        return sh__error_set(e, SH_EINVAL, "fault: unknown action %d", (int)r->action);
    if (r->n_from > SH_FAULT_SET_MAX || r->n_to > SH_FAULT_SET_MAX)
        return sh__error_set(e, SH_EINVAL, "fault: more than %d nodes in a set", SH_FAULT_SET_MAX);
    if (!(r->p >= 0.0 && r->p <= 1.0))
        return sh__error_set(e, SH_EINVAL, "fault: p=%g is not in [0, 1]", r->p);
    if (r->action == SH_FAULT_ACTION_CORRUPT && (r->bytes < 1 || r->bytes > SH_FAULT_FLIPS_MAX))
        return sh__error_set(e, SH_EINVAL, "fault: corrupt bytes=%u is not in 1..%d",
                             (unsigned)r->bytes, SH_FAULT_FLIPS_MAX);
    if (r->action == SH_FAULT_ACTION_DELAY && r->delay_ms > SH_FAULT_DELAY_MAX_MS)
        return sh__error_set(e, SH_EINVAL, "fault: delay %u ms is over 10 minutes",
                             (unsigned)r->delay_ms);
    if (r->type > 255)
        return sh__error_set(e, SH_EINVAL, "fault: message type %u is not in 0..255",
                             (unsigned)r->type);
    return SH_OK;
}

/* Appends checked rule r (caller holds f->mu, room checked). */
static uint64_t add_locked(sh_fault *f, const sh_fault_rule *r, uint64_t now)
{
    rule *x = &f->rules[f->n_rules++];
    x->r = *r;
    x->id = ++f->next_id;
    x->matched = 0;
    x->expires_ms =
        r->lasting_s > 0 && r->lasting_s < 1e9 ? now + (uint64_t)(r->lasting_s * 1000.0 + 0.5) : 0;
    atomic_store(&f->n_active, f->n_rules);
    return x->id;
}

sh_err sh_fault_rule_add(sh_fault *f, const sh_fault_rule *r, uint64_t *id, sh_error *e)
{
    sh_err err = sh__fault_rule_check(r, e);
    if (err)
        return err;
    uint64_t now = mono_ms();
    uv_mutex_lock(&f->mu);
    expire_locked(f, now);
    if (f->n_rules == RULES_MAX) {
        uv_mutex_unlock(&f->mu);
        return sh__error_set(e, SH_ERANGE, "fault: %d rules already", RULES_MAX);
    }
    uint64_t x = add_locked(f, r, now);
    if (id)
        *id = x;
    uv_mutex_unlock(&f->mu);
    return SH_OK;
}

sh_err sh__fault_apply(sh_fault *f, bool clear, uint64_t seed, const sh_fault_rule *rules, size_t n,
                       size_t *active, sh_error *e)
{
    for (size_t i = 0; i < n; i++) {
        sh_error why = {0};
        sh_err err = sh__fault_rule_check(&rules[i], &why);
        if (err)
            return sh__error_set(e, err, "rule %zu: %s", i, why.msg);
    }
    uint64_t now = mono_ms();
    uv_mutex_lock(&f->mu);
    expire_locked(f, now);
    size_t have = clear ? 0 : f->n_rules;
    if (have + n > RULES_MAX) {
        uv_mutex_unlock(&f->mu);
        return sh__error_set(e, SH_ERANGE, "fault: %zu rules and %zu more exceed %d", have, n,
                             RULES_MAX);
    }
    if (clear)
        f->n_rules = 0;
    if (seed) {
        f->seed = seed;
        for (size_t i = 0; i < f->n_links; i++)
            link_seed(&f->links[i], seed, f->self);
    }
    for (size_t i = 0; i < n; i++)
        add_locked(f, &rules[i], now);
    atomic_store(&f->n_active, f->n_rules);
    *active = f->n_rules;
    uv_mutex_unlock(&f->mu);
    return SH_OK;
}

sh_err sh_fault_rule_remove(sh_fault *f, uint64_t id)
{
    sh_err err = SH_ENOTFOUND;
    uv_mutex_lock(&f->mu);
    for (size_t i = 0; i < f->n_rules; i++) {
        if (f->rules[i].id == id) {
            memmove(&f->rules[i], &f->rules[i + 1], (f->n_rules - i - 1) * sizeof f->rules[0]);
            f->n_rules--;
            err = SH_OK;
            break;
        }
    }
    atomic_store(&f->n_active, f->n_rules);
    uv_mutex_unlock(&f->mu);
    return err;
}

static bool set_eq(const uint32_t *a, uint32_t na, const uint32_t *b, uint32_t nb)
{
    if (na != nb)
        return false;
    for (uint32_t i = 0; i < na; i++)
        if (!in_set(b, nb, a[i]))
            return false;
    return true;
}

size_t sh_fault_heal(sh_fault *f, const uint32_t *from, uint32_t n_from, const uint32_t *to,
                     uint32_t n_to)
{
    size_t w = 0, removed = 0;
    uv_mutex_lock(&f->mu);
    for (size_t i = 0; i < f->n_rules; i++) {
        const sh_fault_rule *r = &f->rules[i].r;
        bool hit = (n_from == 0 && n_to == 0) ||
                   (set_eq(r->from, r->n_from, from, n_from) && set_eq(r->to, r->n_to, to, n_to)) ||
                   (set_eq(r->from, r->n_from, to, n_to) && set_eq(r->to, r->n_to, from, n_from));
        if (hit)
            removed++;
        else
            f->rules[w++] = f->rules[i];
    }
    f->n_rules = w;
    atomic_store(&f->n_active, w);
    uv_mutex_unlock(&f->mu);
    return removed;
}

void sh_fault_reseed(sh_fault *f, uint64_t seed)
{
    uv_mutex_lock(&f->mu);
    f->seed = seed;
    for (size_t i = 0; i < f->n_links; i++)
        link_seed(&f->links[i], seed, f->self);
    uv_mutex_unlock(&f->mu);
}

size_t sh_fault_rule_count(sh_fault *f)
{
    uv_mutex_lock(&f->mu);
    expire_locked(f, mono_ms());
    size_t n = f->n_rules;
    uv_mutex_unlock(&f->mu);
    return n;
}

void sh_fault_stats_get(sh_fault *f, sh_fault_stats *out)
{
    uv_mutex_lock(&f->mu);
    *out = f->st;
    out->held = f->n_held;
    uv_mutex_unlock(&f->mu);
}

/* ---- Delayed messages ------------------------------------------------------------------- */

static bool held_less(const held *a, const held *b)
{
    return a->due_ms < b->due_ms || (a->due_ms == b->due_ms && a->order < b->order);
}

static void heap_push(sh_fault *f, held h)
{
    uint32_t i = f->n_held++;
    f->heap[i] = h;
    while (i > 0 && held_less(&f->heap[i], &f->heap[(i - 1) / 2])) {
        held t = f->heap[i];
        f->heap[i] = f->heap[(i - 1) / 2];
        f->heap[(i - 1) / 2] = t;
        i = (i - 1) / 2;
    }
}

static held heap_pop(sh_fault *f)
{
    held top = f->heap[0];
    f->heap[0] = f->heap[--f->n_held];
    uint32_t i = 0;
    for (;;) {
        uint32_t l = 2 * i + 1, r = l + 1, m = i;
        if (l < f->n_held && held_less(&f->heap[l], &f->heap[m]))
            m = l;
        if (r < f->n_held && held_less(&f->heap[r], &f->heap[m]))
            m = r;
        if (m == i)
            break;
        held t = f->heap[i];
        f->heap[i] = f->heap[m];
        f->heap[m] = t;
        i = m;
    }
    return top;
}

/* The timer thread: re-injects held messages when they fall due. */
static void timer_main(void *arg)
{
    sh_fault *f = arg;
    uv_mutex_lock(&f->mu);
    while (!f->stop) {
        if (f->n_held == 0) {
            uv_cond_wait(&f->cv, &f->mu);
            continue;
        }
        uint64_t now = mono_ms();
        if (f->heap[0].due_ms > now) {
            (void)uv_cond_timedwait(&f->cv, &f->mu, (f->heap[0].due_ms - now) * 1000000u);
            continue;
        }
        held h = heap_pop(f);
        uv_mutex_unlock(&f->mu);
        if (sh_transport_reinject(f->rt, h.m, NULL) != SH_OK)
            sh_msg_free(h.m); /* the link refused it (full or closed): lost, like a delay can */
        uv_mutex_lock(&f->mu);
    }
    uv_mutex_unlock(&f->mu);
}

/* ---- Hooks ------------------------------------------------------------------------------ */

static sh_err forward(void *ctx, uint32_t node, const uint8_t *frame, size_t len, sh_error *e)
{
    sh_fault *f = ctx;
    if (!f->has_next || !f->next.send_frame)
        return sh__error_set(e, SH_EUNSUPPORTED, "send: node %u is remote and no transport is set",
                             (unsigned)node);
    return f->next.send_frame(f->next.ctx, node, frame, len, e);
}

/* The zero-copy members pass straight through to the wrapped transport: faults act in the
 * filter, before a message reaches either. */
static sh_err forward_owned(void *ctx, uint32_t node, uint8_t *frame, size_t len,
                            const sh_frame_owner *owner, sh_error *e)
{
    sh_fault *f = ctx;
    if (f->has_next && f->next.send_owned)
        return f->next.send_owned(f->next.ctx, node, frame, len, owner, e);
    sh_err err = forward(f, node, frame, len, e);
    if (!err)
        owner->release(owner->ctx, owner->handle);
    return err;
}

static uint8_t *forward_alloc(void *ctx, uint32_t node, size_t cap, sh_frame_owner *owner)
{
    sh_fault *f = ctx;
    if (!f->has_next || !f->next.frame_alloc || !f->next.send_owned)
        return NULL;
    return f->next.frame_alloc(f->next.ctx, node, cap, owner);
}

/* Everything the rules decide for one message, drawn under the lock. */
static sh_send_verdict filter(void *ctx, sh_msg *m)
{
    sh_fault *f = ctx;
    const sh_msg_hdr *h = sh_msg_header(m);
    uint32_t to = sh_addr_node(h->dst);
    if (to == f->self || atomic_load_explicit(&f->n_active, memory_order_relaxed) == 0)
        return f->has_next && f->next.filter ? f->next.filter(f->next.ctx, m)
                                             : SH_SEND_VERDICT_PASS;
    atomic_fetch_add(&f->busy, 1);
    size_t len = 0;
    const uint8_t *frame = sh_msg_frame(m, &len);
    sh_fault_decision d = {.from = f->self, .to = to, .type = (uint32_t)h->type};
    uint64_t now = mono_ms();
    bool matched = false;
    uv_mutex_lock(&f->mu);
    expire_locked(f, now);
    flink *l = link_get(f, to);
    f->st.seen++;
    if (l) {
        d.seq = l->seq++;
        for (size_t i = 0; i < f->n_rules; i++) {
            const sh_fault_rule *r = &f->rules[i].r;
            if (!rule_matches(r, f->self, to, (uint32_t)h->type))
                continue;
            matched = true;
            if (r->count && ++f->rules[i].matched == r->count)
                f->rules[i].expires_ms = 1; /* this was its last message */
            if (r->action == SH_FAULT_ACTION_PARTITION) {
                d.actions |= 1u << SH_FAULT_ACTION_PARTITION;
                continue;
            }
            bool hit = next_unit(l) < r->p; /* one draw per matching rule, whatever follows */
            if (!hit)
                continue;
            d.actions |= 1u << r->action;
            if (r->action == SH_FAULT_ACTION_DELAY && r->delay_ms > d.delay_ms)
                d.delay_ms = r->delay_ms;
            if (r->action == SH_FAULT_ACTION_CORRUPT && len > 0)
                for (uint32_t k = 0; k < r->bytes && d.n_flips < SH_FAULT_FLIPS_MAX; k++)
                    d.flip_pos[d.n_flips++] = (uint32_t)(next_u64(l) % len);
        }
    }
    sh_send_verdict v = SH_SEND_VERDICT_PASS;
    uint32_t a = d.actions;
    if (a & (1u << SH_FAULT_ACTION_PARTITION)) {
        f->st.partitioned++;
        v = SH_SEND_VERDICT_DROP;
    } else if (a & (1u << SH_FAULT_ACTION_DROP)) {
        f->st.dropped++;
        v = SH_SEND_VERDICT_DROP;
    } else if (a & (1u << SH_FAULT_ACTION_CORRUPT)) {
        f->st.corrupted++;
        v = SH_SEND_VERDICT_TAKEN;
    } else {
        if (a & (1u << SH_FAULT_ACTION_DUPLICATE)) {
            /* Sent now, under the lock: once the original is held the timer thread may free it
             * at any moment. The transport never calls back into the layer, so this is safe. */
            f->st.duplicated++;
            (void)forward(f, to, frame, len, NULL);
        }
        if ((a & (1u << SH_FAULT_ACTION_DELAY)) && d.delay_ms > 0) {
            if (f->n_held < f->max_held) {
                f->st.delayed++;
                heap_push(f, (held){now + d.delay_ms, f->order++, m});
                uv_cond_signal(&f->cv);
                v = SH_SEND_VERDICT_TAKEN;
            } else {
                f->st.overflow++;
            }
        }
    }
    if (matched && f->log_fn)
        f->log_fn(f->log_ud, &d);
    uv_mutex_unlock(&f->mu);
    if (a & (1u << SH_FAULT_ACTION_CORRUPT) && v == SH_SEND_VERDICT_TAKEN) {
        /* The corrupted copy goes out in place of the message; its flip values come from a
         * generator seeded by the decision so that they are reproducible too. */
        uint8_t *copy = malloc(len ? len : 1);
        if (copy) {
            memcpy(copy, frame, len);
            uint64_t x = f->seed ^ ((uint64_t)to << 40) ^ d.seq;
            for (uint32_t k = 0; k < d.n_flips; k++)
                copy[d.flip_pos[k]] ^= (uint8_t)(1u + splitmix64(&x) % 255u);
            (void)forward(f, to, copy, len, NULL);
            free(copy);
        }
        sh_msg_free(m);
    }
    atomic_fetch_sub(&f->busy, 1);
    if (v == SH_SEND_VERDICT_PASS && f->has_next && f->next.filter)
        return f->next.filter(f->next.ctx, m);
    return v;
}

uint32_t sh_fault_decide(sh_fault *f, uint32_t to, uint32_t type)
{
    if (to == f->self || atomic_load_explicit(&f->n_active, memory_order_relaxed) == 0)
        return 0;
    sh_fault_decision d = {.from = f->self, .to = to, .type = type};
    bool matched = false;
    uv_mutex_lock(&f->mu);
    expire_locked(f, mono_ms());
    flink *l = link_get(f, to);
    f->st.seen++;
    if (l) {
        d.seq = l->seq++;
        for (size_t i = 0; i < f->n_rules; i++) {
            const sh_fault_rule *r = &f->rules[i].r;
            if (!rule_matches(r, f->self, to, type))
                continue;
            matched = true;
            if (r->count && ++f->rules[i].matched == r->count)
                f->rules[i].expires_ms = 1;
            if (r->action == SH_FAULT_ACTION_PARTITION) {
                d.actions |= 1u << SH_FAULT_ACTION_PARTITION;
                continue;
            }
            if (next_unit(l) < r->p) { /* one draw per matching rule, as filter */
                d.actions |= 1u << r->action;
                if (r->action == SH_FAULT_ACTION_DELAY && r->delay_ms > d.delay_ms)
                    d.delay_ms = r->delay_ms;
            }
        }
    }
    uint32_t a = d.actions;
    if (a & (1u << SH_FAULT_ACTION_PARTITION))
        f->st.partitioned++;
    else if (a & (1u << SH_FAULT_ACTION_DROP))
        f->st.dropped++;
    else if (a & (1u << SH_FAULT_ACTION_CORRUPT))
        f->st.corrupted++;
    else if (a & (1u << SH_FAULT_ACTION_DUPLICATE))
        f->st.duplicated++;
    if (matched && f->log_fn)
        f->log_fn(f->log_ud, &d);
    uv_mutex_unlock(&f->mu);
    return a;
}

uint32_t sh__fault_decide_rt(sh_runtime *rt, uint32_t to, uint32_t type)
{
    uint32_t a = 0;
    uv_once(&reg_once, reg_init);
    uv_mutex_lock(&reg_mu);
    for (sh_fault *f = reg_head; f; f = f->reg_next)
        if (f->rt == rt)
            a |= sh_fault_decide(f, to, type);
    uv_mutex_unlock(&reg_mu);
    return a;
}

/* ---- Lifecycle -------------------------------------------------------------------------- */

sh_err sh_fault_create(sh_runtime *rt, const sh_fault_opts *opts, sh_fault **out, sh_error *e)
{
    if (!rt || !opts || !out)
        return sh__error_set(e, SH_EINVAL, "fault: NULL argument");
    sh_fault *f = calloc(1, sizeof *f);
    if (!f)
        return sh__error_set(e, SH_ENOMEM, "fault: out of memory");
    f->rt = rt;
    f->self = sh_runtime_node(rt);
    f->seed = opts->seed;
    if (opts->next) {
        f->next = *opts->next;
        f->has_next = true;
    }
    f->log_fn = opts->log_fn;
    f->log_ud = opts->log_ud;
    f->max_held = opts->max_held ? opts->max_held : 4096;
    f->rules = calloc(RULES_MAX, sizeof *f->rules);
    f->heap = calloc(f->max_held, sizeof *f->heap);
    if (!f->rules || !f->heap) {
        free(f->rules);
        free(f->heap);
        free(f);
        return sh__error_set(e, SH_ENOMEM, "fault: out of memory");
    }
    uv_mutex_init(&f->mu);
    uv_cond_init(&f->cv);
    int rv = sh__rt_thread_create(rt, &f->thread, timer_main, f);
    f->hooks = (sh_transport_hooks){.ctx = f,
                                    .send_frame = forward,
                                    .filter = filter,
                                    .send_owned = forward_owned,
                                    .frame_alloc = forward_alloc};
    if (rv || sh_transport_set(rt, &f->hooks) != SH_OK) {
        if (!rv) {
            uv_mutex_lock(&f->mu);
            f->stop = true;
            uv_cond_signal(&f->cv);
            uv_mutex_unlock(&f->mu);
            uv_thread_join(&f->thread);
        }
        uv_cond_destroy(&f->cv);
        uv_mutex_destroy(&f->mu);
        free(f->rules);
        free(f->heap);
        free(f);
        return rv ? sh__error_set(e, SH_EIO, "fault: timer thread: %s", uv_strerror(rv))
                  : sh__error_set(e, SH_ENOMEM, "fault: cannot install hooks");
    }
    uv_once(&reg_once, reg_init);
    uv_mutex_lock(&reg_mu);
    f->reg_next = reg_head;
    reg_head = f;
    uv_mutex_unlock(&reg_mu);
    *out = f;
    return SH_OK;
}

sh_runtime *sh__fault_runtime(sh_fault *f) { return f->rt; }

sh__fault_agent **sh__fault_agent_slot(sh_fault *f) { return &f->agent; }

void sh_fault_destroy(sh_fault *f)
{
    if (!f)
        return;
    uv_mutex_lock(&reg_mu); /* listed: create ran reg_init */
    for (sh_fault **p = &reg_head; *p; p = &(*p)->reg_next)
        if (*p == f) {
            *p = f->reg_next;
            break;
        }
    uv_mutex_unlock(&reg_mu);
    sh__fault_agent_destroy(f->agent);
    sh_transport_set(f->rt, f->has_next ? &f->next : NULL);
    while (atomic_load(&f->busy) > 0) {
        struct timespec ts = {0, 100000};
        nanosleep(&ts, NULL);
    }
    uv_mutex_lock(&f->mu);
    f->stop = true;
    uv_cond_signal(&f->cv);
    uv_mutex_unlock(&f->mu);
    uv_thread_join(&f->thread);
    while (f->n_held > 0)
        sh_msg_free(heap_pop(f).m);
    uv_cond_destroy(&f->cv);
    uv_mutex_destroy(&f->mu);
    free(f->rules);
    free(f->heap);
    free(f->links);
    free(f);
}
