/* Unit tests of the CPU backend's paged attention, KV store and RoPE against dense naive
 * references, on every ISA, with fresh random inputs. */
#include <stdint.h>

#include "kernels/backend.h"
#include "kernels/cpu/cpu.h"
#define KT_SEED 0x13198a2e03707344ull
#include "kernels_test_util.h"

/* 5 query heads per KV head: one full pass of the grouped kernel (4 heads) and a partial one */
enum { N_HEADS = 10, N_KV = 2, N_BLOCKS = 24, N_SEQ = 3, MAX_CTX = 96 };

/* Dense per-sequence history: K/V of every position, the truth the paged cache must reproduce. */
typedef struct dense {
    float k[MAX_CTX][N_KV][64];
    float v[MAX_CTX][N_KV][64];
} dense;

/* out = softmax(scale q.K) V over positions t0..p (t0 = p - window + 1 with a sliding window,
 * else 0), in double. */
static void naive_attn(const dense *d, int hd, int p, int window, const float *q, int h,
                       float scale, double *out)
{
    const int kh = h / (N_HEADS / N_KV);
    const int t0 = window > 0 && p + 1 > window ? p + 1 - window : 0;
    double sc[MAX_CTX], mx = -1e300, sum = 0;
    for (int t = t0; t <= p; t++) {
        double s = 0;
        for (int i = 0; i < hd; i++)
            s += (double)q[i] * d->k[t][kh][i];
        sc[t] = s * scale;
        mx = fmax(mx, sc[t]);
    }
    for (int t = t0; t <= p; t++)
        sum += (sc[t] = exp(sc[t] - mx));
    for (int i = 0; i < hd; i++) {
        double o = 0;
        for (int t = t0; t <= p; t++)
            o += sc[t] / sum * d->v[t][kh][i];
        out[i] = o;
    }
}

/* Two steps over three sequences whose block tables are a shuffled permutation of the pool:
 * step 1 prefills histories (seq 0: 37 tokens, seq 1: 16, seq 2: nothing yet); step 2 mixes a
 * decode row (seq 0 at 37), a 5-row chunk (seq 1 at 16) and a 20-row prefill (seq 2 at 0).
 * With a sliding window, step 2's tables mark every block wholly before a sequence's window as
 * released (-1), as the KV manager does: the kernels must never read them. */
static void run_attention(int isa, int threads, sh_dtype kv_type, int hd, double tol, int window)
{
    sh_backend *be = make(isa, threads);
    sh_backend_stream *s;
    CHECK_OK(sh_backend_stream_create(be, &s, NULL));
    size_t esz = kv_type == SH_DTYPE_F16 ? 2 : 4;
    size_t pool_bytes = (size_t)N_BLOCKS * SH_KV_BLOCK_TOKENS * N_KV * (size_t)hd * esz;
    sh_kv_cache cache = {.type = kv_type,
                         .n_blocks = N_BLOCKS,
                         .n_kv_heads = N_KV,
                         .head_dim = hd,
                         .window = window};
    CHECK_OK(sh_backend_buf_alloc(be, pool_bytes, &cache.k));
    CHECK_OK(sh_backend_buf_alloc(be, pool_bytes, &cache.v));
    memset(cache.k, 0xff, pool_bytes); /* NaN garbage: unwritten slots must never be read */
    memset(cache.v, 0xff, pool_bytes);

    int32_t perm[N_BLOCKS];
    for (int i = 0; i < N_BLOCKS; i++)
        perm[i] = i;
    for (int i = N_BLOCKS - 1; i > 0; i--) {
        int j = (int)(rng_next() % (uint64_t)(i + 1));
        int32_t t = perm[i];
        perm[i] = perm[j];
        perm[j] = t;
    }
    const int32_t *bt[N_SEQ] = {perm, perm + 8, perm + 16}; /* 8 blocks = 128 positions each */
    static dense hist[N_SEQ];

    const int pre[N_SEQ] = {37, 16, 0}, rows2[N_SEQ] = {1, 5, 20};
    /* step 1: store the histories */
    {
        sh_attn_seq seqs[2] = {{pre[0], 0, bt[0]}, {pre[1], 0, bt[1]}};
        sh_attn_batch b = {2, seqs};
        int n = pre[0] + pre[1];
        float *k = malloc((size_t)n * N_KV * hd * sizeof(float));
        float *v = malloc((size_t)n * N_KV * hd * sizeof(float));
        fill(k, (int64_t)n * N_KV * hd, 1.0f);
        fill(v, (int64_t)n * N_KV * hd, 1.0f);
        for (int r = 0; r < n; r++) {
            int sq = r < pre[0] ? 0 : 1, p = r < pre[0] ? r : r - pre[0];
            for (int h = 0; h < N_KV; h++)
                for (int i = 0; i < hd; i++) {
                    hist[sq].k[p][h][i] = k[(r * N_KV + h) * hd + i];
                    hist[sq].v[p][h][i] = v[(r * N_KV + h) * hd + i];
                }
        }
        CHECK_OK(sh_backend_kv_store(be, s, &cache, &b, k, v));
        CHECK_OK(sh_backend_sync(be, s));
        free(k);
        free(v);
    }
    /* step 2: the mixed batch */
    sh_attn_seq seqs[N_SEQ];
    int32_t bt2[N_SEQ][8];
    int n = 0;
    for (int i = 0; i < N_SEQ; i++) {
        int first = window > 0 && pre[i] + 1 > window ? (pre[i] + 1 - window) / 16 : 0;
        for (int j = 0; j < 8; j++)
            bt2[i][j] = j < first ? -1 : bt[i][j];
        seqs[i] = (sh_attn_seq){rows2[i], pre[i], bt2[i]};
        n += rows2[i];
    }
    sh_attn_batch b = {N_SEQ, seqs};
    float *q = malloc((size_t)n * N_HEADS * hd * sizeof(float));
    float *k = malloc((size_t)n * N_KV * hd * sizeof(float));
    float *v = malloc((size_t)n * N_KV * hd * sizeof(float));
    float *out = malloc((size_t)n * N_HEADS * hd * sizeof(float));
    fill(q, (int64_t)n * N_HEADS * hd, 2.0f);
    fill(k, (int64_t)n * N_KV * hd, 1.0f);
    fill(v, (int64_t)n * N_KV * hd, 1.0f);
    for (int sq = 0, r = 0; sq < N_SEQ; sq++)
        for (int j = 0; j < rows2[sq]; j++, r++)
            for (int h = 0; h < N_KV; h++)
                for (int i = 0; i < hd; i++) {
                    hist[sq].k[pre[sq] + j][h][i] = k[(r * N_KV + h) * hd + i];
                    hist[sq].v[pre[sq] + j][h][i] = v[(r * N_KV + h) * hd + i];
                }
    const float scale = 1.0f / sqrtf((float)hd);
    CHECK_OK(sh_backend_kv_store(be, s, &cache, &b, k, v));
    CHECK_OK(sh_backend_attention(be, s, &cache, &b, q, N_HEADS, scale, out));
    CHECK_OK(sh_backend_sync(be, s));
    double worst = 0, ref[64];
    for (int sq = 0, r = 0; sq < N_SEQ; sq++)
        for (int j = 0; j < rows2[sq]; j++, r++)
            for (int h = 0; h < N_HEADS; h++) {
                naive_attn(&hist[sq], hd, pre[sq] + j, window, q + (r * N_HEADS + h) * hd, h, scale,
                           ref);
                for (int i = 0; i < hd; i++) {
                    double e = fabs(out[(r * N_HEADS + h) * hd + i] - ref[i]);
                    if (!(e <= worst)) /* a NaN sticks */
                        worst = e;
                }
            }
    if (!(worst <= tol))
        SH_FAIL_("attention %s threads %d kv %s hd %d window %d: max error %.3g > %.3g",
                 sh_backend_cpu_isa_name(isa), threads, kv_type == SH_DTYPE_F16 ? "f16" : "f32", hd,
                 window, worst, tol);
    free(q);
    free(k);
    free(v);
    free(out);
    sh_backend_buf_free(be, cache.k);
    sh_backend_buf_free(be, cache.v);
    sh_backend_stream_destroy(be, s);
    sh_backend_destroy(be);
}

/* Values are O(1), so absolute tolerances: 1e-5 for an f32 cache; an f16 cache rounds K and V to
 * 11 significant bits (relative 2^-11), so 4e-3. */
static void test_attention(void)
{
    for (int isa = SH_BACKEND_CPU_ISA_SCALAR; isa <= sh__cpu_isa_detect(); isa++)
        for (int threads = 1; threads <= 3; threads++) {
            run_attention(isa, threads, SH_DTYPE_F32, 64, 1e-5, 0);
            run_attention(isa, threads, SH_DTYPE_F32, 40, 1e-5, 0);
            /* sliding windows: shorter than a block, across blocks (seq 0's decode at 37 then
             * has block 0 released), longer than every context (no effect) */
            run_attention(isa, threads, SH_DTYPE_F32, 64, 1e-5, 5);
            run_attention(isa, threads, SH_DTYPE_F32, 64, 1e-5, 20);
            run_attention(isa, threads, SH_DTYPE_F32, 40, 1e-5, 200);
        }
    run_attention(SH_BACKEND_CPU_ISA_AUTO, 2, SH_DTYPE_F16, 64, 4e-3, 0);
    run_attention(SH_BACKEND_CPU_ISA_AUTO, 2, SH_DTYPE_F16, 64, 4e-3, 9);
}

/* Bad block tables are refused at enqueue. */
static void test_attention_invalid(void)
{
    sh_backend *be = make(SH_BACKEND_CPU_ISA_AUTO, 1);
    sh_backend_stream *s;
    CHECK_OK(sh_backend_stream_create(be, &s, NULL));
    float pool[4 * SH_KV_BLOCK_TOKENS * 8], x[64];
    sh_kv_cache c = {
        .type = SH_DTYPE_F32, .n_blocks = 4, .n_kv_heads = 1, .head_dim = 8, .k = pool, .v = pool};
    int32_t bt[2] = {1, 4}; /* 4 is out of range */
    sh_attn_seq sq = {1, 16, bt};
    sh_attn_batch b = {1, &sq};
    CHECK_INT_EQ(sh_backend_kv_store(be, s, &c, &b, x, x), SH_EINVAL);
    CHECK_INT_EQ(sh_backend_attention(be, s, &c, &b, x, 1, 1.0f, x), SH_EINVAL);
    bt[1] = 3;
    CHECK_INT_EQ(sh_backend_attention(be, s, &c, &b, x, 0, 1.0f, x), SH_EINVAL); /* no heads */
    c.n_kv_heads = 2;
    CHECK_INT_EQ(sh_backend_attention(be, s, &c, &b, x, 3, 1.0f, x), SH_EINVAL); /* 3 % 2 */
    sh_backend_stream_destroy(be, s);
    sh_backend_destroy(be);
}

/* RoPE vs the direct formula, both layouts, partial rotation (n_rot < head_dim), positions per
 * token including large ones. */
static void test_rope(void)
{
    enum { T = 4, H = 3, D = 64 };
    const int32_t pos[T] = {0, 1, 17, 4000};
    for (int isa = SH_BACKEND_CPU_ISA_SCALAR; isa <= sh__cpu_isa_detect(); isa++)
        for (int mode = 0; mode < 2; mode++)
            for (int nr = 0; nr < 2; nr++) {
                const int n_rot = nr ? 32 : D;
                const sh_rope_mode m = mode ? SH_ROPE_MODE_NEOX : SH_ROPE_MODE_NORMAL;
                const float base = 10000.0f, fscale = mode ? 0.5f : 1.0f;
                sh_backend *be = make(isa, 2);
                sh_backend_stream *s;
                CHECK_OK(sh_backend_stream_create(be, &s, NULL));
                float x[T * H * D], x0[T * H * D];
                fill(x, T * H * D, 1.0f);
                memcpy(x0, x, sizeof x);
                CHECK_OK(sh_backend_rope(be, s, x, pos, T, H, D, n_rot, base, fscale, m));
                CHECK_OK(sh_backend_sync(be, s));
                for (int t = 0; t < T; t++)
                    for (int h = 0; h < H; h++) {
                        const float *a = x0 + (t * H + h) * D;
                        const float *b = x + (t * H + h) * D;
                        for (int i = 0; i < n_rot / 2; i++) {
                            double th = pos[t] * (double)fscale * pow(base, -2.0 * i / n_rot);
                            int i0 = mode ? i : 2 * i, i1 = mode ? i + n_rot / 2 : 2 * i + 1;
                            double e0 = a[i0] * cos(th) - a[i1] * sin(th);
                            double e1 = a[i0] * sin(th) + a[i1] * cos(th);
                            CHECK_NEAR(b[i0], e0, 2e-5);
                            CHECK_NEAR(b[i1], e1, 2e-5);
                        }
                        for (int i = n_rot; i < D; i++)
                            CHECK_NEAR(b[i], a[i], 0);
                    }
                sh_backend_stream_destroy(be, s);
                sh_backend_destroy(be);
            }
}

/* Head layouts the main test does not reach, fast ISA against the scalar one on the same cache:
 * one KV head for 20 query heads (a group wider than the 16 lanes of the grouped kernel), 3 and
 * 8 heads per KV head (smollm2, tinyllama), head_dim 64 and 48, F32 and F16 caches; a 33-row
 * prefill and a decode row of another sequence in one batch. */
static void test_attention_groups(void)
{
    static const int32_t shapes[][3] = {{20, 1, 64}, {9, 3, 64}, {32, 4, 64}, {6, 2, 48}};
    for (size_t si = 0; si < sizeof shapes / sizeof shapes[0]; si++)
        for (int f16 = 0; f16 < 2; f16++) {
            const int32_t nh = shapes[si][0], nkv = shapes[si][1], hd = shapes[si][2];
            enum { NB = 8, ROWS = 34 };
            const size_t esz = f16 ? 2 : 4, pool = (size_t)NB * SH_KV_BLOCK_TOKENS * nkv * hd * esz;
            sh_backend *be[2] = {make(SH_BACKEND_CPU_ISA_SCALAR, 1),
                                 make(SH_BACKEND_CPU_ISA_AUTO, 3)};
            float *q = malloc((size_t)ROWS * nh * hd * sizeof(float));
            float *kv = malloc((size_t)ROWS * nkv * hd * sizeof(float));
            float *out[2] = {malloc((size_t)ROWS * nh * hd * sizeof(float)),
                             malloc((size_t)ROWS * nh * hd * sizeof(float))};
            fill(q, (int64_t)ROWS * nh * hd, 2.0f);
            fill(kv, (int64_t)ROWS * nkv * hd, 1.0f);
            const int32_t bt0[4] = {5, 1, 7, 3}, bt1[4] = {0, 6, 2, 4};
            for (int i = 0; i < 2; i++) {
                sh_backend_stream *s;
                CHECK_OK(sh_backend_stream_create(be[i], &s, NULL));
                sh_kv_cache c = {.type = f16 ? SH_DTYPE_F16 : SH_DTYPE_F32,
                                 .n_blocks = NB,
                                 .n_kv_heads = nkv,
                                 .head_dim = hd};
                CHECK_OK(sh_backend_buf_alloc(be[i], pool, &c.k));
                CHECK_OK(sh_backend_buf_alloc(be[i], pool, &c.v));
                /* seq 1 first gets a 20-token history, then the batch: seq 0 prefills 33 rows,
                 * seq 1 decodes at position 20 */
                sh_attn_seq hist = {20, 0, bt1};
                sh_attn_batch hb = {1, &hist};
                CHECK_OK(sh_backend_kv_store(be[i], s, &c, &hb, kv, kv));
                sh_attn_seq seqs[2] = {{33, 0, bt0}, {1, 20, bt1}};
                sh_attn_batch b = {2, seqs};
                CHECK_OK(sh_backend_kv_store(be[i], s, &c, &b, kv, kv));
                CHECK_OK(sh_backend_attention(be[i], s, &c, &b, q, nh, 0.2f, out[i]));
                CHECK_OK(sh_backend_sync(be[i], s));
                sh_backend_buf_free(be[i], c.k);
                sh_backend_buf_free(be[i], c.v);
                sh_backend_stream_destroy(be[i], s);
                sh_backend_destroy(be[i]);
            }
            double worst = 0;
            for (int64_t j = 0; j < (int64_t)ROWS * nh * hd; j++) {
                double e = fabs((double)out[0][j] - out[1][j]);
                if (!(e <= worst))
                    worst = e;
            }
            if (!(worst <= 2e-5))
                SH_FAIL_("attention heads %d/%d hd %d %s: fast vs scalar %.3g", nh, nkv, hd,
                         f16 ? "f16" : "f32", worst);
            free(q);
            free(kv);
            free(out[0]);
            free(out[1]);
        }
}

/* Scaled RoPE (sh_rope_scaling) vs the formula written out here in double: per-pair frequency
 * divisors (Llama 3, Phi-3 long rope), linear interpolation, and YaRN's ramp between the
 * interpolated and extrapolated angles with its magnitude factor; both layouts, partial n_rot.
 * Bad parameters are refused at enqueue. */
static void test_rope_scaling(void)
{
    enum { T = 5, H = 2, D = 48 };
    const int32_t pos[T] = {0, 3, 250, 4100, 65000};
    float ff[D / 2];
    for (int i = 0; i < D / 2; i++)
        ff[i] = 1.0f + (float)((i * 7) % 11) * 0.9f; /* divisors 1 .. 10 */
    for (int isa = SH_BACKEND_CPU_ISA_SCALAR; isa <= sh__cpu_isa_detect(); isa++)
        for (int kind = 0; kind < 4; kind++) {
            const sh_rope_mode m = kind & 1 ? SH_ROPE_MODE_NEOX : SH_ROPE_MODE_NORMAL;
            const int n_rot = kind >= 2 ? 32 : D;
            const double base = kind == 3 ? 500000.0 : 10000.0;
            sh_rope_scaling sc = sh_rope_scaling_none();
            sc.freq_factors = kind != 1 ? ff : NULL;
            sc.freq_scale = kind == 0 ? 1.0f : 0.25f;
            if (kind >= 1) { /* YaRN */
                sc.ext_factor = kind == 2 ? 0.5f : 1.0f;
                sc.attn_factor = 0.9f;
                sc.beta_fast = 32.0f;
                sc.beta_slow = 1.0f;
                sc.n_ctx_orig = 4096;
            }
            sh_backend *be = make(isa, 2);
            sh_backend_stream *s;
            CHECK_OK(sh_backend_stream_create(be, &s, NULL));
            float x[T * H * D], x0[T * H * D];
            fill(x, T * H * D, 1.0f);
            memcpy(x0, x, sizeof x);
            CHECK_OK(sh_backend_rope_ext(be, s, x, pos, T, H, D, n_rot, (float)base, &sc, m));
            CHECK_OK(sh_backend_sync(be, s));
            /* YaRN's correction range for this n_rot and base */
            double lo = 0, hi = 0;
            if (sc.ext_factor != 0.0f) {
                double c = n_rot / (2.0 * log(base));
                lo = floor(c * log(4096 / (32.0 * 2 * M_PI)));
                hi = ceil(c * log(4096 / (1.0 * 2 * M_PI)));
                lo = lo < 0 ? 0 : lo;
                hi = hi > n_rot - 1 ? n_rot - 1 : hi;
            }
            for (int t = 0; t < T; t++)
                for (int h = 0; h < H; h++) {
                    const float *a = x0 + (t * H + h) * D;
                    const float *b = x + (t * H + h) * D;
                    for (int i = 0; i < n_rot / 2; i++) {
                        double ex = pos[t] * pow(base, -2.0 * i / n_rot);
                        if (sc.freq_factors)
                            ex /= ff[i];
                        double in = ex * sc.freq_scale, th = in, mag = sc.attn_factor;
                        if (sc.ext_factor != 0.0f) {
                            double y = (i - lo) / (hi - lo > 0.001 ? hi - lo : 0.001);
                            y = y < 0 ? 0 : y > 1 ? 1 : y;
                            double r = (1.0 - y) * sc.ext_factor;
                            th = in * (1 - r) + ex * r;
                            mag *= 1.0 + 0.1 * log(1.0 / sc.freq_scale);
                        }
                        int i0 = kind & 1 ? i : 2 * i, i1 = kind & 1 ? i + n_rot / 2 : 2 * i + 1;
                        double e0 = (a[i0] * cos(th) - a[i1] * sin(th)) * mag;
                        double e1 = (a[i0] * sin(th) + a[i1] * cos(th)) * mag;
                        /* angles up to 65000 rad lose ~1e-11 relative in double */
                        CHECK_NEAR(b[i0], e0, 3e-5);
                        CHECK_NEAR(b[i1], e1, 3e-5);
                    }
                    for (int i = n_rot; i < D; i++)
                        CHECK_NEAR(b[i], a[i], 0);
                }
            /* refused: no n_ctx_orig with YaRN, a zero or NaN freq_scale */
            sh_rope_scaling bad = sc;
            bad.ext_factor = 1.0f;
            bad.n_ctx_orig = 0;
            CHECK_INT_EQ(sh_backend_rope_ext(be, s, x, pos, T, H, D, n_rot, 1e4f, &bad, m),
                         SH_EINVAL);
            bad = sc;
            bad.freq_scale = 0.0f;
            CHECK_INT_EQ(sh_backend_rope_ext(be, s, x, pos, T, H, D, n_rot, 1e4f, &bad, m),
                         SH_EINVAL);
            bad.freq_scale = NAN;
            CHECK_INT_EQ(sh_backend_rope_ext(be, s, x, pos, T, H, D, n_rot, 1e4f, &bad, m),
                         SH_EINVAL);
            sh_backend_stream_destroy(be, s);
            sh_backend_destroy(be);
        }
}

int main(int argc, char **argv)
{
    static const sh_test_case tests[] = {
        {"attention", test_attention},
        {"attention_groups", test_attention_groups},
        {"attention_invalid", test_attention_invalid},
        {"rope", test_rope},
        {"rope_scaling", test_rope_scaling},
        {NULL, NULL},
    };
    return sh_test_main(argc, argv, tests);
}
