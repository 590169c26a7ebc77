/* Whole-model-shape benchmark of the CPU backend: the matmuls of one decode token (and of a
 * 512-token prefill) of the smollm2-135m and tinyllama-1.1b shapes, on synthetic random weights
 * in memory, next to the read bandwidth measured in the same run. One JSON object per line.
 * Usage: bench_model_shapes [--threads N] [--model smollm2|tinyllama] [--type Q4_0|...]
 *        [--tokens N] [--pp N] [--no-prepare] [--no-pp] */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "kernels/backend.h"
#include "kernels/cpu/cpu.h"
#include "kernels/cpu/quant.h"

typedef struct model_shape {
    const char *name;
    int64_t dim, ffn, layers, heads, kv_heads, vocab;
    /* llama.cpp at 2 threads on this machine type (ANCHORS.md), for the ratio columns:
     * tg128 and pp512 tok/s for Q4_0, Q4_1, Q8_0, F16. */
    double tg[4], pp[4];
} model_shape;

static const model_shape models[] = {
    {"smollm2-135m", 576, 1536, 30, 9, 3, 49152, {163, 120, 111, 91}, {1084, 355, 719, 781}},
    {"tinyllama-1.1b", 2048, 5632, 22, 32, 4, 32000, {44.4, 28.5, 25.6, 10.8}, {189, 43, 103, 127}},
};
static const sh_dtype types[] = {SH_DTYPE_Q4_0, SH_DTYPE_Q4_1, SH_DTYPE_Q8_0, SH_DTYPE_F16};

static double now(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

static int cmp_d(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

static uint64_t rng = 0x9e3779b97f4a7c15ull;
static float frand(void)
{
    rng ^= rng << 13;
    rng ^= rng >> 7;
    rng ^= rng << 17;
    return (float)(rng >> 40) / 16777216.0f * 2.0f - 1.0f;
}

/* ---- read bandwidth (same method as bench_kernels' bw_read) ------------------------------ */

typedef struct rd_job {
    sh__cpu_pool *pool;
    const float *a;
    int64_t n;
    float sums[64];
} rd_job;

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
__attribute__((target("avx2"))) static float sum_range(const float *a, int64_t lo, int64_t hi)
{
    __m256 s[8];
    for (int i = 0; i < 8; i++)
        s[i] = _mm256_setzero_ps();
    int64_t i = lo;
    for (; i + 64 <= hi; i += 64)
        for (int j = 0; j < 8; j++)
            s[j] = _mm256_add_ps(s[j], _mm256_loadu_ps(a + i + 8 * j));
    for (int j = 1; j < 8; j++)
        s[0] = _mm256_add_ps(s[0], s[j]);
    float f[8], r = 0;
    _mm256_storeu_ps(f, s[0]);
    for (int k = 0; k < 8; k++)
        r += f[k];
    for (; i < hi; i++)
        r += a[i];
    return r;
}
#else
static float sum_range(const float *a, int64_t lo, int64_t hi)
{
    float r = 0;
    for (int64_t i = lo; i < hi; i++)
        r += a[i];
    return r;
}
#endif

static void rd_run(void *arg, int tid, int nth)
{
    rd_job *j = arg;
    int64_t lo, hi;
    const int64_t units = j->n / 1024, per = sh__cpu_pool_chunk(j->pool, units, 8);
    while (sh__cpu_pool_claim(j->pool, 0, units, per, &lo, &hi))
        j->sums[tid] += sum_range(j->a, lo * 1024, hi * 1024);
    (void)nth;
}

static double read_bw(int threads)
{
    const int64_t n = (int64_t)256 << 20 >> 2; /* 256 MiB */
    float *a = malloc((size_t)n * sizeof(float));
    for (int64_t i = 0; i < n; i++)
        a[i] = (float)(i & 7);
    sh__cpu_pool *pool;
    if (sh__cpu_pool_create(threads, NULL, &pool, NULL)) {
        free(a);
        return 0;
    }
    rd_job j = {.pool = pool, .a = a, .n = n};
    double t[5];
    sh__cpu_pool_run(pool, rd_run, &j);
    for (int r = 0; r < 5; r++) {
        double t0 = now();
        sh__cpu_pool_run(pool, rd_run, &j);
        t[r] = now() - t0;
    }
    sh__cpu_pool_destroy(pool);
    free(a);
    qsort(t, 5, sizeof t[0], cmp_d);
    return (double)n * sizeof(float) / t[2] / 1e9;
}

/* ---- the model ---------------------------------------------------------------------------- */

enum { WQ, WK, WV, WO, WG, WU, WD, NW };

typedef struct layer {
    sh_tensor w[NW];
} layer;

typedef struct sim {
    const model_shape *m;
    sh_dtype type;
    layer *layers;
    sh_tensor out;
    void **blobs;
    int n_blobs;
    size_t bytes_per_token;
    float *norm;
} sim;

static sh_tensor make_w(sim *s, int64_t n_out, int64_t n_in, void *data)
{
    sh_tensor t = {s->type, {n_in, n_out, 1, 1}, data};
    return t;
}

/* One layer's weights are random; the other layers are copies in their own memory, so a token
 * streams every byte from DRAM as a real model does. */
static int sim_build(sim *s, const model_shape *m, sh_dtype type)
{
    memset(s, 0, sizeof *s);
    s->m = m;
    s->type = type;
    const int64_t hd = m->dim / m->heads, kvd = hd * m->kv_heads;
    const int64_t rows[NW] = {m->dim, kvd, kvd, m->dim, m->ffn, m->ffn, m->dim};
    const int64_t cols[NW] = {m->dim, m->dim, m->dim, m->dim, m->dim, m->dim, m->ffn};
    size_t off[NW + 1] = {0};
    for (int i = 0; i < NW; i++)
        off[i + 1] =
            off[i] +
            ((sh__dtype_row_bytes(type, (uint64_t)cols[i]) * (size_t)rows[i] + 63) & ~(size_t)63);
    s->layers = calloc((size_t)m->layers, sizeof *s->layers);
    s->blobs = calloc((size_t)m->layers + 1, sizeof *s->blobs);
    float *row = malloc((size_t)m->ffn * sizeof(float));
    for (int64_t l = 0; l < m->layers; l++) {
        uint8_t *blob = aligned_alloc(64, off[NW]);
        if (!blob)
            return -1;
        s->blobs[s->n_blobs++] = blob;
        if (l == 0) {
            for (int i = 0; i < NW; i++) {
                const size_t rb = sh__dtype_row_bytes(type, (uint64_t)cols[i]);
                for (int64_t r = 0; r < rows[i]; r++) {
                    for (int64_t k = 0; k < cols[i]; k++)
                        row[k] = 0.02f * frand();
                    sh__quant_row(type, row, blob + off[i] + (size_t)r * rb, cols[i]);
                }
            }
        } else {
            memcpy(blob, s->blobs[0], off[NW]);
        }
        for (int i = 0; i < NW; i++)
            s->layers[l].w[i] = make_w(s, rows[i], cols[i], blob + off[i]);
    }
    const size_t rb = sh__dtype_row_bytes(type, (uint64_t)m->dim);
    uint8_t *out = aligned_alloc(64, (rb * (size_t)m->vocab + 63) & ~(size_t)63);
    if (!out)
        return -1;
    s->blobs[s->n_blobs++] = out;
    for (int64_t r = 0; r < m->vocab; r++) {
        for (int64_t k = 0; k < m->dim; k++)
            row[k] = 0.02f * frand();
        sh__quant_row(type, row, out + (size_t)r * rb, m->dim);
    }
    s->out = make_w(s, m->vocab, m->dim, out);
    free(row);
    s->bytes_per_token = off[NW] * (size_t)m->layers + rb * (size_t)m->vocab;
    s->norm = malloc((size_t)m->ffn * sizeof(float));
    for (int64_t i = 0; i < m->ffn; i++)
        s->norm[i] = 1.0f + 0.1f * frand();
    return 0;
}

static void sim_free(sim *s)
{
    for (int i = 0; i < s->n_blobs; i++)
        free(s->blobs[i]);
    free(s->blobs);
    free(s->layers);
    free(s->norm);
}

static void sim_prepare(sim *s, sh_backend *be, int release)
{
    for (int64_t l = 0; l < s->m->layers; l++)
        for (int i = 0; i < NW; i++)
            if (release)
                sh_backend_weight_release(be, s->layers[l].w[i].data);
            else
                sh_backend_weight_prepare(be, &s->layers[l].w[i]);
    if (release)
        sh_backend_weight_release(be, s->out.data);
    else
        sh_backend_weight_prepare(be, &s->out);
}

/* Activations of one step of n_tok tokens. */
typedef struct acts {
    float *x, *q, *k, *v, *att, *h, *logits;
} acts;

/* Enqueues the matmuls of one forward step in the order the forward pass issues them (the
 * attention itself is not simulated: its output is the previous attention buffer). Logits for
 * the last token only, as a prefill does. */
static void sim_step(const sim *s, sh_backend *be, sh_backend_stream *st, const acts *a,
                     int64_t n_tok)
{
    const model_shape *m = s->m;
    for (int64_t l = 0; l < m->layers; l++) {
        const layer *L = &s->layers[l];
        sh_backend_norm_qkv(be, st, a->x, s->norm, 1e-5f, n_tok, &L->w[WQ], &L->w[WK], &L->w[WV],
                            a->q, a->k, a->v);
        sh_backend_matmul_add(be, st, &L->w[WO], a->att, n_tok, a->x);
        sh_backend_norm_ffn_up(be, st, a->x, s->norm, 1e-5f, n_tok, &L->w[WG], &L->w[WU], a->h);
        sh_backend_matmul_add(be, st, &L->w[WD], a->h, n_tok, a->x);
    }
    sh_matmul_args o = {.x = a->x + (n_tok - 1) * m->dim,
                        .n_tok = 1,
                        .norm = s->norm,
                        .norm_eps = 1e-5f,
                        .n_w = 1,
                        .w = {s->out},
                        .y = {a->logits}};
    sh_backend_matmul_ex(be, st, &o);
}

static void acts_init(acts *a, const model_shape *m, int64_t n_tok)
{
    const int64_t kvd = m->dim / m->heads * m->kv_heads;
    a->x = malloc((size_t)(n_tok * m->dim) * sizeof(float));
    a->q = malloc((size_t)(n_tok * m->dim) * sizeof(float));
    a->att = malloc((size_t)(n_tok * m->dim) * sizeof(float));
    a->k = malloc((size_t)(n_tok * kvd) * sizeof(float));
    a->v = malloc((size_t)(n_tok * kvd) * sizeof(float));
    a->h = malloc((size_t)(n_tok * m->ffn) * sizeof(float));
    a->logits = malloc((size_t)m->vocab * sizeof(float));
    for (int64_t i = 0; i < n_tok * m->dim; i++)
        a->x[i] = a->att[i] = frand();
}

static void acts_fini(acts *a)
{
    free(a->x);
    free(a->q);
    free(a->att);
    free(a->k);
    free(a->v);
    free(a->h);
    free(a->logits);
}

/* The residual stream grows with every step; keep it bounded so the timing never meets
 * denormals or infinities. */
static void acts_reset(acts *a, const model_shape *m, int64_t n_tok)
{
    for (int64_t i = 0; i < n_tok * m->dim; i++)
        a->x[i] = 0.01f * (float)((i * 7919) % 201 - 100);
}

int main(int argc, char **argv)
{
    int threads = 2, tokens = 20, pp = 512, prepare = 1, do_pp = 1;
    const char *only_model = NULL, *only_type = NULL;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--threads") && i + 1 < argc)
            threads = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--model") && i + 1 < argc)
            only_model = argv[++i];
        else if (!strcmp(argv[i], "--type") && i + 1 < argc)
            only_type = argv[++i];
        else if (!strcmp(argv[i], "--tokens") && i + 1 < argc)
            tokens = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--pp") && i + 1 < argc)
            pp = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--no-prepare"))
            prepare = 0;
        else if (!strcmp(argv[i], "--no-pp"))
            do_pp = 0;
        else {
            fprintf(
                stderr,
                "usage: %s [--threads N] [--model smollm2|tinyllama] [--type Q4_0|Q4_1|Q8_0|F16]"
                " [--tokens N] [--pp N] [--no-prepare] [--no-pp]\n",
                argv[0]);
            return 2;
        }
    }
    if (tokens < 3 || tokens > 1000 || pp < 1 || threads < 1)
        return 2;
    const double bw = read_bw(threads);
    printf("{\"name\":\"bw_read\",\"value\":%.2f,\"unit\":\"GB/s\",\"threads\":%d}\n", bw, threads);
    fflush(stdout);
    sh_backend *be;
    sh_backend_stream *st;
    sh_backend_cpu_opts o = {.n_threads = threads};
    sh_error e = {0};
    if (sh_backend_cpu_create(&o, &be, &e) || sh_backend_stream_create(be, &st, &e)) {
        fprintf(stderr, "bench_model_shapes: %s\n", e.msg);
        return 1;
    }
    for (size_t mi = 0; mi < sizeof models / sizeof models[0]; mi++) {
        const model_shape *m = &models[mi];
        if (only_model && !strstr(m->name, only_model))
            continue;
        for (size_t ti = 0; ti < sizeof types / sizeof types[0]; ti++) {
            if (only_type && strcmp(only_type, sh__dtype_name(types[ti])))
                continue;
            sim s;
            if (sim_build(&s, m, types[ti])) {
                fprintf(stderr, "bench_model_shapes: out of memory\n");
                return 1;
            }
            if (prepare)
                sim_prepare(&s, be, 0);
            acts a;
            acts_init(&a, m, pp > 1 ? pp : 1);
            double *t = malloc((size_t)tokens * sizeof(double));
            for (int r = -2; r < tokens; r++) {
                acts_reset(&a, m, 1);
                double t0 = now();
                sim_step(&s, be, st, &a, 1);
                sh_backend_sync(be, st);
                if (r >= 0)
                    t[r] = now() - t0;
            }
            qsort(t, (size_t)tokens, sizeof t[0], cmp_d);
            const double sec = t[tokens / 2], gbs = (double)s.bytes_per_token / sec / 1e9;
            printf("{\"name\":\"decode\",\"value\":%.1f,\"unit\":\"tok/s\",\"model\":\"%s\","
                   "\"type\":\"%s\",\"threads\":%d,\"ms_per_tok\":%.3f,\"min_ms\":%.3f,"
                   "\"weight_mb\":%.1f,\"gbs\":%.2f,\"of_read_bw\":%.2f,\"vs_llama_tg128\":%.2f,"
                   "\"prepared\":%d}\n",
                   1.0 / sec, m->name, sh__dtype_name(types[ti]), threads, sec * 1e3, t[0] * 1e3,
                   (double)s.bytes_per_token / 1e6, gbs, gbs / bw, 1.0 / sec / m->tg[ti], prepare);
            fflush(stdout);
            if (do_pp) {
                acts_reset(&a, m, pp);
                double t0 = now();
                sim_step(&s, be, st, &a, pp);
                sh_backend_sync(be, st);
                const double pps = (double)pp / (now() - t0);
                printf("{\"name\":\"prefill\",\"value\":%.1f,\"unit\":\"tok/s\",\"model\":\"%s\","
                       "\"type\":\"%s\",\"threads\":%d,\"n_tok\":%d,\"vs_llama_pp512\":%.2f,"
                       "\"prepared\":%d}\n",
                       pps, m->name, sh__dtype_name(types[ti]), threads, pp, pps / m->pp[ti],
                       prepare);
                fflush(stdout);
            }
            free(t);
            acts_fini(&a);
            if (prepare)
                sim_prepare(&s, be, 1);
            sim_free(&s);
        }
    }
    sh_backend_stream_destroy(be, st);
    sh_backend_destroy(be);
    return 0;
}
