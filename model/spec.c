/* Speculative decoding without actors: --spec parsing, n-gram proposals, verification by
 * sampling and comparing, and draft lengths from cost and acceptance (model/spec.h). */
#include "model/spec.h"

#include <errno.h>
#include <limits.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "base/error.h"

static const char *const KIND_NAMES[] = {"off", "ngram", "draft", "self"};

const char *sh_spec_kind_name(sh_spec_kind k) { return (unsigned)k < 4 ? KIND_NAMES[k] : "?"; }

/* A decimal integer filling the whole of s, in [lo, hi]. */
static bool parse_int(const char *s, long lo, long hi, int32_t *out)
{
    if (!s || !*s)
        return false;
    char *end = NULL;
    errno = 0;
    long v = strtol(s, &end, 10);
    if (errno || *end || v < lo || v > hi)
        return false;
    *out = (int32_t)v;
    return true;
}

sh_err sh_spec_parse(const char *spec, const char *k_text, sh_spec_opts *out, sh_error *e)
{
    memset(out, 0, sizeof *out);
    sh_spec_opts o = {.kind = SH_SPEC_OFF, .k = SH_SPEC_DEFAULT_K};
    if (k_text && !parse_int(k_text, 1, SH_SPEC_MAX_K, &o.k))
        return sh__error_set(e, SH_EINVAL,
                             "--spec-k %s: the draft length must be an integer from 1 to %d",
                             k_text, SH_SPEC_MAX_K);
    if (!spec || !strcmp(spec, "off")) {
        o.kind = SH_SPEC_OFF;
    } else if (!strcmp(spec, "ngram")) {
        o.kind = SH_SPEC_NGRAM;
    } else if (!strncmp(spec, "draft:", 6)) {
        size_t n = strlen(spec + 6);
        if (n == 0 || n >= sizeof o.path)
            return sh__error_set(e, SH_EINVAL,
                                 "--spec %s: draft:PATH needs the draft model's file (at most %d "
                                 "bytes)",
                                 spec, SH_SPEC_PATH_MAX - 1);
        memcpy(o.path, spec + 6, n + 1);
        o.kind = SH_SPEC_DRAFT;
    } else if (!strncmp(spec, "self:", 5)) {
        if (!parse_int(spec + 5, 1, 1 << 16, &o.layers))
            return sh__error_set(e, SH_EINVAL,
                                 "--spec %s: self:LAYERS needs the number of the target's first "
                                 "layers that draft (a positive integer)",
                                 spec);
        o.kind = SH_SPEC_SELF;
    } else {
        return sh__error_set(e, SH_EINVAL,
                             "--spec %s: expected off, ngram, draft:PATH or self:LAYERS", spec);
    }
    *out = o;
    return SH_OK;
}

/* ---- n-gram proposals ---- */

typedef struct pool_entry {
    uint64_t key; /* hash of the SH_SPEC_NGRAM_MAX tokens; 0: empty */
    int32_t n;    /* continuation tokens held */
    int32_t next[SH_SPEC_MAX_K];
} pool_entry;

struct sh_spec_pool {
    int32_t n_entries;
    pool_entry *e;
};

sh_err sh_spec_pool_create(int32_t entries, sh_spec_pool **out, sh_error *e)
{
    *out = NULL;
    if (entries < 1 || entries > (1 << 24))
        return sh__error_set(e, SH_EINVAL, "spec: an n-gram pool of %d entries", (int)entries);
    sh_spec_pool *p = calloc(1, sizeof *p);
    if (p)
        p->e = calloc((size_t)entries, sizeof *p->e);
    if (!p || !p->e) {
        free(p);
        return sh__error_set(e, SH_ENOMEM, "spec: no memory for an n-gram pool of %d entries",
                             (int)entries);
    }
    p->n_entries = entries;
    *out = p;
    return SH_OK;
}

void sh_spec_pool_destroy(sh_spec_pool *p)
{
    if (!p)
        return;
    free(p->e);
    free(p);
}

/* FNV-1a over the n tokens' bytes, never 0 (0 marks an empty slot). */
static uint64_t gram_hash(const int32_t *t, int32_t n)
{
    uint64_t h = 1469598103934665603ull;
    for (int32_t i = 0; i < n; i++) {
        uint32_t v = (uint32_t)t[i];
        for (int b = 0; b < 4; b++) {
            h ^= (v >> (8 * b)) & 0xffu;
            h *= 1099511628211ull;
        }
    }
    return h ? h : 1;
}

void sh_spec_pool_add(sh_spec_pool *p, const int32_t *toks, int32_t n, int32_t from)
{
    const int32_t g = SH_SPEC_NGRAM_MAX;
    if (!p || n <= g)
        return;
    /* The gram at [i, i + g) is followed by toks[i + g ..]; record it once its first
     * continuation token exists and refresh it while its continuation grows to SH_SPEC_MAX_K. */
    int32_t i0 = from - g - SH_SPEC_MAX_K;
    if (i0 < 0)
        i0 = 0;
    for (int32_t i = i0; i + g < n; i++) {
        uint64_t h = gram_hash(toks + i, g);
        pool_entry *pe = &p->e[h % (uint64_t)p->n_entries];
        int32_t c = n - (i + g);
        if (c > SH_SPEC_MAX_K)
            c = SH_SPEC_MAX_K;
        if (pe->key == h && pe->n >= c)
            continue; /* nothing new for this gram */
        pe->key = h;
        pe->n = c;
        memcpy(pe->next, toks + i + g, (size_t)c * sizeof(int32_t));
    }
}

int32_t sh_spec_ngram_propose(const int32_t *hist, int32_t n, const sh_spec_pool *pool, int32_t k,
                              int32_t window, int32_t *out)
{
    if (k > SH_SPEC_MAX_K)
        k = SH_SPEC_MAX_K;
    if (k <= 0 || n < SH_SPEC_NGRAM_MIN + 1)
        goto use_pool;
    int32_t lo = window > 0 && n > window ? n - window : 0;
    for (int32_t g = SH_SPEC_NGRAM_MAX; g >= SH_SPEC_NGRAM_MIN; g--) {
        if (n - lo <= g)
            continue;
        const int32_t *suf = hist + n - g;
        /* The most recent earlier occurrence: starts i < n - g, scanned backwards. */
        for (int32_t i = n - g - 1; i >= lo; i--) {
            if (hist[i] != suf[0] || memcmp(hist + i, suf, (size_t)g * sizeof(int32_t)) != 0)
                continue;
            int32_t c = n - (i + g);
            if (c > k)
                c = k;
            memcpy(out, hist + i + g, (size_t)c * sizeof(int32_t));
            return c;
        }
    }
use_pool:
    if (!pool || k <= 0 || n < SH_SPEC_NGRAM_MAX)
        return 0;
    uint64_t h = gram_hash(hist + n - SH_SPEC_NGRAM_MAX, SH_SPEC_NGRAM_MAX);
    const pool_entry *pe = &pool->e[h % (uint64_t)pool->n_entries];
    if (pe->key != h)
        return 0;
    int32_t c = pe->n < k ? pe->n : k;
    memcpy(out, pe->next, (size_t)c * sizeof(int32_t));
    return c;
}

/* ---- verification ---- */

sh_err sh_spec_verify(sh_sampler *s, const float *logits, int32_t n_vocab, const int32_t *draft,
                      int32_t n_draft, sh_sample *out, int32_t *n_out)
{
    *n_out = 0;
    for (int32_t j = 0; j <= n_draft; j++) {
        sh_err err = sh_sampler_sample(s, logits + (size_t)j * (size_t)n_vocab, &out[j]);
        if (err)
            return err;
        sh_sampler_accept(s, out[j].id);
        *n_out = j + 1;
        if (j == n_draft || out[j].id != draft[j])
            break;
    }
    return SH_OK;
}

/* ---- draft lengths ---- */

static const int32_t COST_ROWS[SH_SPEC_COST_POINTS] = {
    1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 24, 32, 48, 64, 128, 256, 512};

void sh_spec_cost_init(sh_spec_cost *c)
{
    memset(c, 0, sizeof *c);
    memcpy(c->rows, COST_ROWS, sizeof c->rows);
}

static int32_t nearest_point(const sh_spec_cost *c, int32_t rows)
{
    int32_t best = 0;
    for (int32_t i = 1; i < SH_SPEC_COST_POINTS; i++)
        if (abs(c->rows[i] - rows) < abs(c->rows[best] - rows))
            best = i;
    return best;
}

void sh_spec_cost_observe(sh_spec_cost *c, int32_t rows, double us)
{
    if (rows < 1 || !(us > 0.0) || !isfinite(us))
        return;
    int32_t i = nearest_point(c, rows);
    /* Scale to the point's row count in proportion to the rows beyond the first (a pass costs a
     * fixed part plus a part per row), then average: the first few fast, then slowly. */
    double scaled = us;
    if (rows != c->rows[i] && rows > 1 && c->rows[i] > 1)
        scaled = us * (double)c->rows[i] / (double)rows;
    double w = c->seen[i] < 8 ? 1.0 / (c->seen[i] + 1) : 0.125;
    c->us[i] = c->seen[i] ? c->us[i] + w * (scaled - c->us[i]) : scaled;
    if (c->seen[i] < INT32_MAX)
        c->seen[i]++;
}

/* The time of a pass of `rows`, in units of one row's: from the measured points around it (their
 * ratio to the one-row time), else the prior 1 + 0.1 (rows - 1). */
double sh_spec_cost_ratio(const sh_spec_cost *c, int32_t rows)
{
    if (rows <= 1)
        return 1.0;
    double prior = 1.0 + 0.1 * (double)(rows - 1);
    if (!(c->us[0] > 0.0))
        return prior;
    /* The measured points just below and above rows. */
    int32_t lo = -1, hi = -1;
    for (int32_t i = 0; i < SH_SPEC_COST_POINTS; i++) {
        if (!(c->us[i] > 0.0))
            continue;
        if (c->rows[i] <= rows)
            lo = i;
        if (c->rows[i] >= rows && hi < 0)
            hi = i;
    }
    double r;
    if (lo >= 0 && hi >= 0 && c->rows[hi] != c->rows[lo]) {
        double t = (double)(rows - c->rows[lo]) / (double)(c->rows[hi] - c->rows[lo]);
        r = (c->us[lo] + t * (c->us[hi] - c->us[lo])) / c->us[0];
    } else if (lo >= 0 && c->rows[lo] == rows) {
        r = c->us[lo] / c->us[0];
    } else if (lo >= 0) { /* beyond the last measured point: grow linearly from it */
        double per = c->rows[lo] > 1 ? (c->us[lo] / c->us[0] - 1.0) / (c->rows[lo] - 1) : 0.1;
        r = c->us[lo] / c->us[0] + per * (double)(rows - c->rows[lo]);
    } else {
        r = prior;
    }
    return r < 1.0 ? 1.0 : r;
}

void sh_spec_seq_init(sh_spec_seq *q)
{
    memset(q, 0, sizeof *q);
    q->probe = 16;
    q->succ = 1.2; /* the prior: acceptance 0.6, worth two observed tokens */
    q->fail = 0.8;
    q->accept = 0.6;
}

void sh_spec_seq_update(sh_spec_seq *q, int32_t n_draft, int32_t n_accepted)
{
    if (n_draft <= 0)
        return;
    q->drafts++;
    q->drafted += (uint64_t)n_draft;
    q->accepted += (uint64_t)n_accepted;
    /* Each drafted token is kept with probability a until the first rejection, after which the
     * rest are not seen: a draft run says n_accepted successes and one failure (none when every
     * draft was kept), so a = successes / (successes + failures) over the recent runs (counts
     * decayed by 0.8 a run). An estimate from the run lengths alone would never pass
     * k / (k + 1) for runs of k, and 1-token probes would never justify longer drafts. */
    q->succ = 0.8 * q->succ + (double)n_accepted;
    q->fail = 0.8 * q->fail + (n_accepted < n_draft ? 1.0 : 0.0);
    q->accept = q->succ / (q->succ + q->fail);
}

int32_t sh_spec_choose_k(const sh_spec_cost *c, double accept, int32_t kmax, int32_t batch_rows)
{
    if (kmax > SH_SPEC_MAX_K)
        kmax = SH_SPEC_MAX_K;
    if (batch_rows < 1)
        batch_rows = 1;
    double a = accept < 0.0 ? 0.0 : accept > 0.99 ? 0.99 : accept;
    double base = sh_spec_cost_ratio(c, batch_rows);
    /* Throughput of the step: its batch_rows sequences give one token each; this one's drafts
     * add gain - 1 tokens and make the whole step cost rel times as much. */
    const double rows = (double)batch_rows;
    double best = rows; /* plain decode */
    int32_t best_k = 0;
    double gain = 1.0, ak = 1.0;
    for (int32_t k = 1; k <= kmax; k++) {
        ak *= a;
        gain += ak; /* 1 + a + ... + a^k */
        double rel = sh_spec_cost_ratio(c, batch_rows + k) / base;
        double v = (rows - 1.0 + gain) / rel;
        if (v > best * 1.02) { /* a clear gain only: noise in the cost must not make us draft */
            best = v;
            best_k = k;
        }
    }
    return best_k;
}

int32_t sh_spec_seq_plan(sh_spec_seq *q, const sh_spec_cost *c, int32_t kmax, int32_t batch_rows)
{
    q->k = sh_spec_choose_k(c, q->accept, kmax, batch_rows);
    if (q->probe < 16)
        q->probe = 16; /* a state zeroed rather than initialized */
    if (q->k > 0) {
        q->idle = 0;
        q->probe = 16;
    } else if (++q->idle >= q->probe) {
        q->idle = 0;
        q->k = 1;
        if (q->accept >= 0.9 && q->probe < 256)
            q->probe *= 2;
    }
    return q->k;
}
