/* AVX2 matmul on packed Q6_K weights (the 16-row layout at SH_CPU_PACK_Q6K_BLOCK in cpu.h, the one
 * copy the AVX-512 kernel reads): a 256-bit register holds 8 of a group's 16 rows (half h is bytes
 * 32h .. 32h + 31 of each 64-byte vector of a unit), so the dot products of 8 rows against a
 * broadcast 4-byte slice of the activation need no horizontal sums, and each half super-block is
 * unpacked once (into L1) for a block of tokens. For CPUs without AVX-512: vpmaddubsw makes 16-bit
 * pair sums, and one vpmaddwd with the rows' sub-block scales both widens and scales them, so the
 * sums stay integers to the end of a super-block. */
#include <string.h>

#include "kernels/cpu/avx2_store.h"
#include "kernels/cpu/cpu.h"

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>

#define TGT __attribute__((target("avx2,fma,f16c")))
#define INL static inline __attribute__((always_inline)) TGT

/* Tokens per tile. The tile reads the codes unpacked once per half super-block (two loads per
 * unit pair, shared by its tokens) and holds one integer sum per token. callgrind, one 210-token
 * call on a 2048 x 2048 weight: 127.6M instructions for 6 tokens, 127.5M for 8, 123.9M for 10,
 * 128.9M for 12; timed (best of 10, 2 alternated rounds) all within the noise. Earlier, when each
 * tile unpacked its own codes, 8 came out ahead of 6, 5 and 4 (4: about 10% slower). */
#ifndef NT
#define NT 8
#endif
/* The decode matvec walks MV_STREAMS row groups side by side with software prefetch MV_PF_DIST
 * bytes ahead (0: none), the group's d lines prefetched when its walk starts. Sapphire Rapids
 * (4 streams): one super-block ahead ran 0.89-1.14x the file-layout kernel from DRAM, 1024 bytes
 * 0.76-0.85x, 2048 0.89-0.97x. On the 2-vCPU AVX2-only AMD EPYC (Zen 3), the kernel alone (1
 * thread, tinyllama's 2048 x 2048, 5632 x 2048, 2048 x 5632 in 16-40 copies, variants alternated
 * in one process, thread CPU time, best of 8-10, 3 runs at load 5-7, against the kernel of
 * before with 4 streams; this walk in each): 2 streams read 1.00-1.13x, 3 streams 0.96-1.25x, 4
 * 0.76-0.99x, 1 stream 0.76-1.15x, 2 streams two super-blocks ahead 0.97-1.15x, 2 streams without
 * prefetch 0.83-1.04x: unlike Q4_K and Q5_K (3 streams, no prefetch), Q6_K keeps its prefetch. */
#ifndef MV_STREAMS
#define MV_STREAMS 2
#endif
#ifndef MV_PF_DIST
#define MV_PF_DIST SH_CPU_PACK_Q6K_BLOCK
#endif
#ifndef MV_PF_HINT
#define MV_PF_HINT _MM_HINT_T0
#endif
/* Activation bytes (Q8_K) of a token block: its codes stay in L2 while every row group passes. */
#ifndef TOK_BLOCK_BYTES
#define TOK_BLOCK_BYTES (1 << 20)
#endif

INL __m256i bcast4(const void *p)
{
    int32_t v;
    memcpy(&v, p, 4);
    return _mm256_set1_epi32(v);
}

/* The arithmetic, per super-block b, row r, token t (q the 6-bit codes 0..63, a the token's Q8_K
 * codes, sc_s the row's signed sub-block scales, bsum_s the sums of a over sub-block s):
 *   I = sum_s sc_s sum_{i in s} q_i a_i - 32 sum_s sc_s bsum_s,   y += (d_r da) I.
 * vpmaddubsw pairs q_i a_i + q_j a_j reach 2 * 63 * 128 = 16128 in magnitude, so two of them add
 * in int16 without saturating (32256); vpmaddwd with sc_s in both words of a row's lane widens
 * and scales the two such sums of a unit. I is exact in int32: the products reach
 * 16 * 128 * 16 * 63 * 128 < 2^29 and the offset 32 * 16 * 128 * 2048 = 2^27. It is converted to
 * float once per super-block and added by one FMA in block order. Integers do not depend on the
 * order in which they are summed, and the float steps are the same for a token in the matvec and
 * in any tile, so a token's output does not depend on the batch or the row split. */

/* Half h of unit s of the packed super-block wb: c[v], lane r, byte i is the code of element
 * 16s + 4v + i of row 8h + r (its nibble, with its top two bits moved to bits 4-5; the shifts are
 * 16-bit and the masks drop what crossed from the neighbouring byte); sc holds row 8h + r's sc_s
 * in both 16-bit words of lane r. */
INL void unpack_half(const uint8_t *wb, int s, int h, __m256i c[4], __m256i *sc)
{
    const __m256i m0f = _mm256_set1_epi8(0x0f), m30 = _mm256_set1_epi8(0x30);
    const uint8_t *u = wb + SH_CPU_PACK_Q6K_UNITS + s * SH_CPU_PACK_Q6K_UNIT + 32 * h;
    const __m256i z0 = _mm256_loadu_si256((const void *)u);
    const __m256i z1 = _mm256_loadu_si256((const void *)(u + 64));
    const __m256i hb = _mm256_loadu_si256((const void *)(u + 128));
    c[0] =
        _mm256_or_si256(_mm256_and_si256(z0, m0f), _mm256_and_si256(_mm256_slli_epi16(hb, 4), m30));
    c[1] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(z0, 4), m0f),
                           _mm256_and_si256(_mm256_slli_epi16(hb, 2), m30));
    c[2] = _mm256_or_si256(_mm256_and_si256(z1, m0f), _mm256_and_si256(hb, m30));
    c[3] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(z1, 4), m0f),
                           _mm256_and_si256(_mm256_srli_epi16(hb, 2), m30));
    const __m128i b = _mm_loadl_epi64((const void *)(wb + SH_CPU_PACK_Q6K_SC + 16 * s + 8 * h));
    *sc = _mm256_cvtepi8_epi16(_mm_unpacklo_epi8(b, b));
}

/* The scales of sub-blocks 2j and 2j + 1 of rows 8h .. 8h + 7 as int16 pairs, lane r holding row
 * 8h + r's (sc_2j, sc_2j+1): one vpmaddwd with a token's (bsum_2j, bsum_2j+1) gives both terms of
 * its offset. */
INL __m256i scale_pair(const uint8_t *wb, int j, int h)
{
    const uint8_t *p = wb + SH_CPU_PACK_Q6K_SC + 32 * j + 8 * h;
    const __m128i lo = _mm_loadl_epi64((const void *)p),
                  hi = _mm_loadl_epi64((const void *)(p + 16));
    return _mm256_cvtepi8_epi16(_mm_unpacklo_epi8(lo, hi));
}

/* scale_pair times -32 (|-32 sc| <= 4096 fits int16): one vpmaddwd with a token's bsums pair
 * then gives -32 (sc_2j bsum_2j + sc_2j+1 bsum_2j+1) directly (|.| <= 2 * 4096 * 2048 = 2^24). */
INL __m256i scale_pair_m32(const uint8_t *wb, int j, int h)
{
    return _mm256_sub_epi16(_mm256_setzero_si256(), _mm256_slli_epi16(scale_pair(wb, j, h), 5));
}

/* -32 sum_s sc_s bsum_s of rows 8h .. 8h + 7 for nt tokens' blocks ab[0], ab[stride], ...: the
 * starting values of their sums I (sp: scale_pair_m32 of j = 0 .. 7, made once per half
 * super-block for all tiles). */
INL void offsets_half(const __m256i *sp, const sh_block_q8_k *ab, int64_t stride, const int nt,
                      __m256i *iacc)
{
    for (int i = 0; i < nt; i++)
        iacc[i] = _mm256_madd_epi16(sp[0], bcast4(ab[i * stride].bsums));
    for (int j = 1; j < 8; j++) {
        const __m256i p = _mm256_load_si256(sp + j);
        for (int i = 0; i < nt; i++)
            SH_AVX2_ADD32(iacc[i], _mm256_madd_epi16(p, bcast4(ab[i * stride].bsums + 2 * j)));
    }
}

/* offsets_half of both halves for one token (o[h]): the scales of sub-blocks 2j and 2j + 1 of
 * the 16 rows are two 16-byte loads, interleaved once for each half. */
INL void offsets_both(const uint8_t *wb, const sh_block_q8_k *ab, __m256i *i0, __m256i *i1)
{
    __m256i o0 = _mm256_setzero_si256(), o1 = _mm256_setzero_si256();
    for (int j = 0; j < 8; j++) {
        const uint8_t *p = wb + SH_CPU_PACK_Q6K_SC + 32 * j;
        const __m128i lo = _mm_loadu_si128((const void *)p),
                      hi = _mm_loadu_si128((const void *)(p + 16));
        const __m256i bs = bcast4(ab->bsums + 2 * j);
        SH_AVX2_ADD32(o0, _mm256_madd_epi16(_mm256_cvtepi8_epi16(_mm_unpacklo_epi8(lo, hi)), bs));
        SH_AVX2_ADD32(o1, _mm256_madd_epi16(_mm256_cvtepi8_epi16(_mm_unpackhi_epi8(lo, hi)), bs));
    }
    *i0 = _mm256_sub_epi32(_mm256_setzero_si256(), _mm256_slli_epi32(o0, 5));
    *i1 = _mm256_sub_epi32(_mm256_setzero_si256(), _mm256_slli_epi32(o1, 5));
}

/* acc + (d_r da) I for super-block b of half h (wd: the group's d). */
INL __m256 scale_add(const uint8_t *wd, int64_t b, int h, float da, __m256i iacc, __m256 acc)
{
    const __m256 dw = _mm256_cvtph_ps(_mm_loadu_si128((const void *)(wd + b * 32 + 16 * h)));
    return _mm256_fmadd_ps(_mm256_cvtepi32_ps(iacc), _mm256_mul_ps(dw, _mm256_set1_ps(da)), acc);
}

/* Tokens ab[0], ab[nb], ... (nt of them, their blocks of super-block b) against half h of the
 * super-block wb unpacked once for the token block (c[4s + v], sc[s]: unpack_half of unit s), added
 * to their float sums acc[i]. */
INL void tile_sb(const uint8_t *wb, const uint8_t *wd, int64_t b, int h, const __m256i *c,
                 const __m256i *sc, const sh_block_q8_k *ab, int64_t nb, const int nt, __m256 *acc)
{
    __m256i iacc[NT];
    offsets_half(sc + 16, ab, nb, nt, iacc);
    for (int s = 0; s < 16; s++) {
#pragma GCC unroll 2
        for (int pr = 0; pr < 2; pr++) {
            const __m256i c0 = _mm256_load_si256(c + 4 * s + 2 * pr);
            const __m256i c1 = _mm256_load_si256(c + 4 * s + 2 * pr + 1);
            for (int i = 0; i < nt; i++) {
                const int8_t *aq = ab[i * nb].qs + 16 * s + 8 * pr;
                __m256i p = _mm256_maddubs_epi16(c0, bcast4(aq));
                SH_AVX2_ADD16(p, _mm256_maddubs_epi16(c1, bcast4(aq + 4)));
                SH_AVX2_ADD32(iacc[i], _mm256_madd_epi16(p, sc[s]));
            }
        }
    }
    for (int i = 0; i < nt; i++)
        acc[i] = scale_add(wd, b, h, ab[i * nb].d, iacc[i], acc[i]);
}

/* One half of a unit (u: its first code vector) for one token (aq: its codes of the sub-block),
 * sc_s sum q_i a_i of the 8 rows added to ia: each code vector is made right before its
 * vpmaddubsw and the pair sums are scaled as soon as they are complete, so few values are live at
 * once (the two halves' sums, their scales and the masks stay in registers). */
INL void mv_half(const uint8_t *u, __m256i sc, const int8_t *aq, __m256i *ia)
{
    const __m256i m0f = _mm256_set1_epi8(0x0f), m30 = _mm256_set1_epi8(0x30);
    const __m256i hb = _mm256_loadu_si256((const void *)(u + 128));
    const __m256i z0 = _mm256_loadu_si256((const void *)u);
    __m256i p = _mm256_maddubs_epi16(
        _mm256_or_si256(_mm256_and_si256(z0, m0f), _mm256_and_si256(_mm256_slli_epi16(hb, 4), m30)),
        bcast4(aq));
    SH_AVX2_ADD16(
        p, _mm256_maddubs_epi16(_mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(z0, 4), m0f),
                                                _mm256_and_si256(_mm256_slli_epi16(hb, 2), m30)),
                                bcast4(aq + 4)));
    SH_AVX2_ADD32(*ia, _mm256_madd_epi16(p, sc));
    const __m256i z1 = _mm256_loadu_si256((const void *)(u + 64));
    p = _mm256_maddubs_epi16(_mm256_or_si256(_mm256_and_si256(z1, m0f), _mm256_and_si256(hb, m30)),
                             bcast4(aq + 8));
    SH_AVX2_ADD16(
        p, _mm256_maddubs_epi16(_mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(z1, 4), m0f),
                                                _mm256_and_si256(_mm256_srli_epi16(hb, 2), m30)),
                                bcast4(aq + 12)));
    SH_AVX2_ADD32(*ia, _mm256_madd_epi16(p, sc));
}

/* Unit s of both halves for one token (aq: its codes of sub-block s), added to the sums i0 (rows
 * 0 .. 7) and i1 (rows 8 .. 15). */
INL void mv_unit(const uint8_t *wb, int s, const int8_t *aq, __m256i *i0, __m256i *i1)
{
    const __m256i w = _mm256_permute4x64_epi64(
        _mm256_cvtepi8_epi16(_mm_loadu_si128((const void *)(wb + SH_CPU_PACK_Q6K_SC + 16 * s))),
        0xd8);
    const uint8_t *u = wb + SH_CPU_PACK_Q6K_UNITS + s * SH_CPU_PACK_Q6K_UNIT;
    mv_half(u, _mm256_unpacklo_epi16(w, w), aq, i0);
    mv_half(u + 32, _mm256_unpackhi_epi16(w, w), aq, i1);
}

/* One token, groups g0 + k step (k < ns) side by side, a super-block of each in turn, both halves
 * unit by unit (one ascending walk of the super-block); each (row, token) gets tile_sb's integers
 * and its float steps in its order. The offsets of both halves share their scale loads
 * (offsets_both), a unit's 16 scales are one load for both halves (mv_unit) and its code vectors
 * are made one at a time (mv_half): callgrind on `bench_kernels --quick --only mv --isa 2 -t 1
 * --types Q6_K`, 1.996G -> 1.782G instructions in the kernel. */
INL void mv_groups(const sh__cpu_mm *m, int64_t g0, int64_t step, const int ns, int64_t r0,
                   int64_t r1)
{
    const int64_t nb = m->a->n_in / SH_QK_K;
    const uint8_t *w[MV_STREAMS];
    __m256 acc[MV_STREAMS][2];
    for (int k = 0; k < ns; k++) {
        w[k] = m->w + (size_t)(g0 + k * step) * m->row_bytes;
        acc[k][0] = acc[k][1] = _mm256_setzero_ps();
    }
    for (int64_t b = 0; b < nb; b++) {
        const sh_block_q8_k *ab = m->a->qk + b;
        for (int k = 0; k < ns; k++) {
            const uint8_t *wb = w[k] + (size_t)b * SH_CPU_PACK_Q6K_BLOCK;
            const uint8_t *wd = w[k] + (size_t)nb * SH_CPU_PACK_Q6K_BLOCK;
            if (b == 0) /* the group's d, read one 32-byte row of it per super-block */
                for (int64_t l = 0; l < nb * 32; l += 64)
                    _mm_prefetch((const char *)wd + l, MV_PF_HINT);
            __m256i i0, i1;
            offsets_both(wb, ab, &i0, &i1);
            for (int qq = 0; qq < 4; qq++) {
                /* a quarter of the super-block's 52 lines, MV_PF_DIST ahead */
                for (int l = 0; MV_PF_DIST > 0 && l < 13; l++)
                    _mm_prefetch((const char *)wb + 13 * 64 * qq + MV_PF_DIST + 64 * l, MV_PF_HINT);
                mv_unit(wb, 4 * qq, ab->qs + 64 * qq, &i0, &i1);
                mv_unit(wb, 4 * qq + 1, ab->qs + 64 * qq + 16, &i0, &i1);
                mv_unit(wb, 4 * qq + 2, ab->qs + 64 * qq + 32, &i0, &i1);
                mv_unit(wb, 4 * qq + 3, ab->qs + 64 * qq + 48, &i0, &i1);
            }
            acc[k][0] = scale_add(wd, b, 0, ab->d, i0, acc[k][0]);
            acc[k][1] = scale_add(wd, b, 1, ab->d, i1, acc[k][1]);
        }
    }
    for (int k = 0; k < ns; k++)
        for (int h = 0; h < 2; h++)
            sh__avx2_store_half(m, g0 + k * step, h, r0, r1, 0, acc[k][h]);
}

/* At most this many tokens per block: their float sums (32 bytes per half) wait on the stack while
 * a row group passes over its super-blocks. */
#define TOK_MAX 256

/* One tile of n tokens (at: its first token's block of super-block b) against halves h0 .. h1 of
 * super-block b (unpacked: c + 64h, sc + 24h), added to acc[h * TOK_MAX + i]: the second half
 * reads the tile's activations from L1, where the first one brought them. */
#define TILE_HALVES(n)                                                                             \
    do {                                                                                           \
        for (int h = h0; h <= h1; h++)                                                             \
            tile_sb(wb, wd, b, h, c + 64 * h, sc + 24 * h, at + t * nb + b, nb, n,                 \
                    acc + h * TOK_MAX + t - t0);                                                   \
    } while (0)

/* Super-block b of the tokens [t0, t1) of a token block (block-relative acc) in tiles of NT, the
 * tail in tiles of 4, 2 and 1 so that each tile size is a compile-time constant. */
INL void tiles(const uint8_t *wb, const uint8_t *wd, int64_t b, int h0, int h1, const __m256i *c,
               const __m256i *sc, const sh_block_q8_k *at, int64_t nb, int64_t t0, int64_t t1,
               __m256 *acc)
{
    int64_t t = t0;
    for (; t + NT <= t1; t += NT)
        TILE_HALVES(NT);
#if NT > 4
    for (; t + 4 <= t1; t += 4)
        TILE_HALVES(4);
#endif
#if NT > 2
    for (; t + 2 <= t1; t += 2)
        TILE_HALVES(2);
#endif
    if (t < t1)
        TILE_HALVES(1);
}
#undef TILE_HALVES

/* A matvec as in the other packed kernels (MV_STREAMS equal ranges of groups, then the rest one at
 * a time); otherwise token blocks of up to TOK_MAX tokens outermost (their codes stay in L2), then
 * row groups, then super-blocks: each half super-block inside [r0, r1) is unpacked once (2.5 KiB,
 * in L1) for all the block's tokens, which pass over both halves in tiles of NT. Against the
 * kernel of 832627d (one half per pass, the offsets' scale pairs made per tile, the masked store),
 * on the 2-vCPU EPYC at load 6 (1 thread, 512 tokens, thread CPU time, best of 8, alternated in
 * one process, 3 rounds): 2048 x 2048 1.09-1.35x, 5632 x 2048 1.30-1.36x, 2048 x 5632
 * 1.08-1.26x, about half of it the store's unmasked path (avx2_store.h); callgrind on
 * `bench_kernels --quick --only pp --isa 2 --types Q6_K`: 2070.5M -> 1982.3M instructions. Both
 * halves per pass, a 256 KiB or 512 KiB token block and a software prefetch of the next
 * super-block measured within the noise (+-15% at that load). */
TGT void sh__cpu_avx2_mmp_q6_k(const sh__cpu_mm *m, int64_t r0, int64_t r1)
{
    const sh__cpu_act *a = m->a;
    const int64_t n_tok = a->n_tok, nb = a->n_in / SH_QK_K;
    if (n_tok == 1) {
        SH_AVX2_MATVEC(mv_groups, MV_STREAMS, m, r0, r1);
        return;
    }
    int64_t tb = TOK_BLOCK_BYTES / (nb * (int64_t)sizeof(sh_block_q8_k));
    tb = tb < 1 ? 1 : tb > TOK_MAX ? TOK_MAX : tb;
    __m256 acc[2 * TOK_MAX];
    __m256i c[2 * 64], sc[2 * 24];
    for (int64_t t0 = 0; t0 < n_tok; t0 += tb) {
        const int64_t t1 = t0 + tb < n_tok ? t0 + tb : n_tok;
        for (int64_t g = r0 / 16; g * 16 < r1; g++) {
            /* the halves with rows in [r0, r1) */
            const int h0 = 16 * g + 8 <= r0, h1 = 16 * g + 8 < r1;
            const uint8_t *w = m->w + (size_t)g * m->row_bytes;
            const uint8_t *wd = w + (size_t)nb * SH_CPU_PACK_Q6K_BLOCK;
            for (int h = h0; h <= h1; h++)
                for (int64_t t = t0; t < t1; t++)
                    acc[h * TOK_MAX + t - t0] = _mm256_setzero_ps();
            for (int64_t b = 0; b < nb; b++) {
                const uint8_t *wb = w + (size_t)b * SH_CPU_PACK_Q6K_BLOCK;
                for (int h = h0; h <= h1; h++) {
                    for (int s = 0; s < 16; s++)
                        unpack_half(wb, s, h, c + 64 * h + 4 * s, sc + 24 * h + s);
                    for (int j = 0; j < 8; j++)
                        sc[24 * h + 16 + j] = scale_pair_m32(wb, j, h);
                }
                tiles(wb, wd, b, h0, h1, c, sc, a->qk, nb, t0, t1, acc);
            }
            for (int h = h0; h <= h1; h++)
                for (int64_t t = t0; t < t1; t++)
                    sh__avx2_store_half(m, g, h, r0, r1, t, acc[h * TOK_MAX + t - t0]);
        }
    }
}

#endif
