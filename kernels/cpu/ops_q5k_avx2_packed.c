/* AVX2 matmul kernel on packed Q5_K weights (the 16-row interleave of SH_CPU_PACK_ROWS in cpu.h:
 * Q4_K's packed super-block with the 16 rows' qh vectors between its header and its codes). The
 * kernel is ops_q4k_avx2_packed.c's with the fifth bit merged into each 4-bit code (a shift, an
 * and and an or per code vector, done once for a block of tokens): a 256-bit register holds 8 of a
 * group's 16 rows, vpmaddubsw pair sums against a broadcast 4-byte slice of the token's Q8_K codes,
 * vpmaddwd applies the 6-bit scale every four code vectors (the 5-bit codes' pair sums reach
 * 2 * 31 * 128, so eight of them would not fit int16), the minimums from the Q8_K block sums;
 * prefill through k4_sweep (avx2_k4.h: each half super-block unpacked once into L1 for a block
 * of tokens, tiles of K4_RNT that hold each run of four code vectors for all their tokens), and a
 * decode matvec that walks several row groups side by side. */
#include <string.h>

#include "kernels/cpu/avx2_k4.h"
#include "kernels/cpu/avx2_store.h"
#include "kernels/cpu/cpu.h"

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>

#define TGT __attribute__((target("avx2,fma,f16c")))
#define INL static inline __attribute__((always_inline)) TGT

/* The decode matvec walks MV_STREAMS row groups side by side (as ops_avx2_packed.c), without
 * software prefetch: on the 2-vCPU AVX2-only AMD EPYC (Zen 3), the kernel alone (1 thread, 16
 * copies of a 5632 x 2048 or 2048 x 5632 weight, 127 MB, variants alternated in one process,
 * thread CPU time, best of 8; 3 runs, load 4-6), the settings tuned on Sapphire Rapids (2 streams,
 * T1 prefetches 8 KiB ahead) read 5.1-6.1 GB/s, 1-2 KiB ahead 5.2-6.9, 4 KiB 6.5-6.7, 16 KiB
 * 6.8-6.9, T0 5.9-6.1, and with no prefetch 1 stream 6.7-7.8, 2 streams 7.0-9.3, 3 streams
 * 6.9-10.0 (above 2 streams in 5 of 6), 4 7.3-9.5, 6 6.5-7.8: the hardware prefetchers follow
 * the streams better alone. */
#ifndef MV_STREAMS
#define MV_STREAMS 3
#endif
/* Activation bytes of a token block: its Q8_K rows stay in L2 while every row group passes. */
#define TOK_BLOCK_BYTES (1 << 20)

INL __m256i bcast4(const void *p)
{
    int32_t v;
    memcpy(&v, p, 4);
    return _mm256_set1_epi32(v);
}

/* The fifth bits of sub-block j in hb (bit j of each byte, the packed qh) moved to bit 4. The
 * 16-bit shifts move no bit across a byte into bit 4 of the other byte. */
INL __m256i high_bit(__m256i hb, const int j)
{
    const __m256i b4 = _mm256_set1_epi8(0x10);
    if (j < 4)
        return _mm256_and_si256(_mm256_slli_epi16(hb, 4 - j), b4);
    if (j == 4)
        return _mm256_and_si256(hb, b4);
    return _mm256_and_si256(_mm256_srli_epi16(hb, j - 4), b4);
}

/* One super-block (at pb) of half h against the token's Q8_K block a, added to acc. Per row (q
 * the 5-bit codes, a the Q8_K codes with scale da and 16-element sums bsums):
 *   isum = sum_j sc_j sum_{i in j} q_i a_i        (int32, exact)
 *   msum = sum_j m_j (bsums_2j + bsums_2j+1)      (int32, exact)
 *   acc += float(isum) * (d da);  acc -= float(msum) * (dmin da).
 * A vpmaddubsw pair sum is at most 2 * 31 * 128 = 7936 in magnitude, so the 16-bit sums add 4 of
 * them (31744) before vpmaddwd applies the scale and widens: no saturation. isum < 8 * 63 * 32 *
 * 31 * 128 < 2^26 and |msum| < 2^21. The float steps are k4_finish, and the integers are exact in
 * any order, so a token's output does not depend on the path, its tile or the row split.
 * Sub-blocks go in pairs (2k, 2k + 1): each code vector is loaded once for both nibbles and each
 * qh vector once per pair, both fifth bits shifted out of it in registers. The activation pointer
 * is opaque to the compiler at each call (GCC 12 otherwise hoisted the 64 broadcasts out of the
 * streams' loop into stack copies, reloaded for every use). */
INL void sb_half(const uint8_t *pb, const int h, const sh_block_q8_k *ab, __m256 *acc)
{
    const __m256i m4 = _mm256_set1_epi8(0x0f);
    const uint8_t *ph = pb + SH_CPU_PACK_Q5K_QH + 32 * h;
    const int8_t *qa = ab->qs;
    __asm__ volatile("" : "+r"(qa));
    q4k_half s;
    decode_half(pb, h, &s);
    __m256i ia = _mm256_setzero_si256();
#pragma GCC unroll 4
    for (int k = 0; k < 4; k++) {
        const uint8_t *pv = pb + SH_CPU_PACK_Q5K_CODES + 512 * k + 32 * h;
        __m256i lo16 = _mm256_setzero_si256(), hi16 = _mm256_setzero_si256();
#pragma GCC unroll 8
        for (int v = 0; v < 8; v++) {
            const __m256i x = _mm256_loadu_si256((const void *)(pv + 64 * v));
            const __m256i hb = _mm256_loadu_si256((const void *)(ph + 64 * v));
            const __m256i ql = _mm256_or_si256(_mm256_and_si256(x, m4), high_bit(hb, 2 * k));
            const __m256i qu = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(x, 4), m4),
                                               high_bit(hb, 2 * k + 1));
            const __m256i pl = _mm256_maddubs_epi16(ql, bcast4(qa + 64 * k + 4 * v));
            const __m256i pu = _mm256_maddubs_epi16(qu, bcast4(qa + 64 * k + 32 + 4 * v));
            if (v % 4) {
                ADD16(lo16, pl);
                ADD16(hi16, pu);
            } else {
                lo16 = pl;
                hi16 = pu;
            }
            if (v % 4 == 3) {
                SH_AVX2_ADD32(ia, _mm256_madd_epi16(lo16, s.sc[2 * k]));
                SH_AVX2_ADD32(ia, _mm256_madd_epi16(hi16, s.sc[2 * k + 1]));
            }
        }
    }
    *acc = k4_finish(&s, ab, ia, *acc);
}

/* Half h of the super-block at pb as k4_tile's code vectors: the low four bits of sub-block 2k
 * in the low nibbles of code vectors 8k .. 8k + 7, 2k + 1 in their high nibbles, the fifth bit of
 * sub-block j from bit j of the qh vectors. */
INL void unpack_half(const uint8_t *pb, int h, __m256i *q)
{
    const __m256i m4 = _mm256_set1_epi8(0x0f);
    for (int v = 0; v < 8; v++) {
        const __m256i hb =
            _mm256_loadu_si256((const void *)(pb + SH_CPU_PACK_Q5K_QH + 64 * v + 32 * h));
#pragma GCC unroll 4
        for (int k = 0; k < 4; k++) {
            const __m256i x = _mm256_loadu_si256(
                (const void *)(pb + SH_CPU_PACK_Q5K_CODES + 512 * k + 64 * v + 32 * h));
            _mm256_store_si256(q + 16 * k + v,
                               _mm256_or_si256(_mm256_and_si256(x, m4), high_bit(hb, 2 * k)));
            _mm256_store_si256(q + 16 * k + 8 + v,
                               _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(x, 4), m4),
                                               high_bit(hb, 2 * k + 1)));
        }
    }
}

/* One token, groups g0 + k step (k < ns) side by side, super-block by super-block, both halves;
 * each (row, token) sees k4_tile's operations in k4_tile's order. */
INL void mv_groups(const sh__cpu_mm *m, int64_t g0, int64_t step, const int ns, int64_t r0,
                   int64_t r1)
{
    const int64_t nb = m->a->n_in / SH_QK_K;
    __m256 acc[MV_STREAMS][2];
    for (int k = 0; k < ns; k++)
        acc[k][0] = acc[k][1] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const sh_block_q8_k *ab = m->a->qk + b;
        for (int k = 0; k < ns; k++) {
            const uint8_t *pb =
                m->w + (size_t)(g0 + k * step) * m->row_bytes + (size_t)b * SH_CPU_PACK_Q5K_BYTES;
            sb_half(pb, 0, ab, &acc[k][0]);
            sb_half(pb, 1, ab, &acc[k][1]);
        }
    }
    for (int k = 0; k < ns; k++)
        for (int h = 0; h < 2; h++)
            sh__avx2_store_half(m, g0 + k * step, h, r0, r1, 0, acc[k][h]);
}

INL void matvec(const sh__cpu_mm *m, int64_t r0, int64_t r1)
{
    SH_AVX2_MATVEC(mv_groups, MV_STREAMS, m, r0, r1);
}

/* A matvec as above; otherwise k4_sweep: token blocks of up to 256 tokens outermost, then row
 * groups and halves, then super-blocks, each half super-block unpacked once for the block's
 * tokens, in tiles of K4_RNT. */
TGT void sh__cpu_avx2_mmp_q5_k(const sh__cpu_mm *m, int64_t r0, int64_t r1)
{
    const int64_t n_tok = m->a->n_tok;
    if (n_tok == 1) {
        matvec(m, r0, r1);
        return;
    }
    k4_sweep(m, r0, r1, SH_CPU_PACK_Q5K_BYTES, 4, TOK_BLOCK_BYTES, unpack_half);
}

#else
typedef int sh__cpu_q5k_avx2_packed_unused; /* not x86-64: the table never names the kernel */
#endif
