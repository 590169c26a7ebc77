/* The batcher's queue, running set and steps 1 to 3 (actors/batcher.c has the overview):
 * admission, preemption and starvation relief, planning a step from the sequences in no step in
 * flight, the KV replies and dispatching the STEP. Thread: the batcher's loop. */
#include <inttypes.h>
#include <stdlib.h>
#include <string.h>

#include "actors/batcher_int.h"
#include "base/error.h"

/* Preemption and starvation (docs/serving.md, Preemption and No starvation). A slice is SLICE_US
 * and at least SLICE_STEPS steps, so that where steps are slow a sequence still gets enough
 * tokens out of each admission to pay for its recompute. A sequence that has waited a slice is
 * starving; it is admitted ahead of the queue, and a KV shortage spares it for a slice unless
 * nothing else is left. A running sequence that has run a slice, of the starving one's class or
 * a lower one, yields to it when it has more than twice its work left, and STARVE_MARGIN tokens
 * more; among starving sequences the least work goes first, each gaining a credit of
 * AGE_TOKENS_PER_S tokens per second waited. */
#define SLICE_US 1000000
#define SLICE_STEPS 32
#define AGE_TOKENS_PER_S 16
#define STARVE_MARGIN 32

/* ---- the queue and the running set ------------------------------------------------------ */

static bool seq_before(const bseq *x, const bseq *y)
{
    if (x->r->prio != y->r->prio)
        return x->r->prio < y->r->prio;
    if (x->r->arrival != y->r->arrival)
        return x->r->arrival < y->r->arrival;
    return x->choice < y->choice;
}

void sh__batcher_plan_queue_insert(batcher *b, bseq *s)
{
    bseq **pp = &b->queue;
    while (*pp && !seq_before(s, *pp))
        pp = &(*pp)->next;
    s->next = *pp;
    *pp = s;
    s->state = SEQ_WAITING;
    b->n_waiting++;
}

void sh__batcher_plan_queue_remove(batcher *b, bseq *s)
{
    for (bseq **pp = &b->queue; *pp; pp = &(*pp)->next)
        if (*pp == s) {
            *pp = s->next;
            s->next = NULL;
            b->n_waiting--;
            return;
        }
}

/* Adds s to the running set at its rank, so that the set stays in queue order: planning, the
 * kvmgr (which serves reservations in the order they are sent) and preemption all favour the
 * higher class and, within a class, the earlier arrival. */
static void running_insert(batcher *b, bseq *s)
{
    int32_t i = b->n_running;
    while (i > 0 && seq_before(s, b->running[i - 1]))
        i--;
    memmove(b->running + i + 1, b->running + i, (size_t)(b->n_running - i) * sizeof *b->running);
    b->running[i] = s;
    b->n_running++;
}

void sh__batcher_plan_running_remove(batcher *b, bseq *s)
{
    for (int32_t i = 0; i < b->n_running; i++)
        if (b->running[i] == s) {
            memmove(b->running + i, b->running + i + 1,
                    (size_t)(b->n_running - i - 1) * sizeof *b->running);
            b->n_running--;
            return;
        }
}

bseq *sh__batcher_plan_find_running(batcher *b, uint64_t kv_id)
{
    for (int32_t i = 0; i < b->n_running; i++)
        if (b->running[i]->kv_id == kv_id)
            return b->running[i];
    return NULL;
}

/* ---- planning ----------------------------------------------------------------------------- */

static sh_err kv_request(batcher *b, const sh_proto_kv_alloc *a)
{
    sh_error e = {0};
    uint64_t session;
    sh_err err = sh_request_with(b->ctx, b->a.kvmgr, SH_MSG_KV_ALLOC, sh__proto_encode, a, 30000,
                                 &session, &e);
    if (err)
        sh_actor_log(b->ctx, SH_LOG_LEVEL_ERROR, "kv_alloc_send", "err=\"%s\"", e.msg);
    else
        b->allocs_out++;
    return err;
}

/* Reserves the positions of s's next k tokens. Positions reserved past n_computed by an earlier
 * step (its rejected drafts) are given back first (keep): they hold the ids of drafts, and the
 * kvmgr hashes a block by the ids its positions were reserved with once they are computed. */
static void send_alloc(batcher *b, bseq *s, int32_t k)
{
    sh_proto_kv_alloc a = {.seq = s->kv_id, .computed = (uint32_t)s->n_computed};
    int32_t end = s->n_computed + k;
    if (s->n_reserved == 0 && s->n_computed == 0) {
        // A new sequence: the whole token list, so the kvmgr can find a cached prefix.
        a.tokens = (sh_i32s){s->toks, (uint32_t)s->n_toks};
        a.n_tokens = (uint32_t)k;
    } else {
        if (s->n_reserved > s->n_computed && s->n_computed > 0) {
            a.keep = (uint32_t)s->n_computed;
            s->n_reserved = s->n_computed; /* what the kvmgr keeps, whatever its answer */
        }
        a.tokens = (sh_i32s){s->toks + s->n_reserved, (uint32_t)(end - s->n_reserved)};
        a.n_tokens = a.tokens.n;
    }
    if (s->r->embed)
        a.tokens = (sh_i32s){NULL, 0}; /* no prefix cache: mean pooling reads every position */
    s->n_marked = s->n_computed;
    s->kv_wait = 0;
    s->draft_alloc = false;
    if (kv_request(b, &a)) {
        s->planned = false;
        s->step_draft = 0;
        return;
    }
    s->kv_wait = 1;
}

/* Reserves the positions of s's drafts, after its own token's (sent after every other
 * reservation of the plan, so that drafts only take blocks nobody's step needs). */
static void send_draft_alloc(batcher *b, bseq *s)
{
    int32_t end = s->n_computed + s->step_k;
    // The drafts' positions, with their ids: an accepted draft's position is computed holding
    // that very token, and a rejected one's is given back before it is computed.
    sh_proto_kv_alloc d = {.seq = s->kv_id,
                           .n_tokens = (uint32_t)s->step_draft,
                           .tokens = {s->toks + end, (uint32_t)s->step_draft},
                           .computed = (uint32_t)s->n_computed};
    if (b->remote)
        d.tokens = (sh_i32s){NULL, 0}; /* the drafter's tokens are not known here */
    if (kv_request(b, &d)) {
        s->step_draft = 0;
        return;
    }
    s->kv_wait = 2;
    s->draft_alloc = true;
}

static void send_fork(batcher *b, bseq *s, const bseq *parent)
{
    sh_proto_kv_fork f = {
        .seq = parent->kv_id, .child = s->kv_id, .n_tokens = (uint32_t)s->r->shared};
    sh_error e = {0};
    uint64_t session;
    if (sh_request_with(b->ctx, b->a.kvmgr, SH_MSG_KV_FORK, sh__proto_encode, &f, 30000, &session,
                        &e)) {
        sh_actor_log(b->ctx, SH_LOG_LEVEL_ERROR, "kv_fork_send", "err=\"%s\"", e.msg);
        s->planned = false;
        return;
    }
    b->allocs_out++;
}

static bool past_deadline(const breq *r, uint64_t now_ms)
{
    return r->deadline_ms && now_ms >= r->deadline_ms;
}

void sh__batcher_plan_expire(batcher *b)
{
    uint64_t now_ms = sh__act_unix_ms();
    for (breq *r = b->live, *next; r; r = next) {
        next = r->next_live;
        if (past_deadline(r, now_ms))
            sh__batcher_req_finish_all(b, r, SH_PROTO_FINISH_DEADLINE);
    }
}

/* ---- preemption --------------------------------------------------------------------------- */

/* Whether s has had its slice since its latest admission (see SLICE_US). */
static bool slice_used(const batcher *b, const bseq *s, uint64_t now_us)
{
    return now_us - s->admitted_us >= SLICE_US && b->step_no - s->admitted_step >= SLICE_STEPS;
}

/* Whether queued sequence s has waited a slice since it last began to wait. */
static bool starving(const batcher *b, const bseq *s, uint64_t now_us)
{
    return now_us - s->queued_us >= SLICE_US && b->step_no - s->queued_step >= SLICE_STEPS;
}

/* Tokens s still has to generate: what starvation weighs. */
static int64_t work_left(const bseq *s)
{
    int64_t left = (int64_t)s->r->max_tokens - s->n_gen;
    return left > 0 ? left : 0;
}

/* The victim of a KV shortage: among the sequences that hold KV, those of the lowest priority
 * class; of them the last in queue order (the latest arrival), passing over one admitted as
 * starving that has not yet run its slice unless nothing else is left. A sequence ranks by its
 * request's arrival, not by when it was last admitted, so a preempted sequence keeps its place:
 * a shortage takes every later arrival of its class first. */
static bseq *pick_victim(batcher *b, uint64_t now_us)
{
    bseq *last = NULL;
    for (int32_t i = b->n_running - 1; i >= 0; i--) {
        bseq *s = b->running[i];
        if (!s->kv_id || s->fork_pending || s->in_step)
            continue; /* a step in flight is writing the blocks of one in_step */
        if (last && s->r->prio != last->r->prio)
            break; /* the running set is ranked: a better class from here on */
        if (!s->relieved || slice_used(b, s, now_us))
            return s;
        if (!last)
            last = s;
    }
    return last;
}

/* Blocks s's refused reservation would have added to its table. */
static int32_t grow_need(const batcher *b, const bseq *s)
{
    int32_t n = blocks_for(b, s->n_reserved + s->step_k) - s->n_blocks;
    return n > 1 ? n : 1;
}

/* Puts a running sequence back in the queue; it is recomputed from its tokens when readmitted.
 * Choices that were to fork from it wait for it again. */
static void preempt(batcher *b, bseq *s)
{
    sh__batcher_plan_running_remove(b, s);
    sh__batcher_kv_release(b, s);
    s->planned = s->alloc_ok = s->sampled = s->short_kv = false;
    s->step_draft = 0;
    s->queued_us = sh__act_mono_us();
    s->queued_step = b->step_no;
    sh_counter_add(b->m_preempt, 1);
    sh_actor_log(b->ctx, SH_LOG_LEVEL_DEBUG, "preempt", "req=%" PRIu64 " choice=%d tokens=%d",
                 s->r->id, (int)s->choice, (int)s->n_toks);
    sh__batcher_plan_queue_insert(b, s);
}

/* The starving sequence to admit first: among those that waited a slice (and need no fork), the
 * best class, then the least work left less the credit of its wait (ties: the earlier). NULL
 * when none is starving. */
static bseq *pick_starving(const batcher *b, uint64_t now_us)
{
    bseq *best = NULL;
    int64_t best_key = 0;
    for (bseq *s = b->queue; s; s = s->next) {
        if (s->fork_pending || !starving(b, s, now_us))
            continue;
        int64_t k =
            work_left(s) - (int64_t)((now_us - s->queued_us) / 1000) * AGE_TOKENS_PER_S / 1000;
        if (!best || s->r->prio < best->r->prio || (s->r->prio == best->r->prio && k < best_key)) {
            best = s;
            best_key = k;
        }
    }
    return best;
}

/* Whether other choices of s's request still wait to fork from it. */
static bool forks_pending(const bseq *s)
{
    for (int32_t i = 1; s->choice == 0 && i < s->r->n_choices; i++)
        if (s->r->seqs[i].fork_pending)
            return true;
    return false;
}

/* Whether running sequence v may give way to starving sequence h: v holds KV, is of h's class or
 * a lower one, has had its slice, has more than twice h's work left (and STARVE_MARGIN more), and
 * no choice waits to fork from it. Between requests of about the same size the order stays first
 * come, first served, so they do not take turns at the price of recomputing each other. */
static bool may_yield(const batcher *b, const bseq *v, const bseq *h, uint64_t now_us)
{
    return v->kv_id && !v->fork_pending && !v->in_step && v->r->prio >= h->r->prio &&
           slice_used(b, v, now_us) && work_left(v) > 2 * work_left(h) + STARVE_MARGIN &&
           !forks_pending(v);
}

/* ---- admission ---------------------------------------------------------------------------- */

/* Moves queued sequence s into the running set with a first chunk of k tokens (0 for a fork). */
static void admit(batcher *b, bseq *s, int32_t k, uint64_t now_us)
{
    sh__batcher_plan_queue_remove(b, s);
    s->state = SEQ_RUNNING;
    s->planned = !s->fork_pending;
    s->in_step = s->alloc_ok = false;
    s->step_k = k;
    s->kv_id = s->fork_pending ? 0 : ++b->next_kv_id;
    s->n_computed = s->n_reserved = s->n_marked = 0;
    s->emb_has = false; /* an embedding pools anew from position 0 */
    s->admitted_us = now_us;
    s->admitted_step = b->step_no;
    s->relieved = false;
    if (!s->admitted_once) { /* queued_us is still its arrival */
        s->admitted_once = true;
        sh_histogram_observe(b->m_queue_wait, (double)(now_us - s->queued_us) * 1e-6);
    }
    running_insert(b, s);
}

/* A planned running sequence's blocks and tokens this step, given back to *avail and *budget. */
static void unplan(const batcher *b, const bseq *s, int32_t *avail, int32_t *budget)
{
    *avail += s->n_blocks;
    if (s->planned) {
        *avail += blocks_for(b, s->n_computed + s->step_k) - blocks_for(b, s->n_computed);
        *budget += s->step_k;
    }
}

/* Starvation relief: when a starving sequence does not fit, running sequences that may yield to
 * it (worst class first, then most work left) are preempted, but only when together they make
 * room; then it is admitted ahead of the queue (it counts in *n_plan, the sequences of the step).
 * Returns whether one was admitted. */
static bool relieve_starving(batcher *b, uint64_t now_us, int32_t *avail, int32_t *budget,
                             int32_t reserve, int32_t *n_plan)
{
    bseq *h = pick_starving(b, now_us);
    if (!h || *budget <= 0 || b->n_running >= b->a.max_seqs)
        return false;
    /* Relief ages a request within its class and ahead of lower ones, never past a better class
     * that waits (the queue is ranked by class, so its head is the best waiting): a priority-5
     * request queued 1 s went in before a priority-1 one queued 0.8 s when a slot freed
     * (test_serve_batch "priority", 1 run in 4). */
    if (b->queue && b->queue->r->prio < h->r->prio)
        return false;
    int32_t k = h->n_toks < *budget ? h->n_toks : *budget;
    int32_t need = blocks_for(b, k) + 1 + reserve;
    int32_t room = *avail;
    for (int32_t i = 0; i < b->n_running && room < need; i++)
        if (may_yield(b, b->running[i], h, now_us))
            room += b->running[i]->n_blocks;
    if (room < need)
        return false;
    while (*avail < need) {
        bseq *v = NULL;
        for (int32_t i = 0; i < b->n_running; i++) {
            bseq *s = b->running[i];
            if (may_yield(b, s, h, now_us) &&
                (!v || s->r->prio > v->r->prio ||
                 (s->r->prio == v->r->prio && work_left(s) > work_left(v))))
                v = s;
        }
        if (!v)
            return false;
        unplan(b, v, avail, budget);
        preempt(b, v);
    }
    *avail -= blocks_for(b, k) + 1;
    *budget -= k;
    admit(b, h, k, now_us);
    h->relieved = true;
    *n_plan += k > 0;
    return true;
}

/* The most sequences one step may take with P steps in flight: an equal share of the sequences
 * there are to run, so that the groups alternate (32 decoding sequences, P = 2: two groups of
 * 16). Unbounded with one step in flight. */
static int32_t step_share(const batcher *b)
{
    if (b->max_inflight <= 1)
        return INT32_MAX;
    int32_t active = b->n_running + b->n_waiting;
    active = active < b->a.max_seqs ? active : b->a.max_seqs;
    int32_t share = (active + b->max_inflight - 1) / b->max_inflight;
    return share > 1 ? share : 1;
}

/* ---- speculative decoding ---------------------------------------------------------------- */

#define SPEC_WINDOW 8192 /* tokens of a sequence the n-gram lookup reads, the latest */

/* Whether planned sequence s may carry drafts this step: speculation on for the replica and
 * the request (no opt-out, no top logprobs, which only the first token of a step would get), a
 * one-token decode step (its prompt computed) whose request is not being cancelled. A sequence
 * with a grammar never drafts (the sampling stage checks one sampled token a step against it). */
static bool may_draft(const batcher *b, const bseq *s)
{
    const breq *r = s->r;
    return b->spec_on && s->planned && !s->fork_pending && s->kv_id && s->step_k == 1 &&
           s->n_computed > 0 && s->n_computed == s->n_toks - 1 && !r->samp.no_spec &&
           !r->samp.grammar.len && r->samp.n_logprobs == 0 && !r->cancelled;
}

/* Step 1b: drafts for the planned decode steps, after admission (drafts never keep a sequence
 * out of a step). Each sequence's k comes from its acceptance and the measured cost of the
 * step's rows (sh_spec_seq_plan: none once the step is large enough that extra rows cost what
 * they bring), capped by its request's spec_max, the tokens it may still generate, its context,
 * the step's token budget and the KV blocks the estimate says are free beyond `reserve`; the
 * n-gram proposer writes them after its last token. */
static void plan_drafts(batcher *b, int32_t budget, int32_t avail, int32_t reserve)
{
    if (!b->spec_on)
        return;
    int32_t rows = 0;
    int32_t logits = b->a.max_logits > 0 ? b->a.max_logits : b->a.max_seqs;
    for (int32_t i = 0; i < b->n_running; i++) {
        bseq *s = b->running[i];
        if (s->planned && !s->fork_pending) {
            rows += s->step_k;
            s->step_draft = 0;
            logits--; /* at most one row of logits each (a fork, or a prefill chunk, takes none) */
        }
    }
    if (logits < budget)
        budget = logits; /* the drafts' rows of logits */
    for (int32_t i = 0; i < b->n_running && budget > 0; i++) {
        bseq *s = b->running[i];
        if (!may_draft(b, s))
            continue;
        if (b->pool) {
            sh_spec_pool_add(b->pool, s->toks, s->n_toks, s->n_pooled);
            s->n_pooled = s->n_toks;
        }
        int32_t kmax = b->a.spec_k;
        if (s->r->samp.spec_max > 0 && s->r->samp.spec_max < kmax)
            kmax = s->r->samp.spec_max; /* the request's own cap (speculative.n_max) */
        int32_t left = s->r->max_tokens - s->n_gen - 1; /* the step's own token is one */
        int32_t room = b->a.n_ctx - s->n_toks - 1;
        kmax = left < kmax ? left : kmax;
        kmax = room < kmax ? room : kmax;
        kmax = budget < kmax ? budget : kmax;
        if (kmax <= 0)
            continue;
        int32_t k = sh_spec_seq_plan(&s->spec, &b->cost, kmax, rows);
        if (k <= 0)
            continue;
        /* A drafter actor drafts the k tokens the step asks for (or fewer). */
        int32_t d = b->remote ? k
                              : sh_spec_ngram_propose(s->toks, s->n_toks, b->pool, k, SPEC_WINDOW,
                                                      s->toks + s->n_toks);
        if (d <= 0)
            continue;
        int32_t end = s->n_computed + s->step_k; /* what the step's own token reserves up to */
        int32_t more = blocks_for(b, end + d) - blocks_for(b, end);
        if (more > 0 && avail - more < reserve)
            continue; /* no drafts where they would take the last blocks */
        avail -= more > 0 ? more : 0;
        budget -= d;
        rows += d;
        s->step_draft = d;
    }
}

/* Step 1 and 2: choose the step's sequences among those not in a step in flight and ask the
 * kvmgr for their blocks. */
void sh__batcher_plan_step(batcher *b)
{
    if (b->paused || b->n_inflight >= b->max_inflight || b->allocs_out || b->forming)
        return;
    uint64_t now_us = sh__act_mono_us();
    // Deadlines first: anything past its deadline finishes now.
    sh__batcher_plan_expire(b);
    int32_t budget = b->a.max_step_tokens;
    int32_t avail = b->avail_est;
    int32_t share = step_share(b), n_plan = 0;
    // Running sequences, in queue order (running_insert keeps the array ranked by priority class,
    // then arrival), so that a short budget goes to the earlier work. One in a step in flight
    // waits for its answer (its next chunk needs the token that step samples).
    for (int32_t i = 0; i < b->n_running && budget > 0 && n_plan < share; i++) {
        bseq *s = b->running[i];
        if (s->in_step)
            continue;
        s->planned = s->alloc_ok = false;
        int32_t pending = s->n_toks - s->n_computed;
        if (s->fork_pending || pending <= 0)
            continue;
        int32_t k = pending < budget ? pending : budget;
        s->step_k = k;
        s->planned = true;
        budget -= k;
        n_plan++;
        avail -= blocks_for(b, s->n_computed + k) - blocks_for(b, s->n_computed);
    }
    // Forks: choices waiting for choice 0's prompt blocks.
    for (int32_t i = 0; i < b->n_running; i++) {
        bseq *s = b->running[i];
        if (!s->fork_pending || s->kv_id)
            continue;
        const bseq *p = &s->r->seqs[0];
        if (p->state != SEQ_RUNNING || !p->kv_id || p->n_computed < s->r->shared)
            continue;
        if (p->n_marked < s->r->shared && !p->planned)
            continue; /* the kvmgr hears of the computed prompt with choice 0's next alloc */
        s->kv_id = ++b->next_kv_id;
        s->planned = true;
        s->step_k = 0;
    }
    // A starving sequence goes first, with room made for it if need be. Then the queue head while
    // the budget, the sequence limit and the KV allow. Nothing passes a head that does not fit,
    // so a later arrival never overtakes a waiting (or preempted) earlier one. When no sequence
    // holds KV the head goes in whatever the estimate says (choices waiting to fork hold none and
    // must not keep it out).
    int32_t reserve = 1 + b->n_running / 8;
    relieve_starving(b, now_us, &avail, &budget, reserve, &n_plan);
    bool held = false;
    for (int32_t i = 0; i < b->n_running && !held; i++)
        held = b->running[i]->kv_id != 0;
    while (b->queue && budget > 0 && b->n_running < b->a.max_seqs && n_plan < share) {
        bseq *s = b->queue;
        int32_t k = 0;
        if (!s->fork_pending) {
            k = s->n_toks < budget ? s->n_toks : budget;
            int32_t need = blocks_for(b, k) + 1;
            if (avail - need < reserve && held)
                break;
            held = true;
            avail -= need;
            budget -= k;
            n_plan++;
        }
        admit(b, s, k, now_us);
    }
    plan_drafts(b, budget, avail, reserve);
    // Requests: allocs for choice 0s before forks (the kvmgr handles them in order).
    for (int32_t i = 0; i < b->n_running; i++) {
        bseq *s = b->running[i];
        if (s->planned && !s->fork_pending)
            send_alloc(b, s, s->step_k);
    }
    for (int32_t i = 0; i < b->n_running; i++) {
        bseq *s = b->running[i];
        if (s->planned && s->fork_pending)
            send_fork(b, s, &s->r->seqs[0]);
    }
    // Drafts last: a shortage refuses them, never another sequence's step.
    for (int32_t i = 0; i < b->n_running; i++) {
        bseq *s = b->running[i];
        if (s->planned && !s->fork_pending && s->step_draft > 0 && s->kv_wait == 1)
            send_draft_alloc(b, s);
        else if (s->planned && s->kv_wait != 1)
            s->step_draft = 0;
    }
    sh__batcher_update_gauges(b);
    int32_t idle = 0; /* running sequences not in a step in flight */
    for (int32_t i = 0; i < b->n_running; i++)
        idle += !b->running[i]->in_step;
    if (b->allocs_out == 0 && idle > 0) {
        // Nothing could be planned although sequences run: they wait on forks; try later.
        sh_actor_timer_start(b->ctx, 5, 0, TIMER_FORM, &b->form_timer);
        b->forming = true;
        b->form_start_us = sh__act_mono_us();
    }
}

/* Step 3: every reservation answered; run the step with those that got their blocks. */
void sh__batcher_plan_seq_fill(const batcher *b, const bseq *s, sh_proto_step_seq *q)
{
    (void)b;
    memset(q, 0, sizeof *q);
    q->seq = s->kv_id;
    // Drafts follow the step's last token (toks[n_toks ...], unchanged until its answer); a
    // drafter actor appends its own (want_draft), and needs the tokens before pos to draft: they
    // go with the steps before the sequence's first sample (a prefix-cache hit, a resume).
    if (b->remote) {
        q->tokens = (sh_i32s){s->toks + s->n_computed, (uint32_t)s->step_k};
        q->want_draft = (uint32_t)s->step_draft;
        if (!s->sampled && s->n_computed > 0)
            q->prior = (sh_i32s){s->toks, (uint32_t)s->n_computed};
    } else {
        q->tokens = (sh_i32s){s->toks + s->n_computed, (uint32_t)(s->step_k + s->step_draft)};
        q->draft = (uint32_t)s->step_draft;
    }
    q->pos = (uint32_t)s->n_computed;
    q->blocks = (sh_i32s){s->blocks, (uint32_t)s->n_blocks};
    q->sample = s->n_computed + s->step_k == s->n_toks;
    q->sampling = s->r->samp;
    q->sampling.stop = (sh_strv_list){0};
    // The seed of each draw follows from the request's, the choice and the position: a step
    // sent again draws with the seed its lost try had.
    q->sampling.seed = s->r->samp.seed + (uint64_t)s->choice * 0x9E3779B97F4A7C15ull +
                       (uint64_t)s->n_gen * 0xBF58476D1CE4E5B9ull;
    if (q->sample && s->n_gen < s->r->min_mask)
        q->ban = (sh_i32s){b->eog, (uint32_t)b->n_eog};
    // With a grammar, the last stage's matcher must be where the generated tokens left it. Its
    // text and those tokens go with the first sampling step after each admission (a recompute
    // after a preemption or a stage's failure is one), so that the stage builds the matcher and
    // replays them; later steps name the grammar by its hash and the stage keeps the matcher.
    // A stage that lacks it then (a slot reused) answers SH_ENOTFOUND and gets them again.
    if (q->sample && s->r->samp.grammar.len) {
        q->n_gen = (uint32_t)s->n_gen;
        if (s->sampled) {
            q->sampling.grammar = (sh_strv){0};
            q->gram_hash = s->r->gram_hash;
        } else {
            q->gen = (sh_i32s){s->toks + s->n_toks - s->n_gen, (uint32_t)s->n_gen};
        }
    }
    if (q->sample && !s->sampled) {
        int32_t w = s->r->samp.penalty_last_n;
        if (w > s->n_computed + s->step_k)
            w = s->n_computed + s->step_k;
        q->history = (sh_i32s){s->toks + s->n_computed + s->step_k - w, (uint32_t)w};
    }
    if (s->r->embed) { /* a prefill only: the last stage pools instead of sampling */
        q->sample = false;
        q->history = (sh_i32s){0};
        q->embed = s->r->embed;
    }
}

static void dispatch_step(batcher *b)
{
    // A plan starts only with a pipeline slot free, and only this sends a step; a KV reply with
    // no plan under way (none is expected) must not look for a slot that is not there.
    if (b->n_inflight >= b->max_inflight)
        return;
    uint64_t now_us = sh__act_mono_us();
    // Admissions that did not fit go back to the queue; running sequences that could not grow
    // are counted for preemption.
    int32_t failed = 0;
    bseq *refused = NULL;
    for (int32_t i = 0; i < b->n_running; i++) {
        bseq *s = b->running[i];
        if (!s->planned || s->alloc_ok)
            continue;
        s->planned = false;
        if (s->fork_pending)
            continue;
        if (s->kv_id == 0) {
            sh__batcher_plan_running_remove(b, s);
            sh__batcher_plan_queue_insert(b, s);
            refused = refused ? refused : s;
            i--;
        } else if (s->n_toks > s->n_computed) {
            s->short_kv = true;
            failed++;
        }
    }
    int32_t holders = 0;
    for (int32_t i = 0; i < b->n_running; i++)
        holders += b->running[i]->kv_id != 0;
    if (refused && holders == 0) {
        // Refused by a pool that nothing else holds: this prompt can never fit.
        sh__batcher_req_fail(b, refused->r, SH_ENOMEM, 503,
                             "the KV cache is too small for this request's prompt");
    }
    // The blocks the refused growth asks for beyond what the pool has left; victims give theirs
    // back until it is covered. A victim that is itself short needs nothing any more. Only when
    // the one sequence left holding KV is still short does it not fit the pool even alone.
    int32_t deficit = -b->avail_est;
    for (int32_t i = 0; i < b->n_running; i++)
        if (b->running[i]->short_kv)
            deficit += grow_need(b, b->running[i]);
    while (failed > 0 && deficit > 0) {
        bseq *v = pick_victim(b, now_us);
        if (!v)
            break;
        if (holders == 1) {
            if (v->short_kv)
                sh__batcher_req_fail(b, v->r, SH_ENOMEM, 503,
                                     "the KV cache is too small for this request's context");
            break;
        }
        if (v->short_kv) {
            deficit -= grow_need(b, v);
            failed--;
        }
        deficit -= v->n_blocks;
        preempt(b, v);
        holders--;
    }
    for (int32_t i = 0; i < b->n_running; i++)
        b->running[i]->short_kv = false;
    // The step itself, in a free flight slot.
    int32_t slot = 0;
    while (b->fl[slot].step)
        slot++;
    flight *f = &b->fl[slot];
    f->n = 0;
    int32_t n_tok = 0;
    for (int32_t i = 0; i < b->n_running; i++) {
        bseq *s = b->running[i];
        if (!s->planned || !s->alloc_ok || s->step_k <= 0) {
            if (!s->in_step)
                s->step_draft = 0; /* one in another step in flight keeps that step's drafts */
            continue;
        }
        if (s->n_reserved < s->n_computed + s->step_k + s->step_draft)
            s->step_draft = 0; /* their reservation was refused: a plain step */
        sh__batcher_plan_seq_fill(b, s, &b->step_seqs[f->n]);
        s->in_step = true;
        s->fl_slot = slot;
        s->fl_pos = f->n;
        f->order[f->n++] = s;
        n_tok += s->step_k + s->step_draft;
    }
    for (int32_t i = 0; i < b->n_running; i++)
        b->running[i]->planned = false;
    if (f->n == 0) {
        // Nothing to run. With a step in flight its answer plans the next one.
        if (b->n_inflight == 0 && (b->n_running || b->n_waiting)) {
            b->forming = true;
            b->form_start_us = sh__act_mono_us();
            sh_actor_timer_start(b->ctx, 2, 0, TIMER_FORM, &b->form_timer);
        }
        return;
    }
    sh_proto_step st = {
        .step = ++b->step_no, .seqs = {b->step_seqs, (uint32_t)f->n}, .epoch = b->epoch};
    sh_error e = {0};
    if (sh__act_send(sh_actor_runtime(b->ctx), sh_actor_self(b->ctx), b->a.stage, SH_MSG_STEP, 0,
                     &st, &e)) {
        sh_actor_log(b->ctx, SH_LOG_LEVEL_ERROR, "step_send", "err=\"%s\"", e.msg);
        for (int32_t i = 0; i < f->n; i++)
            f->order[i]->in_step = false;
        f->n = 0;
        for (breq *r = b->live, *next; r; r = next) {
            next = r->next_live;
            sh__batcher_req_fail(b, r, SH_EIO, 503, "the stage could not be reached");
        }
        return;
    }
    f->step = b->step_no;
    sh_actor_log(b->ctx, SH_LOG_LEVEL_DEBUG, "step_sent",
                 "step=%" PRIu64 " epoch=%" PRIu64 " seqs=%d tokens=%d", f->step, b->epoch,
                 (int)f->n, (int)n_tok);
    f->sent_us = f->first_us = sh__act_mono_us();
    f->n_tok = n_tok;
    f->n_tries = 1;
    f->tries[0] = f->step;
    f->tries_us[0] = f->sent_us;
    b->n_inflight++;
    sh__batcher_busy_update(b, f->sent_us);
    sh_counter_add(b->m_steps, 1);
    sh_histogram_observe(b->m_batch, f->n);
    sh_histogram_observe(b->m_step_tokens, n_tok);
    sh_histogram_observe(b->m_inflight, b->n_inflight);
    // Room for another step (a pipeline): plan it from the sequences this one left.
    if (b->n_inflight < b->max_inflight)
        sh__batcher_plan_step(b);
}

void sh__batcher_plan_kv_reply(batcher *b, uint32_t type, const sh_proto_body *pb, bool decoded)
{
    if (b->stale_kv > 0) {
        // A reply from before a pause: about the pool the RESET dropped.
        b->stale_kv--;
        return;
    }
    if (b->allocs_out > 0)
        b->allocs_out--;
    uint64_t kv_id = 0;
    int32_t status = SH_EPROTO;
    sh_i32s blocks = {0};
    if (decoded && type == SH_MSG_KV_ALLOC) {
        kv_id = pb->kv_alloc.seq;
        status = pb->kv_alloc.status;
        blocks = pb->kv_alloc.blocks;
        if (pb->kv_alloc.status == 0 || pb->kv_alloc.status == SH_EBUSY)
            b->avail_est = (int32_t)pb->kv_alloc.available;
    } else if (decoded && type == SH_MSG_KV_FORK) {
        kv_id = pb->kv_fork.child;
        status = pb->kv_fork.status;
        blocks = pb->kv_fork.blocks;
    }
    bseq *s = kv_id ? sh__batcher_plan_find_running(b, kv_id) : NULL;
    bool draft_reply = false; /* the reply to the reservation of s's drafts */
    if (s && s->planned && s->kv_wait > 0) {
        draft_reply = s->draft_alloc && s->kv_wait == 1;
        s->kv_wait--;
    }
    if (s && s->planned && draft_reply) {
        // Only the drafts depend on it: refused (the pool is short), the step goes without them
        // and nobody is preempted for them (dispatch_step checks what is reserved).
        if (status == 0 && (int32_t)blocks.n <= b->max_blocks) {
            for (uint32_t i = 0; i < blocks.n; i++)
                s->blocks[i] = sh_i32s_at(blocks, i);
            s->n_blocks = (int32_t)blocks.n;
            s->n_reserved += (int32_t)pb->kv_alloc.appended;
        } else {
            s->step_draft = 0;
        }
        s->draft_alloc = false;
    } else if (s && s->planned) {
        if (status == 0 && (int32_t)blocks.n <= b->max_blocks) {
            for (uint32_t i = 0; i < blocks.n; i++)
                s->blocks[i] = sh_i32s_at(blocks, i);
            s->n_blocks = (int32_t)blocks.n;
            s->held_kv = true;
            if (type == SH_MSG_KV_ALLOC) {
                if (s->n_reserved == 0 && s->n_computed == 0) {
                    s->n_cached = (int32_t)pb->kv_alloc.cached;
                    s->n_computed = s->n_marked = s->n_cached;
                    s->n_reserved = s->n_cached;
                    s->step_k = (int32_t)pb->kv_alloc.appended;
                }
                s->n_reserved += (int32_t)pb->kv_alloc.appended;
                s->alloc_ok = s->step_k > 0;
            } else {
                s->n_computed = s->n_reserved = s->n_marked = s->r->shared;
                s->n_cached = s->r->shared;
                s->fork_pending = false;
                s->alloc_ok = false; /* computes from the next step on */
            }
        } else {
            if (type == SH_MSG_KV_FORK) {
                s->kv_id = 0; /* retried at the next plan when the pool was short */
                if (status != SH_EBUSY)
                    s->fork_pending = false; /* e.g. the window released the prompt's start */
            } else if (s->n_reserved == 0 && s->n_computed == 0) {
                s->kv_id = 0; /* the kvmgr freed the new sequence again */
            }
            if (status != SH_EBUSY && status != 0)
                sh_actor_log(b->ctx, SH_LOG_LEVEL_WARN, "kv_refused", "req=%" PRIu64 " status=%d",
                             s->r->id, (int)status);
            if (status == SH_ERANGE) {
                sh__batcher_seq_finish(b, s, SH_PROTO_FINISH_LENGTH);
                s = NULL;
            }
        }
    } else if (status == 0 && kv_id) {
        // The sequence ended (cancel) while its reservation was on the way: release it.
        sh_proto_kv_free f = {.seq = kv_id};
        sh_error e = {0};
        sh__act_send(sh_actor_runtime(b->ctx), sh_actor_self(b->ctx), b->a.kvmgr, SH_MSG_KV_FREE, 0,
                     &f, &e);
    }
    if (b->allocs_out == 0)
        dispatch_step(b);
}
