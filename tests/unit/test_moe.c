/* Unit tests of the CPU backend's MoE FFN (kernels/cpu/moe.c): routing and outputs against a
 * plain double-precision loop on fresh random data, on every ISA and with the experts prepared
 * (packed per expert where the ISA has packed kernels); a token's result alone equal bit for bit
 * to its result in a batch; thread counts; expert slices; bad arguments. */
#include <stdint.h>
#include <time.h>

#include "kernels/cpu/cpu.h"
#include "kernels_test_util.h"

/* The backends each layer runs on: every ISA with the weights as they are, then the best ISA
 * with the weights prepared (sh_backend_weight_prepare; the others have no packed kernels). */
static int isas[6], n_isas; /* scalar, avx2, avx512, then avx2 and avx512 prepared */
static bool prep[6];
static void list_isas(void)
{
    n_isas = 0;
    for (int i = SH_BACKEND_CPU_ISA_SCALAR; i <= sh__cpu_isa_detect(); i++) {
        prep[n_isas] = false;
        isas[n_isas++] = i;
    }
    for (int i = SH_BACKEND_CPU_ISA_AVX2; i <= sh__cpu_isa_detect(); i++) {
        prep[n_isas] = true;
        isas[n_isas++] = i;
    }
}

static bool quantized(sh_dtype t) { return sh__cpu_type_q8(t) || sh__cpu_type_k(t); }

/* One MoE layer's weights (and their dequantized copies) plus a step's inputs. */
typedef struct layer {
    int64_t dim, n_ff, n_exp, n_ff_sh;
    int32_t k;
    bool norm_topk, shared, shared_gate;
    float w_scale;
    wmat gate, up, down, gate_sh, up_sh, down_sh, ginp;
} layer;

static void layer_make(layer *L, sh_dtype tg, sh_dtype tu, sh_dtype td)
{
    L->gate = make_w(tg, L->n_ff * L->n_exp, L->dim);
    L->up = make_w(tu, L->n_ff * L->n_exp, L->dim);
    L->down = make_w(td, L->dim * L->n_exp, L->n_ff);
    L->gate.t.ne[1] = L->up.t.ne[1] = L->n_ff;
    L->gate.t.ne[2] = L->up.t.ne[2] = L->down.t.ne[2] = L->n_exp;
    L->down.t.ne[1] = L->dim;
    if (L->shared) {
        L->gate_sh = make_w(tg, L->n_ff_sh, L->dim);
        L->up_sh = make_w(tu, L->n_ff_sh, L->dim);
        L->down_sh = make_w(td, L->dim, L->n_ff_sh);
        if (L->shared_gate)
            L->ginp = make_w(SH_DTYPE_F32, 1, L->dim);
    }
}

/* A backend of variant ii (see list_isas) with `threads` threads, the layer's experts prepared
 * when the variant says so. */
static sh_backend *make_for(const layer *L, int ii, int threads)
{
    sh_backend *be = make(isas[ii], threads);
    if (!be || !prep[ii])
        return be;
    const wmat *w[] = {&L->gate, &L->up, &L->down, &L->gate_sh, &L->up_sh, &L->down_sh};
    for (size_t i = 0; i < sizeof w / sizeof w[0]; i++)
        if (w[i]->t.data)
            CHECK_OK(sh_backend_weight_prepare(be, &w[i]->t));
    /* quantized 32-block experts get a packed copy on AVX-512 (the MoE op then reads it); on
     * AVX2 expert stacks stay in the file layout (weights.c) */
    if (isas[ii] >= SH_BACKEND_CPU_ISA_AVX512 && sh__cpu_type_q8(L->gate.t.type))
        CHECK(sh_backend_weight_copied(be, &L->gate.t));
    return be;
}

static void layer_free(layer *L)
{
    wmat *w[] = {&L->gate, &L->up, &L->down, &L->gate_sh, &L->up_sh, &L->down_sh, &L->ginp};
    for (size_t i = 0; i < sizeof w / sizeof w[0]; i++)
        if (w[i]->t.data)
            free_w(w[i]);
}

/* The op's arguments for tokens [t0, t0 + n) of x / logits, local experts [e0, e0 + n_local). */
static sh_moe_args args_for(const layer *L, const float *x, const float *logits, int64_t t0,
                            int64_t n, float *y, int64_t e0, int64_t n_local)
{
    sh_moe_args a = {.x = x + t0 * L->dim,
                     .n_tok = n,
                     .logits = logits + t0 * L->n_exp,
                     .n_expert = (int32_t)L->n_exp,
                     .expert0 = (int32_t)e0,
                     .k = L->k,
                     .norm_topk = L->norm_topk,
                     .w_scale = L->w_scale,
                     .gate = L->gate.t,
                     .up = L->up.t,
                     .down = L->down.t,
                     .y = y};
    const sh_tensor *src[] = {&L->gate.t, &L->up.t, &L->down.t};
    sh_tensor *dst[] = {&a.gate, &a.up, &a.down};
    for (int i = 0; i < 3; i++) { /* the slice of experts [e0, e0 + n_local) */
        const size_t rb = sh__dtype_row_bytes(src[i]->type, (uint64_t)src[i]->ne[0]);
        dst[i]->data = (uint8_t *)src[i]->data + (size_t)e0 * src[i]->ne[1] * rb;
        dst[i]->ne[2] = n_local;
    }
    if (L->shared) {
        a.gate_sh = L->gate_sh.t;
        a.up_sh = L->up_sh.t;
        a.down_sh = L->down_sh.t;
        if (L->shared_gate) {
            a.gate_inp_sh = L->ginp.t;
            a.gate_inp_sh.ne[0] = L->dim;
            a.gate_inp_sh.ne[1] = 1;
        }
    }
    return a;
}

/* ---- the reference: a plain loop in double ------------------------------------------------- */

/* What the kernels multiply a quantized weight with: the activation row rounded to int8 per 32
 * (sh__cpu_act); float weights see the row as is. */
static void act_as_seen(sh_dtype wtype, const float *x, int64_t n, double *out)
{
    if (sh__cpu_type_k(wtype)) { /* the K-quants read the row as Q8_K, per 256 */
        const size_t rb = sh__dtype_row_bytes(SH_DTYPE_Q8_K, (uint64_t)n);
        void *q = malloc(rb);
        float *f = malloc((size_t)n * sizeof(float));
        CHECK_OK(sh__quant_row(SH_DTYPE_Q8_K, x, q, n));
        CHECK_OK(sh__dequant_row(SH_DTYPE_Q8_K, q, f, n));
        for (int64_t i = 0; i < n; i++)
            out[i] = f[i];
        free(q);
        free(f);
        return;
    }
    if (!quantized(wtype)) {
        for (int64_t i = 0; i < n; i++)
            out[i] = x[i];
        return;
    }
    int8_t *qs = malloc((size_t)n);
    float *d = malloc((size_t)(n / 32) * sizeof(float)),
          *s = malloc((size_t)(n / 32) * sizeof(float));
    sh__cpu_quant_act_ref(x, n, qs, d, s);
    for (int64_t i = 0; i < n; i++)
        out[i] = (double)d[i / 32] * qs[i];
    free(qs);
    free(d);
    free(s);
}

/* One FFN (gate/up rows [r0, r0 + n_ff) of wg/wu, down rows [d0, d0 + dim) of wd) on x: out
 * (dim) and scale (dim) = sum |down h| + the gate/up magnitudes carried through (the error
 * scale). */
static void ref_ffn(const layer *L, const wmat *wg, const wmat *wu, const wmat *wd, int64_t n_ff,
                    int64_t r0, int64_t d0, const float *x, double *out, double *scale)
{
    const int64_t dim = L->dim;
    double *xg = malloc((size_t)dim * sizeof(double)), *xu = malloc((size_t)dim * sizeof(double));
    double *hd = malloc((size_t)n_ff * sizeof(double));
    float *h = malloc((size_t)n_ff * sizeof(float));
    double *habs = malloc((size_t)n_ff * sizeof(double));
    act_as_seen(wg->t.type, x, dim, xg);
    act_as_seen(wu->t.type, x, dim, xu);
    for (int64_t i = 0; i < n_ff; i++) {
        double g = 0, u = 0, ga = 0, ua = 0;
        for (int64_t c = 0; c < dim; c++) {
            g += (double)wg->deq[(r0 + i) * dim + c] * xg[c];
            u += (double)wu->deq[(r0 + i) * dim + c] * xu[c];
            ga += fabs((double)wg->deq[(r0 + i) * dim + c] * xg[c]);
            ua += fabs((double)wu->deq[(r0 + i) * dim + c] * xu[c]);
        }
        const double sg = g / (1.0 + exp(-g));
        h[i] = (float)(sg * u);
        /* |d h| <= |dsilu| |g err| |u| + |silu| |u err|, dsilu <= 1.1 */
        habs[i] = 1.1 * ga * fabs(u) + fabs(sg) * ua + fabs(sg * u);
    }
    act_as_seen(wd->t.type, h, n_ff, hd);
    for (int64_t r = 0; r < dim; r++) {
        double o = 0, sa = 0;
        for (int64_t i = 0; i < n_ff; i++) {
            const double w = wd->deq[(d0 + r) * n_ff + i];
            o += w * hd[i];
            sa += fabs(w) * habs[i];
        }
        out[r] = o;
        scale[r] = sa;
    }
    free(xg);
    free(xu);
    free(hd);
    free(h);
    free(habs);
}

/* Token x's routing (ids, weights) and output y (dim) with its error scale, counting only the
 * experts in [e0, e1). */
static void ref_token(const layer *L, const float *x, const float *l, int64_t e0, int64_t e1,
                      int32_t *ids, double *w, double *y, double *scale)
{
    const int64_t dim = L->dim;
    bool *used = calloc((size_t)L->n_exp, 1);
    for (int32_t j = 0; j < L->k; j++) {
        int64_t best = -1;
        for (int64_t e = 0; e < L->n_exp; e++)
            if (!used[e] && (best < 0 || l[e] > l[best]))
                best = e;
        used[best] = true;
        ids[j] = (int32_t)best;
    }
    double sum = 0, wsum = 0;
    for (int64_t e = 0; e < L->n_exp; e++)
        sum += exp((double)l[e] - l[ids[0]]);
    for (int32_t j = 0; j < L->k; j++)
        wsum += w[j] = exp((double)l[ids[j]] - l[ids[0]]) / sum;
    for (int32_t j = 0; j < L->k; j++)
        w[j] = (L->norm_topk ? w[j] / wsum : w[j]) * (L->w_scale ? L->w_scale : 1.0);
    double *o = malloc((size_t)dim * sizeof(double)), *s = malloc((size_t)dim * sizeof(double));
    for (int64_t r = 0; r < dim; r++)
        y[r] = scale[r] = 0;
    for (int32_t j = 0; j < L->k; j++) {
        if (ids[j] < e0 || ids[j] >= e1)
            continue;
        ref_ffn(L, &L->gate, &L->up, &L->down, L->n_ff, ids[j] * L->n_ff, ids[j] * dim, x, o, s);
        for (int64_t r = 0; r < dim; r++) {
            y[r] += w[j] * o[r];
            scale[r] += fabs(w[j]) * s[r];
        }
    }
    if (L->shared) {
        double sc = 1.0;
        if (L->shared_gate) {
            double d = 0;
            for (int64_t c = 0; c < dim; c++)
                d += (double)L->ginp.deq[c] * x[c];
            sc = 1.0 / (1.0 + exp(-d));
        }
        ref_ffn(L, &L->gate_sh, &L->up_sh, &L->down_sh, L->n_ff_sh, 0, 0, x, o, s);
        for (int64_t r = 0; r < dim; r++) {
            y[r] += sc * o[r];
            scale[r] += sc * s[r];
        }
    }
    free(o);
    free(s);
    free(used);
}

/* ---- running the op ------------------------------------------------------------------------ */

static sh_err run_op(sh_backend *be, const sh_moe_args *a)
{
    sh_backend_stream *st = NULL;
    sh_err err = sh_backend_stream_create(be, &st, NULL);
    if (err)
        return err;
    err = sh_backend_moe_ffn(be, st, a);
    sh_err err2 = sh_backend_sync(be, st);
    sh_backend_stream_destroy(be, st);
    return err ? err : err2;
}

static bool bits_equal(const float *a, const float *b, int64_t n, int64_t *where)
{
    for (int64_t i = 0; i < n; i++)
        if (memcmp(&a[i], &b[i], sizeof(float)) != 0) {
            *where = i;
            return false;
        }
    return true;
}

/* Tolerances relative to each output's error scale (see ref_ffn): float weights only differ in
 * f32 summation order and the SwiGLU's exp (1e-6; worst seen about 5e-8); quantized ones may
 * also round a hidden value to the neighbouring int8 code where the kernels' and the
 * reference's f32 values straddle a rounding boundary, one step of the block's max / 127 on a
 * few elements (5e-4; worst seen about 3e-5). */
static double tol_for(const layer *L)
{
    return quantized(L->gate.t.type) || quantized(L->up.t.type) || quantized(L->down.t.type) ? 5e-4
                                                                                             : 1e-6;
}

static double worst_seen[2];

/* Runs one layer on n_tok random tokens on every ISA and checks everything against the
 * reference. */
static void check_layer(layer *L, int64_t n_tok, const char *what)
{
    const int64_t dim = L->dim, n_exp = L->n_exp, k = L->k;
    float *x = malloc((size_t)(n_tok * dim) * sizeof(float));
    float *lg = malloc((size_t)(n_tok * n_exp) * sizeof(float));
    fill(x, n_tok * dim, 1.0f);
    x[0] = 3.0f; /* one outlier block */
    fill(lg, n_tok * n_exp, 2.0f);
    /* two experts nobody picks, so that empty experts next to full ones are covered */
    for (int64_t t = 0; t < n_tok; t++)
        lg[t * n_exp + n_exp / 2] = lg[t * n_exp + n_exp - 1] = -50.0f;
    if (k > n_exp - 2) /* unless every expert must be picked */
        for (int64_t t = 0; t < n_tok; t++)
            lg[t * n_exp + n_exp / 2] = lg[t * n_exp + n_exp - 1] = rng_sym();

    int32_t *rids = malloc((size_t)(n_tok * k) * sizeof(int32_t));
    double *rw = malloc((size_t)(n_tok * k) * sizeof(double));
    double *ry = malloc((size_t)(n_tok * dim) * sizeof(double));
    double *rs = malloc((size_t)(n_tok * dim) * sizeof(double));
    int32_t *rcount = calloc((size_t)n_exp, sizeof(int32_t));
    for (int64_t t = 0; t < n_tok; t++) {
        ref_token(L, x + t * dim, lg + t * n_exp, 0, n_exp, rids + t * k, rw + t * k, ry + t * dim,
                  rs + t * dim);
        for (int64_t j = 0; j < k; j++)
            rcount[rids[t * k + j]]++;
    }

    float *y = malloc((size_t)(n_tok * dim) * sizeof(float));
    float *y1 = malloc((size_t)(n_tok * dim) * sizeof(float));
    float *ya = malloc((size_t)(n_tok * dim) * sizeof(float));
    float *w = malloc((size_t)(n_tok * k) * sizeof(float));
    int32_t *ids = malloc((size_t)(n_tok * k) * sizeof(int32_t));
    int32_t *count = malloc((size_t)n_exp * sizeof(int32_t));
    const double tol = tol_for(L);
    /* the reference over two slices of the experts, computed before any backend exists (their
     * idle threads would spin against it) */
    const bool slices = n_exp >= 2 && !L->shared;
    const int64_t half = n_exp / 2 + (n_tok & 1);
    int32_t *pids = malloc((size_t)k * sizeof(int32_t));
    double *pw = malloc((size_t)k * sizeof(double));
    double *py = malloc((size_t)(2 * n_tok * dim) * sizeof(double));
    double *ps = malloc((size_t)(2 * n_tok * dim) * sizeof(double));
    for (int part = 0; part < 2 && slices; part++)
        for (int64_t t = 0; t < n_tok; t++)
            ref_token(L, x + t * dim, lg + t * n_exp, part ? half : 0, part ? n_exp : half, pids,
                      pw, py + (part * n_tok + t) * dim, ps + (part * n_tok + t) * dim);
    for (int ii = 0; ii < n_isas; ii++) {
        sh_backend *be = make_for(L, ii, 2), *be1 = NULL, *be3 = NULL;
        if (!be)
            goto next;
        char isa[32];
        snprintf(isa, sizeof isa, "%s%s", sh_backend_cpu_isa_name(isas[ii]),
                 prep[ii] ? " prepared" : "");
        sh_moe_args a = args_for(L, x, lg, 0, n_tok, y, 0, n_exp);
        a.expert_ids = ids;
        a.expert_w = w;
        a.expert_tokens = count;
        CHECK_OK(run_op(be, &a));
        for (int64_t i = 0; i < n_tok * k; i++) {
            if (ids[i] != rids[i]) {
                SH_FAIL_("%s %s n_tok %lld: token %lld slot %lld expert %d, reference %d", what,
                         isa, (long long)n_tok, (long long)(i / k), (long long)(i % k), (int)ids[i],
                         (int)rids[i]);
                goto next;
            }
            if (!(fabs(w[i] - rw[i]) <= 1e-6 * fabs(rw[i]) + 1e-9))
                SH_FAIL_("%s %s: token %lld weight %d: %.9g vs %.9g", what, isa, (long long)(i / k),
                         (int)(i % k), w[i], rw[i]);
        }
        for (int64_t e = 0; e < n_exp; e++)
            if (count[e] != rcount[e])
                SH_FAIL_("%s %s: expert %lld tokens %d, reference %d", what, isa, (long long)e,
                         (int)count[e], (int)rcount[e]);
        double worst = 0;
        for (int64_t i = 0; i < n_tok * dim; i++) {
            double e = fabs(y[i] - ry[i]) / (rs[i] + 1e-30);
            if (!(e <= worst))
                worst = e;
        }
        if (worst > worst_seen[tol > 1e-4])
            worst_seen[tol > 1e-4] = worst;
        if (!(worst <= tol))
            SH_FAIL_("%s %s n_tok %lld: worst error %.3g of the scale (tolerance %.1g)", what, isa,
                     (long long)n_tok, worst, tol);

        /* thread counts: bit-identical */
        int64_t at;
        sh_moe_args a1 = args_for(L, x, lg, 0, n_tok, y1, 0, n_exp);
        if (!(be1 = make_for(L, ii, 1)) || !(be3 = make_for(L, ii, 3)))
            goto next;
        CHECK_OK(run_op(be1, &a1));
        if (!bits_equal(y, y1, n_tok * dim, &at))
            SH_FAIL_("%s %s: 1 thread differs from 2 at %lld: %.9g vs %.9g", what, isa,
                     (long long)at, y1[at], y[at]);
        CHECK_OK(run_op(be3, &a1));
        if (!bits_equal(y, y1, n_tok * dim, &at))
            SH_FAIL_("%s %s: 3 threads differ from 2 at %lld", what, isa, (long long)at);
        sh_backend_destroy(be1);
        sh_backend_destroy(be3);
        be1 = be3 = NULL;

        /* each token alone: bit-identical to its row in the batch */
        for (int64_t t = 0; t < n_tok; t++) {
            sh_moe_args at1 = args_for(L, x, lg, t, 1, y1 + t * dim, 0, n_exp);
            CHECK_OK(run_op(be, &at1));
        }
        if (!bits_equal(y, y1, n_tok * dim, &at))
            SH_FAIL_("%s %s: token %lld alone differs from the batch at %lld: %.9g vs %.9g", what,
                     isa, (long long)(at / dim), (long long)(at % dim), y1[at], y[at]);

        /* accumulate: y0 + the result, exactly */
        fill(ya, n_tok * dim, 1.0f);
        memcpy(y1, ya, (size_t)(n_tok * dim) * sizeof(float));
        sh_moe_args aa = args_for(L, x, lg, 0, n_tok, ya, 0, n_exp);
        aa.accumulate = true;
        CHECK_OK(run_op(be, &aa));
        for (int64_t i = 0; i < n_tok * dim; i++)
            if (ya[i] != y1[i] + y[i]) {
                SH_FAIL_("%s %s: accumulate at %lld: %.9g, expected %.9g + %.9g", what, isa,
                         (long long)i, ya[i], y1[i], y[i]);
                break;
            }

        /* two expert slices (expert parallelism): each equals the reference over its experts */
        for (int part = 0; part < 2 && slices; part++) {
            const int64_t e0 = part ? half : 0, e1 = part ? n_exp : half;
            sh_moe_args ap = args_for(L, x, lg, 0, n_tok, y1, e0, e1 - e0);
            CHECK_OK(run_op(be, &ap));
            const double *pyp = py + part * n_tok * dim, *psp = ps + part * n_tok * dim;
            for (int64_t i = 0; i < n_tok * dim; i++)
                if (!(fabs(y1[i] - pyp[i]) <= tol * (psp[i] + 1e-30) + 1e-30)) {
                    SH_FAIL_("%s %s: experts [%lld, %lld) token %lld: %.9g vs %.9g", what, isa,
                             (long long)e0, (long long)e1, (long long)(i / dim), y1[i], pyp[i]);
                    break;
                }
        }
    next:
        sh_backend_destroy(be);
        sh_backend_destroy(be1);
        sh_backend_destroy(be3);
    }
    free(x);
    free(lg);
    free(rids);
    free(rw);
    free(ry);
    free(rs);
    free(rcount);
    free(y);
    free(y1);
    free(ya);
    free(w);
    free(ids);
    free(count);
    free(pids);
    free(pw);
    free(py);
    free(ps);
}

static const sh_dtype types[] = {SH_DTYPE_F32,  SH_DTYPE_F16,  SH_DTYPE_BF16, SH_DTYPE_Q8_0,
                                 SH_DTYPE_Q4_0, SH_DTYPE_Q4_1, SH_DTYPE_Q5_0, SH_DTYPE_Q5_1,
                                 SH_DTYPE_Q2_K, SH_DTYPE_Q3_K, SH_DTYPE_Q4_K, SH_DTYPE_Q5_K,
                                 SH_DTYPE_Q6_K};

/* Every weight type the matmul takes, k = 1, 2 and 8, ragged token counts 1..37, renormalized
 * or not. */
static void test_vs_ref(void)
{
    list_isas();
    const struct {
        int64_t n_exp;
        int32_t k;
    } ek[] = {{4, 1}, {8, 2}, {16, 8}, {8, 8}};
    const int64_t toks[] = {1, 2, 5, 17, 37};
    int n = 0;
    for (size_t ti = 0; ti < sizeof types / sizeof types[0]; ti++)
        for (size_t c = 0; c < sizeof ek / sizeof ek[0]; c++)
            for (size_t tt = 0; tt < sizeof toks / sizeof toks[0]; tt++) {
                /* every combination for Q4_0, a rotating subset for the others (the whole
                 * grid is too slow under the sanitizers) */
                if (types[ti] != SH_DTYPE_Q4_0 &&
                    (c + tt + ti) % (sh__cpu_type_k(types[ti]) ? 5 : 3) != 0)
                    continue;
                /* the K-quant quantizer's searches are slow: at most 8 experts of those */
                if (sh__cpu_type_k(types[ti]) && ek[c].n_exp > 8)
                    continue;
                /* widths: whole 32-blocks, whole 256-blocks for the K-quants; float rows past
                 * 64 elements with ragged tails (the AVX-512 float kernels' four-accumulator
                 * path starts at 64) */
                const bool q = quantized(types[ti]), kq = sh__cpu_type_k(types[ti]);
                layer L = {.dim = kq  ? 256
                                  : q ? 64
                                      : 72,
                           .n_ff = kq  ? 256
                                   : q ? 96
                                       : 72,
                           .n_exp = ek[c].n_exp,
                           .k = ek[c].k,
                           .norm_topk = (c + tt) % 2 == 0,
                           .w_scale = tt == 3 ? 2.5f : 0.0f};
                layer_make(&L, types[ti], types[ti], types[ti]);
                char what[64];
                snprintf(what, sizeof what, "%s e%lld k%d", sh__dtype_name(types[ti]),
                         (long long)L.n_exp, (int)L.k);
                check_layer(&L, toks[tt], what);
                layer_free(&L);
                n++;
            }
    printf("vs_ref: %d layers; worst error float %.3g, quantized %.3g of the scale\n", n,
           worst_seen[0], worst_seen[1]);
}

/* Mixed types per tensor (as in Q4_K_M files), a shared expert with and without its gate, the
 * widths past one chunk with a ragged tail. */
static void test_mixed_shared(void)
{
    list_isas();
    const int64_t toks[] = {1, 3, 16, 37};
    for (size_t tt = 0; tt < sizeof toks / sizeof toks[0]; tt++)
        for (int sg = 0; sg < 2; sg++) {
            layer L = {.dim = 96,
                       .n_ff = 160,
                       .n_exp = 6,
                       .k = 2,
                       .n_ff_sh = 224,
                       .shared = true,
                       .shared_gate = sg,
                       .norm_topk = false};
            layer_make(&L, SH_DTYPE_Q4_0, SH_DTYPE_Q8_0, SH_DTYPE_F16);
            check_layer(&L, toks[tt], sg ? "mixed+shared(gated)" : "mixed+shared");
            layer_free(&L);
            layer K = {.dim = 256,
                       .n_ff = 256,
                       .n_exp = 4,
                       .k = 2,
                       .n_ff_sh = 512,
                       .shared = true,
                       .shared_gate = sg,
                       .norm_topk = true};
            if (tt % 2 == 0) { /* 1 and 16 tokens: the K-quant quantizer is slow */
                layer_make(&K, SH_DTYPE_Q4_K, SH_DTYPE_Q5_0, SH_DTYPE_Q6_K);
                check_layer(&K, toks[tt], "Q4_K/Q5_0/Q6_K+shared");
                layer_free(&K);
            }
            layer M = {.dim = 48,
                       .n_ff = 40,
                       .n_exp = 5,
                       .k = 3,
                       .n_ff_sh = 56,
                       .shared = true,
                       .shared_gate = sg,
                       .norm_topk = true};
            layer_make(&M, SH_DTYPE_F32, SH_DTYPE_BF16, SH_DTYPE_F16);
            check_layer(&M, toks[tt], "float+shared");
            layer_free(&M);
        }
}

/* A long prefill chunk: 300 tokens through 8 experts (groups of many token tiles). */
static void test_long(void)
{
    list_isas();
    layer L = {.dim = 128, .n_ff = 64, .n_exp = 8, .k = 2, .norm_topk = true};
    layer_make(&L, SH_DTYPE_Q4_1, SH_DTYPE_Q4_1, SH_DTYPE_Q8_0);
    check_layer(&L, 300, "long Q4_1/Q8_0");
    layer_free(&L);
}

/* Bad arguments are refused at enqueue with SH_EINVAL; nothing runs. */
static void test_bad_args(void)
{
    sh_backend *be = make(0, 1);
    if (!be)
        return;
    layer L = {.dim = 64, .n_ff = 32, .n_exp = 4, .k = 2, .n_ff_sh = 32, .shared = true};
    layer_make(&L, SH_DTYPE_Q4_0, SH_DTYPE_Q4_0, SH_DTYPE_Q4_0);
    float x[64 * 2], lg[4 * 2], y[64 * 2];
    fill(x, 128, 1.0f);
    fill(lg, 8, 1.0f);
    sh_backend_stream *st = NULL;
    CHECK_OK(sh_backend_stream_create(be, &st, NULL));
    sh_moe_args ok = args_for(&L, x, lg, 0, 2, y, 0, 4);
    CHECK_OK(sh_backend_moe_ffn(be, st, &ok));
    CHECK_OK(sh_backend_sync(be, st));
    sh_moe_args b;
#define BAD(stmt)                                                                                  \
    do {                                                                                           \
        b = ok;                                                                                    \
        stmt;                                                                                      \
        int rc_ = (int)sh_backend_moe_ffn(be, st, &b);                                             \
        if (rc_ != SH_EINVAL)                                                                      \
            SH_FAIL_("%s: %s, expected SH_EINVAL", #stmt, sh_strerror((sh_err)rc_));               \
    } while (0)
    BAD(b.k = 0);
    BAD(b.k = 5);
    BAD(b.n_tok = 0);
    BAD(b.x = NULL);
    BAD(b.logits = NULL);
    BAD(b.y = NULL);
    BAD(b.gating = (sh_moe_gating)7);
    BAD(b.w_scale = NAN);
    BAD(b.up.ne[1] = 64);             /* gate and up disagree */
    BAD(b.down.ne[2] = 3);            /* expert counts disagree */
    BAD(b.down.ne[0] = 64);           /* down's input is not n_ff */
    BAD(b.gate.ne[3] = 2);            /* a 4-D tensor */
    BAD(b.up.data = NULL);            /* a missing tensor */
    BAD(b.gate.type = SH_DTYPE_Q8_1); /* a type the row kernels do not take */
    BAD(b.gate.type = SH_DTYPE_Q4_K); /* K-quants need 256-wide rows: dim is 64 */
    BAD(b.n_expert = 3);              /* the router is narrower than the experts held */
    BAD(b.expert0 = 1);               /* experts [1, 5) of a 4-wide router */
    BAD(b.expert0 = -1);
    BAD(b.down_sh.ne[1] = 32); /* shared expert's output is not dim */
    BAD(b.up_sh.data = NULL);
    BAD((b.gate_inp_sh = L.gate_sh.t, b.gate_inp_sh.ne[1] = 2)); /* its gate is not a vector */
    BAD((b.gate_sh.data = b.up_sh.data = b.down_sh.data = NULL,
         b.gate_inp_sh = L.gate_sh.t)); /* a gate without a shared expert */
    /* quantized weights need whole 32-element blocks: a 40-wide Q4_0 layer */
    layer Q = {.dim = 40, .n_ff = 32, .n_exp = 2, .k = 1};
    Q.gate = make_w(SH_DTYPE_F32, 64, 40);
    Q.up = make_w(SH_DTYPE_F32, 64, 40);
    Q.down = make_w(SH_DTYPE_F32, 80, 32);
    Q.gate.t.ne[1] = Q.up.t.ne[1] = 32;
    Q.gate.t.ne[2] = Q.up.t.ne[2] = Q.down.t.ne[2] = 2;
    Q.down.t.ne[1] = 40;
    b = args_for(&Q, x, lg, 0, 1, y, 0, 2);
    CHECK_OK(sh_backend_moe_ffn(be, st, &b));
    b.gate.type = SH_DTYPE_Q4_0;
    CHECK_INT_EQ(sh_backend_moe_ffn(be, st, &b), SH_EINVAL);
    CHECK_OK(sh_backend_sync(be, st));
    layer_free(&Q);
    sh_backend_stream_destroy(be, st);
    layer_free(&L);
    sh_backend_destroy(be);
}

static const sh_test_case tests[] = {
    {"vs_ref", test_vs_ref},
    {"mixed_shared", test_mixed_shared},
    {"long", test_long},
    {"bad_args", test_bad_args},
    {NULL, NULL},
};

int main(int argc, char **argv)
{
    rng_state = (uint64_t)time(NULL) * 0x9e3779b97f4a7c15ull | 1;
    if (getenv("SH_TEST_SEED"))
        rng_state = strtoull(getenv("SH_TEST_SEED"), NULL, 0) | 1;
    printf("seed %llu (SH_TEST_SEED to repeat)\n", (unsigned long long)rng_state);
    return sh_test_main(argc, argv, tests);
}
