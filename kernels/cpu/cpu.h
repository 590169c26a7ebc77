/* Internals of the CPU backend shared by its files: the worker pool, the kernel table per ISA,
 * and the parameter blocks of the ops. */
#ifndef SH_KERNELS_CPU_CPU_H
#define SH_KERNELS_CPU_CPU_H

#include <stdatomic.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "kernels/backend.h"
#include "kernels/cpu/quant.h"
#include "kernels/cpu/quant_k.h"

/* ---- worker pool --------------------------------------------------------------------------- */

/* A persistent pool of n threads. Thread 0 is the leader (it runs the backend's op queue and
 * calls sh__cpu_pool_run); threads 1..n-1 are helpers that wait for jobs, spinning on the job
 * counter before sleeping on a futex, so ops issued back to back (a decode step) cost no
 * wake-up.
 *
 * Helpers join a job only while the leader is still working on it: a helper that is asleep or
 * preempted (the machine is shared) and arrives after the leader has finished its own call skips
 * the job. So a job never waits for a thread that is not running, but it cannot assume which
 * threads run it: it divides its work with sh__cpu_pool_claim, and `tid` only picks per-thread
 * scratch. */
typedef struct sh__cpu_pool sh__cpu_pool;

/* A job body: called on the leader and on each helper that joins, with its index and the thread
 * count. */
typedef void (*sh__cpu_job_fn)(void *arg, int tid, int nth);

/* Placement of the backend's threads (sh_backend_cpu_opts' cpu_mask, sched, nice, no_spin). */
typedef struct sh__cpu_thread_opts {
    uint64_t cpu_mask;
    int32_t sched, nice, no_spin;
} sh__cpu_thread_opts;

/* Applies *t to the calling thread (Linux: affinity, policy, niceness); 0, or an errno value
 * for the first setting the OS refused. */
int sh__cpu_thread_apply(const sh__cpu_thread_opts *t);

/* Starts the n - 1 helper threads; the leader is the calling thread of sh__cpu_pool_run. t may
 * be NULL (defaults); each helper applies it to itself first. */
sh_err sh__cpu_pool_create(int n, const sh__cpu_thread_opts *t, sh__cpu_pool **out, sh_error *e);
void sh__cpu_pool_destroy(sh__cpu_pool *p); /* accepts NULL; no job may be running */
int sh__cpu_pool_size(const sh__cpu_pool *p);

/* Runs fn(arg, 0, n) on the caller and fn(arg, tid, n) on the helpers that join (see above);
 * returns when every call that started has returned (their writes are then visible). Only one
 * thread (the leader) may call it at a time. */
void sh__cpu_pool_run(sh__cpu_pool *p, sh__cpu_job_fn fn, void *arg);

/* Runs fn(arg, 0, n) on the caller alone, with the work-sharing counters reset: for jobs too
 * small to be worth the hand-off to the helpers (about a microsecond). */
void sh__cpu_pool_run_alone(sh__cpu_pool *p, sh__cpu_job_fn fn, void *arg);

/* Work sharing inside a job. Phase ph (0 or 1; a job may use both, e.g. prepare then compute)
 * hands out [0, n_units) in chunks of `per` units in order: claim returns the next chunk in
 * [*lo, *hi), or false when none is left. finish counts units done (with release order);
 * wait_finished returns once `total` units of the phase are done (acquire): a thread calls it
 * after it has finished everything it claimed, so the wait ends whichever threads joined. */
bool sh__cpu_pool_claim(sh__cpu_pool *p, int ph, int64_t n_units, int64_t per, int64_t *lo,
                        int64_t *hi);
void sh__cpu_pool_finish(sh__cpu_pool *p, int ph, int64_t units);
void sh__cpu_pool_wait_finished(sh__cpu_pool *p, int ph, int64_t total);

/* A chunk size that gives each thread about `per_thread` chunks of n_units (at least 1): small
 * enough that threads that join late or get preempted leave little behind, large enough that
 * the shared counter is touched a few times per op only. */
int64_t sh__cpu_pool_chunk(const sh__cpu_pool *p, int64_t n_units, int per_thread);

/* Static partition of [0, n) into nth parts, each a multiple of `align` except the last:
 * thread tid gets [*lo, *hi) (possibly empty). (The ops share work with sh__cpu_pool_claim
 * instead; kept for callers that own all threads.) */
void sh__cpu_split(int64_t n, int64_t align, int tid, int nth, int64_t *lo, int64_t *hi);

/* ---- activations and matmul ---------------------------------------------------------------- */

/* Elements per activation quantization block (the weight block size of the legacy quantized
 * types Q8_0, Q4_0, Q4_1, Q5_0, Q5_1; the K-quants use 256-element super-blocks, SH_QK_K). */
#define SH_CPU_QK 32

/* Activations of a matmul prepared once for all weights: the f32 rows (normalized when the op
 * fuses RMSNorm) and their int8 quantization, per 32-element block j of token t:
 *   x[t*n_in + 32j + i] ~= d[t*nb + j] * qs[t*n_in + 32j + i],   s[t*nb + j] = d * sum_i qs,
 * with d = max|x| / 127 (ggml's Q8_0/Q8_1 rule). s carries the -8 / -16 offsets of Q4_0 / Q5_0
 * and the minimums of Q4_1 / Q5_1. K-quant weights read the rows quantized to Q8_K instead (qk,
 * sh__quant_row's Q8_K: per 256 elements, bsums included); a fused matmul over both kinds of
 * weight has both. */
typedef struct sh__cpu_act {
    const float *x;          // (n_tok, n_in)
    const int8_t *qs;        // (n_tok, n_in), only when some weight is a 32-block quantized type
    const float *d;          // (n_tok, n_in / 32)
    const float *s;          // (n_tok, n_in / 32)
    const sh_block_q8_k *qk; // (n_tok, n_in / 256), only when some weight is a K-quant
    /* The f32 rows transposed per tile of 16 tokens, xt[(t / 16) * n_in * 16 + k * 16 + t % 16]
     * = x[t * n_in + k] (lanes past n_tok zero): only for packed F16 weights and n_tok > 1, so
     * that a tile's 16 values of element k are one cache line. */
    const float *xt; // (ceil(n_tok / 16), n_in, 16)
    /* The f32 rows rounded to bf16 (round to nearest even) in AMX A-tile order, per tile of 16
     * tokens and 32-element step: xb[((t / 16) * (n_in / 32) + k / 32) * 512 + (t % 16) * 32 +
     * k % 32] = bf16(x[t * n_in + k]) (rows past n_tok zero), so one step of a tile is 1 KiB
     * contiguous. Only where the kernel table has act_bf16 (the AMX level) and n_tok >=
     * SH_CPU_BF16_MIN_TOK; the packed 32-block kernels then compute every token in BF16. */
    const uint16_t *xb; // (ceil(n_tok / 16), n_in / 32, 16, 32)
    int64_t n_in;
    int64_t n_tok;
} sh__cpu_act;

/* One weight's product with all tokens, for output rows [r0, r1):
 *   y[t*ldy + r] (=|+=) sum_k W[r, k] x[t, k]. */
typedef struct sh__cpu_mm {
    const sh__cpu_act *a;
    const uint8_t *w; /* row r at w + r * row_bytes */
    size_t row_bytes;
    float *y;
    int64_t ldy;
    int accumulate;
} sh__cpu_mm;

typedef void (*sh__cpu_mm_fn)(const sh__cpu_mm *m, int64_t r0, int64_t r1);

/* ---- packed weights (pack.c) ---------------------------------------------------------------- */

/* Rows interleaved per group of a packed weight. */
#define SH_CPU_PACK_ROWS 16

/* The packed layout of a quantized weight (n_out, n_in), made once at load by weight_prepare so
 * that one SIMD register holds 16 rows: dpbusd then computes 16 rows' dot products at once against
 * a broadcast 4-byte slice of the activation, the accumulator lanes are the output rows (no
 * horizontal sums), and the 16 rows' block scales load as one vector.
 *
 * Rows are grouped by 16 (the last group padded with zero rows), each group
 * sh__cpu_pack_group_bytes(type, n_in) bytes (a multiple of 64). With nb = n_in / 32 blocks per
 * row, a quantized group holds, for rows 16g .. 16g + 15:
 *   codes   nb blocks of 8 (Q8_0) or 4 (Q4_0/Q4_1) 64-byte vectors; in block b, vector j, lane r
 *           (4 bytes) holds the bytes qs[4j .. 4j + 3] of row r's block b. For Q4 a byte's low
 *           nibble is element 4j + i and its high nibble element 16 + 4j + i, so after the nibble
 *           split vector j (low) and 4 + j (high) hold elements 4j .. 4j + 3 and 16 + 4j ..: in
 *           both types unpacked vector j pairs with activation bytes 4j .. 4j + 3 of the block.
 *           Q8_0 codes are stored biased by +128 as u8 (dpbusd multiplies u8 by s8); the bias is
 *           removed with the activation block sums s: sum_i (q_i + 128) a_i = sum_i q_i a_i +
 *           128 s / da.
 *           Q5_0/Q5_1 codes are packed as Q4's (their low four bits).
 *   d       then nb x 16 fp16 scales (32 bytes per block);
 *   m       then nb x 16 fp16 minimums (Q4_1 and Q5_1 only);
 *   h       then, for Q5_0/Q5_1, nb x 8 64-bit masks (64 bytes per block): bit 4r + i of mask v
 *           is the fifth bit of the element unpacked vector v holds in byte 4r + i (so the
 *           kernel adds 16 to the codes under the mask: one k-register load per vector);
 *   padding to a multiple of 64 bytes.
 * The codes come first so that every code vector is 64-byte aligned (a vector that straddles two
 * cache lines costs two loads; interleaving the 32-byte scales with the codes did that to every
 * other block and made the Q4_0 matvec a third slower in cache).
 * F16 (float arithmetic, no activation codes): block b is 32 steps e of 16 fp16, the element
 * 32b + e of rows 16g .. 16g + 15 (1024 bytes).
 * Q6_K (256-element super-blocks, nb = n_in / 256; weight = d sc_s (q - 32), q 6 bits, sc_s the
 * signed 8-bit scale of sub-block s, elements 16s .. 16s + 15): per super-block
 * SH_CPU_PACK_Q6K_BLOCK bytes, the scales (at SH_CPU_PACK_Q6K_SC, 0) followed by 16 units of
 * SH_CPU_PACK_Q6K_UNIT bytes (one per sub-block s, from SH_CPU_PACK_Q6K_UNITS, 256), then after
 * all super-blocks nb x 16 fp16 d (32 bytes per super-block). The scales come first so that a
 * super-block is read in one ascending walk (the decode matvec's prefetch and the hardware
 * prefetchers follow that best).
 * Unit s is three 64-byte vectors whose lane r (4 bytes) belongs to row r: byte i of lane r of
 * vector 0 holds the low four bits of element 16s + i (low nibble) and 16s + 4 + i (high nibble),
 * of vector 1 those of 16s + 8 + i and 16s + 12 + i, and of vector 2 the top two bits of
 * elements 16s + 4v + i at bits 2v (v < 4). Unpacked, code vector v pairs with activation bytes
 * 16s + 4v .. 16s + 4v + 3 of the super-block. The scales are 16 x 16 bytes: byte 16s + r is
 * row r's sc_s (so the 16 rows' scales of a sub-block are one 128-bit load). A unit plus its share
 * of the scales and d is 210 bytes per row, as in the file.
 * Q4_K (256-element super-blocks, nb = n_in / 256): super-block b of the group is
 * SH_CPU_PACK_Q4K_BYTES (2304) bytes at b * 2304, the same bytes as the 16 rows' file blocks, in
 * the order the kernel reads them (one ascending walk per super-block, which the decode matvec's
 * prefetch and the hardware prefetchers follow best):
 *   scales  at SH_CPU_PACK_Q4K_SC (0), 3 vectors: vector k, lane r holds bytes 4k .. 4k + 3 of row
 *           r's 12 packed 6-bit scales and mins, as in the file (the kernel decodes 16 rows at
 *           once);
 *   d, dmin at SH_CPU_PACK_Q4K_D (192): the 16 rows' fp16 d, then (at 224) their fp16 dmin;
 *   codes   at SH_CPU_PACK_Q4K_CODES (256), 32 vectors of 64 bytes: vector v, lane r holds
 *           qs[4v .. 4v + 3] of row r. So vectors 8p .. 8p + 7 are the qs bytes of sub-blocks 2p
 *           (low nibbles) and 2p + 1 (high), and vector 8p + i pairs with activation bytes
 *           64p + 4i .. (low) and 64p + 32 + 4i .. (high).
 * Every piece is whole cache lines, so the super-blocks need no padding.
 * Q5_K (Q4_K's super-block plus qh, the fifth bit of each code: element 64p + l of the file block,
 * l < 32, has it at bit 2p of qh[l], element 64p + 32 + l at bit 2p + 1): super-block b is
 * SH_CPU_PACK_Q5K_BYTES (2816) bytes at b * 2816, Q4_K's scales and d, dmin at the same offsets,
 * then
 *   qh      at SH_CPU_PACK_Q5K_QH (256), 8 vectors: vector v, lane r holds qh[4v .. 4v + 3] of
 *           row r, so byte i of lane r holds at bit j the fifth bit of element 4v + i of
 *           sub-block j (j < 8): the element that code vector 8 (j / 2) + v holds in its low
 *           (j even) or high nibble, byte 4r + i;
 *   codes   at SH_CPU_PACK_Q5K_CODES (768), Q4_K's 32 code vectors of the low four bits.
 * IQ4_NL (32-element blocks of an fp16 d and 16 bytes of 4-bit indices into the grid
 * SH_IQ4_VALUES, element i in the low nibble of byte i and 16 + i in the high one, as Q4_0): packed
 * exactly as Q4_0 (codes, then d), the indices in place of the codes.
 * IQ4_XS (256-element super-blocks of eight 32-element sub-blocks j, each 16 bytes of IQ4_NL's
 * nibble order and a 6-bit scale ls_j in scales_l / scales_h): super-block b is
 * SH_CPU_PACK_IQ4XS_BYTES (2176) bytes at b * 2176, the 16 rows' file blocks:
 *   scales_l at SH_CPU_PACK_IQ4XS_SL (0), one vector: lane r holds row r's 4 bytes;
 *   scales_h at SH_CPU_PACK_IQ4XS_SH (64), the 16 rows' 16-bit words, then (at
 *            SH_CPU_PACK_IQ4XS_D, 96) their fp16 d;
 *   codes    at SH_CPU_PACK_IQ4XS_CODES (128), 32 vectors: vector v, lane r holds
 *            qs[4v .. 4v + 3] of row r, so vectors 4j .. 4j + 3 are sub-block j's, and vector
 *            4j + k pairs with activation bytes 32j + 4k .. (low nibbles) and 32j + 16 + 4k ..
 *            (high).
 * A packed weight is the size of the original plus the padding rows and at most 63 bytes per
 * group. */
#define SH_CPU_PACK_Q6K_UNIT 192
#define SH_CPU_PACK_Q6K_SC 0
#define SH_CPU_PACK_Q6K_UNITS 256
#define SH_CPU_PACK_Q6K_BLOCK (16 * SH_CPU_PACK_Q6K_UNIT + 256)
#define SH_CPU_PACK_Q4K_BYTES 2304
#define SH_CPU_PACK_Q4K_SC 0
#define SH_CPU_PACK_Q4K_D 192
#define SH_CPU_PACK_Q4K_CODES 256
#define SH_CPU_PACK_Q5K_BYTES 2816
#define SH_CPU_PACK_Q5K_QH 256
#define SH_CPU_PACK_Q5K_CODES 768
#define SH_CPU_PACK_IQ4XS_BYTES 2176
#define SH_CPU_PACK_IQ4XS_SL 0
#define SH_CPU_PACK_IQ4XS_SH 64
#define SH_CPU_PACK_IQ4XS_D 96
#define SH_CPU_PACK_IQ4XS_CODES 128
/* Per block (Q6_K, Q4_K, Q5_K, IQ4_XS: per super-block, codes and scales); 0: no packed
 * layout. */
size_t sh__cpu_pack_code_bytes(sh_dtype type);
size_t sh__cpu_pack_group_bytes(sh_dtype type, int64_t n_in);
size_t sh__cpu_pack_bytes(sh_dtype type, int64_t n_out, int64_t n_in);
/* Writes the packed copy of the weight src (n_out rows of sh__dtype_row_bytes each) to dst. */
void sh__cpu_pack(sh_dtype type, const void *src, int64_t n_out, int64_t n_in, void *dst);

/* The inverse for one block: writes block b of row `row` of a weight packed by sh__cpu_pack back
 * in the file layout (18, 20, 22, 24 or 34 bytes; for F16 the 32 halves, 64 bytes; for Q6_K,
 * Q4_K, Q5_K and IQ4_XS super-block b, 210, 144, 176 and 136 bytes) to `blk`, so that an embedding
 * lookup can read a packed table whose file pages were dropped. */
void sh__cpu_unpack_block(sh_dtype type, const void *packed, int64_t n_in, int64_t row, int64_t b,
                          uint8_t blk[256]);

/* Attention work (defined with the attention functions below). */
typedef struct sh__cpu_attn sh__cpu_attn;

/* The kernels of one ISA. Every member is set (a SIMD table falls back to the reference for what
 * it does not accelerate). */
typedef struct sh__cpu_kernels {
    int32_t isa;
    /* Quantizes n (a multiple of 32) floats as described for sh__cpu_act. */
    void (*quant_act)(const float *x, int64_t n, int8_t *qs, float *d, float *s);
    /* Matmul row kernels by weight type. The K-quant ones (Q2_K..Q6_K) read sh__cpu_act.qk,
     * the others of Q8_0..Q5_1 its qs, d and s. */
    sh__cpu_mm_fn mm_f32, mm_f16, mm_bf16, mm_q8_0, mm_q4_0, mm_q4_1, mm_q5_0, mm_q5_1;
    sh__cpu_mm_fn mm_q2_k, mm_q3_k, mm_q4_k, mm_q5_k, mm_q6_k;
    /* IQ4_NL reads qs and d like Q8_0 (its codes are grid values, no offset); IQ4_XS reads qk
     * like the K-quants (its integer kernel is one of sh__cpu_k_ints_fn's). */
    sh__cpu_mm_fn mm_iq4_nl, mm_iq4_xs;
    /* Optional (NULL: the ISA has none and weights stay in their file layout): row kernels on
     * packed weights (see SH_CPU_PACK_ROWS). For these, sh__cpu_mm.w is the packed data and
     * row_bytes the bytes of one 16-row group; r0 is a multiple of 16 or the kernel computes the
     * whole group and stores only rows [r0, r1). */
    sh__cpu_mm_fn mmp_f16, mmp_q8_0, mmp_q4_0, mmp_q4_1, mmp_q5_0, mmp_q5_1;
    sh__cpu_mm_fn mmp_q6_k;
    sh__cpu_mm_fn mmp_q4_k;
    /* Q5_K, IQ4_NL and IQ4_XS: AVX2 only (the AVX-512 table reads their file layout, so does
     * not pack them: weights.c packs a type only where its table has the mmp kernel). */
    sh__cpu_mm_fn mmp_q5_k, mmp_iq4_nl, mmp_iq4_xs;
    /* Optional (NULL: none): fills act->xb for tokens [t0, t1) (t0 a multiple of 16; the rows
     * of the last tile past n_tok are zeroed). Set at the AMX level only: its packed Q8_0, Q4_0,
     * Q4_1, Q5_0 and Q5_1 kernels then run in BF16 for calls of SH_CPU_BF16_MIN_TOK tokens or
     * more. */
    void (*act_bf16)(const sh__cpu_act *act, int64_t t0, int64_t t1);
    float (*dot)(const float *a, const float *b, int64_t n);
    void (*axpy)(float a, const float *x, float *y, int64_t n); /* y += a x */
    float (*sumsq)(const float *x, int64_t n);
    /* y[i] = silu(g[i]) * u[i], silu(g) = g / (1 + exp(-g)); y may equal g or u. */
    void (*swiglu)(const float *g, const float *u, float *y, int64_t n);
    /* Tiled online-softmax attention (attn_tiled.h) over the work items [i0, i1) of a->items;
     * scratch holds sh__cpu_attn_scratch(head_dim) floats, whatever the context. */
    void (*attn_group)(const sh__cpu_attn *a, int64_t i0, int64_t i1, float *scratch);
} sh__cpu_kernels;

extern const sh__cpu_kernels sh__cpu_kernels_ref;
extern const sh__cpu_kernels sh__cpu_kernels_avx2;
extern const sh__cpu_kernels sh__cpu_kernels_avx512;

/* The ISA's row kernel for a weight type (NULL when unsupported). */
sh__cpu_mm_fn sh__cpu_mm_for(const sh__cpu_kernels *k, sh_dtype type);

/* Which activation form a weight type's kernels read: true for Q8_0, Q4_0, Q4_1, Q5_0, Q5_1,
 * IQ4_NL (qs/d/s per 32), resp. for Q2_K..Q6_K, IQ4_XS (qk per 256). */
bool sh__cpu_type_q8(sh_dtype type);
bool sh__cpu_type_k(sh_dtype type);

/* The AVX-512 VNNI packed kernels (ops_avx512_packed.c). */
void sh__cpu_avx512_mmp_q4_0(const sh__cpu_mm *m, int64_t r0, int64_t r1);
void sh__cpu_avx512_mmp_q4_1(const sh__cpu_mm *m, int64_t r0, int64_t r1);
void sh__cpu_avx512_mmp_q8_0(const sh__cpu_mm *m, int64_t r0, int64_t r1);
void sh__cpu_avx512_mmp_f16(const sh__cpu_mm *m, int64_t r0, int64_t r1);
void sh__cpu_avx512_mmp_q5_0(const sh__cpu_mm *m, int64_t r0, int64_t r1);
void sh__cpu_avx512_mmp_q5_1(const sh__cpu_mm *m, int64_t r0, int64_t r1);
/* Q6_K (ops_q6k_avx512_packed.c): reads sh__cpu_act.qk. Exact integer sums per sub-block, scaled
 * and summed per super-block in float, then one float multiply-add per super-block in block
 * order, the same for a matvec and any token of a tile, so outputs do not depend on the batch or
 * the row split. */
void sh__cpu_avx512_mmp_q6_k(const sh__cpu_mm *m, int64_t r0, int64_t r1);
/* Q4_K (ops_q4k_avx512_packed.c): reads sh__cpu_act.qk; as Q6_K's, exact integers per super-block
 * and row and one float multiply-add each for d and dmin per super-block in block order. */
void sh__cpu_avx512_mmp_q4_k(const sh__cpu_mm *m, int64_t r0, int64_t r1);

/* The AVX2 packed kernels (ops_avx2_packed.c), Q4_0, Q4_1 and Q8_0: 8 of a group's 16 rows per
 * register, vpmaddubsw pair sums (Q8_0: |q| against a * sign(q), exact integer block sums); a
 * token's result is the same alone and in any tile. */
void sh__cpu_avx2_mmp_q4_0(const sh__cpu_mm *m, int64_t r0, int64_t r1);
void sh__cpu_avx2_mmp_q4_1(const sh__cpu_mm *m, int64_t r0, int64_t r1);
void sh__cpu_avx2_mmp_q8_0(const sh__cpu_mm *m, int64_t r0, int64_t r1);
/* F16 (reads sh__cpu_act.xt when n_tok > 1): one FMA chain per (row, token) over the elements in
 * order, alone or in a tile. */
void sh__cpu_avx2_mmp_f16(const sh__cpu_mm *m, int64_t r0, int64_t r1);
/* Q4_K (ops_q4k_avx2_packed.c): reads sh__cpu_act.qk; exact integers per super-block and row, then
 * one float multiply-add each for d and dmin per super-block in block order, the same for a matvec
 * and any token of a tile (so outputs do not depend on the batch or the row split). */
void sh__cpu_avx2_mmp_q4_k(const sh__cpu_mm *m, int64_t r0, int64_t r1);
/* Q6_K (ops_q6k_avx2_packed.c): reads sh__cpu_act.qk; exact integer sums per super-block and row
 * (vpmaddwd scales the pair sums), one float multiply-add per super-block in block order, so a
 * token's result is the same alone and in any tile. */
void sh__cpu_avx2_mmp_q6_k(const sh__cpu_mm *m, int64_t r0, int64_t r1);
/* Q5_K (ops_q5k_avx2_packed.c): Q4_K's kernel with the fifth bit merged into each code; the same
 * exact integers per super-block and row and the same float steps, so a token's result is the
 * same alone and in any tile. */
void sh__cpu_avx2_mmp_q5_k(const sh__cpu_mm *m, int64_t r0, int64_t r1);
/* IQ4_NL (ops_avx2_packed.c): Q8_0's kernel on codes looked up in the grid (vpshufb), exact
 * integer block sums; a token's result is the same alone and in any tile. */
void sh__cpu_avx2_mmp_iq4_nl(const sh__cpu_mm *m, int64_t r0, int64_t r1);
/* IQ4_XS (ops_iq4xs_avx2_packed.c): reads sh__cpu_act.qk; codes looked up in the grid, exact
 * integer sums per super-block and row (vpmaddwd applies the sub-block scale), one float
 * multiply-add per super-block in block order, so a token's result is the same alone and in any
 * tile. */
void sh__cpu_avx2_mmp_iq4_xs(const sh__cpu_mm *m, int64_t r0, int64_t r1);

/* The AMX forms of the packed kernels (ops_avx512_packed.c). With sh__cpu_act.xb set, every
 * token in BF16 (AMX-BF16 tile products on weights dequantized to bf16, fp32 sums): not equal to
 * the VNNI kernels, but a token's result does not depend on the call's other tokens or the row
 * range. Without xb, 16-token tiles through AMX-INT8 tile products and fewer tokens through the
 * VNNI tiles, bitwise equal to the VNNI kernels. Only on a CPU with AMX whose OS granted the tile
 * state (sh__cpu_amx_usable). */
void sh__cpu_amx_mmp_q4_0(const sh__cpu_mm *m, int64_t r0, int64_t r1);
void sh__cpu_amx_mmp_q4_1(const sh__cpu_mm *m, int64_t r0, int64_t r1);
void sh__cpu_amx_mmp_q8_0(const sh__cpu_mm *m, int64_t r0, int64_t r1);
void sh__cpu_amx_mmp_q5_0(const sh__cpu_mm *m, int64_t r0, int64_t r1);
void sh__cpu_amx_mmp_q5_1(const sh__cpu_mm *m, int64_t r0, int64_t r1);
/* The AMX level's act_bf16 (see sh__cpu_kernels). */
void sh__cpu_amx_act_bf16(const sh__cpu_act *act, int64_t t0, int64_t t1);
/* Fewest tokens of a matmul that the AMX level computes in BF16 (fewer: AMX-INT8 / VNNI, as
 * decode). */
#define SH_CPU_BF16_MIN_TOK 16

/* The ISA's packed-weight kernel for a type (NULL when it has none). */
sh__cpu_mm_fn sh__cpu_mmp_for(const sh__cpu_kernels *k, sh_dtype type);

/* Best ISA this CPU runs (cpuid), an SH_BACKEND_CPU_ISA_* value up to AVX512: what AUTO picks.
 * AMX is asked for explicitly (SH_BACKEND_CPU_ISA_AMX or SHOAL_ISA=amx); sh__cpu_amx_usable says
 * whether the CPU has AMX-INT8 and AMX-BF16 and the OS granted the tile state (asked once per
 * process). */
int32_t sh__cpu_isa_detect(void);
bool sh__cpu_amx_usable(void);

/* Fills act->xt for tokens [t0, t1) (t0 a multiple of 16; the lanes of the last tile past
 * n_tok are zeroed). */
void sh__cpu_act_transpose(const sh__cpu_act *act, int64_t t0, int64_t t1);

/* Scalar reference pieces reused by the SIMD files for tails. */
void sh__cpu_quant_act_ref(const float *x, int64_t n, int8_t *qs, float *d, float *s);

/* ---- K-quant row dot products (ops_k_ref.c, ops_k_avx2.c) ---------------------------------- */

/* A K-quant weight row (nb super-blocks of Q2_K..Q6_K or IQ4_XS) against an activation row
 * quantized to Q8_K (nb blocks) computes in two steps. The integer part, per super-block b, fills
 * ints[2b] = sum over sub-blocks j of sc_j * sum_i qw_i qa_i (qw with Q3_K's -4 and Q6_K's -32
 * offsets applied, IQ4_XS's codes as their grid values; sc_j Q3_K's and IQ4_XS's scale minus 32)
 * and ints[2b + 1] = sum_j m_j * sum_i qa_i (the
 * mins of Q2_K, Q4_K and Q5_K; 0 for the others). Integers are exact, so every ISA's integer
 * kernel writes the same ints. The float part, sh__cpu_dot_k, is one function shared by every
 * ISA: acc += da * (dw * ints[2b] - dmin * ints[2b + 1]) in block order, so every ISA's dot
 * product is bit-identical to the reference's. The SIMD integer kernels may read a's bsums,
 * which must be the sums of its qs (as sh__quant_row writes them); the reference reads qs only.
 * All int32 sums stay below 2^31 for any codes and scales. Any thread. */
typedef void (*sh__cpu_k_ints_fn)(const void *w, const sh_block_q8_k *a, int64_t nb, int32_t *ints);

/* The integer kernel of `isa` (an SH_BACKEND_CPU_ISA_* value; AVX-512 has its own for Q4_K and
 * Q6_K and uses the AVX2 kernels for the others) for a weight type, or NULL when the type is not
 * a K-quant weight. */
sh__cpu_k_ints_fn sh__cpu_k_ints_for(int32_t isa, sh_dtype type);

/* The AVX2 integer kernels (ops_k_avx2.c), by type (NULL: not built for x86-64 or not there). */
sh__cpu_k_ints_fn sh__cpu_k_ints_avx2(sh_dtype type);
/* The AVX-512 F/BW ones (ops_k_avx512.c): Q4_K and Q6_K; NULL for the others, which use AVX2's. */
sh__cpu_k_ints_fn sh__cpu_k_ints_avx512(sh_dtype type);

/* dot(weight row w of `type`, activation row a) over nb super-blocks through the integer kernel
 * ints (see above): within float rounding, sum_k dequant(w)_k * dequant(a)_k. */
float sh__cpu_dot_k(sh__cpu_k_ints_fn ints, sh_dtype type, const void *w, const sh_block_q8_k *a,
                    int64_t nb);

/* Software prefetch distance of the K-quant matvecs, in bytes: as the packed kernels' (one core's
 * demand misses alone reach about half the read bandwidth; see ops_avx512_packed.c). */
#define SH_CPU_K_PF_DIST 8192

/* y[t, r] (=|+=) sh__cpu_dot_k(ints, type, row r, token t's Q8_K row) for rows [r0, r1). A matvec
 * (decode) reads each weight row once, prefetching SH_CPU_K_PF_DIST bytes ahead (rows are
 * contiguous); with several tokens the row stays in L1 while its tokens pass over it. */
void sh__cpu_mm_k(const sh__cpu_mm *m, int64_t r0, int64_t r1, sh_dtype type,
                  sh__cpu_k_ints_fn ints);

/* The K-quant matmul row kernels (sh__cpu_mm_fn) of each ISA. The scalar ones give sh__cpu_dot_k
 * of the weight row and the token's Q8_K row; the AVX2 (ops_k_avx2.c, also AVX-512's Q2_K, Q3_K,
 * Q5_K) and AVX-512 Q4_K/Q6_K ones (ops_k_avx512.c) the same exact integers with float sums kept
 * in vectors across blocks, so they differ from the scalar results in rounding only. Each output
 * is a fixed sequence of operations: it does not depend on the thread count, and a batched token
 * equals the same token alone. */
#define SH__CPU_MM_K_DECL(isa)                                                                     \
    void sh__cpu_mm_##isa##_q2_k(const sh__cpu_mm *m, int64_t r0, int64_t r1);                     \
    void sh__cpu_mm_##isa##_q3_k(const sh__cpu_mm *m, int64_t r0, int64_t r1);                     \
    void sh__cpu_mm_##isa##_q4_k(const sh__cpu_mm *m, int64_t r0, int64_t r1);                     \
    void sh__cpu_mm_##isa##_q5_k(const sh__cpu_mm *m, int64_t r0, int64_t r1);                     \
    void sh__cpu_mm_##isa##_q6_k(const sh__cpu_mm *m, int64_t r0, int64_t r1);
SH__CPU_MM_K_DECL(ref)
SH__CPU_MM_K_DECL(avx2)
void sh__cpu_mm_ref_iq4_xs(const sh__cpu_mm *m, int64_t r0, int64_t r1);
void sh__cpu_mm_avx2_iq4_xs(const sh__cpu_mm *m, int64_t r0, int64_t r1);
void sh__cpu_mm_avx512_q4_k(const sh__cpu_mm *m, int64_t r0, int64_t r1);
void sh__cpu_mm_avx512_q6_k(const sh__cpu_mm *m, int64_t r0, int64_t r1);

/* ---- the non-matmul ops, on a row/element range (ops.c) ------------------------------------ */

void sh__cpu_rmsnorm_rows(const sh__cpu_kernels *k, const float *x, const float *w, float eps,
                          int64_t n, float *y, int64_t t0, int64_t t1);
void sh__cpu_rope_range(float *x, const int32_t *pos, int32_t n_heads, int32_t head_dim,
                        int32_t n_rot, float freq_base, sh_rope_scaling scale, sh_rope_mode mode,
                        int64_t i0, int64_t i1);
float sh__cpu_silu(float g);
void sh__cpu_swiglu_ref(const float *g, const float *u, float *y, int64_t n);

/* Gemma's ops (ops_gemma.c). A gated activation y[i] = act(g[i]) * u[i] (y may equal g or u);
 * sh__cpu_geglu_for picks the ISA's GEGLU (gelu, tanh approximation), whose SIMD paths agree
 * with sh__cpu_geglu_ref within a few float roundings. The ranges are [i0, i1) of x and y. */
typedef void (*sh__cpu_glu_fn)(const float *g, const float *u, float *y, int64_t n);
float sh__cpu_gelu(float g);
void sh__cpu_geglu_ref(const float *g, const float *u, float *y, int64_t n);
sh__cpu_glu_fn sh__cpu_geglu_for(int32_t isa);
void sh__cpu_scale_range(const float *x, float s, float *y, int64_t i0, int64_t i1);
void sh__cpu_softcap_range(const float *x, float cap, float *y, int64_t i0, int64_t i1);

/* An attention op as the kernels see it: the cache, the batch's sequences, per row its sequence
 * and position, and the work items. (attn.c, attn_tiled.h) */
struct sh__cpu_attn {
    sh_kv_cache cache;
    const sh_attn_seq *seqs;
    const int32_t *row_seq; // (n_tok) sequence index of each row
    const int32_t *row_pos; // (n_tok) position of each row
    const float *q;
    float *out;
    int32_t n_heads;
    float scale;
    /* Grouped kernels only: work item i is items[4i .. 4i + 3] = (first row, rows, first query
     * head, heads): consecutive rows of one sequence times query heads of one KV head, at most
     * SH_CPU_ATTN_LANES pairs (see sh__cpu_attn_items). */
    const int32_t *items;
};

/* (row, head) pairs one attention item computes side by side (one per vector lane). */
#define SH_CPU_ATTN_LANES 16
/* Keys per tile of the online softmax; tiles start at multiples of it (absolute positions). */
#define SH_CPU_ATTN_TILE 32

/* The tiled attention of each ISA (attn.c, attn_avx2.c, attn_avx512.c; see attn_tiled.h), the
 * scratch one thread needs in floats (independent of the context), and the item table of a
 * batch: writes up to sh__cpu_attn_max_items entries to items (4 int32 each) and returns their
 * count. */
void sh__cpu_ref_attn_range(const sh__cpu_attn *a, int64_t i0, int64_t i1, float *scratch);
void sh__cpu_avx2_attn_range(const sh__cpu_attn *a, int64_t i0, int64_t i1, float *scratch);
void sh__cpu_avx512_attn_range(const sh__cpu_attn *a, int64_t i0, int64_t i1, float *scratch);
size_t sh__cpu_attn_scratch(int32_t head_dim);
int64_t sh__cpu_attn_max_items(int64_t n_rows, int32_t n_seqs, int32_t n_heads);
int64_t sh__cpu_attn_items(const sh_attn_seq *seqs, int32_t n_seqs, int32_t n_heads,
                           int32_t n_kv_heads, int32_t *items);
void sh__cpu_kv_store_rows(const sh_kv_cache *c, const sh_attn_seq *seqs, int32_t n_seqs,
                           const float *k, const float *v);

/* Element k of a float weight row widened to f32; kind 0 F32, 1 F16, 2 BF16. The scalar
 * reference's inner loop, and the fast paths' tail when a row's length is not a multiple of the
 * vector width (float rows may have any length, e.g. stories260K's 172). */
static inline float sh__cpu_wf32(const uint8_t *w, int64_t k, int kind)
{
    if (kind == 0)
        return ((const float *)w)[k];
    const uint16_t h = ((const uint16_t *)w)[k];
    return kind == 1 ? sh__quant_f32_from_fp16(h) : sh__quant_f32_from_bf16(h);
}

#endif
