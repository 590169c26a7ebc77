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
#include <time.h>

#include <immintrin.h>

#include "kernels/backend.h"
#include "model/llama.h"

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
            "                   [--kv f32|f16] [--ctx N] [--no-bw]\n"
            "  pp and tg may repeat; defaults: --pp 128 --pp 512 --tg 128, 3 reps, 2 threads,\n"
            "  F32 KV; --ctx N: the tg runs decode after an N-token context (filled once), so\n"
            "  attention over the cache counts; --no-bw skips the read-bandwidth probe.\n"
            "  SHOAL_ISA=scalar|avx2|avx512 caps the kernels (the first line names them).\n");
}

int main(int argc, char **argv)
{
    const char *path = NULL;
    int threads = 2, reps = 3, n_pp = 0, n_tg = 0, ctx_len = 0;
    bool kv_f16 = false, probe = true;
    int pp[8], tg[8];
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
        if (!strcmp(a, "--no-bw")) {
            probe = false;
            continue;
        }
        if (!v) {
            usage();
            return 2;
        }
        if (!strcmp(a, "-m"))
            path = v;
        else if (!strcmp(a, "-t"))
            threads = atoi(v);
        else if (!strcmp(a, "--reps"))
            reps = atoi(v);
        else if (!strcmp(a, "--pp") && n_pp < 8 && atoi(v) >= 1)
            pp[n_pp++] = atoi(v);
        else if (!strcmp(a, "--tg") && n_tg < 8 && atoi(v) >= 1)
            tg[n_tg++] = atoi(v);
        else if (!strcmp(a, "--ctx") && atoi(v) >= 0)
            ctx_len = atoi(v);
        else if (!strcmp(a, "--kv") && (!strcmp(v, "f16") || !strcmp(v, "f32")))
            kv_f16 = !strcmp(v, "f16");
        else {
            usage();
            return 2;
        }
        i++;
    }
    if (!path || threads < 1 || threads > 16 || reps < 1) {
        usage();
        return 2;
    }
    if (!n_pp && !n_tg) {
        pp[n_pp++] = 128;
        pp[n_pp++] = 512;
        tg[n_tg++] = 128;
    }
    int max_pp = 1, max_tg = 1;
    for (int i = 0; i < n_pp; i++)
        max_pp = pp[i] > max_pp ? pp[i] : max_pp;
    for (int i = 0; i < n_tg; i++)
        max_tg = tg[i] > max_tg ? tg[i] : max_tg;

    sh_error e = {0};
    sh_llama *m = NULL;
    sh_backend *be = NULL;
    sh_llama_ctx *ctx = NULL;
    sh_llama_load_opts lo = {.prefault = true};
    sh_backend_cpu_opts bo = {.n_threads = threads};
    /* the context for --ctx is filled in chunks of at most 512 tokens */
    const int chunk = max_pp > 512 ? max_pp : 512;
    int32_t kv = (max_pp > ctx_len ? max_pp : ctx_len) + max_tg + 16;
    sh_llama_ctx_opts co = {.max_tokens = chunk,
                            .max_seqs = 1,
                            .kv_tokens = kv,
                            .kv_type = kv_f16 ? SH_DTYPE_F16 : SH_DTYPE_F32};
    if (sh_llama_load(path, &lo, &m, &e) || sh_backend_cpu_create(&bo, &be, &e) ||
        sh_llama_ctx_create(m, be, &co, &ctx, &e)) {
        fprintf(stderr, "error: %s\n", e.msg);
        sh_llama_ctx_destroy(ctx);
        sh_backend_destroy(be);
        sh_llama_destroy(m);
        return 2;
    }
    const char *name = strrchr(path, '/') ? strrchr(path, '/') + 1 : path;
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
    int32_t n_blocks = (kv + SH_KV_BLOCK_TOKENS - 1) / SH_KV_BLOCK_TOKENS;
    int32_t *blocks = malloc((size_t)n_blocks * sizeof *blocks);
    const int n_tokens = max_pp > ctx_len ? max_pp : ctx_len;
    int32_t *tokens = malloc((size_t)n_tokens * sizeof *tokens);
    for (int32_t i = 0; i < n_blocks; i++)
        blocks[i] = i;
    uint32_t s = 12345;
    for (int i = 0; i < n_tokens; i++) {
        s = s * 1664525u + 1013904223u;
        tokens[i] = (int32_t)(s % (uint32_t)m->hp.n_vocab);
    }
    int rc = 0;
    sh_llama_out o;
    char kern[160];
    sh_backend_cpu_describe(be, kern, sizeof kern);
    printf("{\"name\":\"kernels\",\"value\":\"%s\",\"kv\":\"%s\"}\n", kern, kv_f16 ? "f16" : "f32");
    double bw_one = 0, bw_eight = 0;
    double read_gbs = probe ? read_bandwidth(threads, &bw_one, &bw_eight) : 0;
    printf("{\"name\":\"read_bandwidth\",\"value\":%.2f,\"unit\":\"GB/s\",\"threads\":%d,"
           "\"one_stream\":%.2f,\"eight_streams\":%.2f}\n",
           read_gbs, threads, bw_one, bw_eight);

    for (int k = 0; k < n_pp && !rc; k++) {
        double best = 0;
        for (int r = 0; r < reps && !rc; r++) {
            sh_llama_seq seq = {tokens, pp[k], 0, blocks, true};
            sh_llama_batch b = {1, &seq, false, NULL};
            double t0 = now_s();
            rc = sh_llama_forward(ctx, &b, &o, &e);
            double tps = pp[k] / (now_s() - t0);
            best = tps > best ? tps : best;
        }
        printf("{\"name\":\"pp%d\",\"model\":\"%s\",\"value\":%.1f,\"unit\":\"tok/s\","
               "\"threads\":%d,\"reps\":%d}\n",
               pp[k], name, best, threads, reps);
        fflush(stdout);
    }
    /* the decode context: filled once; each tg run overwrites the positions after it */
    for (int p = 0; p < ctx_len && !rc; p += chunk) {
        const int n = ctx_len - p < chunk ? ctx_len - p : chunk;
        sh_llama_seq seq = {tokens + p, n, p, blocks, true};
        sh_llama_batch b = {1, &seq, false, NULL};
        rc = sh_llama_forward(ctx, &b, &o, &e);
    }
    for (int k = 0; k < n_tg && !rc; k++) {
        double best = 0;
        for (int r = 0; r < reps && !rc; r++) {
            int32_t tok = tokens[0];
            double t0 = now_s();
            for (int i = 0; i < tg[k] && !rc; i++) {
                sh_llama_seq seq = {&tok, 1, ctx_len + i, blocks, true};
                sh_llama_batch b = {1, &seq, false, NULL};
                rc = sh_llama_forward(ctx, &b, &o, &e);
                tok = (tok * 31 + 7) % m->hp.n_vocab; /* any token: speed does not depend on it */
            }
            double tps = tg[k] / (now_s() - t0);
            best = tps > best ? tps : best;
        }
        double gbs = step_gb * best;
        printf("{\"name\":\"tg%d\",\"model\":\"%s\",\"value\":%.1f,\"unit\":\"tok/s\","
               "\"ctx\":%d,\"threads\":%d,\"reps\":%d,\"weight_gb\":%.4f,\"step_gb\":%.4f,\"decode_"
               "gbs\":%.2f,"
               "\"read_fraction\":%.3f}\n",
               tg[k], name, best, ctx_len, threads, reps, weight_gb, step_gb, gbs,
               read_gbs > 0 ? gbs / read_gbs : 0);
        fflush(stdout);
    }
    if (rc)
        fprintf(stderr, "error: %s\n", e.msg);
    free(tokens);
    free(blocks);
    sh_llama_ctx_destroy(ctx);
    sh_backend_destroy(be);
    sh_llama_destroy(m);
    return rc ? 1 : 0;
}
