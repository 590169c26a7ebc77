/* A standby node's stages: preloaded at start, taken over on promotion (tools/standby.h). */
#include "tools/standby.h"

#include <inttypes.h>
#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "base/error.h"
#include "tools/cmd_util.h"

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec / 1e9;
}

static sh_standby_stage *held(sh_standby *sb, int32_t stage, int32_t rank)
{
    for (int32_t k = 0; k < sb->n; k++)
        if (sb->st[k].stage == stage && sb->st[k].rank == rank)
            return &sb->st[k];
    return NULL;
}

/* The entry's model and context (or group) go. */
static void unload(sh_standby_stage *st)
{
    sh_llama_ctx_destroy(st->ctx);
    sh_llama_destroy(st->m);
    free(st->group);
    st->ctx = NULL;
    st->m = NULL;
    st->group = NULL;
}

/* Loads plan stage i's layers and creates its context with the KV pool the plan gives it, as
 * `shoal node` does for its own stages; for rank `rank` of a tensor-parallel group, that rank's
 * slices and the group's links with this node in the rank's place (the stage actor creates the
 * context when the group forms). Returns the entry, or NULL with the error in e. */
static sh_standby_stage *load(sh_standby *sb, int32_t i, int32_t rank, sh_error *e)
{
    const sh_cluster_plan *p = &sb->plan;
    const sh_cluster_replica_plan *rp = &p->rep[p->stage_replica[i]];
    sh_standby_stage *st = &sb->st[sb->n];
    memset(st, 0, sizeof *st);
    st->stage = i;
    st->rank = rank;
    bool group = p->stage_tp[i] > 1;
    sh_llama_load_opts lo = {.first = p->first[i],
                             .last = p->last[i],
                             .prefault = true,
                             .tp_rank = group ? rank : 0,
                             .tp_size = group ? p->stage_tp[i] : 0};
    if (sh_llama_load(sb->path, &lo, &st->m, e)) {
        if (group) {
            char why[sizeof e->msg];
            snprintf(why, sizeof why, "%s", e->msg);
            sh__error_set(e, e->code, "rank %d of its group of %d: %s", (int)rank,
                          (int)p->stage_tp[i], why);
        }
        return NULL;
    }
    sh_llama_ctx_opts co = {.max_tokens = p->step_tokens,
                            .max_seqs = p->max_seqs,
                            .max_logits = p->max_seqs,
                            .kv_tokens = rp->n_blocks * SH_KV_DEFAULT_BLOCK_TOKENS,
                            .kv_type = p->c->kv.f32 ? SH_DTYPE_F32 : SH_DTYPE_F16};
    if (group) {
        // The group as it will be with this node in the rank's place: its URL for the network
        // collective (the front's REGROUP gives every rank's again before the group forms).
        sh_cluster_plan *mv = malloc(sizeof *mv);
        st->group = malloc(sizeof *st->group);
        sh_error ge = {0};
        int rc = !mv || !st->group;
        if (!rc) {
            *mv = *p;
            mv->rank_node[i][rank] = sb->self;
            if (rank == 0)
                mv->stage_node[i] = sb->self;
            rc = sh__cluster_group(mv, i, st->group, &ge);
        }
        free(mv);
        if (rc) {
            sh__error_set(e, ge.code ? ge.code : SH_ENOMEM, "%s",
                          ge.code ? ge.msg : "out of memory");
            unload(st);
            return NULL;
        }
        for (int32_t r = 0; r < p->stage_tp[i]; r++)
            st->ranks[r] = p->rank_addr[i][r];
        st->co = co;
        size_t need = sh_llama_tp_coll_bytes(st->m, &co);
        st->coll = (sh_coll_opts){.timeout_ms = st->group->timeout_ms,
                                  .max_bytes = need > 4096 ? need : 4096,
                                  .shm_name = st->group->shm_name,
                                  .urls = st->group->url_of};
        sb->n++;
        return st;
    }
    if (sh_llama_ctx_create(st->m, sb->be, &co, &st->ctx, e)) {
        unload(st);
        return NULL;
    }
    sb->n++;
    return st;
}

int sh__standby_preload(sh_standby *sb)
{
    const sh_cluster_plan *p = &sb->plan;
    const sh_config_node *nd = &p->c->nodes[sb->self];
    if (!nd->preload) {
        fprintf(stderr,
                "shoal: node %s is a cold standby: it loads a dead node's layers when "
                "promoted\n",
                nd->name);
        return 0;
    }
    int32_t of = sh_config_find_node(p->c, nd->preload);
    char list[512] = "";
    double t0 = now_s();
    for (int32_t i = 0; i < p->n_stages; i++) {
        int32_t rank = sh__cluster_rank_on(p, i, of);
        if (rank < 0 || p->rep[p->stage_replica[i]].model != sb->model)
            continue;
        sh_error e = {0};
        if (!load(sb, i, rank, &e))
            return (sh__cmd_fail("standby %s: stage %d: %s", nd->name, (int)i + 1, e.msg), 1);
        size_t l = strlen(list);
        snprintf(list + l, sizeof list - l, "%sstage %d layers [%d, %d)", l ? ", " : "", (int)i + 1,
                 (int)p->first[i], (int)p->last[i]);
        if (p->stage_tp[i] > 1) {
            l = strlen(list);
            snprintf(list + l, sizeof list - l, " (rank %d of %d)", (int)rank, (int)p->stage_tp[i]);
        }
    }
    fprintf(stderr, "shoal: node %s is a hot standby for node %s: preloaded %s in %.1f s\n",
            nd->name, nd->preload, list[0] ? list : "nothing (it holds no stage)", now_s() - t0);
    return 0;
}

/* Whether stage i (its leader, for a group) also moves here in this promotion. */
static sh_standby_stage *moving(sh_standby *sb, int32_t i)
{
    for (int32_t k = 0; k < sb->n_want; k++)
        if (sb->want[k] == i && sb->want_rank[k] == 0)
            return held(sb, i, 0);
    return NULL;
}

static void *promote_main(void *arg)
{
    sh_standby *sb = arg;
    const sh_cluster_plan *p = &sb->plan;
    const char *name = p->c->nodes[sb->self].name;
    double t0 = now_s();
    sh_error e = {0};
    int32_t loaded = 0;
    for (int32_t k = 0; k < sb->n_want; k++) {
        int32_t i = sb->want[k];
        if (held(sb, i, sb->want_rank[k]))
            continue;
        if (!load(sb, i, sb->want_rank[k], &e)) {
            fprintf(stderr, "shoal: node %s: promotion failed: stage %d: %s\n", name, (int)i + 1,
                    e.msg);
            atomic_store(&sb->busy, 0);
            return NULL;
        }
        loaded++;
    }
    // Spawn from the last stage back, so that each one's next (here or elsewhere) is known.
    for (int32_t k = sb->n_want; k-- > 0;) {
        int32_t i = sb->want[k];
        sh_standby_stage *st = held(sb, i, sb->want_rank[k]);
        if (st->addr)
            continue; /* promoted for it before */
        const sh_cluster_replica_plan *rp = &p->rep[p->stage_replica[i]];
        sh_addr next = sh__cluster_next_stage(p, i);
        sh_standby_stage *nx = next ? moving(sb, i + 1) : NULL;
        if (nx && nx->addr)
            next = nx->addr;
        st->sa = (sh_stage_args){.model = st->m,
                                 .ctx = st->ctx,
                                 .max_seqs = p->max_seqs,
                                 .max_blocks_per_seq = rp->seq_blocks,
                                 .link_dtype = rp->link_dtype,
                                 .next = next,
                                 .control_node = (uint32_t)p->front + 1};
        if (st->group) {
            st->sa.ctx = NULL;
            st->sa.tp_rank = st->rank;
            st->sa.tp_size = p->stage_tp[i];
            st->sa.tp_ranks = st->ranks;
            st->sa.coll_kind = st->group->kind;
            st->sa.coll = &st->coll;
            st->sa.be = sb->be;
            st->sa.ctx_opts = &st->co;
            st->sa.n_blocks = rp->n_blocks;
        }
        sh_addr addr = 0;
        if (sh_actor_spawn(sb->rt, "stage", &st->sa, 1, &addr, &e)) {
            fprintf(stderr, "shoal: node %s: promotion failed: stage %d: %s\n", name, (int)i + 1,
                    e.msg);
            atomic_store(&sb->busy, 0);
            return NULL;
        }
        st->addr = addr;
    }
    // The identity lists this node's stages in plan order; the front reads it back in HELLO.
    int32_t n = 0;
    char list[512] = "";
    for (int32_t i = 0; i < p->n_stages && n < SH_HELLO_MAX_STAGES; i++) {
        sh_standby_stage *st = NULL;
        for (int32_t k = 0; k < sb->n && !st; k++)
            if (sb->st[k].stage == i && sb->st[k].addr)
                st = &sb->st[k];
        if (!st)
            continue;
        sb->ident->slices[n] = sh__cluster_slice(p, i, st->rank);
        sb->ident->stages[n++] = st->addr;
        size_t l = strlen(list);
        snprintf(list + l, sizeof list - l, "%sstage %d layers [%d, %d)", l ? ", " : "", (int)i + 1,
                 (int)p->first[i], (int)p->last[i]);
        if (p->stage_tp[i] > 1) {
            l = strlen(list);
            snprintf(list + l, sizeof list - l, " (rank %d of %d)", (int)st->rank,
                     (int)p->stage_tp[i]);
        }
    }
    __atomic_store_n(&sb->ident->n_stages, n, __ATOMIC_RELEASE);
    fprintf(stderr, "shoal: node %s promoted: serving %s (%d loaded now, %.2f s)\n", name, list,
            (int)loaded, now_s() - t0);
    fflush(stderr);
    atomic_store(&sb->busy, 0);
    return NULL;
}

void sh__standby_promote(void *user, const int32_t *stages, const int32_t *ranks, int32_t n)
{
    sh_standby *sb = user;
    const sh_cluster_plan *p = &sb->plan;
    const char *name = p->c->nodes[sb->self].name;
    if (n < 1 || n > SH_CLUSTER_MAX_STAGES) {
        fprintf(stderr, "shoal: node %s: promotion refused: %d stages\n", name, (int)n);
        return;
    }
    for (int32_t k = 0; k < n; k++)
        if (stages[k] < 0 || stages[k] >= p->n_stages ||
            p->rep[p->stage_replica[stages[k]]].model != sb->model ||
            sb->n + n > SH_CLUSTER_MAX_STAGES) {
            fprintf(stderr,
                    "shoal: node %s: promotion refused: stage %d is not a stage of this node's "
                    "model\n",
                    name, (int)stages[k] + 1);
            return;
        } else if (ranks[k] < 0 ||
                   ranks[k] >= (p->stage_tp[stages[k]] > 1 ? p->stage_tp[stages[k]] : 1)) {
            fprintf(stderr,
                    "shoal: node %s: promotion refused: stage %d has no rank %d (a group of %d)\n",
                    name, (int)stages[k] + 1, (int)ranks[k], (int)p->stage_tp[stages[k]]);
            return;
        }
    int open = 0;
    if (!atomic_compare_exchange_strong(&sb->gate, &open, 1)) {
        fprintf(stderr, "shoal: node %s: promotion refused: the node is stopping\n", name);
        return;
    }
    if (atomic_exchange(&sb->busy, 1)) {
        atomic_store(&sb->gate, 0);
        fprintf(stderr,
                "shoal: node %s: a promotion is already running; the new request waits "
                "for the front to ask again\n",
                name);
        return;
    }
    if (sb->started) {
        pthread_join(sb->thread, NULL); /* the previous one finished (busy was 0) */
        sb->started = false;
    }
    memcpy(sb->want, stages, (size_t)n * sizeof *stages);
    memcpy(sb->want_rank, ranks, (size_t)n * sizeof *ranks);
    sb->n_want = n;
    fprintf(stderr, "shoal: node %s: promotion asked: %d stage%s\n", name, (int)n,
            n == 1 ? "" : "s");
    if (pthread_create(&sb->thread, NULL, promote_main, sb)) {
        fprintf(stderr, "shoal: node %s: promotion failed: cannot start a thread\n", name);
        atomic_store(&sb->busy, 0);
        atomic_store(&sb->gate, 0);
        return;
    }
    sb->started = true;
    atomic_store(&sb->gate, 0);
}

void sh__standby_join(sh_standby *sb)
{
    /* Close the gate (waiting out a start in progress on hello's loop thread): after this no
     * promotion starts, and `started` says whether one did. */
    for (int open = 0; !atomic_compare_exchange_weak(&sb->gate, &open, 2); open = 0) {
        if (open == 2)
            break;
        sched_yield();
    }
    if (sb->started)
        pthread_join(sb->thread, NULL);
    sb->started = false;
}

void sh__standby_free(sh_standby *sb)
{
    for (int32_t k = 0; k < sb->n; k++)
        unload(&sb->st[k]);
    sb->n = 0;
}
