/* What the AVX2 packed Q4_K and Q5_K kernels share (ops_q4k_avx2_packed.c,
 * ops_q5k_avx2_packed.c): the decoding of 8 rows' 6-bit scales and minimums from the packed
 * super-block (the same header in both layouts, cpu.h), the register pinning of the tiles, and the
 * multi-token sweep that unpacks each half super-block once for a whole block of tokens. */
#ifndef SH_KERNELS_CPU_AVX2_K4_H
#define SH_KERNELS_CPU_AVX2_K4_H

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#include <string.h>

#include "kernels/cpu/avx2_store.h"
#include "kernels/cpu/cpu.h"

#define SH_AVX2_K4_INL static inline __attribute__((always_inline, target("avx2,fma,f16c")))

/* The scales of one half (8 rows) of a super-block, decoded once for all tokens of a tile: per row
 * lane, sub-block j's scale as the int16 pair (sc_j, sc_j), so that one vpmaddwd of the 16-bit
 * pair sums gives sc_j times the row's 32-element dot product, and the minimum m_j likewise (one
 * vpmaddwd with the broadcast pair of block sums (bsums_2j, bsums_2j+1) gives
 * m_j (bsums_2j + bsums_2j+1)). */
typedef struct q4k_half {
    __m256i sc[8], mp[8];
    __m256 d, dmin;
} q4k_half;

/* The byte shuffle that puts byte k of each 32-bit lane in both of its 16-bit halves (zero
 * high bytes). */
SH_AVX2_K4_INL __m256i pair_ctrl(int k)
{
    const char z = (char)-128; /* 0x80: the shuffle writes zero */
    return _mm256_broadcastsi128_si256(
        _mm_setr_epi8((char)k, z, (char)k, z, (char)(4 + k), z, (char)(4 + k), z, (char)(8 + k), z,
                      (char)(8 + k), z, (char)(12 + k), z, (char)(12 + k), z));
}

/* quant_k.c's get_scale_min for 8 rows, four sub-blocks per 32-bit lane (as the AVX-512 kernel):
 * j < 4 are the low six bits of bytes j (sc) and 4 + j (m); j >= 4 the low (sc) or high (m)
 * nibble of byte j + 4 with the top two bits of byte j - 4 (sc) or j (m) above it. The 32-bit
 * shifts carry bits across bytes only into masked-off positions. */
SH_AVX2_K4_INL void decode_half(const uint8_t *pb, int h, q4k_half *s)
{
    const uint8_t *ps = pb + SH_CPU_PACK_Q4K_SC + 32 * h;
    const __m256i v0 = _mm256_loadu_si256((const void *)ps);
    const __m256i v1 = _mm256_loadu_si256((const void *)(ps + 64));
    const __m256i v2 = _mm256_loadu_si256((const void *)(ps + 128));
    const __m256i m6 = _mm256_set1_epi8(0x3f), m4 = _mm256_set1_epi8(0x0f);
    const __m256i t2 = _mm256_set1_epi8(0x30);
    const __m256i sc_lo = _mm256_and_si256(v0, m6), m_lo = _mm256_and_si256(v1, m6);
    const __m256i sc_hi =
        _mm256_or_si256(_mm256_and_si256(v2, m4), _mm256_and_si256(_mm256_srli_epi32(v0, 2), t2));
    const __m256i m_hi = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi32(v2, 4), m4),
                                         _mm256_and_si256(_mm256_srli_epi32(v1, 2), t2));
    for (int k = 0; k < 4; k++) {
        const __m256i c = pair_ctrl(k);
        s->sc[k] = _mm256_shuffle_epi8(sc_lo, c);
        s->sc[4 + k] = _mm256_shuffle_epi8(sc_hi, c);
        s->mp[k] = _mm256_shuffle_epi8(m_lo, c);
        s->mp[4 + k] = _mm256_shuffle_epi8(m_hi, c);
    }
    const uint8_t *pd = pb + SH_CPU_PACK_Q4K_D + 16 * h;
    s->d = _mm256_cvtph_ps(_mm_loadu_si128((const void *)pd));
    s->dmin = _mm256_cvtph_ps(_mm_loadu_si128((const void *)(pd + 32)));
}

/* s += p in 16-bit lanes, and an empty asm that makes v a register value at this point. Written
 * so because GCC (12) otherwise moves each token's vpmaddubsw products ahead of their sums,
 * holding them all at once and spilling most of them to the stack (with a plain add and only the
 * empty asm on s, it kept the sums but added a register copy per product). */
#define ADD16(s, p) __asm__("vpaddw %1, %0, %0" : "+x"(s) : "x"(p))
#define PIN(v) __asm__("" : "+x"(v))

SH_AVX2_K4_INL __m256i k4_bcast4(const void *p)
{
    int32_t v;
    memcpy(&v, p, 4);
    return _mm256_set1_epi32(v);
}

/* Tokens per tile of the sweep below. The codes come from the unpacked copy in L1 (one load per
 * vector, shared by the tile's tokens), so the loop holds per token a 16-bit and a 32-bit sum and
 * beside them only the code vector and the broadcast. callgrind, one 210-token call on a 2048 x
 * 2048 weight: Q4_K 112.0M instructions for 5 tokens, 115.9M for 6, 117.5M for 7 (Q5_K 126.4M,
 * 132.2M, 130.8M); timed (best of 10, 2 alternated rounds) 5 and 6 alike, 7 up to 8% slower. */
#ifndef K4_NT
#define K4_NT 5
#endif
/* At most this many tokens per block of the sweep: their float sums (32 bytes each) live on the
 * stack while a row group's half passes over its super-blocks. */
#define K4_TOK_MAX 256

/* The float steps of one half super-block for one token (ab, its Q8_K block, with scale da and
 * 16-element sums bsums), shared by the tiles and the Q4_K / Q5_K matvecs so that a token's result
 * does not depend on the path: per row, with q the codes and a the Q8_K codes,
 *   isum = sum_j sc_j sum_{i in j} q_i a_i        (int32, exact: ia)
 *   msum = sum_j m_j (bsums_2j + bsums_2j+1)      (int32, exact)
 *   acc += float(isum) * (d da);  acc -= float(msum) * (dmin da).
 * Returns the new acc. */
SH_AVX2_K4_INL __m256 k4_finish(const q4k_half *s, const sh_block_q8_k *ab, __m256i ia, __m256 acc)
{
    const int16_t *bs = ab->bsums;
    __m256i ms0 = _mm256_madd_epi16(s->mp[0], k4_bcast4(bs));
    __m256i ms1 = _mm256_madd_epi16(s->mp[1], k4_bcast4(bs + 2));
    for (int k = 2; k < 8; k += 2) {
        ms0 = _mm256_add_epi32(ms0, _mm256_madd_epi16(s->mp[k], k4_bcast4(bs + 2 * k)));
        ms1 = _mm256_add_epi32(ms1, _mm256_madd_epi16(s->mp[k + 1], k4_bcast4(bs + 2 * k + 2)));
    }
    const __m256 da = _mm256_set1_ps(ab->d);
    acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(ia), _mm256_mul_ps(s->d, da), acc);
    return _mm256_fnmadd_ps(_mm256_cvtepi32_ps(_mm256_add_epi32(ms0, ms1)),
                            _mm256_mul_ps(s->dmin, da), acc);
}

/* One unpacked half super-block (q: vector 8j + v holds sub-block j's codes 4v .. 4v + 3 of the
 * 8 rows, one byte each, s its scales) against tokens ab[0 .. nt - 1] (their Q8_K blocks), added
 * to acc[i]. run code vectors add their vpmaddubsw pair sums in 16 bits before one vpmaddwd
 * applies the sub-block's scale (8 for 4-bit codes, 4 for 5-bit: see the kernels' bounds). Per
 * row and token:
 *   isum = sum_j sc_j sum_{i in j} q_i a_i        (int32, exact)
 *   msum = sum_j m_j (bsums_2j + bsums_2j+1)      (int32, exact)
 *   acc += float(isum) * (d da);  acc -= float(msum) * (dmin da),
 * the kernels' one-super-block step (sb_half) in the same float operations, so a token's output
 * does not depend on the path, its tile or the row split. */
SH_AVX2_K4_INL void k4_tile(const __m256i *q, const q4k_half *s, const sh_block_q8_k *const *ab,
                            const int nt, const int run, __m256 *acc)
{
    __m256i ia[K4_NT];
    for (int i = 0; i < nt; i++)
        ia[i] = _mm256_setzero_si256();
#pragma GCC unroll 8
    for (int j = 0; j < 8; j++) {
        __m256i s16[K4_NT];
#pragma GCC unroll 8
        for (int v = 0; v < 8; v++) {
            const __m256i x = _mm256_load_si256(q + 8 * j + v);
            for (int i = 0; i < nt; i++) {
                const __m256i p = _mm256_maddubs_epi16(x, k4_bcast4(ab[i]->qs + 32 * j + 4 * v));
                if (v % run)
                    ADD16(s16[i], p);
                else
                    s16[i] = p;
            }
            if (v % run == run - 1)
                for (int i = 0; i < nt; i++)
                    SH_AVX2_ADD32(ia[i], _mm256_madd_epi16(s16[i], s->sc[j]));
        }
    }
    for (int i = 0; i < nt; i++)
        acc[i] = k4_finish(s, ab[i], ia[i], acc[i]);
}

/* Tokens per tile of runs of 4 (Q5_K, k4_rtile). With the token loop inside the runs the tile
 * holds 4 code vectors, the scale and one int32 sum per token (k4_tile held a 16-bit and a 32-bit
 * sum per token and spilled). GCC 12, per 32-byte step of the unrolled tile: 4.42 instructions at
 * 33ac572's k4_tile (5 tokens, 39 vector stores to the stack per tile), 4.10 for 5 tokens (13
 * stores), 4.24 for 6 (26), 4.50 for 7 (28); on the 2-vCPU EPYC, 2048 x 2048 and 2048 x 5632 at 512
 * tokens, 5 ran fastest of 5 to 7. */
#ifndef K4_RNT
#define K4_RNT 5
#endif
/* The tile for runs of 4 (Q5_K's 5-bit codes): run r (code vectors 4r .. 4r + 3, sub-block r / 2)
 * is the outer loop and its four code vectors stay in registers while each token in turn adds its
 * four vpmaddubsw pair sums in 16 bits and applies the sub-block's scale, so a token holds only its
 * int32 sum. The integer sums are k4_tile's (exact in any order) and the float steps the same. */
SH_AVX2_K4_INL void k4_rtile(const __m256i *q, const q4k_half *s, const sh_block_q8_k *const *ab,
                             const int nt, __m256 *acc)
{
    __m256i ia[K4_RNT];
    for (int i = 0; i < nt; i++)
        ia[i] = _mm256_setzero_si256();
#pragma GCC unroll 16
    for (int r = 0; r < 16; r++) {
        const __m256i x0 = _mm256_load_si256(q + 4 * r), x1 = _mm256_load_si256(q + 4 * r + 1);
        const __m256i x2 = _mm256_load_si256(q + 4 * r + 2), x3 = _mm256_load_si256(q + 4 * r + 3);
        for (int i = 0; i < nt; i++) {
            const int8_t *pa = ab[i]->qs + 16 * r;
            __m256i p = _mm256_maddubs_epi16(x0, k4_bcast4(pa));
            ADD16(p, _mm256_maddubs_epi16(x1, k4_bcast4(pa + 4)));
            ADD16(p, _mm256_maddubs_epi16(x2, k4_bcast4(pa + 8)));
            ADD16(p, _mm256_maddubs_epi16(x3, k4_bcast4(pa + 12)));
            SH_AVX2_ADD32(ia[i], _mm256_madd_epi16(p, s->sc[r / 2]));
        }
    }
    for (int i = 0; i < nt; i++)
        acc[i] = k4_finish(s, ab[i], ia[i], acc[i]);
}

/* The tail tile of n tokens (n < 8), each size its own compile-time case. */
#define K4_TAIL(n, tile, ntmax, ...)                                                               \
    switch (n) {                                                                                   \
    case 7:                                                                                        \
        tile(q, s, ab, 7 < (ntmax) ? 7 : 1, __VA_ARGS__);                                          \
        break;                                                                                     \
    case 6:                                                                                        \
        tile(q, s, ab, 6 < (ntmax) ? 6 : 1, __VA_ARGS__);                                          \
        break;                                                                                     \
    case 5:                                                                                        \
        tile(q, s, ab, 5 < (ntmax) ? 5 : 1, __VA_ARGS__);                                          \
        break;                                                                                     \
    case 4:                                                                                        \
        tile(q, s, ab, 4 < (ntmax) ? 4 : 1, __VA_ARGS__);                                          \
        break;                                                                                     \
    case 3:                                                                                        \
        tile(q, s, ab, 3 < (ntmax) ? 3 : 1, __VA_ARGS__);                                          \
        break;                                                                                     \
    case 2:                                                                                        \
        tile(q, s, ab, 2 < (ntmax) ? 2 : 1, __VA_ARGS__);                                          \
        break;                                                                                     \
    case 1:                                                                                        \
        tile(q, s, ab, 1, __VA_ARGS__);                                                            \
        break;                                                                                     \
    default:                                                                                       \
        break;                                                                                     \
    }

/* Super-block b of tokens t .. t1 - 1 (block-relative acc) in tiles of K4_NT (K4_RNT for runs of
 * 4) and one tail tile (each tail size its own compile-time case). */
SH_AVX2_K4_INL void k4_tiles(const __m256i *q, const q4k_half *s, const sh__cpu_act *a, int64_t nb,
                             int64_t b, int64_t t, int64_t t1, const int run, __m256 *acc)
{
    _Static_assert(K4_NT <= 8 && K4_RNT <= 8, "the tail cases go up to 7");
    const sh_block_q8_k *ab[8];
    const int ntile = run == 4 ? K4_RNT : K4_NT;
    for (; t + ntile <= t1; t += ntile, acc += ntile) {
        for (int i = 0; i < ntile; i++)
            ab[i] = a->qk + (t + i) * nb + b;
        if (run == 4)
            k4_rtile(q, s, ab, K4_RNT, acc);
        else
            k4_tile(q, s, ab, K4_NT, run, acc);
    }
    const int n = (int)(t1 - t);
    for (int i = 0; i < n; i++)
        ab[i] = a->qk + (t + i) * nb + b;
    if (run == 4) {
        K4_TAIL(n, k4_rtile, K4_RNT, acc)
    } else {
        K4_TAIL(n, k4_tile, K4_NT, run, acc)
    }
}
#undef K4_TAIL

/* The multi-token product of a packed Q4_K or Q5_K weight (super-blocks of sb_bytes; unpack(pb,
 * h, q) writes half h of the super-block at pb as k4_tile's 64 code vectors): token blocks of
 * about block_bytes of activations, at most K4_TOK_MAX tokens, outermost (their Q8_K rows stay in
 * L2), then the row groups of [r0, r1) and their halves, then super-blocks: each half super-block
 * is unpacked once (2 KiB, in L1) and its scales decoded once for all the block's tokens, whose
 * float sums wait on the stack until the half's last super-block. */
SH_AVX2_K4_INL void k4_sweep(const sh__cpu_mm *m, int64_t r0, int64_t r1, size_t sb_bytes,
                             const int run, size_t block_bytes,
                             void (*unpack)(const uint8_t *pb, int h, __m256i *q))
{
    const sh__cpu_act *a = m->a;
    const int64_t nb = a->n_in / SH_QK_K, n_tok = a->n_tok;
    int64_t tb = (int64_t)(block_bytes / ((size_t)nb * sizeof(sh_block_q8_k)));
    tb = tb < 1 ? 1 : tb > K4_TOK_MAX ? K4_TOK_MAX : tb;
    __m256 acc[K4_TOK_MAX];
    __m256i q[64];
    for (int64_t t0 = 0; t0 < n_tok; t0 += tb) {
        const int64_t t1 = t0 + tb < n_tok ? t0 + tb : n_tok;
        for (int64_t g = r0 / 16; g * 16 < r1; g++)
            for (int h = 0; h < 2; h++) {
                if (16 * g + 8 * h >= r1 || 16 * g + 8 * h + 8 <= r0)
                    continue;
                for (int64_t t = t0; t < t1; t++)
                    acc[t - t0] = _mm256_setzero_ps();
                const uint8_t *w = m->w + (size_t)g * m->row_bytes;
                for (int64_t b = 0; b < nb; b++) {
                    const uint8_t *pb = w + (size_t)b * sb_bytes;
                    q4k_half s;
                    decode_half(pb, h, &s);
                    unpack(pb, h, q);
                    k4_tiles(q, &s, a, nb, b, t0, t1, run, acc);
                }
                for (int64_t t = t0; t < t1; t++)
                    sh__avx2_store_half(m, g, h, r0, r1, t, acc[t - t0]);
            }
    }
}

#endif

#endif
