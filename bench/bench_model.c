/* Prefill and decode speed of a model through the full forward pass, like llama-bench: ppN runs
 * one N-token prompt as one batch, tgN decodes N tokens one at a time. Prints one JSON object per
 * result line, with the read bandwidth measured in the same run so decode can be judged against
 * the machine's ceiling (weight bytes per token / time per token). */
#include <pthread.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include <immintrin.h>

#include "kernels/backend.h"
#include "model/llama.h"
#include "runtime/coll.h"

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

typedef struct bw_arg {
    const uint64_t *p;
    size_t n;
    int streams;
    uint64_t sum;
} bw_arg;

/* Sums the thread's part of the array with 256-bit loads and independent accumulators, so the loop
 * is bound by memory, not by the adds (a scalar loop undercounts the machine's read bandwidth).
 * The part is read as `streams` contiguous pieces walked side by side, one cache line of each per
 * iteration: one core reading one sequential stream is limited by how many misses one stream keeps
 * in flight, while a matrix-vector product walks several weight rows at once, so a one-stream
 * probe undercounts what a single-threaded decode can reach (it once made decode look 1.10x
 * faster than "the" bandwidth). */
__attribute__((target("avx2"))) static void *bw_read(void *arg)
{
    bw_arg *a = arg;
    __m256i s0 = _mm256_setzero_si256(), s1 = s0;
    int k = a->streams;
    size_t lines = a->n / 8 / (size_t)k; /* 64-byte lines per stream */
    const __m256i *base[16];
    for (int j = 0; j < k; j++)
        base[j] = (const __m256i *)(a->p + (size_t)j * lines * 8);
    for (size_t i = 0; i < lines; i++) {
        for (int j = 0; j < k; j++) {
            s0 = _mm256_add_epi64(s0, _mm256_load_si256(base[j] + 2 * i));
            s1 = _mm256_add_epi64(s1, _mm256_load_si256(base[j] + 2 * i + 1));
        }
    }
    s0 = _mm256_add_epi64(s0, s1);
    uint64_t lanes[4];
    _mm256_storeu_si256((__m256i *)lanes, s0);
    a->sum = lanes[0] + lanes[1] + lanes[2] + lanes[3];
    return NULL;
}

/* One pass over the 1 GiB array with `threads` threads of `streams` streams each, GB/s. */
static double bw_pass(const uint64_t *p, size_t n, int threads, int streams)
{
    pthread_t th[16];
    bw_arg args[16];
    size_t per = n / (size_t)threads / ((size_t)streams * 8) * ((size_t)streams * 8);
    double t0 = now_s();
    for (int i = 0; i < threads; i++) {
        args[i] = (bw_arg){p + per * (size_t)i, per, streams, 0};
        pthread_create(&th[i], NULL, bw_read, &args[i]);
    }
    uint64_t sum = 0;
    for (int i = 0; i < threads; i++) {
        pthread_join(th[i], NULL);
        sum += args[i].sum;
    }
    double gbs = (double)(per * (size_t)threads * 8) / (now_s() - t0) / 1e9;
    return sum == 1 ? 0 : gbs; /* the sum keeps the reads from being optimised away */
}

/* Read-only bandwidth (sum reduction over 1 GiB split across threads, as in ANCHORS.md): the best
 * of 3 passes with one stream per thread and 3 with eight, GB/s; each kind's best goes to *one and
 * *eight. */
static double read_bandwidth(int threads, double *one, double *eight)
{
    size_t bytes = (size_t)1 << 30, n = bytes / 8;
    uint64_t *p = aligned_alloc(64, bytes);
    if (!p)
        return 0;
    for (size_t i = 0; i < n; i++)
        p[i] = i * 0x9E3779B97F4A7C15ull;
    *one = *eight = 0;
    for (int rep = 0; rep < 6; rep++) {
        double *best = rep % 2 ? eight : one;
        double gbs = bw_pass(p, n, threads, rep % 2 ? 8 : 1);
        if (gbs > *best)
            *best = gbs;
    }
    free(p);
    return *one > *eight ? *one : *eight;
}

static void usage(void)
{
    fprintf(stderr,
            "usage: bench_model -m MODEL.gguf [-t THREADS] [--pp N] [--tg N] [--reps R]\n"
            "                   [--kv f32|f16] [--ctx N] [--tp N [--procs]] [--no-bw]\n"
            "                   [--kcost K [--kseqs S] [--kwarm N]]\n"
            "  pp and tg may repeat; defaults: --pp 128 --pp 512 --tg 128, 3 reps, 2 threads,\n"
            "  F32 KV; --ctx N: the tg runs decode after an N-token context (filled once), so\n"
            "  attention over the cache counts; --no-bw skips the read-bandwidth probe.\n"
            "  --kcost K (1..63): the k-row forward cost table of speculative decoding, alone\n"
            "  unless pp or tg is given: after a --ctx context (default 256), the median time\n"
            "  of one forward pass of n rows of one sequence with logits for every row (a\n"
            "  verify step of n-1 drafts), n = 1..K+1, 32, 64, and its ratio to n = 1; then S\n"
            "  sequences (--kseqs S, default 8, 0 or 1: none) of 1+k rows each, k = 0, 1, 2,\n"
            "  4, .., K, against S x 1 row; --reps defaults to 15 with --kcost; each timed\n"
            "  pass follows --kwarm N (default 0, at most 8) untimed passes of its size.\n"
            "  --tp N: N tensor-parallel ranks as threads of this process (not processes), each\n"
            "  with its own backend of -t THREADS threads, over the in-process shared-memory\n"
            "  collective; the figures are the group's (rank 0 times every step).\n"
            "  --procs: the ranks are processes instead (fork()ed before anything is loaded,\n"
            "  over a named shared-memory segment); every rank prints its peak RSS.\n"
            "  coll_fraction: the share of the best run's time rank 0 spent inside collectives\n"
            "  (waiting for the other ranks included; 0 without --tp).\n"
            "  SHOAL_ISA=scalar|avx2|avx512 caps the kernels (the first line names them).\n");
}

#define KC_POINTS 96 /* kcost points: rows 1..K+1, 32 and 64, and the batch points */

/* What every rank runs: the same forward calls in the same order. */
typedef struct bench_cfg {
    const char *path;
    int threads, reps, n_pp, n_tg, ctx_len, tp;
    int pp[8], tg[8];
    int chunk;
    int kcost, kseqs, kreps; /* --kcost K, --kseqs S and their reps */
    int kwarm;               /* untimed passes of a point's size before each timed one */
    int32_t nb; /* KV blocks of one sequence; sequence s has blocks [s nb, s nb + nb) */
    int32_t kv;
    bool kv_f16;
    int32_t *tokens, *blocks;
    sh_coll_inproc *group; /* the ranks are threads */
    bool procs;            /* the ranks are processes, over shm_name */
    char shm_name[64];
} bench_cfg;

typedef struct bench_rank {
    const bench_cfg *cfg;
    int32_t rank;
    sh_llama *m;
    sh_backend *be;
    sh_llama_ctx *ctx;
    sh_coll *coll;
    double pp_best[8], tg_best[8];
    double pp_coll[8], tg_coll[8]; /* share of the best run's time spent inside collectives */
    int32_t kc_n;                  /* kcost points measured */
    int32_t kc_seqs[KC_POINTS], kc_rows[KC_POINTS];
    double kc_us[KC_POINTS]; /* median of the reps, microseconds */
    int rc;
    sh_error e;
} bench_rank;

static size_t group_bytes(const bench_cfg *c, int32_t dim, int32_t n_vocab)
{
    size_t a = (size_t)c->chunk * (size_t)dim * sizeof(float);
    size_t g = (size_t)c->tp * (size_t)((n_vocab + c->tp - 1) / c->tp) * sizeof(float) *
               (size_t)(c->kcost ? c->chunk : 1); /* --kcost: logits for every row */
    return a > g ? a : g;
}

/* Loads the rank's slices (already loaded for rank 0), joins the group and makes the context. */
static int rank_open(bench_rank *r)
{
    const bench_cfg *c = r->cfg;
    sh_llama_load_opts lo = {.prefault = true, .tp_rank = r->rank, .tp_size = c->tp};
    sh_backend_cpu_opts bo = {.n_threads = c->threads};
    const int32_t seqs = c->kseqs > 1 ? c->kseqs : 1;
    sh_llama_ctx_opts co = {.max_tokens = c->chunk,
                            .max_seqs = seqs,
                            .max_logits = c->kcost ? c->chunk : 0,
                            .kv_tokens = c->nb * SH_KV_BLOCK_TOKENS * seqs,
                            .kv_type = c->kv_f16 ? SH_DTYPE_F16 : SH_DTYPE_F32};
    if (!r->m && sh_llama_load(c->path, &lo, &r->m, &r->e))
        return 2;
    if (c->tp > 1) {
        sh_coll_opts o = {.rank = r->rank,
                          .size = c->tp,
                          .epoch = 1,
                          .timeout_ms = 60000,
                          .max_bytes = group_bytes(c, r->m->hp.dim, r->m->hp.n_vocab),
                          .shm_name = c->procs ? c->shm_name : NULL,
                          .inproc = c->group};
        if (sh_coll_create(SH_COLL_SHM, &o, &r->coll, &r->e))
            return 2;
        co.comm = (sh_llama_comm){sh_coll_rank(r->coll), sh_coll_size(r->coll), r->coll,
                                  sh_coll_allreduce_ud, sh_coll_allgather_ud};
    }
    if (sh_backend_cpu_create(&bo, &r->be, &r->e) ||
        sh_llama_ctx_create(r->m, r->be, &co, &r->ctx, &r->e))
        return 2;
    return 0;
}

/* Nanoseconds this rank has spent inside collective calls so far (0 without a group). */
static uint64_t coll_ns(const bench_rank *r)
{
    sh_coll_stats s = {0};
    if (r->coll)
        sh_coll_stats_get(r->coll, &s);
    return s.wait_ns;
}

/* Keeps the best throughput of a phase and the collective share of that run. */
static void keep_best(double tps, double secs, uint64_t ns, double *best, double *coll)
{
    if (tps > *best) {
        *best = tps;
        *coll = secs > 0 ? (double)ns * 1e-9 / secs : 0;
    }
}

static int cmp_double(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

/* Fills positions [0, ctx_len) of the sequence with block table `blocks`, in chunks. */
static int fill_ctx(bench_rank *r, const int32_t *blocks)
{
    const bench_cfg *c = r->cfg;
    sh_llama_out o;
    int rc = 0;
    for (int p = 0; p < c->ctx_len && !rc; p += c->chunk) {
        const int n = c->ctx_len - p < c->chunk ? c->ctx_len - p : c->chunk;
        sh_llama_seq seq = {c->tokens + p, n, p, blocks, true, 0};
        sh_llama_batch b = {1, &seq, false, NULL, false, false};
        rc = sh_llama_forward(r->ctx, &b, &o, &r->e);
    }
    return rc;
}

static void kc_point(bench_rank *r, int32_t seqs, int32_t rows)
{
    if (r->kc_n < KC_POINTS) {
        r->kc_seqs[r->kc_n] = seqs;
        r->kc_rows[r->kc_n++] = rows;
    }
}

/* The k-row forward cost table (--kcost K): after a ctx_len-token context, the time of one
 * forward pass of n rows of one sequence with logits for all n (a verify step of n - 1 drafts),
 * n = 1..K+1, then 32 and 64 rows, then kseqs sequences of 1 + k rows each (k = 0, 1, 2, 4, ..,
 * K). Every rep times every point once, ascending and descending in turn, so that a change of
 * the machine's load during the run falls on all points alike; the median of the reps is kept. */
static int kcost_run(bench_rank *r)
{
    const bench_cfg *c = r->cfg;
    const int K = c->kcost;
    r->kc_n = 0;
    for (int n = 1; n <= K + 1; n++)
        kc_point(r, 1, n);
    for (int n = 32; n <= 64; n *= 2)
        if (n > K + 1)
            kc_point(r, 1, n);
    if (c->kseqs > 1) {
        kc_point(r, c->kseqs, 1);
        int k = 1;
        for (; k < K; k *= 2)
            kc_point(r, c->kseqs, k + 1);
        kc_point(r, c->kseqs, K + 1);
    }
    const int seqs = c->kseqs > 1 ? c->kseqs : 1;
    int rc = 0;
    for (int s = 0; s < seqs && !rc; s++)
        rc = fill_ctx(r, c->blocks + (size_t)s * (size_t)c->nb);
    double *t = malloc((size_t)r->kc_n * (size_t)c->kreps * sizeof *t);
    sh_llama_seq q[64];
    if (!t)
        return 2;
    for (int rep = -1; rep < c->kreps && !rc; rep++) /* rep -1: a warm-up pass, not kept */
        for (int i = 0; i < r->kc_n && !rc; i++) {
            const int p = rep % 2 ? r->kc_n - 1 - i : i;
            const int32_t ns = r->kc_seqs[p], nr = r->kc_rows[p];
            for (int s = 0; s < ns; s++)
                q[s] = (sh_llama_seq){
                    c->tokens, nr, c->ctx_len, c->blocks + (size_t)s * (size_t)c->nb, true, nr};
            sh_llama_batch b = {ns, q, false, NULL, false, false};
            sh_llama_out o;
            for (int w = 0; w < c->kwarm && !rc; w++) /* as in a run of steps of one size */
                rc = sh_llama_forward(r->ctx, &b, &o, &r->e);
            double t0 = now_s();
            if (!rc)
                rc = sh_llama_forward(r->ctx, &b, &o, &r->e);
            if (rep >= 0)
                t[(size_t)p * (size_t)c->kreps + (size_t)rep] = (now_s() - t0) * 1e6;
        }
    for (int p = 0; p < r->kc_n && !rc; p++) {
        double *v = t + (size_t)p * (size_t)c->kreps;
        qsort(v, (size_t)c->kreps, sizeof *v, cmp_double);
        r->kc_us[p] = c->kreps % 2 ? v[c->kreps / 2] : (v[c->kreps / 2 - 1] + v[c->kreps / 2]) / 2;
    }
    free(t);
    return rc;
}

/* The measured calls: every pp run, the decode context, every tg run, the kcost table. */
static int rank_run(bench_rank *r)
{
    const bench_cfg *c = r->cfg;
    sh_llama_out o;
    int rc = 0;
    for (int k = 0; k < c->n_pp && !rc; k++)
        for (int i = 0; i < c->reps && !rc; i++) {
            sh_llama_seq seq = {c->tokens, c->pp[k], 0, c->blocks, true, 0};
            sh_llama_batch b = {1, &seq, false, NULL, false, false};
            uint64_t w0 = coll_ns(r);
            double t0 = now_s();
            rc = sh_llama_forward(r->ctx, &b, &o, &r->e);
            double dt = now_s() - t0;
            keep_best(c->pp[k] / dt, dt, coll_ns(r) - w0, &r->pp_best[k], &r->pp_coll[k]);
        }
    /* the decode context: filled once; each tg run overwrites the positions after it */
    if (c->n_tg && !rc)
        rc = fill_ctx(r, c->blocks);
    for (int k = 0; k < c->n_tg && !rc; k++)
        for (int i = 0; i < c->reps && !rc; i++) {
            int32_t tok = c->tokens[0];
            uint64_t w0 = coll_ns(r);
            double t0 = now_s();
            for (int j = 0; j < c->tg[k] && !rc; j++) {
                sh_llama_seq seq = {&tok, 1, c->ctx_len + j, c->blocks, true, 0};
                sh_llama_batch b = {1, &seq, false, NULL, false, false};
                rc = sh_llama_forward(r->ctx, &b, &o, &r->e);
                tok =
                    (tok * 31 + 7) % r->m->hp.n_vocab; /* any token: speed does not depend on it */
            }
            double dt = now_s() - t0;
            keep_best(c->tg[k] / dt, dt, coll_ns(r) - w0, &r->tg_best[k], &r->tg_coll[k]);
        }
    if (c->kcost && !rc)
        rc = kcost_run(r);
    return rc;
}

static void *rank_thread(void *arg)
{
    bench_rank *r = arg;
    r->rc = rank_open(r);
    if (!r->rc)
        r->rc = rank_run(r);
    return NULL;
}

static void rank_close(bench_rank *r)
{
    sh_llama_ctx_destroy(r->ctx);
    sh_coll_destroy(r->coll);
    sh_backend_destroy(r->be);
    sh_llama_destroy(r->m);
}

/* Resets this process's peak RSS (VmHWM) to its current RSS: the bandwidth probe's 1 GiB is
 * not the model's. */
static void reset_peak_rss(void)
{
    FILE *f = fopen("/proc/self/clear_refs", "w");
    if (f) {
        fputs("5", f);
        fclose(f);
    }
}

/* A field of /proc/self/status in kB (VmHWM: peak RSS), or -1. */
static long status_kb(const char *field)
{
    FILE *f = fopen("/proc/self/status", "r");
    char line[256];
    long v = -1;
    size_t n = strlen(field);
    while (f && fgets(line, sizeof line, f))
        if (!strncmp(line, field, n) && line[n] == ':')
            v = atol(line + n + 1);
    if (f)
        fclose(f);
    return v;
}

static void print_rss(const bench_cfg *c, int32_t rank)
{
    struct stat st;
    double file_mb = stat(c->path, &st) == 0 ? (double)st.st_size / 1048576.0 : 0;
    printf("{\"name\":\"peak_rss\",\"rank\":%d,\"procs\":%s,\"pid\":%d,\"vm_hwm_mb\":%.1f,"
           "\"vm_rss_mb\":%.1f,\"rss_anon_mb\":%.1f,\"rss_file_mb\":%.1f,\"file_mb\":%.1f}\n",
           c->procs ? (int)rank : -1, c->procs ? "true" : "false", (int)getpid(),
           (double)status_kb("VmHWM") / 1024.0, (double)status_kb("VmRSS") / 1024.0,
           (double)status_kb("RssAnon") / 1024.0, (double)status_kb("RssFile") / 1024.0, file_mb);
    fflush(stdout);
}

int main(int argc, char **argv)
{
    static bench_cfg cfg = {.threads = 2, .reps = 3, .tp = 1};
    bench_cfg *c = &cfg;
    bool probe = true, reps_set = false;
    c->kseqs = 8;
    c->kwarm = 0;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
        if (!strcmp(a, "--no-bw")) {
            probe = false;
            continue;
        }
        if (!strcmp(a, "--procs")) {
            c->procs = true;
            continue;
        }
        if (!v) {
            usage();
            return 2;
        }
        if (!strcmp(a, "-m"))
            c->path = v;
        else if (!strcmp(a, "-t"))
            c->threads = atoi(v);
        else if (!strcmp(a, "--reps")) {
            c->reps = atoi(v);
            reps_set = true;
        } else if (!strcmp(a, "--kcost") && atoi(v) >= 1 && atoi(v) <= 63)
            c->kcost = atoi(v);
        else if (!strcmp(a, "--kseqs") && atoi(v) >= 0 && atoi(v) <= 64)
            c->kseqs = atoi(v);
        else if (!strcmp(a, "--kwarm") && atoi(v) >= 0 && atoi(v) <= 8)
            c->kwarm = atoi(v);
        else if (!strcmp(a, "--pp") && c->n_pp < 8 && atoi(v) >= 1)
            c->pp[c->n_pp++] = atoi(v);
        else if (!strcmp(a, "--tg") && c->n_tg < 8 && atoi(v) >= 1)
            c->tg[c->n_tg++] = atoi(v);
        else if (!strcmp(a, "--ctx") && atoi(v) >= 0)
            c->ctx_len = atoi(v);
        else if (!strcmp(a, "--tp") && atoi(v) >= 1 && atoi(v) <= 16)
            c->tp = atoi(v);
        else if (!strcmp(a, "--kv") && (!strcmp(v, "f16") || !strcmp(v, "f32")))
            c->kv_f16 = !strcmp(v, "f16");
        else {
            usage();
            return 2;
        }
        i++;
    }
    if (!c->path || c->threads < 1 || c->threads > 16 || c->reps < 1 || (c->procs && c->tp < 2)) {
        usage();
        return 2;
    }
    bool ctx_set = false;
    for (int i = 1; i < argc; i++)
        ctx_set |= !strcmp(argv[i], "--ctx");
    if (c->kcost && !ctx_set)
        c->ctx_len = 256;
    c->kreps = c->kcost && !reps_set ? 15 : c->reps;
    if (c->kseqs > 1 && (c->kseqs * (c->kcost + 1) > 1024))
        c->kseqs = 1024 / (c->kcost + 1);
    if (!c->n_pp && !c->n_tg && !c->kcost) {
        c->pp[c->n_pp++] = 128;
        c->pp[c->n_pp++] = 512;
        c->tg[c->n_tg++] = 128;
    }
    int max_pp = 1, max_tg = 1;
    for (int i = 0; i < c->n_pp; i++)
        max_pp = c->pp[i] > max_pp ? c->pp[i] : max_pp;
    for (int i = 0; i < c->n_tg; i++)
        max_tg = c->tg[i] > max_tg ? c->tg[i] : max_tg;
    /* the context for --ctx is filled in chunks of at most 512 tokens */
    c->chunk = max_pp > 512 ? max_pp : 512;
    /* the kcost table's largest pass: 64 rows of one sequence, or kseqs x (K+1) rows */
    int kc_rows = c->kcost ? 64 : 0;
    if (c->kcost && c->kseqs > 1 && c->kseqs * (c->kcost + 1) > kc_rows)
        kc_rows = c->kseqs * (c->kcost + 1);
    c->chunk = kc_rows > c->chunk ? kc_rows : c->chunk;
    int after = max_tg > (c->kcost ? 64 : 0) ? max_tg : (c->kcost ? 64 : 0);
    c->kv = (max_pp > c->ctx_len ? max_pp : c->ctx_len) + after + 16;

    /* The probe first, before any rank exists (its 1 GiB is then not in any rank's peak RSS). */
    double bw_one = 0, bw_eight = 0;
    double read_gbs = probe ? read_bandwidth(c->threads, &bw_one, &bw_eight) : 0;
    reset_peak_rss();
    /* --procs: rank k > 0 is a child forked before anything is loaded; each process runs its
     * rank as "rank 0" of this code below (me is its rank). */
    static bench_rank ranks[16];
    int32_t me = 0;
    pid_t kids[16] = {0};
    if (c->procs) {
        snprintf(c->shm_name, sizeof c->shm_name, "/shoal-bench-%d", (int)getpid());
        fflush(stdout);
        for (int32_t k = 1; k < c->tp; k++) {
            pid_t pid = fork();
            if (pid < 0) {
                perror("fork");
                return 2;
            }
            if (pid == 0) {
                me = k;
                reset_peak_rss();
                break;
            }
            kids[k] = pid;
        }
    }
    sh_error e = {0};
    bench_rank *r0 = &ranks[me];
    *r0 = (bench_rank){.cfg = c, .rank = me};
    sh_llama_load_opts lo = {.prefault = true, .tp_rank = me, .tp_size = c->tp};
    if (sh_llama_load(c->path, &lo, &r0->m, &e)) {
        fprintf(stderr, "error: rank %d: %s\n", (int)me, e.msg);
        return 2;
    }
    const sh_llama *m = r0->m;
    c->nb = (c->kv + SH_KV_BLOCK_TOKENS - 1) / SH_KV_BLOCK_TOKENS;
    int32_t n_blocks = c->nb * (c->kseqs > 1 ? c->kseqs : 1);
    c->blocks = malloc((size_t)n_blocks * sizeof *c->blocks);
    int n_tokens = max_pp > c->ctx_len ? max_pp : c->ctx_len;
    n_tokens = n_tokens > 64 ? n_tokens : 64;
    c->tokens = malloc((size_t)n_tokens * sizeof *c->tokens);
    for (int32_t i = 0; i < n_blocks; i++)
        c->blocks[i] = i;
    uint32_t s = 12345;
    for (int i = 0; i < n_tokens; i++) {
        s = s * 1664525u + 1013904223u;
        c->tokens[i] = (int32_t)(s % (uint32_t)m->hp.n_vocab);
    }
    const char *name = strrchr(c->path, '/') ? strrchr(c->path, '/') + 1 : c->path;
    /* rank 0's share of the weights (the whole model without --tp) */
    double weight_gb = (double)sh_llama_weight_bytes(m) / 1e9;
    /* A decode step reads every weight once except a MoE layer's experts, of which a token uses
     * n_expert_used of n_expert (equal sizes): step_gb is what one step reads. */
    double step_gb = weight_gb;
    for (int32_t l = 0; l < m->hp.n_layers && m->hp.n_expert > 0; l++) {
        const sh_tensor *xs[] = {&m->layers[l].gate_exps, &m->layers[l].up_exps,
                                 &m->layers[l].down_exps};
        for (int i = 0; i < 3; i++)
            if (xs[i]->data)
                step_gb -= (double)sh__dtype_row_bytes(xs[i]->type, (uint64_t)xs[i]->ne[0]) *
                           (double)xs[i]->ne[1] * (double)xs[i]->ne[2] / 1e9 *
                           (1.0 - (double)m->hp.n_expert_used / m->hp.n_expert);
    }
    if (c->tp > 1 && !c->procs &&
        sh_coll_inproc_create(c->tp, group_bytes(c, m->hp.dim, m->hp.n_vocab), &c->group, &e)) {
        fprintf(stderr, "error: %s\n", e.msg);
        return 2;
    }
    pthread_t th[16];
    for (int32_t k = 1; k < c->tp && !c->procs; k++) {
        ranks[k] = (bench_rank){.cfg = c, .rank = k};
        pthread_create(&th[k], NULL, rank_thread, &ranks[k]);
    }
    r0->rc = rank_open(r0);
    if (me > 0) { /* a rank process: run, say its peak RSS, leave */
        if (!r0->rc)
            r0->rc = rank_run(r0);
        if (r0->rc)
            fprintf(stderr, "error: rank %d: %s\n", (int)me, r0->e.msg);
        else
            print_rss(c, me);
        rank_close(r0);
        free(c->tokens);
        free(c->blocks);
        _exit(r0->rc ? 1 : 0);
    }
    if (!r0->rc) {
        char kern[160];
        sh_backend_cpu_describe(r0->be, kern, sizeof kern);
        printf("{\"name\":\"kernels\",\"value\":\"%s\",\"kv\":\"%s\",\"tp\":%d}\n", kern,
               c->kv_f16 ? "f16" : "f32", c->tp);
        printf("{\"name\":\"read_bandwidth\",\"value\":%.2f,\"unit\":\"GB/s\",\"threads\":%d,"
               "\"one_stream\":%.2f,\"eight_streams\":%.2f}\n",
               read_gbs, c->threads, bw_one, bw_eight);
        fflush(stdout);
        r0->rc = rank_run(r0);
    }
    int rc = 0;
    for (int32_t k = 1; k < c->tp; k++) {
        if (!c->procs) {
            pthread_join(th[k], NULL);
            continue;
        }
        int st = 0;
        if (waitpid(kids[k], &st, 0) != kids[k] || !WIFEXITED(st) || WEXITSTATUS(st)) {
            fprintf(stderr, "error: rank %d's process failed\n", (int)k);
            rc = 1;
        }
    }
    for (int32_t k = 0; k < c->tp; k++)
        if (ranks[k].rc) {
            fprintf(stderr, "error: rank %d: %s\n", (int)k, ranks[k].e.msg);
            rc = 1;
        }
    if (!rc)
        print_rss(c, 0);
    for (int k = 0; k < c->n_pp && !rc; k++)
        printf("{\"name\":\"pp%d\",\"model\":\"%s\",\"value\":%.1f,\"unit\":\"tok/s\","
               "\"threads\":%d,\"tp\":%d,\"reps\":%d,\"coll_fraction\":%.3f}\n",
               c->pp[k], name, r0->pp_best[k], c->threads, c->tp, c->reps, r0->pp_coll[k]);
    for (int k = 0; k < c->n_tg && !rc; k++) {
        double gbs = step_gb * r0->tg_best[k];
        printf("{\"name\":\"tg%d\",\"model\":\"%s\",\"value\":%.1f,\"unit\":\"tok/s\","
               "\"ctx\":%d,\"threads\":%d,\"tp\":%d,\"reps\":%d,\"weight_gb\":%.4f,\"step_gb\":"
               "%.4f,\"decode_gbs\":%.2f,\"read_fraction\":%.3f,\"coll_fraction\":%.3f}\n",
               c->tg[k], name, r0->tg_best[k], c->ctx_len, c->threads, c->tp, c->reps, weight_gb,
               step_gb, gbs, read_gbs > 0 ? gbs / read_gbs : 0, r0->tg_coll[k]);
    }
    for (int p = 0; p < r0->kc_n && !rc; p++) {
        /* the ratio is to the same number of sequences with one row each */
        double base = 0;
        for (int q = 0; q < r0->kc_n; q++)
            if (r0->kc_seqs[q] == r0->kc_seqs[p] && r0->kc_rows[q] == 1)
                base = r0->kc_us[q];
        printf("{\"name\":\"kcost\",\"model\":\"%s\",\"isa\":\"%s\",\"threads\":%d,"
               "\"tp\":%d,\"kv\":\"%s\",\"ctx\":%d,\"seqs\":%d,\"rows_per_seq\":%d,"
               "\"rows\":%d,\"us\":%.1f,\"ratio\":%.3f,\"reps\":%d}\n",
               name, sh_backend_cpu_isa_name(sh_backend_cpu_isa(r0->be)), c->threads, c->tp,
               c->kv_f16 ? "f16" : "f32", c->ctx_len, r0->kc_seqs[p], r0->kc_rows[p],
               r0->kc_seqs[p] * r0->kc_rows[p], r0->kc_us[p], base > 0 ? r0->kc_us[p] / base : 0,
               c->kreps);
    }
    for (int32_t k = 0; k < (c->procs ? 1 : c->tp); k++)
        rank_close(&ranks[k]);
    sh_coll_inproc_destroy(c->group);
    free(c->tokens);
    free(c->blocks);
    return rc;
}
