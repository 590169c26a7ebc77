/* The network collectives' frame header (seal and check) and the f16 / int8 codecs of what
 * crosses the links (runtime/coll_net.h). */
#include <math.h>
#include <string.h>

#include "runtime/coll_net.h"
#include "runtime/crc32c.h"

static void put16(uint8_t *p, uint16_t v)
{
    p[0] = (uint8_t)v;
    p[1] = (uint8_t)(v >> 8);
}

static void put32(uint8_t *p, uint32_t v)
{
    for (int i = 0; i < 4; i++)
        p[i] = (uint8_t)(v >> (8 * i));
}

static void put64(uint8_t *p, uint64_t v)
{
    for (int i = 0; i < 8; i++)
        p[i] = (uint8_t)(v >> (8 * i));
}

static uint16_t get16(const uint8_t *p) { return (uint16_t)(p[0] | (p[1] << 8)); }

static uint32_t get32(const uint8_t *p)
{
    return (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24;
}

static uint64_t get64(const uint8_t *p)
{
    return (uint64_t)get32(p) | (uint64_t)get32(p + 4) << 32;
}

void sh__coll_net_seal(const sh__coll_net_hdr *h, uint8_t *frame, size_t plen)
{
    put32(frame, SH__COLL_NET_MAGIC);
    frame[4] = SH__COLL_NET_VERSION;
    frame[5] = (uint8_t)(h->type | (h->resent ? SH__COLL_NET_RESENT : 0u));
    frame[6] = h->op;
    frame[7] = h->compress;
    put32(frame + 8, h->epoch);
    put16(frame + 12, h->src);
    put16(frame + 14, h->size);
    put64(frame + 16, h->seq);
    put64(frame + 24, h->total);
    put32(frame + 32, h->index);
    put32(frame + 36, h->count);
    uint32_t crc = sh__crc32c(0, frame, 40);
    put32(frame + 40, sh__crc32c(crc, frame + SH__COLL_NET_HDR, plen));
}

bool sh__coll_net_open(const uint8_t *frame, size_t len, sh__coll_net_hdr *h)
{
    if (len < SH__COLL_NET_HDR || get32(frame) != SH__COLL_NET_MAGIC ||
        frame[4] != SH__COLL_NET_VERSION)
        return false;
    uint32_t crc = sh__crc32c(0, frame, 40);
    crc = sh__crc32c(crc, frame + SH__COLL_NET_HDR, len - SH__COLL_NET_HDR);
    if (crc != get32(frame + 40))
        return false;
    h->type = frame[5] & (uint8_t)~SH__COLL_NET_RESENT;
    h->resent = (frame[5] & SH__COLL_NET_RESENT) != 0;
    h->op = frame[6];
    h->compress = frame[7];
    h->epoch = get32(frame + 8);
    h->src = get16(frame + 12);
    h->size = get16(frame + 14);
    h->seq = get64(frame + 16);
    h->total = get64(frame + 24);
    h->index = get32(frame + 32);
    h->count = get32(frame + 36);
    return true;
}

/* ---- Codecs ----------------------------------------------------------------------------- */

#define INT8_BLOCK 256u

size_t sh__coll_net_wire_size(sh_coll_compress cmp, size_t n)
{
    switch (cmp) {
    case SH_COLL_COMPRESS_F16:
        return n * 2;
    case SH_COLL_COMPRESS_INT8:
        return (n + INT8_BLOCK - 1) / INT8_BLOCK * sizeof(float) + n;
    default:
        return n * sizeof(float);
    }
}

/* f32 -> f16, rounding to nearest even (F. Giesen's float_to_half_fast3_rtne), saturating finite
 * values to +-65504 so that a large activation does not become an infinity. */
static uint16_t f16_from(float f)
{
    uint32_t u;
    memcpy(&u, &f, 4);
    uint32_t sign = u & 0x80000000u;
    u ^= sign;
    uint32_t o;
    if (u > 0x7f800000u) {
        o = 0x7e00u; /* NaN stays NaN */
    } else if (u >= (uint32_t)(127 + 16) << 23) {
        o = 0x7bffu; /* +-65504 */
    } else if (u < (uint32_t)113 << 23) {
        /* Subnormal or zero: adding 0.5 lines the f16 subnormal's last bit up with the f32
         * mantissa's, and the FPU rounds to nearest even. */
        float a;
        memcpy(&a, &u, 4);
        a += 0.5f;
        memcpy(&o, &a, 4);
        o -= 0x3f000000u;
    } else {
        uint32_t odd = (u >> 13) & 1u;
        u += ((uint32_t)(15 - 127) << 23) + 0xfffu + odd;
        o = u >> 13;
        if (o > 0x7bffu)
            o = 0x7bffu;
    }
    return (uint16_t)(o | (sign >> 16));
}

static float f16_to(uint16_t h)
{
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16, e = (h >> 10) & 0x1fu, m = h & 0x3ffu;
    if (e == 0) {
        float v = (float)m * 0x1p-24f;
        return sign ? -v : v;
    }
    uint32_t u =
        e == 31 ? (sign | 0x7f800000u | (m << 13)) : (sign | ((e + 112) << 23) | (m << 13));
    float f;
    memcpy(&f, &u, 4);
    return f;
}

void sh__coll_net_encode(sh_coll_compress cmp, const float *x, size_t n, uint8_t *out)
{
    if (cmp == SH_COLL_COMPRESS_F16) {
        for (size_t i = 0; i < n; i++) {
            uint16_t h = f16_from(x[i]);
            memcpy(out + 2 * i, &h, 2);
        }
    } else if (cmp == SH_COLL_COMPRESS_INT8) {
        for (size_t b = 0; b < n; b += INT8_BLOCK) {
            size_t k = n - b < INT8_BLOCK ? n - b : INT8_BLOCK;
            float amax = 0.0f;
            for (size_t i = 0; i < k; i++)
                amax = fmaxf(amax, fabsf(x[b + i]));
            float scale = amax / 127.0f, inv = amax > 0.0f ? 127.0f / amax : 0.0f;
            memcpy(out, &scale, 4);
            int8_t *q = (int8_t *)(out + 4);
            for (size_t i = 0; i < k; i++) {
                float v = rintf(x[b + i] * inv);
                if (!(v >= -127.0f)) /* NaN too (an infinite block's scale is infinite) */
                    v = -127.0f;
                if (v > 127.0f)
                    v = 127.0f;
                q[i] = (int8_t)v;
            }
            out += 4 + k;
        }
    } else {
        memcpy(out, x, n * sizeof(float));
    }
}

void sh__coll_net_decode(sh_coll_compress cmp, const uint8_t *in, size_t n, float *x, bool add)
{
    if (cmp == SH_COLL_COMPRESS_F16) {
        for (size_t i = 0; i < n; i++) {
            uint16_t h;
            memcpy(&h, in + 2 * i, 2);
            x[i] = add ? x[i] + f16_to(h) : f16_to(h);
        }
    } else if (cmp == SH_COLL_COMPRESS_INT8) {
        for (size_t b = 0; b < n; b += INT8_BLOCK) {
            size_t k = n - b < INT8_BLOCK ? n - b : INT8_BLOCK;
            float scale;
            memcpy(&scale, in, 4);
            const int8_t *q = (const int8_t *)(in + 4);
            for (size_t i = 0; i < k; i++)
                x[b + i] = add ? x[b + i] + (float)q[i] * scale : (float)q[i] * scale;
            in += 4 + k;
        }
    } else if (add) {
        for (size_t i = 0; i < n; i++) {
            float v;
            memcpy(&v, in + 4 * i, 4);
            x[i] += v;
        }
    } else {
        memcpy(x, in, n * sizeof(float));
    }
}
