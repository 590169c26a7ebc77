/* CRC-32C: carry-less multiplication (AVX-512 VPCLMULQDQ) on long inputs, the SSE4.2 instruction
 * otherwise when the CPU has it, slice-by-8 tables elsewhere. */
#include "runtime/crc32c.h"

#include <string.h>

#include <uv.h>

#define POLY 0x82f63b78u

static uint32_t table[8][256];
static uv_once_t once = UV_ONCE_INIT;
static int mode; /* after `once`: 1 software, 2 hardware */

static void tables_build(void)
{
    for (uint32_t n = 0; n < 256; n++) {
        uint32_t c = n;
        for (int k = 0; k < 8; k++)
            c = c & 1 ? (c >> 1) ^ POLY : c >> 1;
        table[0][n] = c;
    }
    for (uint32_t n = 0; n < 256; n++)
        for (int t = 1; t < 8; t++)
            table[t][n] = (table[t - 1][n] >> 8) ^ table[0][table[t - 1][n] & 0xff];
}

static uint32_t sw_run(uint32_t c, const uint8_t *p, size_t len)
{
    while (len && ((uintptr_t)p & 7)) {
        c = table[0][(c ^ *p++) & 0xff] ^ (c >> 8);
        len--;
    }
    while (len >= 8) {
        uint64_t w;
        memcpy(&w, p, 8);
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_BIG_ENDIAN__
        w = __builtin_bswap64(w);
#endif
        w ^= c;
        c = table[7][w & 0xff] ^ table[6][(w >> 8) & 0xff] ^ table[5][(w >> 16) & 0xff] ^
            table[4][(w >> 24) & 0xff] ^ table[3][(w >> 32) & 0xff] ^ table[2][(w >> 40) & 0xff] ^
            table[1][(w >> 48) & 0xff] ^ table[0][w >> 56];
        p += 8;
        len -= 8;
    }
    while (len--)
        c = table[0][(c ^ *p++) & 0xff] ^ (c >> 8);
    return c;
}

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define HAVE_X86 1
#include <immintrin.h>
#include <stdbool.h>
#define FOLD_MIN 1024u /* bytes from which fold_run is used, where it has it */
/* One chain of crc32 instructions, 8 bytes each after aligning. */
__attribute__((target("sse4.2"))) static uint32_t hw_chain(uint32_t c, const uint8_t *p, size_t len)
{
    uint64_t c64 = c;
    while (len && ((uintptr_t)p & 7)) {
        c64 = __builtin_ia32_crc32qi((uint32_t)c64, *p++);
        len--;
    }
    while (len >= 8) {
        uint64_t w;
        memcpy(&w, p, 8);
        c64 = __builtin_ia32_crc32di(c64, w);
        p += 8;
        len -= 8;
    }
    c = (uint32_t)c64;
    while (len--)
        c = __builtin_ia32_crc32qi(c, *p++);
    return c;
}

/* a * b mod P in the reflected bit order of the CRC. */
static uint32_t gf2_mul(uint32_t a, uint32_t b)
{
    uint32_t r = 0;
    for (int i = 0; i < 32; i++) {
        if (a & 0x80000000u)
            r ^= b;
        a <<= 1;
        b = b & 1 ? (b >> 1) ^ POLY : b >> 1;
    }
    return r;
}

/* x^n mod P, reflected (x^(8 len) is the join's shift over len bytes); computed by squaring. */
static uint32_t x_pow(uint64_t n)
{
    uint32_t r = 0x80000000u, sq = 0x40000000u; /* x^0 and x^1 */
    while (n) {
        if (n & 1)
            r = gf2_mul(r, sq);
        sq = gf2_mul(sq, sq);
        n >>= 1;
    }
    return r;
}

#define STRIPE 4096u   /* bytes per chain and round; the joins cost two multiplications a round */
static uint32_t shift; /* x^(8 * STRIPE), set once */

/* Long inputs run three independent chains over three stripes, which hides the instruction's
 * 3-cycle latency; the chains' registers are joined by multiplying the earlier ones by
 * x^(8 * STRIPE) mod P (the register is linear in its start value). */
__attribute__((target("sse4.2"))) static uint32_t hw_run(uint32_t c, const uint8_t *p, size_t len)
{
    while (len >= 3 * STRIPE) {
        uint64_t a = c, b = 0, d = 0;
        const uint8_t *q = p;
        for (size_t i = 0; i < STRIPE; i += 8) {
            uint64_t wa, wb, wd;
            memcpy(&wa, q + i, 8);
            memcpy(&wb, q + STRIPE + i, 8);
            memcpy(&wd, q + 2 * STRIPE + i, 8);
            a = __builtin_ia32_crc32di(a, wa);
            b = __builtin_ia32_crc32di(b, wb);
            d = __builtin_ia32_crc32di(d, wd);
        }
        /* crc(A||B||D) = shift(shift(a) ^ b) ^ d, shift = multiply by x^(8 STRIPE) */
        uint32_t ab = gf2_mul((uint32_t)a, shift) ^ (uint32_t)b;
        c = gf2_mul(ab, shift) ^ (uint32_t)d;
        p += 3 * STRIPE;
        len -= 3 * STRIPE;
    }
    return hw_chain(c, p, len);
}

/* ---- Folding with carry-less multiplication (AVX-512 VPCLMULQDQ) ----
 *
 * The crc32 instruction takes 8 bytes a cycle at best; carry-less multiplication folds 64 bytes
 * per instruction pair and lane, as in Intel's "Fast CRC Computation for Generic Polynomials
 * Using PCLMULQDQ" (Gopal et al., 2009). A 128-bit lane X (bit k the coefficient of x^(127 - k),
 * the reflected order of the bytes as they lie) moved D bits further down the message is
 *   X * x^D = lo * x^(64 + D) + hi * x^D = lo * (x^(63 + D) mod P) * x + hi * (x^(D - 1) mod P) * x
 * where lo and hi are X's 64-bit halves, and the trailing "* x" is the one-bit offset of a
 * reflected 64 x 64 product read as 128 bits. Each lane is therefore folded with two products
 * whose sum stays congruent to the message mod P; at the end one lane X is left, and the
 * register is crc32 over X's 16 bytes from 0 (X * x^32 mod P, as for the message itself). The
 * starting register is xored into the first 4 bytes (the same polynomial). */
static uint64_t fold_k[3][2]; /* by 2048, 512 and 128 bits: {x^(63 + D), x^(D - 1)} mod P */
static bool have_fold;

static void fold_setup(void)
{
    static const uint64_t d[3] = {2048, 512, 128};
    for (int i = 0; i < 3; i++) {
        /* A 32-bit reflected remainder sits in the upper half of a reflected 64-bit operand. */
        fold_k[i][0] = (uint64_t)x_pow(63 + d[i]) << 32;
        fold_k[i][1] = (uint64_t)x_pow(d[i] - 1) << 32;
    }
}

#define FOLD_TARGET __attribute__((target("sse4.2,pclmul,avx512f,vpclmulqdq")))

/* x folded by the constants in every 128-bit lane of k, plus y. */
FOLD_TARGET static inline __m512i fold512(__m512i x, __m512i k, __m512i y)
{
    return _mm512_ternarylogic_epi64(_mm512_clmulepi64_epi128(x, k, 0x00),
                                     _mm512_clmulepi64_epi128(x, k, 0x11), y, 0x96);
}

FOLD_TARGET static inline __m128i fold128(__m128i x, __m128i k, __m128i y)
{
    return _mm_xor_si128(
        _mm_xor_si128(_mm_clmulepi64_si128(x, k, 0x00), _mm_clmulepi64_si128(x, k, 0x11)), y);
}

/* len >= 256. */
FOLD_TARGET static uint32_t fold_run(uint32_t c, const uint8_t *p, size_t len)
{
    __m512i k2048 =
        _mm512_broadcast_i32x4(_mm_set_epi64x((long long)fold_k[0][1], (long long)fold_k[0][0]));
    __m512i k512 =
        _mm512_broadcast_i32x4(_mm_set_epi64x((long long)fold_k[1][1], (long long)fold_k[1][0]));
    __m128i k128 = _mm_set_epi64x((long long)fold_k[2][1], (long long)fold_k[2][0]);
    __m512i z0 =
        _mm512_xor_si512(_mm512_loadu_si512(p), _mm512_zextsi128_si512(_mm_cvtsi32_si128((int)c)));
    __m512i z1 = _mm512_loadu_si512(p + 64), z2 = _mm512_loadu_si512(p + 128),
            z3 = _mm512_loadu_si512(p + 192);
    p += 256;
    len -= 256;
    while (len >= 256) { /* four lanes of four, each moved 256 bytes on */
        z0 = fold512(z0, k2048, _mm512_loadu_si512(p));
        z1 = fold512(z1, k2048, _mm512_loadu_si512(p + 64));
        z2 = fold512(z2, k2048, _mm512_loadu_si512(p + 128));
        z3 = fold512(z3, k2048, _mm512_loadu_si512(p + 192));
        p += 256;
        len -= 256;
    }
    z0 = fold512(z0, k512, z1);
    z0 = fold512(z0, k512, z2);
    z0 = fold512(z0, k512, z3);
    while (len >= 64) {
        z0 = fold512(z0, k512, _mm512_loadu_si512(p));
        p += 64;
        len -= 64;
    }
    __m128i x = _mm512_extracti32x4_epi32(z0, 0);
    x = fold128(x, k128, _mm512_extracti32x4_epi32(z0, 1));
    x = fold128(x, k128, _mm512_extracti32x4_epi32(z0, 2));
    x = fold128(x, k128, _mm512_extracti32x4_epi32(z0, 3));
    while (len >= 16) {
        x = fold128(x, k128, _mm_loadu_si128((const __m128i *)p));
        p += 16;
        len -= 16;
    }
    uint64_t r = __builtin_ia32_crc32di(0, (uint64_t)_mm_cvtsi128_si64(x));
    r = __builtin_ia32_crc32di(r, (uint64_t)_mm_extract_epi64(x, 1));
    return hw_chain((uint32_t)r, p, len);
}
#endif

static void setup(void)
{
    tables_build();
    mode = 1;
#ifdef HAVE_X86
    shift = x_pow(8 * (uint64_t)STRIPE);
    fold_setup();
    __builtin_cpu_init();
    if (__builtin_cpu_supports("sse4.2"))
        mode = 2;
    have_fold = mode == 2 && __builtin_cpu_supports("pclmul") &&
                __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("vpclmulqdq");
#endif
}

static int init(void)
{
    uv_once(&once, setup);
    return mode;
}

uint32_t sh__crc32c_sw(uint32_t crc, const void *p, size_t len)
{
    init();
    return ~sw_run(~crc, p, len);
}

uint32_t sh__crc32c(uint32_t crc, const void *p, size_t len)
{
#ifdef HAVE_X86
    if (init() == 2)
        return len >= FOLD_MIN && have_fold ? ~fold_run(~crc, p, len) : ~hw_run(~crc, p, len);
#else
    init();
#endif
    return ~sw_run(~crc, p, len);
}

uint32_t sh__crc32c_insn(uint32_t crc, const void *p, size_t len)
{
#ifdef HAVE_X86
    if (init() == 2)
        return ~hw_run(~crc, p, len);
#else
    init();
#endif
    return ~sw_run(~crc, p, len);
}

int sh__crc32c_hw(void)
{
#ifdef HAVE_X86
    return init() == 2 ? 1 + have_fold : 0;
#else
    init();
    return 0;
#endif
}
