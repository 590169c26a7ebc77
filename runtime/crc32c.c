/* CRC-32C with the SSE4.2 instruction when the CPU has it, slice-by-8 tables otherwise. */
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

/* x^(8 * len) mod P, reflected, for the join; computed by squaring. */
static uint32_t x_pow_8n(size_t n)
{
    uint32_t r = 0x80000000u, sq = 0x00800000u; /* x^0 and x^8 */
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
#endif

static void setup(void)
{
    tables_build();
    mode = 1;
#ifdef HAVE_X86
    shift = x_pow_8n(STRIPE);
    __builtin_cpu_init();
    if (__builtin_cpu_supports("sse4.2"))
        mode = 2;
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
        return ~hw_run(~crc, p, len);
#else
    init();
#endif
    return ~sw_run(~crc, p, len);
}

int sh__crc32c_hw(void) { return init() == 2; }
