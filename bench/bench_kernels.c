/* Benchmark of the CPU backend: memory bandwidth ceilings, decode matvec bandwidth and prefill
 * matmul throughput and the per-op overhead of the queue and pool, one JSON object per line.
 * Usage: bench_kernels [--quick] [--bw-mib N] [--only bw|op|attn|mv|pp] [--layout file|packed|both]
 * [--threads N] (default: 1 then 2) [--isa N] (SH_BACKEND_CPU_ISA_*; default the best)
 * [--types "Q4_K Q6_K ..."] (the matvec/matmul weight types; default Q4_0 Q4_1 Q8_0 F16)
 * (packed: quantized weights prepared with sh_backend_weight_prepare). */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "kernels/backend.h"
#include "kernels/cpu/cpu.h"
#include "kernels/cpu/quant.h"

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#define TGT __attribute__((target("avx2,fma")))
#else
#define TGT
#endif

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

static double median(double *v, int n)
{
    qsort(v, (size_t)n, sizeof *v, cmp_d);
    return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

/* ---- memory bandwidth (the pool's threads, static split) --------------------------------- */

typedef struct bw_job {
    sh__cpu_pool *pool;
    float *a, *b, *c;
    int64_t n;
    int kind; /* 0 copy b = a, 1 triad a = b + s c, 2 read-only sum of a */
    double sums[64];
} bw_job;

/* Eight independent accumulators so the reduction is bound by loads, not by add latency. */
TGT static double sum_range(const float *a, int64_t lo, int64_t hi)
{
#if defined(__x86_64__) && defined(__GNUC__)
    __m256 s[8];
    for (int i = 0; i < 8; i++)
        s[i] = _mm256_setzero_ps();
    int64_t i = lo;
    for (; i + 64 <= hi; i += 64)
        for (int j = 0; j < 8; j++)
            s[j] = _mm256_add_ps(s[j], _mm256_loadu_ps(a + i + 8 * j));
    __m256 t = _mm256_add_ps(_mm256_add_ps(_mm256_add_ps(s[0], s[1]), _mm256_add_ps(s[2], s[3])),
                             _mm256_add_ps(_mm256_add_ps(s[4], s[5]), _mm256_add_ps(s[6], s[7])));
    float f[8];
    _mm256_storeu_ps(f, t);
    double r = 0;
    for (int k = 0; k < 8; k++)
        r += f[k];
    for (; i < hi; i++)
        r += a[i];
    return r;
#else
    double r = 0;
    for (int64_t i = lo; i < hi; i++)
        r += a[i];
    return r;
#endif
}

TGT static void triad_range(float *a, const float *b, const float *c, int64_t lo, int64_t hi)
{
    for (int64_t i = lo; i < hi; i++)
        a[i] = b[i] + 3.0f * c[i];
}

static void bw_run(void *arg, int tid, int nth)
{
    bw_job *j = arg;
    int64_t lo, hi;
    /* chunks of 1024 floats from the pool's counter, as the kernels share work */
    const int64_t units = j->n / 1024;
    const int64_t per = sh__cpu_pool_chunk(j->pool, units, 8);
    while (sh__cpu_pool_claim(j->pool, 0, units, per, &lo, &hi)) {
        lo *= 1024;
        hi *= 1024;
        if (j->kind == 0)
            memcpy(j->b + lo, j->a + lo, (size_t)(hi - lo) * sizeof(float));
        else if (j->kind == 1)
            triad_range(j->a, j->b, j->c, lo, hi);
        else
            j->sums[tid] += sum_range(j->a, lo, hi);
    }
    (void)nth;
}

static void bench_bw(int64_t mib, int reps)
{
    const int64_t n = mib * 1024 * 1024 / (int64_t)sizeof(float);
    float *a = malloc((size_t)n * sizeof(float)), *b = malloc((size_t)n * sizeof(float));
    float *c = malloc((size_t)n * sizeof(float));
    if (!a || !b || !c) {
        fprintf(stderr, "bench_bw: out of memory for %lld MiB arrays\n", (long long)mib);
        free(a);
        free(b);
        free(c);
        return;
    }
    for (int64_t i = 0; i < n; i++)
        a[i] = b[i] = c[i] = (float)(i & 255);
    static const char *names[3] = {"bw_copy", "bw_triad", "bw_read"};
    static const double bytes_per[3] = {2, 3, 1}; /* arrays touched (read + written) */
    for (int threads = 1; threads <= 2; threads++) {
        sh__cpu_pool *pool;
        if (sh__cpu_pool_create(threads, NULL, &pool, NULL))
            break;
        for (int kind = 0; kind < 3; kind++) {
            bw_job j = {.pool = pool, .a = a, .b = b, .c = c, .n = n, .kind = kind};
            double t[16];
            sh__cpu_pool_run(pool, bw_run, &j); /* warm-up */
            for (int r = 0; r < reps; r++) {
                double t0 = now();
                sh__cpu_pool_run(pool, bw_run, &j);
                t[r] = now() - t0;
            }
            double gbs = bytes_per[kind] * (double)n * sizeof(float) / median(t, reps) / 1e9;
            printf("{\"name\":\"%s\",\"value\":%.2f,\"unit\":\"GB/s\",\"threads\":%d,"
                   "\"array_mib\":%lld}\n",
                   names[kind], gbs, threads, (long long)mib);
            fflush(stdout);
        }
        sh__cpu_pool_destroy(pool);
    }
    free(a);
    free(b);
    free(c);
}

/* ---- matmul ------------------------------------------------------------------------------- */

typedef struct shape {
    const char *model;
    int64_t n_out, n_in;
} shape;

static const shape shapes[] = {
    {"smollm2-135m", 576, 576},     {"smollm2-135m", 1536, 576},    {"smollm2-135m", 576, 1536},
    {"smollm2-135m", 49152, 576},   {"tinyllama-1.1b", 2048, 2048}, {"tinyllama-1.1b", 5632, 2048},
    {"tinyllama-1.1b", 2048, 5632},
};
/* The weight types of the matvec/matmul sweeps (--types replaces them). */
static sh_dtype mtypes[16] = {SH_DTYPE_Q4_0, SH_DTYPE_Q4_1, SH_DTYPE_Q8_0, SH_DTYPE_F16};
static size_t n_mtypes = 4;

static uint64_t rng = 88172645463325252ull;
static float frand(void)
{
    rng ^= rng << 13;
    rng ^= rng >> 7;
    rng ^= rng << 17;
    return (float)(rng >> 40) / 16777216.0f * 2.0f - 1.0f;
}

/* `copies` copies of a random weight, so a sweep over them streams from DRAM, not the cache. */
static void **make_weights(sh_dtype type, const shape *s, int copies, size_t *bytes)
{
    const size_t rb = sh__dtype_row_bytes(type, (uint64_t)s->n_in);
    *bytes = rb * (size_t)s->n_out;
    void **w = calloc((size_t)copies, sizeof *w);
    float *row = malloc((size_t)s->n_in * sizeof(float));
    for (int c = 0; c < copies; c++) {
        w[c] = malloc(*bytes);
        if (c > 0) {
            memcpy(w[c], w[0], *bytes);
            continue;
        }
        for (int64_t r = 0; r < s->n_out; r++) {
            for (int64_t k = 0; k < s->n_in; k++)
                row[k] = 0.02f * frand();
            sh__quant_row(type, row, (uint8_t *)w[c] + (size_t)r * rb, s->n_in);
        }
    }
    free(row);
    return w;
}

static void bench_mm(sh_backend *be, sh_backend_stream *st, int threads, int64_t n_tok,
                     double budget_s, int quick, int packed)
{
    for (size_t si = 0; si < sizeof shapes / sizeof shapes[0]; si++)
        for (size_t ti = 0; ti < n_mtypes; ti++) {
            const shape *s = &shapes[si];
            if (s->n_in % sh__dtype_info(mtypes[ti])->block_elems)
                continue; /* rows of whole blocks only (576 is no K-quant row) */
            if (n_tok > 1 && s->n_out == 49152)
                continue; /* the logits matmul runs once per step, not per prefill token */
            size_t bytes;
            /* enough copies for ~384 MB of weights: well past the last-level cache */
            size_t one = sh__dtype_row_bytes(mtypes[ti], (uint64_t)s->n_in) * (size_t)s->n_out;
            int copies = n_tok == 1 ? (int)((384u << 20) / one + 1) : 1;
            if (copies > 64)
                copies = 64;
            void **w = make_weights(mtypes[ti], s, copies, &bytes);
            float *x = malloc((size_t)(n_tok * s->n_in) * sizeof(float));
            float *y = malloc((size_t)(n_tok * s->n_out) * sizeof(float));
            for (int64_t i = 0; i < n_tok * s->n_in; i++)
                x[i] = frand();
            sh_tensor t = {mtypes[ti], {s->n_in, s->n_out, 1, 1}, NULL};
            for (int c = 0; packed && c < copies; c++) {
                t.data = w[c];
                sh_backend_weight_prepare(be, &t);
            }
            /* warm-up sweep, then timed sweeps until the budget is spent */
            for (int c = 0; c < copies; c++) {
                t.data = w[c];
                sh_backend_matmul(be, st, &t, x, n_tok, y);
            }
            sh_backend_sync(be, st);
            double times[64];
            int reps = 0;
            double t_start = now();
            while (reps < (quick ? 3 : 9) && (reps < 3 || now() - t_start < budget_s)) {
                double t0 = now();
                for (int c = 0; c < copies; c++) {
                    t.data = w[c];
                    sh_backend_matmul(be, st, &t, x, n_tok, y);
                }
                sh_backend_sync(be, st);
                times[reps++] = (now() - t0) / copies;
            }
            double sec = median(times, reps);
            if (n_tok == 1)
                printf("{\"name\":\"matvec\",\"value\":%.2f,\"unit\":\"GB/s\",\"model\":\"%s\","
                       "\"n_out\":%lld,\"n_in\":%lld,\"type\":\"%s\",\"threads\":%d,"
                       "\"us\":%.1f,\"layout\":\"%s\"}\n",
                       (double)bytes / sec / 1e9, s->model, (long long)s->n_out, (long long)s->n_in,
                       sh__dtype_name(mtypes[ti]), threads, sec * 1e6, packed ? "packed" : "file");
            else
                printf("{\"name\":\"matmul\",\"value\":%.1f,\"unit\":\"GFLOP/s\",\"model\":\"%s\","
                       "\"n_out\":%lld,\"n_in\":%lld,\"n_tok\":%lld,\"type\":\"%s\","
                       "\"threads\":%d,\"ms\":%.3f,\"layout\":\"%s\"}\n",
                       2.0 * (double)s->n_out * (double)s->n_in * (double)n_tok / sec / 1e9,
                       s->model, (long long)s->n_out, (long long)s->n_in, (long long)n_tok,
                       sh__dtype_name(mtypes[ti]), threads, sec * 1e3, packed ? "packed" : "file");
            fflush(stdout);
            for (int c = 0; c < copies; c++) {
                sh_backend_weight_release(be, w[c]);
                free(w[c]);
            }
            free(w);
            free(x);
            free(y);
        }
}

/* Per-op overhead: ops that do almost nothing (an add of 16 floats; a 64x64 Q8_0 matvec with
 * its activation quantization, prepared), issued back to back and synced once as a decode step
 * issues them (the queue hand-off per op), and the round trip of one op enqueued and synced at
 * a time (queue hand-off, leader wake-up, completion signal to the host). */
static void bench_op_overhead(sh_backend *be, sh_backend_stream *st, int threads)
{
    enum { OPS = 2000 };
    float a[64], b[64], y[64];
    for (int i = 0; i < 64; i++)
        a[i] = b[i] = (float)i;
    const shape tiny = {"tiny", 64, 64};
    size_t bytes;
    void **w = make_weights(SH_DTYPE_Q8_0, &tiny, 1, &bytes);
    sh_tensor t = {SH_DTYPE_Q8_0, {64, 64, 1, 1}, w[0]};
    sh_backend_weight_prepare(be, &t);
    for (int kind = 0; kind < 2; kind++) {
        double times[9];
        for (int r = 0; r < 9; r++) {
            double t0 = now();
            for (int i = 0; i < OPS; i++) {
                if (kind == 0)
                    sh_backend_add(be, st, a, b, 16, y);
                else
                    sh_backend_matmul(be, st, &t, a, 1, y);
            }
            sh_backend_sync(be, st);
            times[r] = (now() - t0) / OPS;
        }
        printf("{\"name\":\"%s\",\"value\":%.0f,\"unit\":\"ns/op\",\"threads\":%d}\n",
               kind == 0 ? "op_overhead_add16" : "op_overhead_matvec64", median(times, 9) * 1e9,
               threads);
        fflush(stdout);
    }
    /* Round trip: one tiny op enqueued and synced at a time (the host waits for each). */
    double times[9];
    for (int r = 0; r < 9; r++) {
        double t0 = now();
        for (int i = 0; i < OPS / 4; i++) {
            sh_backend_add(be, st, a, b, 16, y);
            sh_backend_sync(be, st);
        }
        times[r] = (now() - t0) / (OPS / 4);
    }
    printf("{\"name\":\"op_roundtrip_add16\",\"value\":%.0f,\"unit\":\"ns/op\",\"threads\":%d}\n",
           median(times, 9) * 1e9, threads);
    fflush(stdout);
    sh_backend_weight_release(be, w[0]);
    free(w[0]);
    free(w);
}

/* Attention at context lengths 512, 4096 and 16384: a 512-row prefill chunk ending at the
 * context (the last chunk of a chunked prefill; at 512 the whole prompt) and one decode row at
 * its last position, smollm2-135m and tinyllama-1.1b heads (9/3 and 32/4, head_dim 64; at 16k
 * smollm2's only), F32 and F16 caches. Names keep the 512 results' old names. */
static void bench_attn(sh_backend *be, sh_backend_stream *st, int threads)
{
    enum { CHUNK = 512, HD = 64 };
    static const int32_t heads[2][2] = {{9, 3}, {32, 4}};
    static const char *names[2] = {"smollm2-135m", "tinyllama-1.1b"};
    static const int32_t ctxs[3] = {512, 4096, 16384};
    for (int ci = 0; ci < 3; ci++)
        for (int mi = 0; mi < 2; mi++)
            for (int f16 = 0; f16 < 2; f16++) {
                const int32_t T = ctxs[ci], nh = heads[mi][0], nkv = heads[mi][1];
                if (T > 4096 && mi > 0)
                    continue;
                const size_t esz = f16 ? 2 : 4, pool = (size_t)T * nkv * HD * esz;
                sh_kv_cache c = {.type = f16 ? SH_DTYPE_F16 : SH_DTYPE_F32,
                                 .n_blocks = T / SH_KV_BLOCK_TOKENS,
                                 .n_kv_heads = nkv,
                                 .head_dim = HD,
                                 .k = malloc(pool),
                                 .v = malloc(pool)};
                int32_t *blocks = malloc((size_t)(T / SH_KV_BLOCK_TOKENS) * sizeof *blocks);
                for (int i = 0; i < T / SH_KV_BLOCK_TOKENS; i++)
                    blocks[i] = i;
                float *q = malloc((size_t)CHUNK * nh * HD * sizeof(float));
                float *kv = malloc((size_t)T * nkv * HD * sizeof(float));
                float *out = malloc((size_t)CHUNK * nh * HD * sizeof(float));
                for (int64_t i = 0; i < (int64_t)CHUNK * nh * HD; i++)
                    q[i] = frand();
                for (int64_t i = 0; i < (int64_t)T * nkv * HD; i++)
                    kv[i] = frand();
                sh_attn_seq all = {T, 0, blocks};
                sh_attn_batch ball = {1, &all};
                sh_backend_kv_store(be, st, &c, &ball, kv, kv);
                sh_backend_sync(be, st);
                sh_attn_seq last = {CHUNK, T - CHUNK, blocks};
                sh_attn_batch b = {1, &last};
                for (int decode = 0; decode < 2; decode++) {
                    sh_attn_seq one = {1, T - 1, blocks};
                    sh_attn_batch bd = {1, &one};
                    double times[5];
                    const int rounds = T > 4096 && !decode ? 3 : 5;
                    for (int r = 0; r < rounds; r++) {
                        const int reps = decode ? 50 : 1;
                        double t0 = now();
                        for (int i = 0; i < reps; i++)
                            sh_backend_attention(be, st, &c, decode ? &bd : &b, q, nh, 0.125f, out);
                        sh_backend_sync(be, st);
                        times[r] = (now() - t0) / reps;
                    }
                    char name[64];
                    if (T == CHUNK)
                        snprintf(name, sizeof name, "%s",
                                 decode ? "attn_decode_pos511" : "attn_prefill512");
                    else
                        snprintf(name, sizeof name, "%s%d",
                                 decode ? "attn_decode_ctx" : "attn_prefill512_ctx", (int)T);
                    printf("{\"name\":\"%s\",\"value\":%.1f,\"unit\":\"us\",\"model\":\"%s\","
                           "\"kv\":\"%s\",\"threads\":%d}\n",
                           name, median(times, rounds) * 1e6, names[mi], f16 ? "F16" : "F32",
                           threads);
                    fflush(stdout);
                }
                free(blocks);
                free(q);
                free(kv);
                free(out);
                free(c.k);
                free(c.v);
            }
}

int main(int argc, char **argv)
{
    int quick = 0;
    int64_t mib = 1024;
    const char *only = NULL;
    int layout = 2; /* 0 file, 1 packed, 2 both */
    int th_lo = 1, th_hi = 2, isa = 0;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--quick"))
            quick = 1;
        else if (!strcmp(argv[i], "--bw-mib") && i + 1 < argc)
            mib = atoll(argv[++i]);
        else if (!strcmp(argv[i], "--only") && i + 1 < argc)
            only = argv[++i];
        else if (!strcmp(argv[i], "--isa") && i + 1 < argc)
            isa = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--threads") && i + 1 < argc)
            th_lo = th_hi = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--types") && i + 1 < argc) {
            n_mtypes = 0;
            char buf[256];
            snprintf(buf, sizeof buf, "%s", argv[++i]);
            for (char *sv = NULL, *tok = strtok_r(buf, " ,", &sv); tok;
                 tok = strtok_r(NULL, " ,", &sv)) {
                uint32_t t = 0;
                while (t < SH_DTYPE_COUNT_ &&
                       (!sh__dtype_info(t) || strcmp(sh__dtype_info(t)->name, tok) != 0))
                    t++;
                if (t == SH_DTYPE_COUNT_ || n_mtypes == sizeof mtypes / sizeof mtypes[0] ||
                    !sh__quant_supported((sh_dtype)t)) {
                    fprintf(stderr,
                            "bench_kernels: --types: '%s' is not a weight type it can make\n", tok);
                    return 2;
                }
                mtypes[n_mtypes++] = (sh_dtype)t;
            }
        } else if (!strcmp(argv[i], "--layout") && i + 1 < argc) {
            i++;
            layout = !strcmp(argv[i], "file") ? 0 : !strcmp(argv[i], "packed") ? 1 : 2;
        } else {
            fprintf(stderr,
                    "usage: %s [--quick] [--bw-mib N] [--only bw|op|attn|mv|pp] "
                    "[--layout file|packed|both] [--threads N] [--isa 1|2|3] [--types \"T ...\"]\n",
                    argv[0]);
            return 2;
        }
    }
    if (!only || !strcmp(only, "bw"))
        bench_bw(quick ? 256 : mib, quick ? 3 : 7);
    for (int threads = th_lo; threads <= th_hi; threads++) {
        sh_backend *be;
        sh_backend_stream *st;
        sh_backend_cpu_opts o = {.n_threads = threads, .isa = isa};
        sh_error e = {0};
        if (sh_backend_cpu_create(&o, &be, &e) || sh_backend_stream_create(be, &st, &e)) {
            fprintf(stderr, "bench_kernels: %s\n", e.msg);
            return 1;
        }
        if (threads == 1)
            fprintf(stderr, "bench_kernels: isa %s\n",
                    sh_backend_cpu_isa_name(sh_backend_cpu_isa(be)));
        if (!only || !strcmp(only, "op"))
            bench_op_overhead(be, st, threads);
        if (!only || !strcmp(only, "attn"))
            bench_attn(be, st, threads);
        for (int packed = 1; packed >= 0; packed--) {
            if ((layout == 1 && !packed) || (layout == 0 && packed))
                continue;
            if (!only || !strcmp(only, "mv"))
                bench_mm(be, st, threads, 1, quick ? 0.2 : 1.0, quick, packed);
            if (!only || !strcmp(only, "pp")) {
                bench_mm(be, st, threads, 128, quick ? 0.2 : 1.0, quick, packed);
                if (!quick)
                    bench_mm(be, st, threads, 512, 1.0, quick, packed);
            }
        }
        sh_backend_stream_destroy(be, st);
        sh_backend_destroy(be);
    }
    return 0;
}
