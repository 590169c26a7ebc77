/* `shoal run`: generates text from a model on the CPU, one prompt or an interactive chat. */
#include <errno.h>
#include <inttypes.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "base/error.h"
#include "base/file.h"
#include "kernels/backend.h"
#include "model/chat.h"
#include "model/gguf.h"
#include "model/llama.h"
#include "model/sampler.h"
#include "model/spec.h"
#include "model/spec_draft.h"
#include "model/tokenizer.h"
#include "tools/cmd.h"
#include "tools/cmd_util.h"

#define PREFILL_CHUNK 256 /* rows per forward call while reading a prompt */
#define MAX_PROMPT_IDS 65536
#define SPEC_POOL_ENTRIES 4096 /* n-gram pool slots shared by the turns of --chat */

typedef struct opts {
    const char *model, *tokenizer, *prompt, *prompt_ids;
    const char *spec, *spec_k; /* --spec, --spec-k as given (parsed into so) */
    sh_spec_opts so;
    int32_t n_gen, threads, top_k;
    float temp, top_p, min_p, repeat_penalty, presence_penalty, frequency_penalty;
    uint32_t samp_set; /* SH_CMD_SAMP_* of the sampling flags given (the model file's otherwise) */
    uint64_t seed;
    bool chat, ids, kv_f16;
} opts;

/* Everything one run holds; freed by close_all. */
typedef struct run {
    opts o;
    sh_llama *m;
    sh_tokenizer *tok;
    sh_backend *be;
    sh_llama_ctx *ctx;
    sh_sampler *smp;
    sh_tokenizer_stream *stream;
    int32_t *blocks; // (n_blocks) the one sequence's block table: 0, 1, 2, ...
    int32_t *hist;   // (kv_tokens) the ids whose keys and values are in the cache, in order
    int32_t n_hist;  /* positions [0, n_hist) are cached */
    int32_t kv_tokens;
    double prompt_s, gen_s;
    int64_t prompt_tokens, gen_tokens, gen_evals;
    /* Speculative decoding (o.so.kind != SH_SPEC_OFF): */
    sh_spec_pool *pool;   /* n-gram continuations of earlier turns (ngram) */
    int32_t pool_from;    /* hist positions already added to the pool */
    sh_spec_draft *draft; /* draft:PATH and self:LAYERS */
    sh_spec_cost cost;    /* the time of a step by its rows, drafting included */
    sh_spec_seq sq;       /* acceptance, the next draft length, the counters */
    double calib_s;       /* the calibration's time at start */
    double draft_us;      /* a model drafter's time per drafted token, from the calibration */
    /* Where a speculative run's decode steps spent their time (wall seconds, the timings line):
     * proposing (a model drafter's catch-up and drafting passes), verification passes of 2 or
     * more rows, and one-row steps without a draft. */
    double draft_s, verify_s, plain_s;
    int64_t verify_steps, plain_steps;
    /* The tokens sampled but not yet printed: after a verification, the accepted drafts and the
     * target's own token; all but the last are in the cache already. */
    sh_sample pend[SH_SPEC_MAX_K + 1];
    int32_t n_pend;
} run;

static void usage(FILE *f)
{
    fprintf(f,
            "usage: shoal run -m MODEL [-z TOKENIZER] [-p TEXT | --prompt-ids \"1 2 3\"] [-n N]\n"
            "                 [--temp T] [--top-k K] [--top-p P] [--min-p P] [--seed S]\n"
            "                 [--repeat-penalty R] [--presence-penalty P]\n"
            "                 [--frequency-penalty F] [-t THREADS] [--chat] [--ids]\n"
            "                 [--kv-f16] [--spec off|ngram|draft:PATH|self:LAYERS]\n"
            "                 [--spec-k N]\n\n"
            "Generates text from a GGUF model, or a llama2.c .bin checkpoint with its\n"
            "tokenizer.bin (-z). Without a prompt it starts from the BOS token.\n\n"
            "  -m MODEL          model file (.gguf or llama2.c .bin)\n"
            "  -z TOKENIZER      llama2.c tokenizer.bin (for a .bin model)\n"
            "  -p TEXT           prompt text\n"
            "  --prompt-ids IDS  prompt as token ids, space-separated\n"
            "  -n N              tokens to generate (default 256; per answer with --chat)\n"
            "  --temp T          temperature, 0 = greedy (default 0)\n"
            "  --top-k K, --top-p P, --min-p P   truncation (default off)\n"
            "  --seed S          random seed (default 0)\n"
            "  --repeat-penalty R, --presence-penalty P, --frequency-penalty F\n"
            "                    penalties over the last 64 tokens (default off)\n"
            "                    (--temp, --top-k, --top-p, --min-p and --repeat-penalty not\n"
            "                    given take the model file's general.sampling.* values, and\n"
            "                    its penalty_last_n the window, when it has them)\n"
            "  -t THREADS        compute threads (default: all CPUs)\n"
            "  --chat            interactive chat with the model's chat template\n"
            "  --ids             print generated token ids instead of text\n"
            "  --kv-f16          keep the KV cache in F16 (as shoal serve and llama.cpp do by\n"
            "                    default; here the default is F32)\n"
            "  --spec S          speculative decoding: off (default); ngram (prompt and output\n"
            "                    lookup); draft:PATH (a smaller model with the same vocabulary);\n"
            "                    self:LAYERS (the model's first LAYERS layers and its head)\n"
            "  --spec-k N        most drafted tokens per step, 1..16 (default 8); the draft\n"
            "                    length adapts to the measured step cost and acceptance\n\n"
            "Prints one line `timings: ...` on stderr at the end (with --spec: drafts,\n"
            "drafted and accepted tokens, the acceptance rate, and the decode steps' time\n"
            "in proposing (draft_ms), verification passes (verify_ms, verify_steps) and\n"
            "one-row steps (plain_ms, plain_steps)).\n");
}

/* Returns 0 to go on, 1 after --help (exit 0), 2 on bad usage (message printed). */
static int parse(int argc, char **argv, opts *o)
{
    memset(o, 0, sizeof *o);
    o->n_gen = 256;
    o->top_p = 1.0f;
    o->repeat_penalty = 1.0f;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        if (!strcmp(a, "-h") || !strcmp(a, "--help")) {
            usage(stdout);
            return 1;
        }
        if (!strcmp(a, "--chat")) {
            o->chat = true;
            continue;
        }
        if (!strcmp(a, "--ids")) {
            o->ids = true;
            continue;
        }
        if (!strcmp(a, "--kv-f16")) {
            o->kv_f16 = true;
            continue;
        }
        if (!sh__cmd_is_flag(" -m -z -p --prompt-ids -n -t --top-k --seed --temp --top-p --min-p "
                             "--repeat-penalty --presence-penalty --frequency-penalty --spec "
                             "--spec-k ",
                             a))
            return sh__cmd_fail("unknown option '%s' (see shoal run --help)", a);
        if (i + 1 >= argc)
            return sh__cmd_fail("option '%s' needs a value", a);
        const char *v = argv[++i];
        int64_t n;
        bool ok = true;
        if (!strcmp(a, "-m"))
            o->model = v;
        else if (!strcmp(a, "-z"))
            o->tokenizer = v;
        else if (!strcmp(a, "-p"))
            o->prompt = v;
        else if (!strcmp(a, "--prompt-ids"))
            o->prompt_ids = v;
        else if (!strcmp(a, "--spec"))
            o->spec = v;
        else if (!strcmp(a, "--spec-k"))
            o->spec_k = v;
        else if (!strcmp(a, "-n"))
            ok = sh__cmd_parse_i64(v, 1, 1 << 20, &n) && ((o->n_gen = (int32_t)n), true);
        else if (!strcmp(a, "-t"))
            ok = sh__cmd_parse_i64(v, 1, 1024, &n) && ((o->threads = (int32_t)n), true);
        else if (!strcmp(a, "--top-k"))
            ok = sh__cmd_parse_i64(v, 0, INT32_MAX, &n) &&
                 ((o->top_k = (int32_t)n), (o->samp_set |= SH_CMD_SAMP_TOP_K));
        else if (!strcmp(a, "--seed"))
            ok = sh__cmd_parse_i64(v, 0, INT64_MAX, &n) && ((o->seed = (uint64_t)n), true);
        else if (!strcmp(a, "--temp"))
            ok = sh__cmd_parse_f32(v, 0.0f, 100.0f, &o->temp) && (o->samp_set |= SH_CMD_SAMP_TEMP);
        else if (!strcmp(a, "--top-p"))
            ok = sh__cmd_parse_f32(v, 0.0f, 1.0f, &o->top_p) && (o->samp_set |= SH_CMD_SAMP_TOP_P);
        else if (!strcmp(a, "--min-p"))
            ok = sh__cmd_parse_f32(v, 0.0f, 1.0f, &o->min_p) && (o->samp_set |= SH_CMD_SAMP_MIN_P);
        else if (!strcmp(a, "--repeat-penalty"))
            ok = sh__cmd_parse_f32(v, 0.01f, 100.0f, &o->repeat_penalty) &&
                 (o->samp_set |= SH_CMD_SAMP_REPEAT);
        else if (!strcmp(a, "--presence-penalty"))
            ok = sh__cmd_parse_f32(v, -100.0f, 100.0f, &o->presence_penalty);
        else if (!strcmp(a, "--frequency-penalty"))
            ok = sh__cmd_parse_f32(v, -100.0f, 100.0f, &o->frequency_penalty);
        else
            return sh__cmd_fail("unknown option '%s' (see shoal run --help)", a);
        if (!ok)
            return sh__cmd_fail("bad value '%s' for %s", v, a);
    }
    if (!o->model)
        return sh__cmd_fail("no model given (-m MODEL)");
    if (o->prompt && o->prompt_ids)
        return sh__cmd_fail("give -p or --prompt-ids, not both");
    if (o->chat && (o->prompt || o->prompt_ids || o->ids))
        return sh__cmd_fail("--chat takes no prompt and no --ids");
    sh_error e = {0};
    if (sh_spec_parse(o->spec, o->spec_k, &o->so, &e))
        return sh__cmd_fail("%s", e.msg);
    return 0;
}

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

/* A progress bar on stderr while the weights are read in (terminals only). */
static void progress(float done, void *arg)
{
    (void)arg;
    int w = 40, k = (int)(done * (float)w + 0.5f);
    fprintf(stderr, "\rloading [%.*s%*s] %3d%%", k, "########################################",
            w - k, "", (int)(done * 100.0f + 0.5f));
    if (done >= 1.0f)
        fprintf(stderr, "\r%*s\r", w + 20, "");
    fflush(stderr);
}

static void close_all(run *r)
{
    sh_spec_draft_destroy(r->draft);
    sh_spec_pool_destroy(r->pool);
    sh_tokenizer_stream_destroy(r->stream);
    sh_sampler_destroy(r->smp);
    sh_llama_ctx_destroy(r->ctx);
    sh_backend_destroy(r->be);
    sh_tokenizer_destroy(r->tok);
    sh_llama_destroy(r->m);
    free(r->blocks);
    free(r->hist);
}

static int load(run *r)
{
    const opts *o = &r->o;
    sh_error e = {0};
    struct stat sb;
    if (stat(o->model, &sb) != 0)
        return sh__cmd_fail("%s: %s", o->model, strerror(errno));
    sh_llama_load_opts lo = {.prefault = true};
    if (isatty(2) && sb.st_size > (64 << 20))
        lo.progress = progress;
    if (sh_llama_load(o->model, &lo, &r->m, &e))
        return sh__cmd_fail("%s", e.msg);
    if (r->m->gguf) {
        if (sh_tokenizer_create_gguf(r->m->gguf, &r->tok, &e))
            return sh__cmd_fail("%s: tokenizer: %s", o->model, e.msg);
    } else {
        if (!o->tokenizer)
            return sh__cmd_fail("%s is a llama2.c checkpoint: give its tokenizer.bin with -z",
                                o->model);
        // The file layer's check first: its message names the path once, and a FIFO or a
        // device is refused before the tokenizer reader sees it.
        if (sh__file_check(o->tokenizer, &e) ||
            sh_tokenizer_create_llama2c(o->tokenizer, r->m->hp.n_vocab, &r->tok, &e))
            return sh__cmd_fail("%s", e.msg);
    }
    if (sh_tokenizer_n_vocab(r->tok) > r->m->hp.n_vocab)
        return sh__cmd_fail("tokenizer has more tokens than the model's embedding");
    sh_backend_cpu_opts bo = {.n_threads = o->threads};
    if (sh_backend_cpu_create(&bo, &r->be, &e))
        return (sh__cmd_fail("backend: %s", e.msg), 1);
    // KV capacity: the trained context, capped so a small machine can hold it.
    int32_t cap = r->m->hp.n_ctx_train;
    if (cap > 4096)
        cap = 4096;
    r->kv_tokens = cap;
    const bool spec = o->so.kind != SH_SPEC_OFF;
    sh_llama_ctx_opts co = {.max_tokens = PREFILL_CHUNK,
                            .max_seqs = 1,
                            .max_logits = spec ? o->so.k + 1 : 1, /* a verification's rows */
                            .kv_tokens = cap,
                            .kv_type = o->kv_f16 ? SH_DTYPE_F16 : SH_DTYPE_F32};
    if (sh_llama_ctx_create(r->m, r->be, &co, &r->ctx, &e))
        return sh__cmd_fail("%s", e.msg);
    int32_t nb = sh_llama_ctx_n_blocks(r->ctx);
    r->blocks = malloc((size_t)nb * sizeof *r->blocks);
    r->hist = malloc((size_t)r->kv_tokens * sizeof *r->hist);
    if (!r->blocks || !r->hist)
        return (sh__cmd_fail("out of memory"), 1);
    for (int32_t i = 0; i < nb; i++)
        r->blocks[i] = i;
    sh_sampler_params sp = sh_sampler_params_default();
    sp.temperature = o->temp;
    sp.top_k = o->top_k;
    sp.top_p = o->top_p;
    sp.min_p = o->min_p;
    sp.seed = o->seed;
    sp.repeat_penalty = o->repeat_penalty;
    sp.presence_penalty = o->presence_penalty;
    sp.frequency_penalty = o->frequency_penalty;
    // The model file's recommended sampling (general.sampling.*) for what no flag set.
    uint32_t f = o->samp_set;
    int32_t last_n = sp.penalty_last_n;
    uint32_t file = sh__cmd_model_sampling(
        r->m, f & SH_CMD_SAMP_TEMP ? NULL : &sp.temperature,
        f & SH_CMD_SAMP_TOP_K ? NULL : &sp.top_k, f & SH_CMD_SAMP_TOP_P ? NULL : &sp.top_p,
        f & SH_CMD_SAMP_MIN_P ? NULL : &sp.min_p,
        f & SH_CMD_SAMP_REPEAT ? NULL : &sp.repeat_penalty, &last_n);
    sp.penalty_last_n = last_n < 0 ? r->kv_tokens : last_n;
    if (file & ~f)
        fprintf(stderr,
                "sampling from the model file (flags override): temperature %g, top_k %d, top_p "
                "%g, min_p %g, repeat_penalty %g, penalty window %d\n",
                (double)sp.temperature, (int)sp.top_k, (double)sp.top_p, (double)sp.min_p,
                (double)sp.repeat_penalty, (int)sp.penalty_last_n);
    if (sh_sampler_create(r->m->hp.n_vocab, &sp, &r->smp, &e))
        return sh__cmd_fail("%s", e.msg);
    uint32_t flags = sh_tokenizer_get_kind(r->tok) == SH_TOKENIZER_SPM ? SH_DECODE_STRIP_SPACE : 0;
    if (sh_tokenizer_stream_create(r->tok, flags, &r->stream, &e))
        return sh__cmd_fail("%s", e.msg);
    if (o->so.kind == SH_SPEC_NGRAM && sh_spec_pool_create(SPEC_POOL_ENTRIES, &r->pool, &e))
        return sh__cmd_fail("%s", e.msg);
    if (o->so.kind == SH_SPEC_DRAFT || o->so.kind == SH_SPEC_SELF) {
        struct stat db;
        if (o->so.kind == SH_SPEC_DRAFT && stat(o->so.path, &db) != 0)
            return sh__cmd_fail("draft model %s: %s", o->so.path, strerror(errno));
        sh_spec_draft_opts dopt = {.path = o->so.kind == SH_SPEC_DRAFT ? o->so.path : NULL,
                                   .self_layers = o->so.kind == SH_SPEC_SELF ? o->so.layers : 0,
                                   .l2c_tokenizer = o->tokenizer,
                                   .kv_tokens = r->kv_tokens,
                                   .kv_type = co.kv_type,
                                   .max_tokens = PREFILL_CHUNK,
                                   .prefault = true};
        if (sh_spec_draft_create(r->m, r->tok, r->be, &dopt, &r->draft, &e))
            return sh__cmd_fail("%s", e.msg);
    }
    return 0;
}

/* The time of one forward pass of n rows (n rows of logits, a verification's shape) at position
 * 0 of the empty cache (the prompt overwrites it), in microseconds; < 0 on a failure (printed). */
static double time_rows(run *r, const int32_t *toks, int32_t n)
{
    sh_llama_seq s = {.tokens = toks, .n_tokens = n, .pos0 = 0, .blocks = r->blocks, .n_logits = n};
    sh_llama_batch b = {.n_seqs = 1, .seqs = &s};
    sh_llama_out out;
    sh_error e = {0};
    double t0 = now_s();
    if (sh_llama_forward(r->ctx, &b, &out, &e)) {
        fprintf(stderr, "error: %s\n", e.msg);
        return -1.0;
    }
    return (now_s() - t0) * 1e6;
}

/* Measures the step cost table at start: the target's forward pass of 1..k+1 rows plus, for a
 * model drafter, the time of the drafted tokens; each point the faster of two passes (a pass
 * slowed by another process on the machine must not switch speculation off), after a warm-up:
 * at most 13 passes of at most k + 1 rows, about what as many decode steps cost. Learning the table
 * from real steps alone would measure only the lengths already chosen (from a prior); the real
 * steps are observed too (step()) and refine it. Returns 1 on a runtime failure. */
static int calibrate(run *r)
{
    double t_start = now_s();
    sh_spec_cost_init(&r->cost);
    sh_spec_seq_init(&r->sq);
    /* (a context of fewer than k + 1 positions is measured as far as it goes) */
    const int32_t kmax = r->o.so.k < r->kv_tokens - 1 ? r->o.so.k : r->kv_tokens - 1;
    int32_t toks[SH_SPEC_MAX_K + 1], drafts[SH_SPEC_MAX_K];
    int32_t tok = sh_tokenizer_bos(r->tok) >= 0 ? sh_tokenizer_bos(r->tok) : 0;
    for (int32_t i = 0; i <= kmax; i++)
        toks[i] = tok;
    sh_error e = {0};
    double draft_us = 0.0; /* one drafted token's time: the faster of two runs of k */
    for (int round = 0; r->draft && round < 2; round++) {
        int32_t nd = 0;
        double t0 = now_s();
        if (sh_spec_draft_propose(r->draft, toks, 1, kmax, drafts, &nd, &e)) {
            fprintf(stderr, "error: %s\n", e.msg);
            return 1;
        }
        double us = (now_s() - t0) * 1e6 / (nd > 0 ? nd : 1);
        draft_us = round == 0 || us < draft_us ? us : draft_us;
    }
    r->draft_us = draft_us;
    if (time_rows(r, toks, 1) < 0.0) /* warm-up */
        return 1;
    /* Rows 1, 2, 3, 5, 9 and 17 up to k + 1, and k + 1: the cost grows about linearly in the rows
     * and sh_spec_cost_ratio interpolates between measured points. */
    static const int32_t points[] = {1, 2, 3, 5, 9, 17};
    int32_t rows[8], nr = 0;
    for (size_t i = 0; i < sizeof points / sizeof points[0]; i++)
        if (points[i] <= kmax + 1)
            rows[nr++] = points[i];
    if (rows[nr - 1] != kmax + 1)
        rows[nr++] = kmax + 1;
    for (int32_t i = 0; i < nr; i++) {
        const int32_t n = rows[i];
        double a = time_rows(r, toks, n), b = a < 0.0 ? a : time_rows(r, toks, n);
        if (a < 0.0 || b < 0.0)
            return 1;
        sh_spec_cost_observe(&r->cost, n, (a < b ? a : b) + (double)(n - 1) * draft_us);
    }
    r->calib_s = now_s() - t_start;
    return 0;
}

/* Feeds ids[0, n) at positions n_hist.. and leaves the logits of the last one in *logits.
 * Returns 1 on a runtime failure (message printed). */
static int feed(run *r, const int32_t *ids, int32_t n, const float **logits, bool prompt)
{
    double t0 = now_s();
    for (int32_t i = 0; i < n; i += PREFILL_CHUNK) {
        int32_t k = n - i < PREFILL_CHUNK ? n - i : PREFILL_CHUNK;
        sh_llama_seq s = {.tokens = ids + i,
                          .n_tokens = k,
                          .pos0 = r->n_hist,
                          .blocks = r->blocks,
                          .want_logits = i + k == n};
        sh_llama_batch b = {.n_seqs = 1, .seqs = &s};
        sh_llama_out out;
        sh_error e = {0};
        if (sh_llama_forward(r->ctx, &b, &out, &e)) {
            fprintf(stderr, "\nerror: %s\n", e.msg);
            return 1;
        }
        memcpy(r->hist + r->n_hist, ids + i, (size_t)k * sizeof *ids);
        r->n_hist += k;
        *logits = out.logits;
    }
    double dt = now_s() - t0;
    if (prompt) {
        r->prompt_s += dt;
        r->prompt_tokens += n;
    } else {
        r->gen_evals += n; // generate() times the whole loop, sampling and printing included
    }
    return 0;
}

static void emit_text(run *r, int32_t id)
{
    const char *text;
    size_t len;
    if (sh_tokenizer_stream_feed(r->stream, id, &text, &len) == SH_OK && len)
        fwrite(text, 1, len, stdout);
}

/* A growing NUL-terminated string (the chat answer); capacity doubles, so appending a token's
 * text is amortised O(1). */
typedef struct text_buf {
    char *p;
    size_t len, cap;
} text_buf;

static int append(text_buf *b, const char *s, size_t n)
{
    if (b->len + n + 1 > b->cap) {
        size_t cap = b->cap ? b->cap : 256;
        while (cap < b->len + n + 1)
            cap *= 2;
        char *p = realloc(b->p, cap);
        if (!p) {
            fprintf(stderr, "\nerror: out of memory\n");
            return 1;
        }
        b->p = p;
        b->cap = cap;
    }
    memcpy(b->p + b->len, s, n);
    b->len += n;
    b->p[b->len] = '\0';
    return 0;
}

/* Samples the token after `logits` into the pending list (taken into the sampler's window).
 * Returns 1 when every token is banned (message printed). */
static int sample_one(run *r, const float *logits)
{
    if (sh_sampler_sample(r->smp, logits, &r->pend[0])) {
        fprintf(stderr, "\nerror: every token is banned; cannot sample\n");
        return 1;
    }
    sh_sampler_accept(r->smp, r->pend[0].id);
    r->n_pend = 1;
    return 0;
}

/* Drafts up to k tokens to follow hist[0, n) into out; returns how many, or -1 on a failure
 * (message printed). *catch_up_s: the time a model drafter spent bringing its cache up to hist
 * (the tokens of steps without drafts, and a fully accepted draft's last token), which a step
 * that ends up with no draft does not count. */
static int32_t propose(run *r, int32_t n, int32_t k, int32_t *out, double *catch_up_s)
{
    *catch_up_s = 0.0;
    if (r->o.so.kind == SH_SPEC_NGRAM)
        return sh_spec_ngram_propose(r->hist, n, r->pool, k, 0, out);
    int32_t nd = 0;
    sh_error e = {0};
    double t0 = now_s();
    sh_err err = sh_spec_draft_sync(r->draft, r->hist, n, &e);
    *catch_up_s = now_s() - t0;
    if (err || sh_spec_draft_propose(r->draft, r->hist, n, k, out, &nd, &e)) {
        fprintf(stderr, "\nerror: %s\n", e.msg);
        return -1;
    }
    return nd;
}

/* One decode step after the last pending token `id` (not yet in the cache), which leaves the
 * next tokens in the pending list: with speculation, drafts of a length chosen from the step
 * cost and the acceptance so far are verified in one forward pass of [id, drafts] (one row of
 * logits each) and the accepted ones with the target's own next token become pending; the
 * cache keeps id and the accepted drafts, and the positions of rejected drafts are overwritten
 * by the next step. Without a draft, a plain one-token step. `remaining`: tokens still wanted.
 * Returns 1 on a runtime failure (message printed). */
static int step(run *r, int32_t id, int32_t remaining)
{
    double t0 = now_s();
    int32_t drafts[SH_SPEC_MAX_K], nd = 0;
    double catch_up_s = 0.0;
    const bool spec = r->o.so.kind != SH_SPEC_OFF;
    if (spec) {
        int32_t k = sh_spec_seq_plan(&r->sq, &r->cost, r->o.so.k, 1);
        if (k > r->kv_tokens - r->n_hist - 1)
            k = r->kv_tokens - r->n_hist - 1; /* positions n_hist .. n_hist + k */
        if (k > remaining - 1)
            k = remaining - 1; /* a step gives at most k + 1 tokens */
        if (k > 0) {
            r->hist[r->n_hist] = id; /* (its position's token once fed, whatever is accepted) */
            if ((nd = propose(r, r->n_hist + 1, k, drafts, &catch_up_s)) < 0)
                return 1;
            r->draft_s += now_s() - t0;
        }
    }
    if (nd == 0) {
        const float *logits = NULL;
        double tf = now_s();
        if (feed(r, &id, 1, &logits, false))
            return 1;
        r->plain_s += now_s() - tf;
        r->plain_steps++;
        if (spec)
            sh_spec_cost_observe(&r->cost, 1, (now_s() - t0 - catch_up_s) * 1e6);
        return sample_one(r, logits);
    }
    int32_t toks[SH_SPEC_MAX_K + 1];
    toks[0] = id;
    memcpy(toks + 1, drafts, (size_t)nd * sizeof *drafts);
    sh_llama_seq s = {.tokens = toks,
                      .n_tokens = nd + 1,
                      .pos0 = r->n_hist,
                      .blocks = r->blocks,
                      .n_logits = nd + 1};
    sh_llama_batch b = {.n_seqs = 1, .seqs = &s};
    sh_llama_out out;
    sh_error e = {0};
    double tv = now_s();
    if (sh_llama_forward(r->ctx, &b, &out, &e)) {
        fprintf(stderr, "\nerror: %s\n", e.msg);
        return 1;
    }
    r->verify_s += now_s() - tv;
    r->verify_steps++;
    int32_t m = 0;
    if (sh_spec_verify(r->smp, out.logits, r->m->hp.n_vocab, drafts, nd, r->pend, &m)) {
        fprintf(stderr, "\nerror: every token is banned; cannot sample\n");
        return 1;
    }
    /* id and the m - 1 accepted drafts stay in the cache. */
    memcpy(r->hist + r->n_hist, toks, (size_t)m * sizeof *toks);
    r->n_hist += m;
    r->gen_evals += m;
    r->n_pend = m;
    sh_spec_seq_update(&r->sq, nd, m - 1);
    /* The whole step, a model drafter's catch-up included: the tokens of the steps without
     * drafts before it have to pass through the drafter now, a cost that drafting brings and
     * not drafting avoids. Counting only one drafter pass for it (as the calibration does) made
     * steps of 1 or 2 drafts between one-row steps look cheaper than they were: on the AVX2
     * machine of bench/README.md (Q4_1 drafting for its F16 copy) a catch-up averaged 3.4 rows
     * and 1.6 drafter passes' time, and those steps cost more per token than one-row steps. */
    double us = (now_s() - t0) * 1e6;
    sh_spec_cost_observe(&r->cost, nd + 1, us);
    return 0;
}

/* Samples up to n_gen tokens after `logits`, streaming them; stops at end-of-generation or a
 * full cache. Appends the generated text to `answer` when given (chat). */
static int generate(run *r, const float *logits, text_buf *answer)
{
    double t0 = now_s();
    int rc = sample_one(r, logits);
    int32_t at = 0; /* the next pending token to print */
    for (int32_t i = 0; rc == 0;) {
        int32_t id = r->pend[at++].id;
        if (sh_tokenizer_is_eog(r->tok, id) || (!r->m->gguf && id == 1))
            break; // llama2.c models delimit stories with BOS
        r->gen_tokens++;
        if (r->o.ids) {
            printf(i ? " %d" : "%d", (int)id);
        } else {
            const char *text;
            size_t len;
            if (sh_tokenizer_stream_feed(r->stream, id, &text, &len) == SH_OK && len) {
                fwrite(text, 1, len, stdout);
                if (answer)
                    rc = append(answer, text, len);
            }
        }
        fflush(stdout);
        if (++i == r->o.n_gen || rc)
            break;
        if (at < r->n_pend)
            continue; /* an accepted draft: already in the cache */
        if (r->n_hist >= r->kv_tokens) {
            fprintf(stderr, "\n[context full: %d tokens]\n", (int)r->kv_tokens);
            break;
        }
        rc = step(r, id, r->o.n_gen - i);
        at = 0;
    }
    const char *text;
    size_t len;
    sh_tokenizer_stream_flush(r->stream, &text, &len);
    if (!r->o.ids && len)
        fwrite(text, 1, len, stdout);
    putchar('\n');
    fflush(stdout);
    r->gen_s += now_s() - t0;
    if (r->pool) { /* later turns of --chat look up this one's n-grams too */
        sh_spec_pool_add(r->pool, r->hist, r->n_hist, r->pool_from);
        r->pool_from = r->n_hist;
    }
    return rc;
}

/* After a prompt: brings a model drafter's cache to it, so that the first step does not pay for
 * the prompt (counted as prompt time). */
static int draft_prompt(run *r)
{
    if (!r->draft || r->n_hist == 0)
        return 0;
    double t0 = now_s();
    sh_error e = {0};
    if (sh_spec_draft_sync(r->draft, r->hist, r->n_hist, &e)) {
        fprintf(stderr, "\nerror: %s\n", e.msg);
        return 1;
    }
    r->prompt_s += now_s() - t0;
    return 0;
}

/* Tokenizes text (BOS when the vocabulary wants it); *ids is malloc'd. */
static int tokenize(run *r, const char *text, uint32_t flags, int32_t **ids, size_t *n)
{
    sh_error e = {0};
    if (sh_tokenizer_wants_bos(r->tok) && sh_tokenizer_bos(r->tok) >= 0)
        flags |= SH_TOKENIZE_ADD_BOS;
    size_t need = 0;
    sh_err err = sh_tokenizer_encode(r->tok, text, strlen(text), flags, NULL, 0, &need, &e);
    if (err && err != SH_ERANGE)
        return sh__cmd_fail("tokenizer: %s", e.msg);
    *ids = malloc((need + 1) * sizeof **ids);
    if (!*ids || sh_tokenizer_encode(r->tok, text, strlen(text), flags, *ids, need + 1, n, &e))
        return sh__cmd_fail("tokenizer: %s", e.msg);
    return 0;
}

static int one_shot(run *r)
{
    const opts *o = &r->o;
    int32_t *ids = NULL;
    size_t n = 0;
    int rc = 0;
    if (o->prompt_ids) {
        ids = malloc(MAX_PROMPT_IDS * sizeof *ids);
        const char *p = o->prompt_ids;
        while (ids) {
            while (*p == ' ' || *p == '\t' || *p == ',' || *p == '\n')
                p++;
            if (!*p)
                break;
            char *end;
            errno = 0;
            long v = strtol(p, &end, 10);
            if (end == p || (*end && !strchr(" \t,\n", *end))) {
                free(ids);
                return sh__cmd_fail("--prompt-ids: '%s' is not a list of token ids", o->prompt_ids);
            }
            if (errno || v < 0 || v >= r->m->hp.n_vocab || n >= MAX_PROMPT_IDS) {
                free(ids);
                return sh__cmd_fail("--prompt-ids: id %ld is outside the vocabulary of %d", v,
                                    (int)r->m->hp.n_vocab);
            }
            ids[n++] = (int32_t)v;
            p = end;
        }
    } else if (o->prompt && *o->prompt) {
        if ((rc = tokenize(r, o->prompt, 0, &ids, &n)))
            return rc;
    } else {
        ids = malloc(sizeof *ids);
        if (ids && sh_tokenizer_bos(r->tok) >= 0)
            ids[n++] = sh_tokenizer_bos(r->tok);
    }
    if (!ids)
        return (sh__cmd_fail("out of memory"), 1);
    if (n == 0) {
        free(ids);
        return sh__cmd_fail("empty prompt and the vocabulary has no BOS token");
    }
    if ((int64_t)n >= r->kv_tokens) {
        free(ids);
        return sh__cmd_fail("prompt longer than the context");
    }
    // Echo the prompt text as the tokenizer reads it back (not with --ids).
    for (size_t i = 0; i < n; i++) {
        sh_sampler_accept(r->smp, ids[i]);
        if (!o->ids)
            emit_text(r, ids[i]);
    }
    const float *logits = NULL;
    rc = feed(r, ids, (int32_t)n, &logits, true);
    free(ids);
    if (rc == 0)
        rc = draft_prompt(r);
    return rc ? rc : generate(r, logits, NULL);
}

/* Interactive chat: the whole conversation is rendered each turn; only the tokens past the
 * prefix already in the cache are fed. */
static int chat(run *r)
{
    const char *tmpl_text = NULL;
    size_t tmpl_len = 0;
    sh_str st;
    if (r->m->gguf && sh_gguf_get_str(r->m->gguf, "tokenizer.chat_template", &st) == SH_OK) {
        tmpl_text = st.ptr;
        tmpl_len = (size_t)st.len;
    }
    sh_chat_template tmpl = sh_chat_for_model(tmpl_text, tmpl_len, r->m->hp.arch);
    char sys[512];
    bool has_sys = sh_chat_default_system(tmpl_text, tmpl_len, sys, sizeof sys);
    fprintf(stderr, "chat template: %s (empty line or end of input quits)\n", sh_chat_name(tmpl));
    sh_chat_msg *msgs = NULL;
    size_t n_msgs = 0;
    int rc = 0;
    char line[4096];
    for (;;) {
        if (isatty(0))
            fprintf(stderr, "> ");
        if (!fgets(line, sizeof line, stdin))
            break;
        line[strcspn(line, "\n")] = '\0';
        if (!line[0])
            break;
        sh_chat_msg *nm = realloc(msgs, (n_msgs + 2) * sizeof *msgs);
        char *content = strdup(line);
        if (!nm || !content) {
            free(content);
            msgs = nm ? nm : msgs;
            rc = 1;
            break;
        }
        msgs = nm;
        msgs[n_msgs++] = (sh_chat_msg){"user", content};
        // What the user types is text: only the template's own markers become special tokens,
        // so a line holding <|im_end|> cannot close the turn.
        int32_t *ids = NULL;
        size_t n = 0;
        sh_error e = {0};
        if (sh_chat_tokenize(r->tok, tmpl, msgs, n_msgs, has_sys ? sys : NULL, true, 0, &ids, &n,
                             &e)) {
            rc = sh__cmd_fail("chat: %s", e.msg);
            break;
        }
        if ((int64_t)n + 1 >= r->kv_tokens) {
            free(ids);
            fprintf(stderr, "[context full]\n");
            break;
        }
        // Keep the cached prefix that still matches; overwrite from the first difference.
        int32_t keep = 0;
        while (keep < r->n_hist && (size_t)keep < n - 1 && r->hist[keep] == ids[keep])
            keep++;
        r->n_hist = keep;
        if (r->pool_from > keep)
            r->pool_from = keep; /* the pool takes the rewritten part again */
        const float *logits = NULL;
        sh_tokenizer_stream_reset(r->stream);
        sh_sampler_reset(r->smp, r->o.seed + n_msgs);
        for (size_t i = 0; i < n; i++)
            sh_sampler_accept(r->smp, ids[i]);
        rc = feed(r, ids + keep, (int32_t)(n - (size_t)keep), &logits, true);
        free(ids);
        if (rc == 0)
            rc = draft_prompt(r);
        text_buf answer = {0};
        if (rc || (rc = generate(r, logits, &answer)) || (rc = append(&answer, "", 0))) {
            free(answer.p);
            break;
        }
        msgs[n_msgs++] = (sh_chat_msg){"assistant", answer.p};
    }
    for (size_t i = 0; i < n_msgs; i++)
        free((char *)msgs[i].content);
    free(msgs);
    return rc;
}

int sh__cmd_run(int argc, char **argv)
{
    run r;
    memset(&r, 0, sizeof r);
    int rc = parse(argc, argv, &r.o);
    if (rc)
        return rc == 1 ? 0 : 2;
    double t0 = now_s();
    rc = load(&r);
    double load_ms = (now_s() - t0) * 1e3;
    if (rc == 0 && r.o.so.kind != SH_SPEC_OFF)
        rc = calibrate(&r);
    if (rc == 0)
        rc = r.o.chat ? chat(&r) : one_shot(&r);
    char spec[384] = "";
    const sh_spec_seq *q = &r.sq;
    if (r.o.so.kind != SH_SPEC_OFF)
        snprintf(spec, sizeof spec,
                 " spec=%s spec_k=%d calib_ms=%.0f drafts=%" PRIu64 " drafted=%" PRIu64
                 " accepted=%" PRIu64 " accept_rate=%.3f draft_ms=%.0f verify_ms=%.0f"
                 " verify_steps=%" PRId64 " plain_ms=%.0f plain_steps=%" PRId64,
                 sh_spec_kind_name(r.o.so.kind), (int)r.o.so.k, r.calib_s * 1e3, q->drafts,
                 q->drafted, q->accepted,
                 q->drafted ? (double)q->accepted / (double)q->drafted : 0.0, r.draft_s * 1e3,
                 r.verify_s * 1e3, r.verify_steps, r.plain_s * 1e3, r.plain_steps);
    if (rc == 0)
        fprintf(stderr,
                "timings: load_ms=%.0f prompt_tokens=%" PRId64
                " prompt_tps=%.1f gen_tokens=%" PRId64 " gen_tps=%.1f%s\n",
                load_ms, r.prompt_tokens,
                r.prompt_s > 0 ? (double)r.prompt_tokens / r.prompt_s : 0.0, r.gen_tokens,
                r.gen_s > 0 ? (double)r.gen_evals / r.gen_s : 0.0, spec);
    close_all(&r);
    return rc;
}
