/* The tiled online-softmax attention of one ISA (argv[1]: scalar, avx2 or avx512; exit 77 when
 * this CPU lacks it) against a dense reference in double on fresh random inputs: F32 and F16
 * caches (the reference reads the same f16-rounded values, so both are held to 1e-5), ragged
 * head sizes and groups, sliding windows, contexts of many tiles; and the property the serving
 * path relies on: a row's output is bitwise the same however the rows are cut into calls. */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kernels/backend.h"
#include "kernels/cpu/cpu.h"
#define KT_SEED 0x452821e638d01377ull
#include "kernels_test_util.h"

static int g_isa;

/* One sequence's cache: a shuffled block table over a pool sized for ctx tokens, and the dense
 * history the paged cache must reproduce (rounded to f16 when the cache is F16). */
typedef struct seq_cache {
    sh_backend *be;
    sh_backend_stream *s;
    sh_kv_cache c;
    int32_t *bt;
    float *k, *v; /* (ctx, n_kv, hd) dense, as stored */
    int32_t ctx, n_kv, hd;
} seq_cache;

static void cache_init(seq_cache *sc, sh_dtype type, int32_t ctx, int32_t n_kv, int32_t hd,
                       int32_t window)
{
    const int32_t nb = (ctx + SH_KV_BLOCK_TOKENS - 1) / SH_KV_BLOCK_TOKENS;
    const size_t esz = type == SH_DTYPE_F16 ? 2 : 4;
    const size_t pool = (size_t)nb * SH_KV_BLOCK_TOKENS * (size_t)n_kv * (size_t)hd * esz;
    *sc = (seq_cache){.ctx = ctx, .n_kv = n_kv, .hd = hd};
    sc->be = make(g_isa, 3);
    CHECK_OK(sh_backend_stream_create(sc->be, &sc->s, NULL));
    sc->c = (sh_kv_cache){
        .type = type, .n_blocks = nb, .n_kv_heads = n_kv, .head_dim = hd, .window = window};
    CHECK_OK(sh_backend_buf_alloc(sc->be, pool, &sc->c.k));
    CHECK_OK(sh_backend_buf_alloc(sc->be, pool, &sc->c.v));
    memset(sc->c.k, 0xff, pool); /* NaN garbage: slots never written must never be read */
    memset(sc->c.v, 0xff, pool);
    sc->bt = malloc((size_t)nb * sizeof *sc->bt);
    for (int32_t i = 0; i < nb; i++)
        sc->bt[i] = i;
    for (int32_t i = nb - 1; i > 0; i--) {
        int32_t j = (int32_t)(rng_next() % (uint64_t)(i + 1)), t = sc->bt[i];
        sc->bt[i] = sc->bt[j];
        sc->bt[j] = t;
    }
    const size_t n = (size_t)ctx * n_kv * hd;
    sc->k = malloc(n * sizeof(float));
    sc->v = malloc(n * sizeof(float));
    fill(sc->k, (int64_t)n, 1.0f);
    fill(sc->v, (int64_t)n, 1.0f);
    if (type == SH_DTYPE_F16)
        for (size_t i = 0; i < n; i++) {
            sc->k[i] = sh__quant_f32_from_fp16(sh__quant_fp16_from_f32(sc->k[i]));
            sc->v[i] = sh__quant_f32_from_fp16(sh__quant_fp16_from_f32(sc->v[i]));
        }
    /* store everything once, in chunks of at most 512 rows */
    for (int32_t p = 0; p < ctx; p += 512) {
        sh_attn_seq q = {ctx - p < 512 ? ctx - p : 512, p, sc->bt};
        sh_attn_batch b = {1, &q};
        const size_t off = (size_t)p * n_kv * hd;
        CHECK_OK(sh_backend_kv_store(sc->be, sc->s, &sc->c, &b, sc->k + off, sc->v + off));
        CHECK_OK(sh_backend_sync(sc->be, sc->s)); /* the op reads q when it runs */
    }
}

static void cache_fini(seq_cache *sc)
{
    sh_backend_buf_free(sc->be, sc->c.k);
    sh_backend_buf_free(sc->be, sc->c.v);
    sh_backend_stream_destroy(sc->be, sc->s);
    sh_backend_destroy(sc->be);
    free(sc->bt);
    free(sc->k);
    free(sc->v);
}

/* Attention of rows [p0, p0 + n) in one call, out (n, n_heads, hd). */
static void attend(seq_cache *sc, int32_t p0, int32_t n, const float *q, int32_t n_heads,
                   float scale, float *out)
{
    sh_attn_seq s = {n, p0, sc->bt};
    sh_attn_batch b = {1, &s};
    CHECK_OK(sh_backend_attention(sc->be, sc->s, &sc->c, &b, q, n_heads, scale, out));
    CHECK_OK(sh_backend_sync(sc->be, sc->s));
}

/* The worst of |out - ref| / (1 + |ref|) over rows [p0, p0 + n), ref = softmax(scale q.K) V in
 * double over each row's causal window. */
static double worst_error(const seq_cache *sc, int32_t p0, int32_t n, const float *q,
                          int32_t n_heads, float scale, const float *out)
{
    const int32_t hd = sc->hd, group = n_heads / sc->n_kv, w = sc->c.window;
    double *sco = malloc((size_t)sc->ctx * sizeof(double)), worst = 0;
    double *o = malloc((size_t)hd * sizeof(double));
    for (int32_t r = 0; r < n; r++)
        for (int32_t h = 0; h < n_heads; h++) {
            const int32_t p = p0 + r, kh = h / group, t0 = w > 0 && p + 1 > w ? p + 1 - w : 0;
            const float *qr = q + ((int64_t)r * n_heads + h) * hd;
            double mx = -INFINITY, sum = 0;
            for (int32_t t = t0; t <= p; t++) {
                const float *kt = sc->k + ((int64_t)t * sc->n_kv + kh) * hd;
                double d = 0;
                for (int32_t i = 0; i < hd; i++)
                    d += (double)qr[i] * kt[i];
                sco[t] = d * scale;
                mx = fmax(mx, sco[t]);
            }
            memset(o, 0, (size_t)hd * sizeof(double));
            for (int32_t t = t0; t <= p; t++) {
                const double e = exp(sco[t] - mx);
                const float *vt = sc->v + ((int64_t)t * sc->n_kv + kh) * hd;
                sum += e;
                for (int32_t i = 0; i < hd; i++)
                    o[i] += e * vt[i];
            }
            const float *got = out + ((int64_t)r * n_heads + h) * hd;
            for (int32_t i = 0; i < hd; i++) {
                const double ref = o[i] / sum, err = fabs(got[i] - ref) / (1.0 + fabs(ref));
                if (!(err <= worst)) /* a NaN sticks */
                    worst = err;
            }
        }
    free(sco);
    free(o);
    return worst;
}

/* Shapes: (n_heads, n_kv, hd): smollm2's 9/3/64, tinyllama's 32/4/64, a group wider than the 16
 * lanes (20/1), head sizes that are not a multiple of any vector (40, 72) or of 16 (24). */
static const int32_t shapes[][3] = {{9, 3, 64},  {32, 4, 64}, {20, 1, 64},
                                    {10, 2, 40}, {6, 3, 72},  {4, 4, 24}};

/* A prefill chunk and a decode row at several points of a context of many tiles, against the
 * reference, F32 and F16, with and without a sliding window (shorter than a tile, longer than
 * one, not a multiple of the tile). */
static void test_vs_reference(void)
{
    static const int32_t windows[] = {0, 5, 37, 300};
    for (size_t si = 0; si < sizeof shapes / sizeof shapes[0]; si++)
        for (int f16 = 0; f16 < 2; f16++)
            for (size_t wi = 0; wi < sizeof windows / sizeof windows[0]; wi++) {
                const int32_t nh = shapes[si][0], nkv = shapes[si][1], hd = shapes[si][2];
                const int32_t ctx = 700;
                seq_cache sc;
                cache_init(&sc, f16 ? SH_DTYPE_F16 : SH_DTYPE_F32, ctx, nkv, hd, windows[wi]);
                /* (first row, rows): a prefill from 0, chunks at ragged offsets, decode rows */
                static const int32_t runs[][2] = {{0, 45}, {61, 19}, {333, 1}, {640, 60}, {699, 1}};
                for (size_t ri = 0; ri < sizeof runs / sizeof runs[0]; ri++) {
                    const int32_t p0 = runs[ri][0], n = runs[ri][1];
                    float *q = malloc((size_t)n * nh * hd * sizeof(float));
                    float *out = malloc((size_t)n * nh * hd * sizeof(float));
                    fill(q, (int64_t)n * nh * hd, 2.0f);
                    const float scale = 1.0f / sqrtf((float)hd);
                    attend(&sc, p0, n, q, nh, scale, out);
                    const double e = worst_error(&sc, p0, n, q, nh, scale, out);
                    if (!(e <= 1e-5))
                        SH_FAIL_("%s heads %d/%d hd %d %s window %d rows [%d, %d): error %.3g",
                                 sh_backend_cpu_isa_name(g_isa), nh, nkv, hd, f16 ? "f16" : "f32",
                                 windows[wi], p0, p0 + n, e);
                    free(q);
                    free(out);
                }
                cache_fini(&sc);
            }
}

/* Rows [0, 150) of one sequence computed in one call, in ragged chunks, one row at a time, and
 * beside another sequence in the same batch (so the rows fall into other items): bitwise
 * equal, every shape, both cache types, with and without a window. */
static void test_chunking_bitwise(void)
{
    enum { N = 150 };
    static const int32_t cuts[] = {0, 1, 6, 23, 24, 40, 80, 97, 150};
    for (size_t si = 0; si < sizeof shapes / sizeof shapes[0]; si++)
        for (int f16 = 0; f16 < 2; f16++)
            for (int32_t window = 0; window <= 41; window += 41) {
                const int32_t nh = shapes[si][0], nkv = shapes[si][1], hd = shapes[si][2];
                const int64_t row = (int64_t)nh * hd;
                seq_cache sc;
                cache_init(&sc, f16 ? SH_DTYPE_F16 : SH_DTYPE_F32, N + 16, nkv, hd, window);
                float *q = malloc((size_t)(N + 3) * row * sizeof(float));
                float *whole = malloc((size_t)N * row * sizeof(float));
                float *part = malloc((size_t)(N + 3) * row * sizeof(float));
                fill(q, (int64_t)(N + 3) * row, 2.0f);
                attend(&sc, 0, N, q, nh, 0.3f, whole);
                for (size_t c = 0; c + 1 < sizeof cuts / sizeof cuts[0]; c++)
                    attend(&sc, cuts[c], cuts[c + 1] - cuts[c], q + cuts[c] * row, nh, 0.3f,
                           part + cuts[c] * row);
                if (memcmp(whole, part, (size_t)N * row * sizeof(float)))
                    SH_FAIL_("%s heads %d/%d hd %d %s window %d: chunks differ from one call",
                             sh_backend_cpu_isa_name(g_isa), nh, nkv, hd, f16 ? "f16" : "f32",
                             window);
                for (int32_t p = 0; p < N; p += 7) { /* decode rows */
                    attend(&sc, p, 1, q + p * row, nh, 0.3f, part);
                    if (memcmp(whole + p * row, part, (size_t)row * sizeof(float)))
                        SH_FAIL_("%s heads %d/%d hd %d %s window %d: row %d alone differs",
                                 sh_backend_cpu_isa_name(g_isa), nh, nkv, hd, f16 ? "f16" : "f32",
                                 window, p);
                }
                /* a 3-row sequence first (rows 16..18 of the same cache, as another sequence),
                 * then rows 50..149: the second sequence's items start at other lanes */
                sh_attn_seq two[2] = {{3, 16, sc.bt}, {100, 50, sc.bt}};
                sh_attn_batch b = {2, two};
                memcpy(part, q + 16 * row, (size_t)3 * row * sizeof(float));
                memcpy(part + 3 * row, q + 50 * row, (size_t)100 * row * sizeof(float));
                float *o2 = malloc((size_t)103 * row * sizeof(float));
                CHECK_OK(sh_backend_attention(sc.be, sc.s, &sc.c, &b, part, nh, 0.3f, o2));
                CHECK_OK(sh_backend_sync(sc.be, sc.s));
                if (memcmp(whole + 16 * row, o2, (size_t)3 * row * sizeof(float)) ||
                    memcmp(whole + 50 * row, o2 + 3 * row, (size_t)100 * row * sizeof(float)))
                    SH_FAIL_("%s heads %d/%d hd %d %s window %d: batched rows differ",
                             sh_backend_cpu_isa_name(g_isa), nh, nkv, hd, f16 ? "f16" : "f32",
                             window);
                free(o2);
                free(q);
                free(whole);
                free(part);
                cache_fini(&sc);
            }
}

/* A 16k-token context (512 tiles): the last 16 rows of a prefill and a decode row, F16, against
 * the reference; the kernel's scratch is the same as for a 16-token context. */
static void test_long_context(void)
{
    enum { CTX = 16384, NH = 8, NKV = 2, HD = 64 };
    seq_cache sc;
    cache_init(&sc, SH_DTYPE_F16, CTX, NKV, HD, 0);
    float *q = malloc((size_t)16 * NH * HD * sizeof(float));
    float *out = malloc((size_t)16 * NH * HD * sizeof(float));
    fill(q, 16 * NH * HD, 2.0f);
    attend(&sc, CTX - 17, 16, q, NH, 0.125f, out);
    double e = worst_error(&sc, CTX - 17, 16, q, NH, 0.125f, out);
    if (!(e <= 1e-5))
        SH_FAIL_("%s 16k context: error %.3g", sh_backend_cpu_isa_name(g_isa), e);
    attend(&sc, CTX - 1, 1, q, NH, 0.125f, out);
    e = worst_error(&sc, CTX - 1, 1, q, NH, 0.125f, out);
    if (!(e <= 1e-5))
        SH_FAIL_("%s 16k decode: error %.3g", sh_backend_cpu_isa_name(g_isa), e);
    CHECK_INT_EQ((int64_t)sh__cpu_attn_scratch(HD),
                 16 * HD + 16 * SH_CPU_ATTN_TILE + 48 + 2 * SH_CPU_ATTN_TILE * HD + 16);
    free(q);
    free(out);
    cache_fini(&sc);
}

int main(int argc, char **argv)
{
    int32_t isa = 0;
    if (argc < 2 || sh_backend_cpu_isa_parse(argv[1], &isa) != SH_OK ||
        isa == SH_BACKEND_CPU_ISA_AUTO) {
        fprintf(stderr, "usage: test_attn_tiled scalar|avx2|avx512 [case ...]\n");
        return 2;
    }
    if (isa > sh__cpu_isa_detect()) {
        fprintf(stderr, "skip: this CPU lacks %s\n", argv[1]);
        return 77;
    }
    g_isa = isa;
    static const sh_test_case tests[] = {
        {"vs_reference", test_vs_reference},
        {"chunking_bitwise", test_chunking_bitwise},
        {"long_context", test_long_context},
        {NULL, NULL},
    };
    return sh_test_main(argc - 1, argv + 1, tests);
}
