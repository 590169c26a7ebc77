/* AVX-512 VNNI matmul kernels on packed quantized weights (16 rows interleaved, see
 * SH_CPU_PACK_ROWS in cpu.h): decode matvecs near the memory bandwidth and register-blocked
 * prefill tiles (16 rows x up to NT tokens) that read each unpacked weight block once per tile;
 * and the AMX level's forms (SHOAL_ISA=amx): its prefill in BF16 tiles, or INT8 tiles where no
 * bf16 activations were made. */
#include <pthread.h>
#include <stdlib.h>
#include <string.h>

#include "kernels/cpu/cpu.h"

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>

#define TGT __attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")))
#define INL static inline __attribute__((always_inline)) TGT

/* Tokens per register tile: NT float accumulators for the scaled products and NT for the
 * block-sum terms, plus the 8 unpacked code vectors and the scales, fit the 32 zmm registers. */
#define NT 6

enum { K_Q4_0, K_Q4_1, K_Q8_0, K_Q5_0, K_Q5_1 };

/* The decode matvec (one token) walks MV_STREAMS row-group ranges side by side, one group of each
 * at a time, block by block, and software-prefetches each stream MV_PF_DIST bytes ahead into L2.
 * One core streaming a single sequential run reaches only part of the read bandwidth (few misses
 * in flight: the fill buffers, and an L2 streamer that runs ahead of one run within a 4 KiB
 * page); several independent runs keep more lines in flight. Gemma 3 270M's 262144 x 640 Q8_0
 * head, 1 thread, variants alternated in one process on a loaded 2-vCPU Sapphire Rapids VM, mean
 * of 12 rounds: one stream 8 KiB ahead (the kernel before) 7.3 GB/s, 8 streams 1 KiB ahead 9.8;
 * in other runs 2 and 4 streams fell in between, 16 streams and 512 B or 1.5 KiB ahead were no
 * better, 8 streams without software prefetch lost 10-20% on the 2048 x 640 Q5_0 matrices. The
 * stream loop is unrolled so that the accumulators stay in registers (in a loop they lived in
 * memory: L2-resident 2048 x 640 matvecs ran 17.8 GB/s for Q5_0 and 31 for Q8_0, unrolled 20.9 and
 * 47). The nibble types (more unpacking per byte) walk 4 streams: against 8, the same or 6%
 * better from memory on Gemma's 2048 x 640 Q5_0 matrices and 10% better from L2, while the Q8_0
 * head was 1-2% better with 8. Each group's sums run the same instructions as in the prefill
 * tiles, so a token's result does not depend on the path (test_kernels_packed: matvec_streams). */
#define MV_STREAMS 8
#define MV_STREAMS_Q4 4
#define MV_PF_DIST 1024
#define PF_HINT _MM_HINT_T1

INL __m512i bcast4(const int8_t *p)
{
    int32_t v;
    memcpy(&v, p, 4);
    return _mm512_set1_epi32(v);
}

/* Block b of a packed 16-row group w (nb blocks per row) unpacked: q[j] pairs with activation
 * bytes 4j .. 4j + 3 of the block (see cpu.h); dw holds the 16 rows' scales and vw the factor of
 * the block-sum term (dw, or the minimums of Q4_1/Q5_1). */
INL void unpack(const uint8_t *w, int64_t nb, int64_t b, const int kind, __m512i q[8], __m512 *dw,
                __m512 *vw)
{
    const size_t cb = kind == K_Q8_0 ? 512 : 256; /* code bytes per block */
    const int has_m = kind == K_Q4_1 || kind == K_Q5_1, q5 = kind == K_Q5_0 || kind == K_Q5_1;
    const uint8_t *wd = w + (size_t)nb * cb, *wm = wd + (size_t)nb * 32; /* d, m (Q4_1/Q5_1) */
    const uint8_t *wh = wd + (size_t)nb * 32 * (has_m ? 2 : 1);          /* Q5 fifth bits */
    const uint8_t *wb = w + (size_t)b * cb;
    *dw = _mm512_cvtph_ps(_mm256_loadu_si256((const void *)(wd + b * 32)));
    *vw = has_m ? _mm512_cvtph_ps(_mm256_loadu_si256((const void *)(wm + b * 32))) : *dw;
    if (kind == K_Q8_0) {
        for (int j = 0; j < 8; j++)
            q[j] = _mm512_loadu_si512((const void *)(wb + 64 * j));
        return;
    }
    const __m512i low4 = _mm512_set1_epi8(0x0f);
    for (int j = 0; j < 4; j++) {
        const __m512i z = _mm512_loadu_si512((const void *)(wb + 64 * j));
        q[j] = _mm512_and_si512(z, low4);
        q[4 + j] = _mm512_and_si512(_mm512_srli_epi16(z, 4), low4);
    }
    if (q5) {
        const __m512i c16 = _mm512_set1_epi8(16);
        for (int j = 0; j < 8; j++) {
            uint64_t hb;
            memcpy(&hb, wh + b * 64 + 8 * j, 8);
            q[j] = _mm512_mask_add_epi8(q[j], _cvtu64_mask64(hb), q[j], c16);
        }
    }
}

/* Software prefetches for block b of group w, dist bytes ahead in each of its parts. */
INL void prefetch(const uint8_t *w, int64_t nb, int64_t b, const int kind, size_t dist)
{
    const size_t cb = kind == K_Q8_0 ? 512 : 256;
    const int has_m = kind == K_Q4_1 || kind == K_Q5_1, q5 = kind == K_Q5_0 || kind == K_Q5_1;
    const uint8_t *wd = w + (size_t)nb * cb, *wm = wd + (size_t)nb * 32;
    const uint8_t *wh = wd + (size_t)nb * 32 * (has_m ? 2 : 1);
    for (size_t o = 0; o < cb; o += 64)
        _mm_prefetch((const char *)(w + (size_t)b * cb) + dist + o, PF_HINT);
    if (b % 2 == 0) { /* the scales: 64 bytes per two blocks, 1/8 of the codes' pace */
        _mm_prefetch((const char *)(wd + b * 32) + dist / 8, PF_HINT);
        if (has_m)
            _mm_prefetch((const char *)(wm + b * 32) + dist / 8, PF_HINT);
    }
    if (q5) /* the fifth bits: 64 bytes per block, 1/4 of the codes' pace */
        _mm_prefetch((const char *)(wh + b * 64) + dist / 4, PF_HINT);
}

/* Token t's products with unpacked block b, added to acc (the scaled code sums) and acco (the
 * block-sum term); see tile. */
INL void dot(const sh__cpu_act *a, int64_t t, int64_t b, const __m512i q[8], __m512 dw, __m512 vw,
             __m512 *acc, __m512 *acco)
{
    const int64_t nb = a->n_in / SH_CPU_QK;
    const int8_t *ab = a->qs + t * a->n_in + b * SH_CPU_QK;
    __m512i d0, d1;
    /* Two dependency chains of four dpbusd each (one token alone would otherwise wait on the
     * dpbusd latency eight times per block). */
    d0 = _mm512_dpbusd_epi32(_mm512_setzero_si512(), q[0], bcast4(ab));
    d1 = _mm512_dpbusd_epi32(_mm512_setzero_si512(), q[1], bcast4(ab + 4));
    d0 = _mm512_dpbusd_epi32(d0, q[2], bcast4(ab + 8));
    d1 = _mm512_dpbusd_epi32(d1, q[3], bcast4(ab + 12));
    d0 = _mm512_dpbusd_epi32(d0, q[4], bcast4(ab + 16));
    d1 = _mm512_dpbusd_epi32(d1, q[5], bcast4(ab + 20));
    d0 = _mm512_dpbusd_epi32(d0, q[6], bcast4(ab + 24));
    d1 = _mm512_dpbusd_epi32(d1, q[7], bcast4(ab + 28));
    const __m512 f = _mm512_cvtepi32_ps(_mm512_add_epi32(d0, d1));
    *acc = _mm512_fmadd_ps(f, _mm512_mul_ps(dw, _mm512_set1_ps(a->d[t * nb + b])), *acc);
    *acco = _mm512_fmadd_ps(vw, _mm512_set1_ps(a->s[t * nb + b]), *acco);
}

/* Token t's outputs of group g, the rows in [r0, r1): acc + c acco (c: the offset of tile's
 * formula). */
INL void store(const sh__cpu_mm *m, int64_t g, int64_t r0, int64_t r1, int64_t t, const int kind,
               __m512 acc, __m512 acco)
{
    const int has_m = kind == K_Q4_1 || kind == K_Q5_1;
    const float c = kind == K_Q4_0 ? -8.0f : kind == K_Q5_0 ? -16.0f : has_m ? 1.0f : -128.0f;
    const int64_t lo = r0 > 16 * g ? r0 - 16 * g : 0, hi = r1 < 16 * g + 16 ? r1 - 16 * g : 16;
    const __mmask16 k = (__mmask16)(((1u << hi) - 1u) & ~((1u << lo) - 1u));
    float *y = m->y + t * m->ldy + 16 * g;
    __m512 v = _mm512_fmadd_ps(_mm512_set1_ps(c), acco, acc);
    if (m->accumulate)
        v = _mm512_add_ps(v, _mm512_maskz_loadu_ps(k, y));
    _mm512_mask_storeu_ps(y, k, v);
}

/* Rows [16g, 16g + 16) of the packed weight against tokens t0 .. t0 + nt - 1, stored for the
 * rows in [r0, r1). Per block b, token t, row r (q: weight codes, a: activation codes, da/s: the
 * activation block's scale and scaled sum, see sh__cpu_act):
 *   Q4_0: dw (da sum_i q_i a_i - 8 s)          (codes are nibbles, weight = dw (q - 8))
 *   Q4_1: dw da sum_i q_i a_i + m s            (weight = dw q + m)
 *   Q8_0: dw (da sum_i u_i a_i - 128 s)        (u = q + 128, stored biased)
 *   Q5_0: dw (da sum_i q_i a_i - 16 s)         (q = nibble + 16 under the fifth-bit mask)
 *   Q5_1: dw da sum_i q_i a_i + m s
 * so each output is sum_b dw da dot_b + c sum_b v s_b with (c, v) = (-8, dw), (1, m), (-128, dw),
 * (-16, dw), (1, m):
 * acc carries the first sum and acco the second, both 16 rows wide. */
INL void tile(const sh__cpu_mm *m, int64_t g, int64_t r0, int64_t r1, int64_t t0, const int nt,
              const int kind)
{
    const int64_t nb = m->a->n_in / SH_CPU_QK;
    const uint8_t *w = m->w + (size_t)g * m->row_bytes;
    __m512 acc[NT], acco[NT];
    for (int i = 0; i < nt; i++)
        acc[i] = acco[i] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        __m512i q[8];
        __m512 dw, vw;
        unpack(w, nb, b, kind, q, &dw, &vw);
        for (int i = 0; i < nt; i++)
            dot(m->a, t0 + i, b, q, dw, vw, &acc[i], &acco[i]);
    }
    for (int i = 0; i < nt; i++)
        store(m, g, r0, r1, t0 + i, kind, acc[i], acco[i]);
}

/* The matvec of groups g0 + k * step (k < ns) side by side: block b of each in turn. */
INL void mv_groups(const sh__cpu_mm *m, int64_t g0, int64_t step, const int ns, int64_t r0,
                   int64_t r1, const int kind)
{
    const int64_t nb = m->a->n_in / SH_CPU_QK;
    const uint8_t *w0 = m->w + (size_t)g0 * m->row_bytes;
    const size_t sb = (size_t)step * m->row_bytes; /* from one stream's group to the next's */
    __m512 acc[MV_STREAMS], acco[MV_STREAMS];
    for (int k = 0; k < ns; k++)
        acc[k] = acco[k] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        /* unrolled, so that the accumulators stay in registers */
#pragma GCC unroll 16
        for (int k = 0; k < ns; k++) {
            __m512i q[8];
            __m512 dw, vw;
            prefetch(w0 + k * sb, nb, b, kind, MV_PF_DIST);
            unpack(w0 + k * sb, nb, b, kind, q, &dw, &vw);
            dot(m->a, 0, b, q, dw, vw, &acc[k], &acco[k]);
        }
    }
    for (int k = 0; k < ns; k++)
        store(m, g0 + k * step, r0, r1, 0, kind, acc[k], acco[k]);
}

/* One token: the groups of [r0, r1) in MV_STREAMS (Q8_0) or MV_STREAMS_Q4 equal ranges walked
 * side by side (see MV_STREAMS), the groups left over one at a time. */
INL void matvec(const sh__cpu_mm *m, int64_t r0, int64_t r1, const int kind)
{
    const int ns = kind == K_Q8_0 ? MV_STREAMS : MV_STREAMS_Q4;
    const int64_t g0 = r0 / 16, g1 = (r1 + 15) / 16, part = (g1 - g0) / ns;
    for (int64_t i = 0; i < part; i++)
        mv_groups(m, g0 + i, part, ns, r0, r1, kind);
    for (int64_t g = g0 + ns * part; g < g1; g++)
        mv_groups(m, g, 0, 1, r0, r1, kind);
}

/* A few tokens (2 .. FEW_MAX: a speculative verify step of up to 16 drafts, a small decode
 * batch): the matvec's walk (FEW_STREAMS row-group ranges side by side, software prefetch) with
 * each group's unpacked block applied to every token, so the weights stream once at the
 * matvec's pace, where the prefill tiles (one group at a time, no prefetch) read them at one
 * stream's. Each (row, token) sees dot's operations in block order, as in tile and mv_groups, so
 * its result does not depend on the path or the batch (test_kernels_packed: few_tokens). The
 * accumulators that do not fit the registers live in L1. Default model (Q4_1, 2 threads) on the
 * 2-vCPU Sapphire Rapids VM, forward passes of n rows against one (bench/README.md, "Few-row
 * passes"): 4 streams for every n measured better than fewer streams for more tokens (2 streams
 * for 3-4 tokens, 1 from 5, with the accumulators in registers). */
#define FEW_MAX 17
#define FEW_STREAMS 4

INL void few_groups(const sh__cpu_mm *m, int64_t g0, int64_t step, const int ns, int64_t r0,
                    int64_t r1, const int nt, const int kind)
{
    const int64_t nb = m->a->n_in / SH_CPU_QK;
    const uint8_t *w0 = m->w + (size_t)g0 * m->row_bytes;
    const size_t sb = (size_t)step * m->row_bytes;
    __m512 acc[FEW_STREAMS][FEW_MAX], acco[FEW_STREAMS][FEW_MAX];
#pragma GCC unroll 4
    for (int k = 0; k < ns; k++)
        for (int i = 0; i < nt; i++)
            acc[k][i] = acco[k][i] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
#pragma GCC unroll 4
        for (int k = 0; k < ns; k++) {
            __m512i q[8];
            __m512 dw, vw;
            prefetch(w0 + k * sb, nb, b, kind, MV_PF_DIST);
            unpack(w0 + k * sb, nb, b, kind, q, &dw, &vw);
            for (int i = 0; i < nt; i++)
                dot(m->a, i, b, q, dw, vw, &acc[k][i], &acco[k][i]);
        }
    }
#pragma GCC unroll 4
    for (int k = 0; k < ns; k++)
        for (int i = 0; i < nt; i++)
            store(m, g0 + k * step, r0, r1, i, kind, acc[k][i], acco[k][i]);
}

/* Tokens 0 .. nt - 1 (all of them): the groups of [r0, r1) in FEW_STREAMS equal ranges walked
 * side by side, the groups left over one at a time. */
INL void few(const sh__cpu_mm *m, int64_t r0, int64_t r1, const int nt, const int kind)
{
    const int ns = FEW_STREAMS;
    const int64_t g0 = r0 / 16, g1 = (r1 + 15) / 16, part = (g1 - g0) / ns;
    for (int64_t i = 0; i < part; i++)
        few_groups(m, g0 + i, part, ns, r0, r1, nt, kind);
    for (int64_t g = g0 + ns * part; g < g1; g++)
        few_groups(m, g, 0, 1, r0, r1, nt, kind);
}

/* few over all the tokens when there are 2 .. FEW_MAX of them (nt a run-time count: one
 * instance per kind, so that builds with sanitizers compile it in reasonable time); false
 * (nothing done) otherwise. */
INL bool few_tok(const sh__cpu_mm *m, int64_t r0, int64_t r1, const int kind)
{
    const int64_t n = m->a->n_tok;
    if (n < 2 || n > FEW_MAX)
        return false;
    few(m, r0, r1, (int)n, kind);
    return true;
}

/* AMX (Sapphire Rapids and later): the integer sums of 16 tokens x 16 rows x one 32-element
 * block in one tile instruction. The packed codes are already the layout of AMX's second operand
 * (vector j, lane r: the 4 codes of row r that pair with activation bytes 4j .. 4j + 3, i.e. an
 * 8 x 64-byte tile of K/4 rows), and the activation codes of 16 tokens, one row each at a stride
 * of n_in bytes, are the first: TDPBSUD (s8 activations x u8 codes) gives C[t][r] = sum_i a_i
 * u_i, exactly the integer dpbusd sums for that (token, row). The float work per block and token
 * is then the VNNI tile's own (dot, store), in the same order, so an AMX output is bitwise the
 * VNNI kernel's: a token's result does not depend on the path or the batch. Two C tiles
 * alternate so that block b's tile product runs while block b - 1 is scaled. */
#define AMX_TGT                                                                                    \
    __attribute__((target("amx-tile,amx-int8,avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,"       \
                          "f16c")))

/* The tile configuration (LDTILECFG's 64-byte layout): tiles 0 and 1 the C accumulators (16 x
 * 16 int32), 2 and 3 the activations (16 tokens x 32 bytes), 4 and 5 the codes (8 x 64). */
typedef struct amx_cfg {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} amx_cfg;

static AMX_TGT void amx_config(void)
{
    amx_cfg cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette = 1;
    for (int i = 0; i < 6; i++) {
        cfg.colsb[i] = i == 2 || i == 3 ? 32 : 64;
        cfg.rows[i] = i == 4 || i == 5 ? 8 : 16;
    }
    _tile_loadconfig(&cfg);
}

static inline __attribute__((always_inline)) AMX_TGT void
amx_scale(const sh__cpu_act *a, int64_t t0, int64_t b, const int32_t *c, __m512 dw, __m512 *acc)
{
    const int64_t nb = a->n_in / SH_CPU_QK;
    for (int i = 0; i < 16; i++) {
        const __m512 f = _mm512_cvtepi32_ps(_mm512_load_si512((const void *)(c + 16 * i)));
        acc[i] =
            _mm512_fmadd_ps(f, _mm512_mul_ps(dw, _mm512_set1_ps(a->d[(t0 + i) * nb + b])), acc[i]);
    }
}

/* Rows [16g, 16g + 16) against tokens t0 .. t0 + 15 (see the comment above; the formulas are
 * tile's). The tile configuration must be loaded (amx_config). Not inlined: sweep, which calls
 * it, is also compiled for the VNNI entry points, whose target has no AMX. */
static __attribute__((noinline)) AMX_TGT void amx_tile(const sh__cpu_mm *m, int64_t g, int64_t r0,
                                                       int64_t r1, int64_t t0, const int kind)
{
    const sh__cpu_act *a = m->a;
    const int64_t nb = a->n_in / SH_CPU_QK;
    const uint8_t *w = m->w + (size_t)g * m->row_bytes;
    const int8_t *qa = a->qs + t0 * a->n_in;
    _Alignas(64) uint8_t codes[2][512];
    _Alignas(64) int32_t cs[16 * 16];
    __m512 acc[16], dws[3];
    for (int i = 0; i < 16; i++)
        acc[i] = _mm512_setzero_ps();
    /* Iteration b stores block b - 2's products (C tile b % 2, computed an iteration ago), starts
     * block b's into that tile, then scales block b - 2 while the tile unit works: the vector
     * work never waits on a tile product it has just issued. Tile numbers must be constants, so
     * the two parities are spelled out. */
    for (int64_t b = 0; b < nb + 2; b++) {
        const int p = (int)(b & 1);
        if (b >= 2) {
            if (p == 0)
                _tile_stored(0, cs, 64);
            else
                _tile_stored(1, cs, 64);
        }
        if (b < nb) {
            __m512i q[8];
            __m512 vw;
            unpack(w, nb, b, kind, q, &dws[b % 3], &vw);
            const uint8_t *cb = w + (size_t)b * 512; /* Q8_0: the packed codes as they are */
            if (kind != K_Q8_0) {
                for (int j = 0; j < 8; j++)
                    _mm512_store_si512((void *)(codes[p] + 64 * j), q[j]);
                cb = codes[p];
            }
            if (p == 0) {
                _tile_loadd(2, qa + b * SH_CPU_QK, a->n_in);
                _tile_loadd(4, cb, 64);
                _tile_zero(0);
                _tile_dpbsud(0, 2, 4);
            } else {
                _tile_loadd(3, qa + b * SH_CPU_QK, a->n_in);
                _tile_loadd(5, cb, 64);
                _tile_zero(1);
                _tile_dpbsud(1, 3, 5);
            }
        }
        if (b >= 2)
            amx_scale(a, t0, b - 2, cs, dws[(b - 2) % 3], acc);
    }
    /* the block-sum terms, per token in block order as tile's dot adds them (blocks outer, so
     * each block's factors widen once for the 16 tokens) */
    const int has_m = kind == K_Q4_1 || kind == K_Q5_1;
    const uint8_t *wd = w + (size_t)nb * (kind == K_Q8_0 ? 512 : 256);
    const uint8_t *wv = has_m ? wd + (size_t)nb * 32 : wd;
    __m512 acco[16];
    for (int i = 0; i < 16; i++)
        acco[i] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const __m512 vw = _mm512_cvtph_ps(_mm256_loadu_si256((const void *)(wv + b * 32)));
        for (int i = 0; i < 16; i++)
            acco[i] = _mm512_fmadd_ps(vw, _mm512_set1_ps(a->s[(t0 + i) * nb + b]), acco[i]);
    }
    for (int i = 0; i < 16; i++)
        store(m, g, r0, r1, t0 + i, kind, acc[i], acco[i]);
}

/* AMX-BF16 (the AMX level's prefill when sh__cpu_act.xb is set): the weights of a pair of row
 * groups are dequantized once per token block into a bf16 panel in the layout of AMX's second
 * operand (per 32-element step s and group, 1 KiB: tile row p, column r holds elements 2p and
 * 2p + 1 of row r's block s), the activations arrive as bf16 A tiles (xb, converted once per
 * matmul), and TDPBF16PS runs over the whole K with fp32 sums in the C tiles: 2 x 2 C tiles
 * (32 tokens x 32 rows) with 2 A and 2 B tiles, one tile load per tile product. There is no
 * per-block scaling: the scales are inside the dequantized weights (dw (q + c), or dw q + m,
 * exact in fp32 and then rounded to bf16 like the activations). So a result differs from the
 * INT8 kernels' (bf16 keeps 8 significant bits: each product carries a relative error up to
 * about 2^-8, where the int8 activation codes carry up to 1/254 of their block's maximum), but
 * every token of a call runs the same instructions: C zeroed, one tile product per step in step
 * order, then y = C or y + C; so a token's result does not depend on which tile, token block or
 * row range it falls in, on the other tokens of the call or on the thread count. */
#define AMXB_TGT                                                                                   \
    __attribute__((target("amx-tile,amx-bf16,avx512f,avx512bw,avx512vl,avx512vnni,avx512bf16,"     \
                          "avx2,fma,f16c")))
#define AMXB_INL static inline __attribute__((always_inline)) AMXB_TGT

/* The BF16 sweep's blocking (see amxb_sweep): token tiles per token block (512 tokens: the
 * panels are built once per block), bf16 activation bytes of one K range of a token block
 * (L2-resident while a row block passes over them; the range's panel, 2 KiB per step, stays in
 * L1), and 16-row group pairs per row block (their partial sums, 2 KiB per pair and token tile,
 * stored and reloaded between K ranges). Direct calls, tinyllama shapes, 512 tokens, 1 thread,
 * thread CPU time, best of 10, 2 rounds on a loaded VM: 256 KiB ranges (8 steps) 880-955
 * GFLOP/s, 512 KiB 780-885, 1 MiB 850-905. */
#define AMXB_TOK_TILES 32
#define AMXB_A_BYTES (256 << 10)
#define AMXB_ROW_PAIRS 4
/* Prefetch distance of the panel builds' weight reads (4 Q8_0 blocks, 8 Q4_0 ones). */
#define AMXB_PF_DIST 2048

AMXB_TGT void sh__cpu_amx_act_bf16(const sh__cpu_act *act, int64_t t0, int64_t t1)
{
    const int64_t n_in = act->n_in, ns = n_in / SH_CPU_QK;
    uint16_t *xb = (uint16_t *)act->xb;
    for (int64_t tile = t0 / 16; tile * 16 < t1; tile++)
        for (int64_t l = 0; l < 16; l++) {
            const int64_t t = tile * 16 + l;
            uint16_t *dst = xb + tile * ns * 512 + l * 32;
            if (t < t0 || t >= t1) {
                if (t >= act->n_tok) /* padding rows of the last tile */
                    for (int64_t s = 0; s < ns; s++)
                        _mm512_store_si512((void *)(dst + s * 512), _mm512_setzero_si512());
                continue;
            }
            const float *x = act->x + t * n_in;
            for (int64_t s = 0; s < ns; s++) {
                const __m512bh v = _mm512_cvtne2ps_pbh(_mm512_loadu_ps(x + 32 * s + 16),
                                                       _mm512_loadu_ps(x + 32 * s));
                _mm512_store_si512((void *)(dst + s * 512), (__m512i)v);
            }
        }
}

/* Block b of group w as 1 KiB of B tile (see above). unpack's vector j holds, per row lane, the
 * codes of elements 4j .. 4j + 3: its bytes 0-1 make tile row 2j, bytes 2-3 row 2j + 1. */
AMXB_INL void amxb_deq(const uint8_t *w, int64_t nb, int64_t b, const int kind, uint16_t *dst)
{
    __m512i q[8];
    __m512 dw, vw;
    unpack(w, nb, b, kind, q, &dw, &vw);
    const int has_m = kind == K_Q4_1 || kind == K_Q5_1;
    const float c = kind == K_Q4_0 ? -8.0f : kind == K_Q5_0 ? -16.0f : -128.0f;
    /* dw (q + c) = fma(q, dw, c dw): c dw is exact (c a power of two) and so is the result (at
     * most 8 + 11 significant bits); dw q + m rounds once, as the scalar dequantization does */
    const __m512 off = has_m ? vw : _mm512_mul_ps(dw, _mm512_set1_ps(c));
    const __m512i m8 = _mm512_set1_epi32(0xff);
    /* word 2r from the first source's lane r, word 2r + 1 from the second's */
    const __m512i ilv = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24,
                                         8, 23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
    for (int j = 0; j < 8; j++) {
        const __m512i v = q[j];
        const __m512 w0 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_and_si512(v, m8)), dw, off);
        const __m512 w1 = _mm512_fmadd_ps(
            _mm512_cvtepi32_ps(_mm512_and_si512(_mm512_srli_epi32(v, 8), m8)), dw, off);
        const __m512 w2 = _mm512_fmadd_ps(
            _mm512_cvtepi32_ps(_mm512_and_si512(_mm512_srli_epi32(v, 16), m8)), dw, off);
        const __m512 w3 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_srli_epi32(v, 24)), dw, off);
        _mm512_store_si512((void *)(dst + 64 * j),
                           _mm512_permutexvar_epi16(ilv, (__m512i)_mm512_cvtne2ps_pbh(w1, w0)));
        _mm512_store_si512((void *)(dst + 64 * j + 32),
                           _mm512_permutexvar_epi16(ilv, (__m512i)_mm512_cvtne2ps_pbh(w3, w2)));
    }
}

/* Tiles 0-3 the C tiles (16 tokens x 16 fp32), 4-5 the A tiles (16 tokens x 32 bf16), 6-7 the B
 * tiles (16 pairs x 16 rows x 2 bf16): all 16 rows of 64 bytes. */
static AMXB_TGT void amxb_config(void)
{
    amx_cfg cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette = 1;
    for (int i = 0; i < 8; i++) {
        cfg.colsb[i] = 64;
        cfg.rows[i] = 16;
    }
    _tile_loadconfig(&cfg);
}

/* A C tile of tokens t0 .. t0 + 15 x rows 16g .. 16g + 15 (stored at c) into y: the tokens
 * below n_tok and the rows in [r0, r1), y + C when accumulating. */
AMXB_INL void amxb_out(const sh__cpu_mm *m, int64_t g, int64_t r0, int64_t r1, int64_t t0,
                       const float *c)
{
    const int64_t lo = r0 > 16 * g ? r0 - 16 * g : 0, hi = r1 < 16 * g + 16 ? r1 - 16 * g : 16;
    const __mmask16 k = (__mmask16)(((1u << hi) - 1u) & ~((1u << lo) - 1u));
    const int64_t nt = m->a->n_tok - t0 < 16 ? m->a->n_tok - t0 : 16;
    for (int64_t i = 0; i < nt; i++) {
        float *y = m->y + (t0 + i) * m->ldy + 16 * g;
        __m512 v = _mm512_load_ps(c + 16 * i);
        if (m->accumulate)
            v = _mm512_add_ps(v, _mm512_maskz_loadu_ps(k, y));
        _mm512_mask_storeu_ps(y, k, v);
    }
}

/* C tile tn (tokens from t0, rows of group g) into y: straight from the tile where all of it
 * lands there unchanged, else through cbuf. */
#define AMXB_STORE(tn, g, t0)                                                                      \
    do {                                                                                           \
        if (!m->accumulate && (t0) + 16 <= m->a->n_tok && 16 * (g) >= r0 && 16 * (g) + 16 <= r1)   \
            _tile_stored(tn, m->y + (t0)*m->ldy + 16 * (g), m->ldy * (int64_t)sizeof(float));      \
        else {                                                                                     \
            _tile_stored(tn, cbuf, 64);                                                            \
            amxb_out(m, g, r0, r1, t0, cbuf);                                                      \
        }                                                                                          \
    } while (0)

/* The panel of the next work item, dequantized a block at a time between the tile products of
 * the current one (amxb_tiles), so that the vector units build it while the tile unit works: n
 * blocks (1 KiB each, block i of step s0 + i / ng and group g + i % ng) into dst, one every
 * period steps of the tile loop, cnt steps to go before the next. */
typedef struct amxb_dq {
    const uint8_t *w; /* group g of the next item */
    size_t row_bytes;
    uint16_t *dst;
    int64_t ns, s0, i, n, period, cnt;
    int ng;
} amxb_dq;

AMXB_INL void amxb_dq_one(amxb_dq *q, const int kind)
{
    const int64_t i = q->i++;
    const int64_t s = q->s0 + (q->ng == 2 ? i >> 1 : i), gi = q->ng == 2 ? i & 1 : 0;
    const uint8_t *w = q->w + (size_t)gi * q->row_bytes;
    /* the tile loop leaves the weights' stream too slow for the hardware prefetcher */
    prefetch(w, q->ns, s, kind, AMXB_PF_DIST);
    amxb_deq(w, q->ns, s, kind, q->dst + i * 512);
}

/* Token tiles T (and T + 1 when ntt is 2) against group g (and g + 1 when ng is 2) over steps
 * [s0, s1), whose panel is pan (steps of ng KiB from s0), building q's panel on the side. The C
 * tiles start at zero at step 0, else from the partial sums at part (written by the previous
 * step range: fp32 stored and loaded exactly, so the sums are those of one pass over the whole
 * K); they go to y at the last step, else back to part. Per token tile pair part holds 4 tiles
 * of 1 KiB: (T, g), (T, g + 1), (T + 1, g), (T + 1, g + 1). */
AMXB_INL void amxb_tiles(const sh__cpu_mm *m, const uint16_t *pan, const int ng, int64_t g,
                         int64_t r0, int64_t r1, int64_t T, const int ntt, int64_t s0, int64_t s1,
                         float *part, amxb_dq *q, const int kind)
{
    const int64_t ns = m->a->n_in / SH_CPU_QK;
    const uint16_t *x0 = m->a->xb + T * ns * 512, *x1 = x0 + ns * 512;
    _Alignas(64) float cbuf[256];
    if (s0 == 0) {
        _tile_zero(0);
        if (ng == 2)
            _tile_zero(1);
        if (ntt == 2)
            _tile_zero(2);
        if (ng == 2 && ntt == 2)
            _tile_zero(3);
    } else {
        _tile_loadd(0, part, 64);
        if (ng == 2)
            _tile_loadd(1, part + 256, 64);
        if (ntt == 2)
            _tile_loadd(2, part + 512, 64);
        if (ng == 2 && ntt == 2)
            _tile_loadd(3, part + 768, 64);
    }
    for (int64_t s = s0; s < s1; s++) {
        const uint16_t *b = pan + (s - s0) * ng * 512;
        _tile_loadd(4, x0 + s * 512, 64);
        _tile_loadd(6, b, 64);
        if (ng == 2)
            _tile_loadd(7, b + 512, 64);
        if (ntt == 2)
            _tile_loadd(5, x1 + s * 512, 64);
        _tile_dpbf16ps(0, 4, 6);
        if (ng == 2)
            _tile_dpbf16ps(1, 4, 7);
        if (ntt == 2)
            _tile_dpbf16ps(2, 5, 6);
        if (ng == 2 && ntt == 2)
            _tile_dpbf16ps(3, 5, 7);
        if (--q->cnt == 0) {
            q->cnt = q->period;
            if (q->i < q->n)
                amxb_dq_one(q, kind);
        }
    }
    if (s1 < ns) {
        _tile_stored(0, part, 64);
        if (ng == 2)
            _tile_stored(1, part + 256, 64);
        if (ntt == 2)
            _tile_stored(2, part + 512, 64);
        if (ng == 2 && ntt == 2)
            _tile_stored(3, part + 768, 64);
        return;
    }
    AMXB_STORE(0, g, 16 * T);
    if (ng == 2)
        AMXB_STORE(1, g + 1, 16 * T);
    if (ntt == 2)
        AMXB_STORE(2, g, 16 * T + 16);
    if (ng == 2 && ntt == 2)
        AMXB_STORE(3, g + 1, 16 * T + 16);
}

/* Per-thread panel and partial-sum memory, kept between calls (freed when the thread exits). */
static pthread_key_t amxb_key;
static pthread_once_t amxb_once = PTHREAD_ONCE_INIT;
static _Thread_local void *amxb_buf;
static _Thread_local size_t amxb_cap;
static void amxb_key_init(void) { (void)pthread_key_create(&amxb_key, free); }

static void *amxb_mem(size_t bytes)
{
    if (amxb_cap >= bytes)
        return amxb_buf;
    pthread_once(&amxb_once, amxb_key_init);
    void *p = aligned_alloc(64, bytes);
    if (!p)
        return NULL;
    free(amxb_buf);
    amxb_buf = p;
    amxb_cap = bytes;
    (void)pthread_setspecific(amxb_key, p);
    return p;
}

/* A work item of amxb_sweep: token block [tt0, tt1) (tiles), row block from group gb, steps
 * [s0, s1), group pair g (ng groups). */
typedef struct amxb_item {
    int64_t tt0, gb, s0, g;
} amxb_item;

typedef struct amxb_plan {
    int64_t ntile, nbt, ns, kc, g0, g1;
} amxb_plan;

/* The item after it (false at the end): pairs, then step ranges, then row blocks, then token
 * blocks. */
static inline bool amxb_next(const amxb_plan *p, amxb_item *it)
{
    const int64_t gb1 = it->gb + 2 * AMXB_ROW_PAIRS < p->g1 ? it->gb + 2 * AMXB_ROW_PAIRS : p->g1;
    if ((it->g += 2) < gb1)
        return true;
    it->g = it->gb;
    if ((it->s0 += p->kc) < p->ns)
        return true;
    it->s0 = 0;
    if ((it->gb += 2 * AMXB_ROW_PAIRS) < p->g1) {
        it->g = it->gb;
        return true;
    }
    it->gb = it->g = p->g0;
    return (it->tt0 += p->nbt) < p->ntile;
}

/* Sets q to build item it's panel into dst, spread over iters steps of the tile loop. */
static inline void amxb_dq_set(const sh__cpu_mm *m, const amxb_plan *p, const amxb_item *it,
                               uint16_t *dst, int64_t iters, amxb_dq *q)
{
    const int64_t gb1 = it->gb + 2 * AMXB_ROW_PAIRS < p->g1 ? it->gb + 2 * AMXB_ROW_PAIRS : p->g1;
    const int64_t s1 = it->s0 + p->kc < p->ns ? it->s0 + p->kc : p->ns;
    q->w = m->w + (size_t)it->g * m->row_bytes;
    q->row_bytes = m->row_bytes;
    q->dst = dst;
    q->ns = p->ns;
    q->s0 = it->s0;
    q->ng = it->g + 1 < gb1 ? 2 : 1;
    q->i = 0;
    q->n = (s1 - it->s0) * q->ng;
    q->period = iters > q->n ? iters / q->n : 1;
    q->cnt = q->period;
}

/* Token blocks of up to AMXB_TOK_TILES tiles outermost, then row blocks of AMXB_ROW_PAIRS group
 * pairs, then K ranges of kc steps (the block's bf16 activations of a range fill at most
 * AMXB_A_BYTES, and stay in L2 while the row block's pairs pass over them), then the pairs (the
 * panel of a pair's kc steps dequantized once), then token tile pairs. So a weight is
 * dequantized once per token block (once per matmul up to 512 tokens) whatever K is, where a
 * token block sized to hold the whole K in L2 rebuilt it n_tok * n_in * 2 / 1 MiB times (8 times
 * for a 512-token prefill through tinyllama's 2048 x 5632 down projection). Each item's panel is
 * built during the previous item's tile products (two panels alternate; the first item's is
 * built alone). False (nothing written) when the panel memory cannot be had. */
AMXB_INL bool amxb_sweep_k(const sh__cpu_mm *m, int64_t r0, int64_t r1, const int kind)
{
    amxb_plan p;
    p.ns = m->a->n_in / SH_CPU_QK;
    p.ntile = (m->a->n_tok + 15) / 16;
    p.nbt = p.ntile < AMXB_TOK_TILES ? p.ntile : AMXB_TOK_TILES; /* tiles per block */
    p.kc = AMXB_A_BYTES / (p.nbt * 1024);
    p.kc = p.kc > p.ns ? p.ns : p.kc;
    p.g0 = r0 / 16;
    p.g1 = (r1 + 15) / 16;
    /* two panels, then per pair of a row block (nbt + 1) * 2 C tiles of partial sums */
    const size_t pan_bytes = (size_t)p.kc * 2048;
    const size_t part_tiles = p.kc < p.ns ? (size_t)AMXB_ROW_PAIRS * (size_t)(p.nbt + 1) * 2 : 0;
    uint16_t *pans = amxb_mem(2 * pan_bytes + part_tiles * 1024);
    if (!pans)
        return false;
    float *part = (float *)(void *)((uint8_t *)pans + 2 * pan_bytes);
    amxb_config();
    amxb_item it = {0, p.g0, 0, p.g0};
    amxb_dq q;
    amxb_dq_set(m, &p, &it, pans, 1, &q);
    while (q.i < q.n)
        amxb_dq_one(&q, kind);
    int cur = 0;
    for (bool more = true; more;) {
        amxb_item nx = it;
        more = amxb_next(&p, &nx);
        const int64_t tt1 = it.tt0 + p.nbt < p.ntile ? it.tt0 + p.nbt : p.ntile;
        const int64_t gb1 = it.gb + 2 * AMXB_ROW_PAIRS < p.g1 ? it.gb + 2 * AMXB_ROW_PAIRS : p.g1;
        const int64_t s0 = it.s0, s1 = s0 + p.kc < p.ns ? s0 + p.kc : p.ns, g = it.g;
        const int ng = g + 1 < gb1 ? 2 : 1;
        const uint16_t *pan = (const uint16_t *)((const uint8_t *)pans + cur * pan_bytes);
        uint16_t *npan = (uint16_t *)(void *)((uint8_t *)pans + (1 - cur) * pan_bytes);
        if (more)
            amxb_dq_set(m, &p, &nx, npan, (s1 - s0) * ((tt1 - it.tt0 + 1) / 2), &q);
        else
            q.i = q.n = 0;
        float *pp = part + (size_t)((g - it.gb) / 2) * (size_t)(p.nbt + 1) * 512;
        for (int64_t T = it.tt0; T < tt1; T += 2) {
            float *pt = pp + (T - it.tt0) * 512;
            if (T + 1 < tt1) {
                if (ng == 2)
                    amxb_tiles(m, pan, 2, g, r0, r1, T, 2, s0, s1, pt, &q, kind);
                else
                    amxb_tiles(m, pan, 1, g, r0, r1, T, 2, s0, s1, pt, &q, kind);
            } else if (ng == 2)
                amxb_tiles(m, pan, 2, g, r0, r1, T, 1, s0, s1, pt, &q, kind);
            else
                amxb_tiles(m, pan, 1, g, r0, r1, T, 1, s0, s1, pt, &q, kind);
        }
        while (q.i < q.n)
            amxb_dq_one(&q, kind);
        it = nx;
        cur = 1 - cur;
    }
    _tile_release();
    return true;
}

/* amxb_sweep_k with kind a constant in each form. Not inlined: the AMX entry points' target has
 * no AMX-BF16. */
static __attribute__((noinline)) AMXB_TGT bool amxb_sweep(const sh__cpu_mm *m, int64_t r0,
                                                          int64_t r1, const int kind)
{
    switch (kind) {
    case K_Q4_0:
        return amxb_sweep_k(m, r0, r1, K_Q4_0);
    case K_Q4_1:
        return amxb_sweep_k(m, r0, r1, K_Q4_1);
    case K_Q8_0:
        return amxb_sweep_k(m, r0, r1, K_Q8_0);
    case K_Q5_0:
        return amxb_sweep_k(m, r0, r1, K_Q5_0);
    default:
        return amxb_sweep_k(m, r0, r1, K_Q5_1);
    }
}

/* Activation bytes of a token block: the tokens whose codes stay in L2 while every row group
 * of the chunk passes over them. */
#define TOK_BLOCK_BYTES (1 << 20)

/* Token blocks outermost, then row groups, then token tiles: a group's packed blocks (nb * 288
 * bytes for Q4_0) stay in L1/L2 while the block's token tiles pass over them, and the block's
 * activation codes stay in L2 across the groups. Weights are read once per token block (once
 * per matmul unless n_tok * n_in passes 1 MiB, e.g. a 512-token prefill through a 5632-wide
 * FFN). */
INL void sweep(const sh__cpu_mm *m, int64_t r0, int64_t r1, const int kind, const int amx)
{
    const int64_t n_tok = m->a->n_tok;
    if (n_tok == 1) {
        matvec(m, r0, r1, kind);
        return;
    }
    if (!amx && few_tok(m, r0, r1, kind))
        return;
    int64_t tb = TOK_BLOCK_BYTES / m->a->n_in / 48 * 48; /* a multiple of NT and of 16 */
    tb = tb < 48 ? 48 : tb;
    for (int64_t t0 = 0; t0 < n_tok; t0 += tb) {
        const int64_t t1 = t0 + tb < n_tok ? t0 + tb : n_tok;
        for (int64_t g = r0 / 16; g * 16 < r1; g++) {
            int64_t t = t0;
            if (amx)
                for (; t + 16 <= t1; t += 16)
                    amx_tile(m, g, r0, r1, t, kind);
            for (; t + NT <= t1; t += NT)
                tile(m, g, r0, r1, t, NT, kind);
            switch (t1 - t) {
            case 5:
                tile(m, g, r0, r1, t, 5, kind);
                break;
            case 4:
                tile(m, g, r0, r1, t, 4, kind);
                break;
            case 3:
                tile(m, g, r0, r1, t, 3, kind);
                break;
            case 2:
                tile(m, g, r0, r1, t, 2, kind);
                break;
            case 1:
                tile(m, g, r0, r1, t, 1, kind);
                break;
            default:
                break;
            }
        }
    }
}

/* F16: packed block b of group g is 32 steps of 16 fp16 (element 32b + e of the 16 rows), so
 * acc[t] (16 rows) += w[e] * x[t][32b + e] with x broadcast from memory: no horizontal sums and
 * one conversion per 16 weights for all nt tokens. Every (row, token) is one FMA chain over the
 * elements in order, in a tile of any size and in the one-token matvec alike, so a token's result
 * does not depend on the batch (the matvec covers the FMA latency with several row groups' chains
 * side by side, not by splitting one sum). */
#define NTF 16
/* Prefetch distance of the F16 matvec: 8 KiB ahead measured 1.3-2x faster than no prefetch on the
 * quantized kernels' single-stream form (tinyllama shapes, 1 thread). */
#define F16_PF_DIST 8192
/* Row groups the one-token matvec walks side by side (independent FMA chains). */
#define F16_MV_GROUPS 4

/* Stores (or adds) acc as token t's rows of group g inside [r0, r1). */
INL void store_f16(const sh__cpu_mm *m, int64_t g, int64_t r0, int64_t r1, int64_t t, __m512 acc)
{
    const int64_t lo = r0 > 16 * g ? r0 - 16 * g : 0, hi = r1 < 16 * g + 16 ? r1 - 16 * g : 16;
    const __mmask16 km = (__mmask16)(((1u << hi) - 1u) & ~((1u << lo) - 1u));
    float *y = m->y + t * m->ldy + 16 * g;
    if (m->accumulate)
        acc = _mm512_add_ps(acc, _mm512_maskz_loadu_ps(km, y));
    _mm512_mask_storeu_ps(y, km, acc);
}

INL void tile_f16(const sh__cpu_mm *m, int64_t g, int64_t r0, int64_t r1, int64_t t0, const int nt)
{
    const sh__cpu_act *a = m->a;
    const int64_t n_in = a->n_in;
    const uint16_t *w = (const uint16_t *)(m->w + (size_t)g * m->row_bytes);
    __m512 acc[NTF];
    for (int i = 0; i < NTF; i++)
        acc[i] = _mm512_setzero_ps();
    /* the tile's tokens lie in one 16-token tile of xt (NTF 16 tiles start at multiples of 16;
     * the tail tiles 8, 4, 2, 1 stay inside the last one), lanes from t0 % 16 */
    const float *xt = a->xt + (t0 / 16) * n_in * 16 + t0 % 16;
    for (int64_t k = 0; k < n_in; k++) {
        const __m512 wv = _mm512_cvtph_ps(_mm256_loadu_si256((const void *)(w + 16 * k)));
        for (int i = 0; i < nt; i++)
            acc[i] = _mm512_fmadd_ps(wv, _mm512_set1_ps(xt[k * 16 + i]), acc[i]);
    }
    for (int i = 0; i < nt; i++)
        store_f16(m, g, r0, r1, t0 + i, acc[i]);
}

/* One token (n_tok 1, read from x), row groups g0 .. g0 + ng - 1 side by side. */
INL void mv_f16(const sh__cpu_mm *m, int64_t g0, const int ng, int64_t r0, int64_t r1)
{
    const float *x = m->a->x;
    const int64_t n_in = m->a->n_in;
    const uint16_t *w[F16_MV_GROUPS];
    __m512 acc[F16_MV_GROUPS];
    for (int j = 0; j < ng; j++) {
        w[j] = (const uint16_t *)(m->w + (size_t)(g0 + j) * m->row_bytes);
        acc[j] = _mm512_setzero_ps();
    }
    for (int64_t k = 0; k < n_in; k++) {
        const __m512 xv = _mm512_set1_ps(x[k]);
        for (int j = 0; j < ng; j++) {
            if ((k & 3) == 0) /* 4 steps of 32 bytes: two cache lines */
                for (int c = 0; c < 128; c += 64)
                    _mm_prefetch((const char *)(w[j] + 16 * k) + F16_PF_DIST + c, _MM_HINT_T1);
            acc[j] = _mm512_fmadd_ps(
                _mm512_cvtph_ps(_mm256_loadu_si256((const void *)(w[j] + 16 * k))), xv, acc[j]);
        }
    }
    for (int j = 0; j < ng; j++)
        store_f16(m, g0 + j, r0, r1, 0, acc[j]);
}

TGT void sh__cpu_avx512_mmp_f16(const sh__cpu_mm *m, int64_t r0, int64_t r1)
{
    const int64_t n_tok = m->a->n_tok, g1 = (r1 + 15) / 16;
    if (n_tok == 1) {
        int64_t g = r0 / 16;
        for (; g + F16_MV_GROUPS <= g1; g += F16_MV_GROUPS)
            mv_f16(m, g, F16_MV_GROUPS, r0, r1);
        for (; g < g1; g++)
            mv_f16(m, g, 1, r0, r1);
        return;
    }
    for (int64_t g = r0 / 16; g < g1; g++) {
        int64_t t = 0;
        for (; t + NTF <= n_tok; t += NTF)
            tile_f16(m, g, r0, r1, t, NTF);
        /* the tail in power-of-two tiles, so that each tile size is a compile-time constant */
        if (n_tok - t >= 8) {
            tile_f16(m, g, r0, r1, t, 8);
            t += 8;
        }
        if (n_tok - t >= 4) {
            tile_f16(m, g, r0, r1, t, 4);
            t += 4;
        }
        if (n_tok - t >= 2) {
            tile_f16(m, g, r0, r1, t, 2);
            t += 2;
        }
        if (n_tok - t >= 1)
            tile_f16(m, g, r0, r1, t, 1);
    }
}

TGT void sh__cpu_avx512_mmp_q4_0(const sh__cpu_mm *m, int64_t r0, int64_t r1)
{
    sweep(m, r0, r1, K_Q4_0, 0);
}

TGT void sh__cpu_avx512_mmp_q4_1(const sh__cpu_mm *m, int64_t r0, int64_t r1)
{
    sweep(m, r0, r1, K_Q4_1, 0);
}

TGT void sh__cpu_avx512_mmp_q8_0(const sh__cpu_mm *m, int64_t r0, int64_t r1)
{
    sweep(m, r0, r1, K_Q8_0, 0);
}

TGT void sh__cpu_avx512_mmp_q5_0(const sh__cpu_mm *m, int64_t r0, int64_t r1)
{
    sweep(m, r0, r1, K_Q5_0, 0);
}

TGT void sh__cpu_avx512_mmp_q5_1(const sh__cpu_mm *m, int64_t r0, int64_t r1)
{
    sweep(m, r0, r1, K_Q5_1, 0);
}

/* The AMX forms: with xb every token through amxb_sweep (BF16); without, 16-token tiles
 * through amx_tile (INT8) and the tokens left over (and decode) through the VNNI tiles. Tile
 * state is configured per call and released after it, so a pool thread holds none between
 * ops. */
#define AMX_ENTRY(name, kind, vnni)                                                                \
    AMX_TGT void name(const sh__cpu_mm *m, int64_t r0, int64_t r1)                                 \
    {                                                                                              \
        if (m->a->xb && amxb_sweep(m, r0, r1, kind))                                               \
            return;                                                                                \
        if (m->a->n_tok < 16) {                                                                    \
            vnni(m, r0, r1);                                                                       \
            return;                                                                                \
        }                                                                                          \
        amx_config();                                                                              \
        sweep(m, r0, r1, kind, 1);                                                                 \
        _tile_release();                                                                           \
    }
AMX_ENTRY(sh__cpu_amx_mmp_q4_0, K_Q4_0, sh__cpu_avx512_mmp_q4_0)
AMX_ENTRY(sh__cpu_amx_mmp_q4_1, K_Q4_1, sh__cpu_avx512_mmp_q4_1)
AMX_ENTRY(sh__cpu_amx_mmp_q8_0, K_Q8_0, sh__cpu_avx512_mmp_q8_0)
AMX_ENTRY(sh__cpu_amx_mmp_q5_0, K_Q5_0, sh__cpu_avx512_mmp_q5_0)
AMX_ENTRY(sh__cpu_amx_mmp_q5_1, K_Q5_1, sh__cpu_avx512_mmp_q5_1)

#endif
