/* The CPU backend's prepared weights: packed copies made at load (weight_prepare), found again
 * by data pointer when a matmul is enqueued. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>

#include "kernels/cpu/backend_cpu.h"

static size_t slot_of(const void *data, size_t cap)
{
    /* Weights are at least 64-byte aligned in practice: drop the low bits, then a Fibonacci
     * hash spreads neighbouring tensors of one mapping over the table. */
    return (size_t)(((uintptr_t)data >> 6) * 0x9e3779b97f4a7c15ull) & (cap - 1);
}

static sh__cpu_packed *find(sh__cpu_ctx *c, const void *data)
{
    if (!c->pack_count)
        return NULL;
    for (size_t i = slot_of(data, c->pack_cap);; i = (i + 1) & (c->pack_cap - 1)) {
        if (!c->packs[i].data)
            return NULL;
        if (c->packs[i].data == data)
            return &c->packs[i];
    }
}

static void insert(sh__cpu_packed *tab, size_t cap, const sh__cpu_packed *e)
{
    size_t i = slot_of(e->data, cap);
    while (tab[i].data)
        i = (i + 1) & (cap - 1);
    tab[i] = *e;
}

/* Rehashes into a table of `cap` slots (also how release closes the gap it leaves). */
static bool rehash(sh__cpu_ctx *c, size_t cap)
{
    sh__cpu_packed *tab = calloc(cap, sizeof *tab);
    if (!tab)
        return false;
    for (size_t i = 0; i < c->pack_cap; i++)
        if (c->packs[i].data)
            insert(tab, cap, &c->packs[i]);
    free(c->packs);
    c->packs = tab;
    c->pack_cap = cap;
    return true;
}

/* Huge pages for the large packed weights. A decode streams every weight once per token; with 4 KiB
 * pages a 1 GB model takes a TLB miss (a page walk) every 4 KiB of that stream. Transparent huge
 * pages are usually in "madvise" mode, so ask for them: the copy is 2 MiB-aligned and its whole
 * 2 MiB pages are advised. The tail past the last whole one stays in 4 KiB pages (advised so, for
 * the "always" mode): a huge page there is resident whole for what may be a few bytes (a 4.5 MiB
 * matrix of llama3-8b's took 6 MiB, 117 MiB over a tensor-parallel rank's share). */
#define HUGE_BYTES ((size_t)2 << 20)
static void *pack_alloc(size_t bytes)
{
    if (bytes < HUGE_BYTES)
        return aligned_alloc(64, bytes);
    const size_t whole = bytes & ~(HUGE_BYTES - 1);
    const size_t len = (bytes + HUGE_BYTES - 1) & ~(HUGE_BYTES - 1);
    void *p = aligned_alloc(HUGE_BYTES, len);
#if defined(MADV_HUGEPAGE) && defined(MADV_NOHUGEPAGE)
    if (p) {
        (void)madvise(p, whole, MADV_HUGEPAGE);
        if (len > whole)
            (void)madvise((uint8_t *)p + whole, len - whole, MADV_NOHUGEPAGE);
    }
#endif
    return p;
}

size_t sh__cpu_weights_mat_bytes(sh_dtype type, int64_t n_out, int64_t n_in)
{
    return (sh__cpu_pack_bytes(type, n_out, n_in) + 63) & ~(size_t)63;
}

static bool is_float(sh_dtype t)
{
    return t == SH_DTYPE_F32 || t == SH_DTYPE_F16 || t == SH_DTYPE_BF16;
}

sh_err sh__cpu_weights_prepare(sh__cpu_ctx *c, const sh_tensor *w)
{
    if (!w || !w->data || w->ne[0] < 1 || w->ne[1] < 1 || w->ne[2] < 1 || w->ne[3] != 1)
        return SH_EINVAL;
    if (w->ne[0] % SH_CPU_QK)
        return SH_OK; /* rows that are not whole blocks (float weights) are read as they are */
    if (!sh__cpu_mmp_for(c->kern, w->type))
        return SH_OK; /* this ISA reads the file layout */
    /* A stack of matrices (MoE experts) is read by the MoE op only, which keeps float experts in
     * the file layout (moe.c: kernel_for), so a copy of those would only cost memory. */
    if (w->ne[2] > 1 && is_float(w->type))
        return SH_OK;
    /* AVX2's packed kernels are for 2-D weights only for now: with Mixture-of-Experts stacks
     * packed, test_llama_weights' synthetic MoE model gave logits 1% away from the file layout's
     * on 3 seeds of 4, while test_moe's op-level comparison of the same kernels passes. The cause
     * (found 2026-12-07): the AVX2 file-layout row kernels (ops_avx2.c) sum a block in 8 float
     * lanes where the packed ones fold each block's exact integer sum into one accumulator, so
     * the two differ in the last bits; in that random 3-layer model a hidden value sits within
     * that of an int8 rounding boundary, its code flips, and the flip grows to 1% of the logits
     * (the same test fails that way with clang even with the stacks unpacked, through the packed
     * attention weights). Branch `moe` (de978ed) makes the row kernels compute in the packed
     * order, bit for bit, and packs the stacks again, at 15-30% of the file layout's speed
     * (Q5_0 and Q5_1, which have no AVX2 packed kernel, pay it): not landed for that cost. */
    if (w->ne[2] > 1 && c->kern->isa == SH_BACKEND_CPU_ISA_AVX2)
        return SH_OK;
    const int64_t n_in = w->ne[0], n_out = w->ne[1], n_mat = w->ne[2];
    /* Already prepared with this shape (another context over the same model): share it. */
    pthread_mutex_lock(&c->pack_mu);
    sh__cpu_packed *have = find(c, w->data);
    if (have && have->type == w->type && have->n_in == n_in && have->n_out == n_out &&
        have->n_mat == n_mat) {
        have->refs++;
        pthread_mutex_unlock(&c->pack_mu);
        return SH_OK;
    }
    pthread_mutex_unlock(&c->pack_mu);
    /* Matrix m of the stack is packed on its own at m * mat_bytes (a 64-byte multiple), so each
     * expert is one ordinary packed weight for the kernels. */
    const size_t mat = sh__cpu_weights_mat_bytes(w->type, n_out, n_in);
    const size_t src = sh__dtype_row_bytes(w->type, (uint64_t)n_in) * (size_t)n_out;
    void *p = pack_alloc(mat * (size_t)n_mat);
    if (!p)
        return SH_ENOMEM;
    for (int64_t m = 0; m < n_mat; m++)
        sh__cpu_pack(w->type, (const uint8_t *)w->data + (size_t)m * src, n_out, n_in,
                     (uint8_t *)p + (size_t)m * mat);
    sh__cpu_packed e = {w->data, w->type, n_in, n_out, n_mat, p, 1};
    sh_err err = SH_OK;
    pthread_mutex_lock(&c->pack_mu);
    sh__cpu_packed *old = find(c, w->data);
    if (old) { /* prepared again with another shape (or raced): the newest copy wins */
        e.refs = old->refs + 1;
        free(old->packed);
        *old = e;
    } else if ((c->pack_count + 1) * 2 > c->pack_cap &&
               !rehash(c, c->pack_cap ? 2 * c->pack_cap : 64)) {
        free(p);
        err = SH_ENOMEM;
    } else {
        insert(c->packs, c->pack_cap, &e);
        c->pack_count++;
    }
    pthread_mutex_unlock(&c->pack_mu);
    return err;
}

void sh__cpu_weights_release(sh__cpu_ctx *c, const void *data)
{
    pthread_mutex_lock(&c->pack_mu);
    sh__cpu_packed *e = data ? find(c, data) : NULL;
    if (e && --e->refs > 0)
        e = NULL; /* still used by another prepare */
    if (e) {
        free(e->packed);
        memset(e, 0, sizeof *e);
        c->pack_count--;
        /* Linear probing cannot leave a hole in a probe chain: rebuild (prepare and release
         * happen at load and unload, not per token). If that fails, keep the hole's chain
         * intact by leaving the table as it is minus this entry's copy: lookups of entries
         * past the hole then miss and those weights run unpacked, which is still correct. */
        rehash(c, c->pack_cap);
    }
    pthread_mutex_unlock(&c->pack_mu);
}

const void *sh__cpu_weights_lookup(sh__cpu_ctx *c, const sh_tensor *w)
{
    const void *p = NULL;
    pthread_mutex_lock(&c->pack_mu);
    const sh__cpu_packed *e = find(c, w->data);
    if (e && e->type == w->type && e->n_in == w->ne[0] && e->n_out == w->ne[1] &&
        e->n_mat == w->ne[2])
        p = e->packed;
    pthread_mutex_unlock(&c->pack_mu);
    return p;
}

void sh__cpu_weights_fini(sh__cpu_ctx *c)
{
    for (size_t i = 0; i < c->pack_cap; i++)
        free(c->packs[i].packed);
    free(c->packs);
    c->packs = NULL;
    c->pack_cap = c->pack_count = 0;
}
