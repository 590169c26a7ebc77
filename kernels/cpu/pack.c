/* Load-time repacking of quantized weights into the 16-row interleaved layout of the CPU
 * backend's packed kernels (the layout is described at SH_CPU_PACK_ROWS in cpu.h). */
#include <stddef.h>
#include <string.h>

#include "kernels/cpu/cpu.h"

size_t sh__cpu_pack_code_bytes(sh_dtype type)
{
    switch (type) {
    case SH_DTYPE_Q4_0:
    case SH_DTYPE_Q4_1:
    case SH_DTYPE_Q5_0:
    case SH_DTYPE_Q5_1:
    case SH_DTYPE_IQ4_NL:
        return 256;
    case SH_DTYPE_Q8_0:
        return 512;
    case SH_DTYPE_F16:
        return 32 * 16 * 2;
    case SH_DTYPE_Q6_K:
        return SH_CPU_PACK_Q6K_BLOCK;
    case SH_DTYPE_Q4_K:
        return SH_CPU_PACK_Q4K_BYTES;
    case SH_DTYPE_Q5_K:
        return SH_CPU_PACK_Q5K_BYTES;
    case SH_DTYPE_IQ4_XS:
        return SH_CPU_PACK_IQ4XS_BYTES;
    default:
        return 0;
    }
}

/* The scale vectors per block that follow the codes: d, and m for Q4_1 and Q5_1. */
static size_t scale_vectors(sh_dtype type)
{
    return type == SH_DTYPE_Q4_1 || type == SH_DTYPE_Q5_1 ? 2 : type == SH_DTYPE_F16 ? 0 : 1;
}

/* Bytes per block of the Q5 fifth-bit masks that follow the scales (0 for the other types). */
static size_t high_bytes(sh_dtype type)
{
    return type == SH_DTYPE_Q5_0 || type == SH_DTYPE_Q5_1 ? 64 : 0;
}

size_t sh__cpu_pack_group_bytes(sh_dtype type, int64_t n_in)
{
    if (type == SH_DTYPE_Q6_K) /* codes and scales per super-block, then the 16 rows' d */
        return ((size_t)(n_in / SH_QK_K) * (SH_CPU_PACK_Q6K_BLOCK + 32) + 63) & ~(size_t)63;
    if (type == SH_DTYPE_Q4_K || type == SH_DTYPE_Q5_K || type == SH_DTYPE_IQ4_XS)
        return (size_t)(n_in / SH_QK_K) * sh__cpu_pack_code_bytes(type);
    const size_t nb = (size_t)(n_in / SH_CPU_QK);
    return (nb * (sh__cpu_pack_code_bytes(type) + 32 * scale_vectors(type) + high_bytes(type)) +
            63) &
           ~(size_t)63;
}

/* Where a source block keeps its codes, its fifth bits (Q5) and its size. */
static void src_layout(sh_dtype type, size_t *sbb, size_t *qoff, size_t *hoff)
{
    switch (type) {
    case SH_DTYPE_Q8_0:
        *sbb = 34, *qoff = 2, *hoff = 0;
        break;
    case SH_DTYPE_Q4_1:
        *sbb = 20, *qoff = 4, *hoff = 0;
        break;
    case SH_DTYPE_Q5_0:
        *sbb = 22, *qoff = 6, *hoff = 2;
        break;
    case SH_DTYPE_Q5_1:
        *sbb = 24, *qoff = 8, *hoff = 4;
        break;
    default: /* Q4_0, IQ4_NL (fp16 d and 16 bytes of nibbles, in the same places) */
        *sbb = 18, *qoff = 2, *hoff = 0;
        break;
    }
}

size_t sh__cpu_pack_bytes(sh_dtype type, int64_t n_out, int64_t n_in)
{
    const int64_t groups = (n_out + SH_CPU_PACK_ROWS - 1) / SH_CPU_PACK_ROWS;
    return (size_t)groups * sh__cpu_pack_group_bytes(type, n_in);
}

/* ---- Q6_K (layout at SH_CPU_PACK_Q6K_BLOCK in cpu.h) ---- */

/* The 6-bit codes (0..63) of a Q6_K block in element order: in half h, byte l < 32 of ql and
 * byte l + 32 hold elements 128h + l and + 32 in their low nibbles and + 64 and + 96 in their
 * high ones, with the top two bits at bits 0, 2, 4, 6 of qh byte 32h + l (quant_k.c's
 * dequant_q6_k). */
static void q6k_codes(const sh_block_q6_k *x, uint8_t q[SH_QK_K])
{
    for (int h = 0; h < 2; h++) {
        const uint8_t *ql = x->ql + 64 * h, *qh = x->qh + 32 * h;
        uint8_t *o = q + 128 * h;
        for (int l = 0; l < 32; l++) {
            o[l] = (uint8_t)((ql[l] & 15) | (qh[l] & 3) << 4);
            o[l + 32] = (uint8_t)((ql[l + 32] & 15) | (qh[l] >> 2 & 3) << 4);
            o[l + 64] = (uint8_t)(ql[l] >> 4 | (qh[l] >> 4 & 3) << 4);
            o[l + 96] = (uint8_t)(ql[l + 32] >> 4 | (qh[l] >> 6 & 3) << 4);
        }
    }
}

/* The inverse of q6k_codes (the codes' bits of a block; scales and d untouched). */
static void q6k_put(const uint8_t q[SH_QK_K], sh_block_q6_k *x)
{
    for (int h = 0; h < 2; h++) {
        uint8_t *ql = x->ql + 64 * h, *qh = x->qh + 32 * h;
        const uint8_t *c = q + 128 * h;
        for (int l = 0; l < 32; l++) {
            ql[l] = (uint8_t)((c[l] & 15) | (c[l + 64] & 15) << 4);
            ql[l + 32] = (uint8_t)((c[l + 32] & 15) | (c[l + 96] & 15) << 4);
            qh[l] = (uint8_t)(c[l] >> 4 | (c[l + 32] >> 4) << 2 | (c[l + 64] >> 4) << 4 |
                              (c[l + 96] >> 4) << 6);
        }
    }
}

/* Super-block b of a group, one row at a time in the group's order so that the group's packed
 * bytes stay in cache: element 16s + 4v + i (v, i < 4) of row r has its nibble in byte 4r + i
 * of plane v / 2 of unit s (low half for even v) and its top two bits in byte 4r + i of the
 * unit's third plane at bit 2v. */
static void pack_q6_k(const void *src, int64_t n_out, int64_t n_in, uint8_t *out)
{
    const int64_t nb = n_in / SH_QK_K;
    const size_t gb = sh__cpu_pack_group_bytes(SH_DTYPE_Q6_K, n_in);
    for (int64_t g0 = 0; g0 < n_out; g0 += SH_CPU_PACK_ROWS) {
        uint8_t *pg = out + (size_t)(g0 / SH_CPU_PACK_ROWS) * gb;
        for (int64_t b = 0; b < nb; b++)
            for (size_t r = 0; r < SH_CPU_PACK_ROWS && g0 + (int64_t)r < n_out; r++) {
                const sh_block_q6_k *sb = (const sh_block_q6_k *)src + (g0 + (int64_t)r) * nb + b;
                uint8_t *pb = pg + (size_t)b * SH_CPU_PACK_Q6K_BLOCK;
                uint8_t q[SH_QK_K];
                q6k_codes(sb, q);
                for (size_t s = 0; s < 16; s++) {
                    uint8_t *u = pb + SH_CPU_PACK_Q6K_UNITS + s * SH_CPU_PACK_Q6K_UNIT + 4 * r;
                    const uint8_t *c = q + 16 * s;
                    for (size_t i = 0; i < 4; i++) {
                        u[i] = (uint8_t)((c[i] & 15) | (c[4 + i] & 15) << 4);
                        u[64 + i] = (uint8_t)((c[8 + i] & 15) | (c[12 + i] & 15) << 4);
                        u[128 + i] = (uint8_t)(c[i] >> 4 | (c[4 + i] >> 4) << 2 |
                                               (c[8 + i] >> 4) << 4 | (c[12 + i] >> 4) << 6);
                    }
                    pb[SH_CPU_PACK_Q6K_SC + 16 * s + r] = (uint8_t)sb->scales[s];
                }
                memcpy(pg + (size_t)nb * SH_CPU_PACK_Q6K_BLOCK + (size_t)b * 32 + 2 * r, &sb->d, 2);
            }
    }
}

static void unpack_q6_k(const void *packed, int64_t n_in, int64_t row, int64_t b, uint8_t *blk)
{
    const int64_t nb = n_in / SH_QK_K;
    const size_t gb = sh__cpu_pack_group_bytes(SH_DTYPE_Q6_K, n_in);
    const uint8_t *pg = (const uint8_t *)packed + (size_t)(row / SH_CPU_PACK_ROWS) * gb;
    const uint8_t *pb = pg + (size_t)b * SH_CPU_PACK_Q6K_BLOCK;
    const size_t r = (size_t)(row % SH_CPU_PACK_ROWS);
    sh_block_q6_k out;
    uint8_t q[SH_QK_K];
    for (size_t s = 0; s < 16; s++) {
        const uint8_t *u = pb + SH_CPU_PACK_Q6K_UNITS + s * SH_CPU_PACK_Q6K_UNIT + 4 * r;
        uint8_t *c = q + 16 * s;
        for (size_t i = 0; i < 4; i++) {
            c[i] = (uint8_t)((u[i] & 15) | (u[128 + i] & 3) << 4);
            c[4 + i] = (uint8_t)(u[i] >> 4 | (u[128 + i] >> 2 & 3) << 4);
            c[8 + i] = (uint8_t)((u[64 + i] & 15) | (u[128 + i] >> 4 & 3) << 4);
            c[12 + i] = (uint8_t)(u[64 + i] >> 4 | (u[128 + i] >> 6) << 4);
        }
        out.scales[s] = (int8_t)pb[SH_CPU_PACK_Q6K_SC + 16 * s + r];
    }
    q6k_put(q, &out);
    memcpy(&out.d, pg + (size_t)nb * SH_CPU_PACK_Q6K_BLOCK + (size_t)b * 32 + 2 * r, 2);
    memcpy(blk, &out, sizeof out);
}

/* ---- Q4_K and Q5_K (layouts at SH_CPU_PACK_ROWS in cpu.h) ---- */

/* Super-block b of row r (r < 16) of a Q4_K or Q5_K group to or from its place in the packed
 * group pg; `to_packed` chooses the direction, so that both share the offsets. */
static void k4_block(sh_dtype type, uint8_t *pg, size_t r, int64_t b, uint8_t *blk, bool to_packed)
{
    /* 3 scale vectors of 4 of the 12 scale bytes per row, the d and dmin halves, (Q5_K: 8 qh
     * vectors of 4 qh bytes per row,) then 32 code vectors of 4 qs bytes per row */
    const bool q5 = type == SH_DTYPE_Q5_K;
    uint8_t *pb = pg + (size_t)b * sh__cpu_pack_code_bytes(type);
    const size_t qs = q5 ? offsetof(sh_block_q5_k, qs) : offsetof(sh_block_q4_k, qs);
    const size_t sc = offsetof(sh_block_q4_k, scales), qh = offsetof(sh_block_q5_k, qh);
    const size_t codes = q5 ? SH_CPU_PACK_Q5K_CODES : SH_CPU_PACK_Q4K_CODES;
    for (size_t v = 0; v < (q5 ? 43u : 35u); v++) {
        size_t po, fo;
        if (v < 32) {
            po = codes + 64 * v;
            fo = qs + 4 * v;
        } else if (v < 35) {
            po = SH_CPU_PACK_Q4K_SC + 64 * (v - 32);
            fo = sc + 4 * (v - 32);
        } else {
            po = SH_CPU_PACK_Q5K_QH + 64 * (v - 35);
            fo = qh + 4 * (v - 35);
        }
        uint8_t *p = pb + po + 4 * r, *f = blk + fo;
        memcpy(to_packed ? p : f, to_packed ? f : p, 4);
    }
    /* d and dmin are the first 4 bytes of both file blocks */
    uint8_t *pd = pb + SH_CPU_PACK_Q4K_D + 2 * r, *pm = pd + 32;
    memcpy(to_packed ? pd : blk + offsetof(sh_block_q4_k, d),
           to_packed ? blk + offsetof(sh_block_q4_k, d) : pd, 2);
    memcpy(to_packed ? pm : blk + offsetof(sh_block_q4_k, dmin),
           to_packed ? blk + offsetof(sh_block_q4_k, dmin) : pm, 2);
}

/* ---- IQ4_XS (layout at SH_CPU_PACK_ROWS in cpu.h) ---- */

/* Super-block b of row r of an IQ4_XS group to or from its place in pg, as k4_block. */
static void iq4xs_block(uint8_t *pg, size_t r, int64_t b, uint8_t *blk, bool to_packed)
{
    uint8_t *pb = pg + (size_t)b * SH_CPU_PACK_IQ4XS_BYTES;
    /* the 32 code vectors, then scales_l (4 bytes per row), scales_h and d (2 bytes per row) */
    struct {
        size_t packed, file, n;
    } piece[35];
    for (size_t v = 0; v < 32; v++) {
        piece[v].packed = SH_CPU_PACK_IQ4XS_CODES + 64 * v + 4 * r;
        piece[v].file = offsetof(sh_block_iq4_xs, qs) + 4 * v;
        piece[v].n = 4;
    }
    piece[32].packed = SH_CPU_PACK_IQ4XS_SL + 4 * r;
    piece[32].file = offsetof(sh_block_iq4_xs, scales_l);
    piece[32].n = 4;
    piece[33].packed = SH_CPU_PACK_IQ4XS_SH + 2 * r;
    piece[33].file = offsetof(sh_block_iq4_xs, scales_h);
    piece[33].n = 2;
    piece[34].packed = SH_CPU_PACK_IQ4XS_D + 2 * r;
    piece[34].file = offsetof(sh_block_iq4_xs, d);
    piece[34].n = 2;
    for (size_t i = 0; i < 35; i++) {
        uint8_t *p = pb + piece[i].packed, *f = blk + piece[i].file;
        memcpy(to_packed ? p : f, to_packed ? f : p, piece[i].n);
    }
}

void sh__cpu_pack(sh_dtype type, const void *src, int64_t n_out, int64_t n_in, void *dst)
{
    const int64_t nb = n_in / SH_CPU_QK;
    const size_t gb = sh__cpu_pack_group_bytes(type, n_in), cb = sh__cpu_pack_code_bytes(type);
    const size_t rb = sh__dtype_row_bytes(type, (uint64_t)n_in);
    uint8_t *out = dst;
    memset(out, 0, sh__cpu_pack_bytes(type, n_out, n_in)); /* padding rows: zero scales, codes */
    if (type == SH_DTYPE_Q4_K || type == SH_DTYPE_Q5_K) {
        const size_t fb = type == SH_DTYPE_Q4_K ? sizeof(sh_block_q4_k) : sizeof(sh_block_q5_k);
        for (int64_t row = 0; row < n_out; row++)
            for (int64_t b = 0; b < n_in / SH_QK_K; b++)
                k4_block(type, out + (size_t)(row / SH_CPU_PACK_ROWS) * gb,
                         (size_t)(row % SH_CPU_PACK_ROWS), b,
                         (uint8_t *)src + (size_t)row * rb + (size_t)b * fb, true);
        return;
    }
    if (type == SH_DTYPE_Q6_K) {
        pack_q6_k(src, n_out, n_in, out);
        return;
    }
    if (type == SH_DTYPE_IQ4_XS) {
        for (int64_t row = 0; row < n_out; row++)
            for (int64_t b = 0; b < n_in / SH_QK_K; b++)
                iq4xs_block(out + (size_t)(row / SH_CPU_PACK_ROWS) * gb,
                            (size_t)(row % SH_CPU_PACK_ROWS), b,
                            (uint8_t *)src + (size_t)row * rb + (size_t)b * sizeof(sh_block_iq4_xs),
                            true);
        return;
    }
    if (type == SH_DTYPE_F16) {
        /* element k of row 16g + r at group g, index 16k + r */
        for (int64_t row = 0; row < n_out; row++) {
            const uint16_t *sr = (const uint16_t *)((const uint8_t *)src + (size_t)row * rb);
            uint16_t *pg = (uint16_t *)(out + (size_t)(row / SH_CPU_PACK_ROWS) * gb);
            for (int64_t k = 0; k < n_in; k++)
                pg[16 * k + row % SH_CPU_PACK_ROWS] = sr[k];
        }
        return;
    }
    /* Source block: fp16 d, [fp16 m,] [qh,] codes. */
    size_t sbb, qoff, hoff;
    src_layout(type, &sbb, &qoff, &hoff);
    const size_t qbytes = type == SH_DTYPE_Q8_0 ? 32 : 16, sv = scale_vectors(type);
    for (int64_t row = 0; row < n_out; row++) {
        uint8_t *pg = out + (size_t)(row / SH_CPU_PACK_ROWS) * gb;
        const size_t r = (size_t)(row % SH_CPU_PACK_ROWS);
        for (int64_t b = 0; b < nb; b++) {
            const uint8_t *sb = (const uint8_t *)src + (size_t)row * rb + (size_t)b * sbb;
            memcpy(pg + (size_t)nb * cb + (size_t)b * 32 + 2 * r, sb, 2); /* d */
            if (sv == 2)
                memcpy(pg + (size_t)nb * (cb + 32) + (size_t)b * 32 + 2 * r, sb + 2, 2); /* m */
            if (high_bytes(type)) {
                /* Mask v (8 bytes) has bit 4r + i set when element 4j + i (v = j < 4) or
                 * 16 + 4j + i (v = 4 + j) of row r has its fifth bit: the 64 byte lanes of the
                 * unpacked code vector v, so the kernel adds 16 under it. */
                uint32_t qh;
                memcpy(&qh, sb + hoff, 4);
                uint8_t *hm = pg + (size_t)nb * (cb + 32 * sv) + (size_t)b * 64;
                for (size_t v = 0; v < 8; v++) {
                    const uint32_t nib = (qh >> (v < 4 ? 4 * v : 16 + 4 * (v - 4))) & 15u;
                    hm[8 * v + r / 2] |= (uint8_t)(nib << (4 * (r % 2)));
                }
            }
            uint8_t *codes = pg + (size_t)b * cb;
            for (size_t j = 0; j < qbytes / 4; j++)
                for (size_t i = 0; i < 4; i++) {
                    uint8_t v = sb[qoff + 4 * j + i];
                    /* Q8_0: the signed code plus 128, as u8 (two's complement: flip bit 7) */
                    codes[64 * j + 4 * r + i] = type == SH_DTYPE_Q8_0 ? (uint8_t)(v ^ 0x80u) : v;
                }
        }
    }
}

void sh__cpu_unpack_block(sh_dtype type, const void *packed, int64_t n_in, int64_t row, int64_t b,
                          uint8_t blk[256])
{
    if (type == SH_DTYPE_Q4_K || type == SH_DTYPE_Q5_K) {
        const size_t gb = sh__cpu_pack_group_bytes(type, n_in);
        k4_block(type, (uint8_t *)packed + (size_t)(row / SH_CPU_PACK_ROWS) * gb,
                 (size_t)(row % SH_CPU_PACK_ROWS), b, blk, false);
        return;
    }
    if (type == SH_DTYPE_Q6_K) {
        unpack_q6_k(packed, n_in, row, b, blk);
        return;
    }
    if (type == SH_DTYPE_IQ4_XS) {
        const size_t gb = sh__cpu_pack_group_bytes(type, n_in);
        iq4xs_block((uint8_t *)packed + (size_t)(row / SH_CPU_PACK_ROWS) * gb,
                    (size_t)(row % SH_CPU_PACK_ROWS), b, blk, false);
        return;
    }
    const int64_t nb = n_in / SH_CPU_QK;
    const size_t gb = sh__cpu_pack_group_bytes(type, n_in), cb = sh__cpu_pack_code_bytes(type);
    const uint8_t *pg = (const uint8_t *)packed + (size_t)(row / SH_CPU_PACK_ROWS) * gb;
    const size_t r = (size_t)(row % SH_CPU_PACK_ROWS);
    if (type == SH_DTYPE_F16) {
        const uint8_t *pc = pg + (size_t)b * cb;
        for (size_t k = 0; k < 32; k++) /* element 32b + k at index 16k + r of block b's codes */
            memcpy(blk + 2 * k, pc + 2 * (16 * k + r), 2);
        return;
    }
    /* The same offsets as sh__cpu_pack, read instead of written. */
    size_t sbb, qoff, hoff;
    src_layout(type, &sbb, &qoff, &hoff);
    const size_t qbytes = type == SH_DTYPE_Q8_0 ? 32 : 16, sv = scale_vectors(type);
    memcpy(blk, pg + (size_t)nb * cb + (size_t)b * 32 + 2 * r, 2); /* d */
    if (sv == 2)
        memcpy(blk + 2, pg + (size_t)nb * (cb + 32) + (size_t)b * 32 + 2 * r, 2); /* m */
    if (high_bytes(type)) {
        const uint8_t *hm = pg + (size_t)nb * (cb + 32 * sv) + (size_t)b * 64;
        uint32_t qh = 0;
        for (size_t v = 0; v < 8; v++) {
            const uint32_t nib = (uint32_t)(hm[8 * v + r / 2] >> (4 * (r % 2))) & 15u;
            qh |= nib << (v < 4 ? 4 * v : 16 + 4 * (v - 4));
        }
        memcpy(blk + hoff, &qh, 4);
    }
    const uint8_t *codes = pg + (size_t)b * cb;
    for (size_t j = 0; j < qbytes / 4; j++)
        for (size_t i = 0; i < 4; i++) {
            uint8_t v = codes[64 * j + 4 * r + i];
            blk[qoff + 4 * j + i] = type == SH_DTYPE_Q8_0 ? (uint8_t)(v ^ 0x80u) : v;
        }
}

sh__cpu_mm_fn sh__cpu_mmp_for(const sh__cpu_kernels *k, sh_dtype type)
{
    switch (type) {
    case SH_DTYPE_F16:
        return k->mmp_f16;
    case SH_DTYPE_Q8_0:
        return k->mmp_q8_0;
    case SH_DTYPE_Q4_0:
        return k->mmp_q4_0;
    case SH_DTYPE_Q4_1:
        return k->mmp_q4_1;
    case SH_DTYPE_Q5_0:
        return k->mmp_q5_0;
    case SH_DTYPE_Q5_1:
        return k->mmp_q5_1;
    case SH_DTYPE_Q6_K:
        return k->mmp_q6_k;
    case SH_DTYPE_Q4_K:
        return k->mmp_q4_k;
    case SH_DTYPE_Q5_K:
        return k->mmp_q5_k;
    case SH_DTYPE_IQ4_NL:
        return k->mmp_iq4_nl;
    case SH_DTYPE_IQ4_XS:
        return k->mmp_iq4_xs;
    default:
        return NULL;
    }
}

void sh__cpu_act_transpose(const sh__cpu_act *act, int64_t t0, int64_t t1)
{
    const int64_t n_in = act->n_in;
    float *xt = (float *)act->xt;
    for (int64_t tile = t0 / 16; tile * 16 < t1; tile++) {
        float *dst = xt + tile * n_in * 16;
        for (int64_t l = 0; l < 16; l++) {
            const int64_t t = tile * 16 + l;
            if (t < t0 || t >= t1) {
                if (t >= act->n_tok) /* padding lanes of the last tile */
                    for (int64_t k = 0; k < n_in; k++)
                        dst[k * 16 + l] = 0.0f;
                continue;
            }
            const float *x = act->x + t * n_in;
            for (int64_t k = 0; k < n_in; k++)
                dst[k * 16 + l] = x[k];
        }
    }
}
