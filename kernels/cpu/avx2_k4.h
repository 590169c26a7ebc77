/* What the AVX2 packed Q4_K and Q5_K kernels share (ops_q4k_avx2_packed.c,
 * ops_q5k_avx2_packed.c): the decoding of 8 rows' 6-bit scales and minimums from the packed
 * super-block (the same header in both layouts, cpu.h) and the register pinning of the tiles. */
#ifndef SH_KERNELS_CPU_AVX2_K4_H
#define SH_KERNELS_CPU_AVX2_K4_H

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>

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

#endif

#endif
