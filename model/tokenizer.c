/* Tokenizer common part: the vocabulary tables, creation from GGUF or llama2.c, queries, and the
 * encode driver that splits out special tokens before the SPM or BPE algorithm runs. */
#include "model/tokenizer.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "base/error.h"
#include "base/file.h"
#include "model/tokenizer_internal.h"

/* Upper bound on encode input: keeps every symbol index and escaped offset inside int32. */
#define MAX_ENCODE_BYTES ((size_t)512 << 20)

/* ---- creation ---- */

static sh_tokenizer *tok_alloc(sh_tokenizer_kind kind, int32_t n_vocab)
{
    sh_tokenizer *t = calloc(1, sizeof *t);
    if (!t)
        return NULL;
    t->kind = kind;
    t->n_vocab = n_vocab;
    t->bos = t->eos = t->eot = t->eom = t->unk = -1;
    t->scores = calloc((size_t)n_vocab, sizeof *t->scores);
    t->types = malloc((size_t)n_vocab);
    t->piece_off = calloc((size_t)n_vocab, sizeof *t->piece_off);
    t->piece_len = calloc((size_t)n_vocab, sizeof *t->piece_len);
    if (!t->scores || !t->types || !t->piece_off || !t->piece_len ||
        sh__tok_map_resize(t, n_vocab)) {
        sh_tokenizer_destroy(t);
        return NULL;
    }
    memset(t->types, SH_TOKEN_NORMAL, (size_t)n_vocab);
    return t;
}

void sh_tokenizer_destroy(sh_tokenizer *t)
{
    if (!t)
        return;
    sh__pre_fini(t);
    sh__tok_u64map_fini(&t->merges);
    sh__tok_u64map_fini(&t->trie);
    free(t->trie_any);
    free(t->trie_user);
    free(t->map);
    free(t->pool);
    free(t->sym_off);
    free(t->sym_len);
    free(t->piece_off);
    free(t->piece_len);
    free(t->scores);
    free(t->types);
    free(t);
}

static bool is_special_type(uint8_t ty)
{
    return ty == SH_TOKEN_CONTROL || ty == SH_TOKEN_UNKNOWN || ty == SH_TOKEN_USER_DEFINED;
}

/* Builds the trie of special-token texts used to split them out of the input. */
static sh_err build_trie(sh_tokenizer *t)
{
    size_t nodes = 1;
    for (int32_t i = 0; i < t->n_vocab; i++)
        if (is_special_type(t->types[i]))
            nodes += t->sym_len[i];
    sh_err err = sh__tok_u64map_init(&t->trie, nodes);
    if (err)
        return err;
    t->trie_any = malloc(nodes * sizeof *t->trie_any);
    t->trie_user = malloc(nodes * sizeof *t->trie_user);
    if (!t->trie_any || !t->trie_user)
        return SH_ENOMEM;
    t->trie_any[0] = t->trie_user[0] = -1;
    t->n_trie = 1;
    for (int32_t id = 0; id < t->n_vocab; id++) {
        if (!is_special_type(t->types[id]) || t->sym_len[id] == 0)
            continue;
        const unsigned char *s = (const unsigned char *)sh__tok_sym_text(t, id);
        int32_t node = 0;
        for (uint32_t k = 0; k < t->sym_len[id]; k++) {
            uint64_t key = ((uint64_t)node << 8) | s[k];
            const sh__tok_u64slot *sl = sh__tok_u64map_get(&t->trie, key);
            if (sl) {
                node = sl->a;
            } else {
                int32_t child = t->n_trie++;
                t->trie_any[child] = t->trie_user[child] = -1;
                sh__tok_u64map_put(&t->trie, key, child, 0);
                node = child;
            }
        }
        /* With repeated texts the lowest id wins; llama.cpp's choice there is unspecified. */
        if (t->trie_any[node] < 0)
            t->trie_any[node] = id;
        if (t->types[id] == SH_TOKEN_USER_DEFINED && t->trie_user[node] < 0)
            t->trie_user[node] = id;
        t->special_first[s[0]] = true;
    }
    return SH_OK;
}

/* The byte of a "<0xNN>" text (two upper- or lower-case hex digits), or -1. */
static int byte_token_value(const char *s, size_t n)
{
    if (n != 6 || memcmp(s, "<0x", 3) != 0 || s[5] != '>')
        return -1;
    int v = 0;
    for (int i = 3; i < 5; i++) {
        char c = s[i];
        int d = c >= '0' && c <= '9'   ? c - '0'
                : c >= 'A' && c <= 'F' ? c - 'A' + 10
                : c >= 'a' && c <= 'f' ? c - 'a' + 10
                                       : -1;
        if (d < 0)
            return -1;
        v = v * 16 + d;
    }
    return v;
}

/* Decoded bytes of every token, computed once so that decoding is a copy. */
static sh_err build_pieces(sh_tokenizer *t)
{
    char *tmp = malloc((size_t)t->max_token_len + 1);
    if (!tmp)
        return SH_ENOMEM;
    sh_err err = SH_OK;
    for (int32_t id = 0; id < t->n_vocab && !err; id++) {
        const char *s = sh__tok_sym_text(t, id);
        size_t n = t->sym_len[id], m = 0;
        switch (t->types[id]) {
        case SH_TOKEN_NORMAL:
            if (t->kind == SH_TOKENIZER_BPE) {
                m = sh__bpe_unmap(s, n, tmp);
            } else {
                /* U+2581 (E2 96 81) stands for a space. */
                for (size_t i = 0; i < n; i++) {
                    if (i + 2 < n && memcmp(s + i, "\xE2\x96\x81", 3) == 0) {
                        tmp[m++] = ' ';
                        i += 2;
                    } else {
                        tmp[m++] = s[i];
                    }
                }
            }
            break;
        case SH_TOKEN_BYTE: {
            int v = t->kind == SH_TOKENIZER_SPM ? byte_token_value(s, n) : -1;
            if (v >= 0)
                tmp[m++] = (char)v;
            break;
        }
        case SH_TOKEN_USER_DEFINED:
        case SH_TOKEN_CONTROL:
        case SH_TOKEN_UNKNOWN:
            memcpy(tmp, s, n);
            m = n;
            break;
        default: /* UNUSED and UNDEFINED decode to nothing, as in llama.cpp */
            break;
        }
        t->piece_len[id] = (uint32_t)m;
        if (m > t->max_piece)
            t->max_piece = m;
        err = sh__tok_pool_add(t, tmp, m, false, &t->piece_off[id]);
    }
    free(tmp);
    return err;
}

/* Texts llama.cpp recognises as end of turn when the file names no EOT id. */
static const char *const eot_texts[] = {
    "<|eot_id|>",
    "<|im_end|>",
    "<|end|>",
    "<end_of_turn>",
    "<|endoftext|>",
    "<EOT>",
    ("<\xEF\xBD\x9C"
     "end\xE2\x96\x81of\xE2\x96\x81sentence\xEF\xBD\x9C>"), /* DeepSeek's, with fullwidth bars */
};

/* Everything after the vocabulary is in place: tables, pieces, the kind's own setup. */
static sh_err finish(sh_tokenizer *t, const sh_gguf_value *merges, sh_error *e)
{
    /* BPE merges add strings of their own; SPM needs room for the vocabulary only, and a smaller
     * table stays in cache better (lookups dominate SPM encoding). */
    size_t room = t->kind == SH_TOKENIZER_BPE ? (size_t)t->n_vocab * 2 + 1024 : (size_t)t->n_vocab;
    sh_err err = sh__tok_map_resize(t, room);
    if (err)
        return sh__error_set(e, err, "tokenizer: cannot size the vocabulary table");
    for (int32_t i = 0; i < t->n_vocab; i++)
        if (t->sym_len[i] > t->max_token_len)
            t->max_token_len = t->sym_len[i];
    if (t->eot < 0) {
        for (size_t k = 0; k < sizeof eot_texts / sizeof eot_texts[0] && t->eot < 0; k++)
            t->eot = sh__tok_lookup(t, eot_texts[k], strlen(eot_texts[k]));
    }
    if ((err = build_trie(t)))
        return sh__error_set(e, err, "tokenizer: cannot build the special-token table");
    if (t->kind == SH_TOKENIZER_SPM)
        err = sh__spm_init(t, e);
    else
        err = sh__bpe_init(t, merges, e);
    if (err)
        return err;
    if ((err = build_pieces(t)))
        return sh__error_set(e, err, "tokenizer: cannot build the token pieces");
    return SH_OK;
}

/* A special id from the file, keeping the default when absent or invalid (llama.cpp ignores an
 * out-of-range id with a warning; UINT32_MAX is the converters' "none"). */
static void read_id(const sh_gguf *g, const char *key, int32_t n_vocab, int32_t *id)
{
    uint32_t v;
    if (sh_gguf_get_u32(g, key, &v) == SH_OK && v < (uint32_t)n_vocab)
        *id = (int32_t)v;
}

static bool is_int_type(sh_gguf_type ty)
{
    return ty <= SH_GGUF_INT32 || ty == SH_GGUF_UINT64 || ty == SH_GGUF_INT64;
}

sh_err sh_tokenizer_create_gguf(const sh_gguf *g, sh_tokenizer **out, sh_error *e)
{
    if (!out)
        return sh__error_set(e, SH_EINVAL, "tokenizer: out is NULL");
    *out = NULL;
    if (!g)
        return sh__error_set(e, SH_EINVAL, "tokenizer: gguf is NULL");
    sh_str model;
    sh_err err = sh_gguf_get_str(g, "tokenizer.ggml.model", &model);
    if (err)
        return sh__error_set(e, err == SH_ENOTFOUND ? SH_ENOTFOUND : SH_EFORMAT,
                             "tokenizer.ggml.model: %s", sh_strerror(err));
    sh_tokenizer_kind kind;
    if (sh_str_eq(model, "llama"))
        kind = SH_TOKENIZER_SPM;
    else if (sh_str_eq(model, "gpt2"))
        kind = SH_TOKENIZER_BPE;
    else
        return sh__error_set(e, SH_EUNSUPPORTED, "tokenizer.ggml.model '%.*s' is not supported",
                             (int)(model.len > 64 ? 64 : model.len), model.ptr);

    const sh_gguf_value *toks, *merges = NULL;
    if ((err = sh_gguf_get_arr(g, "tokenizer.ggml.tokens", SH_GGUF_STRING, &toks)))
        return sh__error_set(e, err == SH_ENOTFOUND ? SH_ENOTFOUND : SH_EFORMAT,
                             "tokenizer.ggml.tokens: %s", sh_strerror(err));
    uint64_t n = toks->v.arr.n;
    if (n == 0 || n > INT32_MAX / 4)
        return sh__error_set(e, SH_EFORMAT, "tokenizer.ggml.tokens: %llu tokens",
                             (unsigned long long)n);
    if (kind == SH_TOKENIZER_BPE &&
        (err = sh_gguf_get_arr(g, "tokenizer.ggml.merges", SH_GGUF_STRING, &merges)))
        return sh__error_set(e, err == SH_ENOTFOUND ? SH_ENOTFOUND : SH_EFORMAT,
                             "tokenizer.ggml.merges: %s", sh_strerror(err));
    const sh_gguf_value *scores = sh_gguf_find(g, "tokenizer.ggml.scores");
    const sh_gguf_value *types = sh_gguf_find(g, "tokenizer.ggml.token_type");
    if (scores &&
        (scores->type != SH_GGUF_ARRAY || scores->v.arr.n != n ||
         (scores->v.arr.type != SH_GGUF_FLOAT32 && scores->v.arr.type != SH_GGUF_FLOAT64)))
        return sh__error_set(e, SH_EFORMAT, "tokenizer.ggml.scores: not %llu floats",
                             (unsigned long long)n);
    if (types &&
        (types->type != SH_GGUF_ARRAY || types->v.arr.n != n || !is_int_type(types->v.arr.type)))
        return sh__error_set(e, SH_EFORMAT, "tokenizer.ggml.token_type: not %llu integers",
                             (unsigned long long)n);

    sh_tokenizer *t = tok_alloc(kind, (int32_t)n);
    if (!t)
        return sh__error_set(e, SH_ENOMEM, "tokenizer: out of memory for %llu tokens",
                             (unsigned long long)n);
    for (uint64_t i = 0; i < n; i++) {
        const sh_str *s = &toks->v.arr.strs[i];
        int32_t id;
        if (s->len > UINT32_MAX / 2 || (err = sh__tok_sym_add(t, s->ptr, (size_t)s->len, &id))) {
            sh_tokenizer_destroy(t);
            return sh__error_set(e, err ? err : SH_EFORMAT, "tokenizer.ggml.tokens[%llu]: %s",
                                 (unsigned long long)i, err ? sh_strerror(err) : "too long");
        }
        if (scores) {
            double f = sh_gguf_arr_f64(scores, i);
            t->scores[i] = isnan(f) ? -INFINITY : (float)f;
        }
        if (types) {
            int64_t ty = sh_gguf_arr_i64(types, i);
            if (ty < 0 || ty > SH_TOKEN_BYTE) {
                sh_tokenizer_destroy(t);
                return sh__error_set(e, SH_EFORMAT, "tokenizer.ggml.token_type[%llu] = %lld",
                                     (unsigned long long)i, (long long)ty);
            }
            t->types[i] = (uint8_t)ty;
        }
    }

    if (kind == SH_TOKENIZER_SPM) {
        /* llama.cpp's defaults for a SentencePiece vocabulary. */
        t->unk = 0;
        t->bos = n > 1 ? 1 : -1;
        t->eos = n > 2 ? 2 : -1;
        t->add_bos = true;
        t->add_space_prefix = true;
    }
    read_id(g, "tokenizer.ggml.bos_token_id", t->n_vocab, &t->bos);
    read_id(g, "tokenizer.ggml.eos_token_id", t->n_vocab, &t->eos);
    read_id(g, "tokenizer.ggml.unknown_token_id", t->n_vocab, &t->unk);
    read_id(g, "tokenizer.ggml.eot_token_id", t->n_vocab, &t->eot);
    read_id(g, "tokenizer.ggml.eom_token_id", t->n_vocab, &t->eom);
    (void)sh_gguf_get_bool(g, "tokenizer.ggml.add_bos_token", &t->add_bos);
    (void)sh_gguf_get_bool(g, "tokenizer.ggml.add_eos_token", &t->add_eos);
    if (kind == SH_TOKENIZER_SPM)
        (void)sh_gguf_get_bool(g, "tokenizer.ggml.add_space_prefix", &t->add_space_prefix);

    sh_str pre;
    strcpy(t->pre, "default");
    if (sh_gguf_get_str(g, "tokenizer.ggml.pre", &pre) == SH_OK) {
        size_t m = pre.len < sizeof t->pre - 1 ? (size_t)pre.len : sizeof t->pre - 1;
        memcpy(t->pre, pre.ptr, m);
        t->pre[m] = '\0';
    }

    if ((err = finish(t, merges, e))) {
        sh_tokenizer_destroy(t);
        return err;
    }
    *out = t;
    return SH_OK;
}

static int32_t rd_i32(const uint8_t *p)
{
    uint32_t v = (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24;
    int32_t r;
    memcpy(&r, &v, 4);
    return r;
}

/* Copies a llama2.c token text, writing its spaces as U+2581 so that the SentencePiece code sees
 * the same vocabulary as a GGUF file converted from the same model. */
static sh_err add_llama2c_text(sh_tokenizer *t, const uint8_t *s, size_t n)
{
    char *tmp = malloc(n * 3 + 1);
    if (!tmp)
        return SH_ENOMEM;
    size_t m = 0;
    for (size_t i = 0; i < n; i++) {
        if (s[i] == ' ') {
            memcpy(tmp + m, "\xE2\x96\x81", 3);
            m += 3;
        } else {
            tmp[m++] = (char)s[i];
        }
    }
    int32_t id;
    sh_err err = sh__tok_sym_add(t, tmp, m, &id);
    free(tmp);
    return err;
}

sh_err sh_tokenizer_create_llama2c(const char *path, int32_t n_vocab, sh_tokenizer **out,
                                   sh_error *e)
{
    if (!out)
        return sh__error_set(e, SH_EINVAL, "tokenizer: out is NULL");
    *out = NULL;
    if (!path || n_vocab < 3 || n_vocab > INT32_MAX / 4)
        return sh__error_set(e, SH_EINVAL, "tokenizer: bad llama2.c arguments (n_vocab %d)",
                             (int)n_vocab);
    sh_file_map fm;
    sh_err err = sh__file_map(path, 0, &fm, e); /* its errors already name the path */
    if (err)
        return err;
    sh_tokenizer *t = tok_alloc(SH_TOKENIZER_SPM, n_vocab);
    if (!t) {
        sh__file_unmap(&fm);
        return sh__error_set(e, SH_ENOMEM, "tokenizer: out of memory for %d tokens", (int)n_vocab);
    }
    size_t off = 4;
    if (fm.size < 4) {
        err = sh__error_set(e, SH_EFORMAT, "%s: too short for a llama2.c tokenizer", path);
        goto fail;
    }
    for (int32_t i = 0; i < n_vocab; i++) {
        if (fm.size - off < 8) {
            err = sh__error_set(e, SH_EFORMAT, "%s: token %d: truncated at byte %zu", path, (int)i,
                                off);
            goto fail;
        }
        float score;
        memcpy(&score, fm.data + off, 4);
        int32_t len = rd_i32(fm.data + off + 4);
        off += 8;
        if (len < 0 || (size_t)len > fm.size - off) {
            err = sh__error_set(e, SH_EFORMAT, "%s: token %d: length %d beyond the file", path,
                                (int)i, (int)len);
            goto fail;
        }
        const uint8_t *s = fm.data + off;
        off += (size_t)len;
        t->scores[i] = isnan(score) ? -INFINITY : score;
        /* run.c's export writes BOS and EOS as "\n<s>\n" and "\n</s>\n". */
        static const char *const names[3] = {"<unk>", "<s>", "</s>"};
        if (i < 3) {
            int32_t id;
            err = sh__tok_sym_add(t, names[i], strlen(names[i]), &id);
            t->types[i] = i == 0 ? SH_TOKEN_UNKNOWN : SH_TOKEN_CONTROL;
        } else {
            err = add_llama2c_text(t, s, (size_t)len);
            if (byte_token_value((const char *)s, (size_t)len) >= 0)
                t->types[i] = SH_TOKEN_BYTE;
        }
        if (err) {
            sh__error_set(e, err, "%s: token %d: %s", path, (int)i, sh_strerror(err));
            goto fail;
        }
    }
    sh__file_unmap(&fm);
    t->unk = 0;
    t->bos = 1;
    t->eos = 2;
    t->add_bos = true;
    t->add_space_prefix = true;
    strcpy(t->pre, "llama2c");
    if ((err = finish(t, NULL, e))) {
        sh_tokenizer_destroy(t);
        return err;
    }
    *out = t;
    return SH_OK;
fail:
    sh__file_unmap(&fm);
    sh_tokenizer_destroy(t);
    return err;
}

/* ---- queries ---- */

sh_tokenizer_kind sh_tokenizer_get_kind(const sh_tokenizer *t) { return t->kind; }
const char *sh_tokenizer_pre(const sh_tokenizer *t) { return t->pre; }
bool sh_tokenizer_pre_known(const sh_tokenizer *t) { return t->pre_known; }
int32_t sh_tokenizer_n_vocab(const sh_tokenizer *t) { return t->n_vocab; }
int32_t sh_tokenizer_bos(const sh_tokenizer *t) { return t->bos; }
int32_t sh_tokenizer_eos(const sh_tokenizer *t) { return t->eos; }
int32_t sh_tokenizer_eot(const sh_tokenizer *t) { return t->eot; }
int32_t sh_tokenizer_unk(const sh_tokenizer *t) { return t->unk; }
bool sh_tokenizer_wants_bos(const sh_tokenizer *t) { return t->add_bos && t->bos >= 0; }
bool sh_tokenizer_wants_eos(const sh_tokenizer *t) { return t->add_eos && t->eos >= 0; }

bool sh_tokenizer_is_eog(const sh_tokenizer *t, int32_t id)
{
    return id >= 0 && (id == t->eos || id == t->eot || id == t->eom);
}

const char *sh_tokenizer_token_text(const sh_tokenizer *t, int32_t id, size_t *len)
{
    if (id < 0 || id >= t->n_vocab) {
        if (len)
            *len = 0;
        return NULL;
    }
    if (len)
        *len = t->sym_len[id];
    return sh__tok_sym_text(t, id);
}

sh_token_type sh_tokenizer_token_type(const sh_tokenizer *t, int32_t id)
{
    return id >= 0 && id < t->n_vocab ? (sh_token_type)t->types[id] : SH_TOKEN_UNDEFINED;
}

bool sh_tokenizer_is_control(const sh_tokenizer *t, int32_t id)
{
    sh_token_type ty = sh_tokenizer_token_type(t, id);
    return ty == SH_TOKEN_CONTROL || ty == SH_TOKEN_UNKNOWN;
}

bool sh_tokenizer_is_special(const sh_tokenizer *t, int32_t id)
{
    return id >= 0 && id < t->n_vocab && is_special_type(t->types[id]);
}

int32_t sh_tokenizer_find(const sh_tokenizer *t, const char *text, size_t len)
{
    if (!text && len)
        return -1;
    int32_t id = sh__tok_lookup(t, text ? text : "", len);
    return id < t->n_vocab ? id : -1;
}

/* ---- encode ---- */

/* The longest special token starting at s[0, n) that the mode accepts; its length in *len. */
static int32_t match_special(const sh_tokenizer *t, const unsigned char *s, size_t n,
                             bool parse_special, size_t *len)
{
    int32_t node = 0, best = -1;
    for (size_t k = 0; k < n; k++) {
        const sh__tok_u64slot *sl = sh__tok_u64map_get(&t->trie, ((uint64_t)node << 8) | s[k]);
        if (!sl)
            break;
        node = sl->a;
        int32_t id = parse_special ? t->trie_any[node] : t->trie_user[node];
        if (id >= 0) {
            best = id;
            *len = k + 1;
        }
    }
    return best;
}

/* Every raw fragment starts the text or follows a special token, so with add_space_prefix each one
 * gets the SPM space prefix (llama.cpp's is_prev_special rule). */
static sh_err encode_fragment(const sh_tokenizer *t, sh__tok_work *w, const char *s, size_t n)
{
    if (t->kind == SH_TOKENIZER_SPM)
        return sh__spm_encode(t, w, s, n, t->add_space_prefix);
    return sh__bpe_encode(t, w, s, n);
}

/* The encoder proper: the ids land in w->out[0, w->n_out). Special texts are matched with
 * parse_special semantics only inside the spans (everywhere when there are none). */
static sh_err encode_work(const sh_tokenizer *t, const char *text, size_t len, uint32_t flags,
                          const sh_tokenizer_span *spans, size_t n_spans, sh__tok_work *w,
                          sh_error *e)
{
    if (!t || (!text && len))
        return sh__error_set(e, SH_EINVAL, "tokenizer: bad encode arguments");
    if (len > MAX_ENCODE_BYTES)
        return sh__error_set(e, SH_EINVAL, "tokenizer: input of %zu bytes is above the %zu limit",
                             len, MAX_ENCODE_BYTES);
    if ((flags & SH_TOKENIZE_ADD_BOS) && t->bos < 0)
        return sh__error_set(e, SH_EINVAL, "tokenizer: ADD_BOS but the vocabulary has no BOS");
    for (size_t k = 0; k < n_spans; k++)
        if (spans[k].off > len || spans[k].len > len - spans[k].off ||
            (k > 0 && spans[k].off < spans[k - 1].off + spans[k - 1].len))
            return sh__error_set(e, SH_EINVAL,
                                 "tokenizer: special span %zu is out of order or "
                                 "outside the text",
                                 k);
    sh_err err = SH_OK;
    if (flags & SH_TOKENIZE_ADD_BOS)
        err = sh__tok_push(w, t->bos);
    bool parse_special = (flags & SH_TOKENIZE_PARSE_SPECIAL) != 0;
    const unsigned char *s = (const unsigned char *)text;
    size_t start = 0, i = 0, sp = 0;
    while (i < len && !err) {
        if (!t->special_first[s[i]]) {
            i++;
            continue;
        }
        // Inside a span a match must end inside it; outside the spans only USER_DEFINED texts
        // (which plain text may hold) are recognised.
        bool parse = parse_special;
        size_t lim = len - i;
        if (parse && n_spans) {
            while (sp < n_spans && spans[sp].off + spans[sp].len <= i)
                sp++;
            parse = sp < n_spans && spans[sp].off <= i;
            if (parse)
                lim = spans[sp].off + spans[sp].len - i;
        }
        size_t mlen = 0;
        int32_t id = match_special(t, s + i, lim, parse, &mlen);
        if (id < 0) {
            i++;
            continue;
        }
        if (i > start)
            err = encode_fragment(t, w, text + start, i - start);
        if (!err)
            err = sh__tok_push(w, id);
        i += mlen;
        start = i;
    }
    if (!err && start < len)
        err = encode_fragment(t, w, text + start, len - start);
    return err;
}

sh_err sh_tokenizer_encode(const sh_tokenizer *t, const char *text, size_t len, uint32_t flags,
                           int32_t *ids, size_t cap, size_t *n_ids, sh_error *e)
{
    if (n_ids)
        *n_ids = 0;
    if (!n_ids || (!ids && cap))
        return sh__error_set(e, SH_EINVAL, "tokenizer: bad encode arguments");
    sh__tok_work w = {.e = e};
    sh_err err = encode_work(t, text, len, flags, NULL, 0, &w, e);
    if (!err) {
        *n_ids = w.n_out;
        if (w.n_out > cap)
            err = sh__error_set(e, SH_ERANGE, "tokenizer: %zu ids do not fit in %zu", w.n_out, cap);
        else if (w.n_out)
            memcpy(ids, w.out, w.n_out * sizeof *ids);
    }
    sh__tok_work_fini(&w);
    return err;
}

sh_err sh_tokenizer_encode_opts(const sh_tokenizer *t, const char *text, size_t len,
                                const sh_tokenize_opts *o, int32_t **ids, size_t *n_ids,
                                sh_error *e)
{
    if (n_ids)
        *n_ids = 0;
    if (ids)
        *ids = NULL;
    if (!ids || !n_ids)
        return sh__error_set(e, SH_EINVAL, "tokenizer: bad encode arguments");
    sh_tokenize_opts none = {0};
    if (!o)
        o = &none;
    if (o->n_special && !o->special)
        return sh__error_set(e, SH_EINVAL, "tokenizer: n_special without spans");
    if (t && o->max_ids) {
        // No token covers more input bytes than its vocabulary text has (a space becomes the
        // 3-byte U+2581, a byte the 6-byte <0xNN>), except <unk> for one character of up to
        // 4 bytes; so a text of more than max_ids * that many bytes needs more than max_ids ids.
        size_t per = t->max_token_len > 4 ? t->max_token_len : 4;
        if (o->max_ids <= SIZE_MAX / per && len > o->max_ids * per) {
            *n_ids = o->max_ids + 1;
            return sh__error_set(e, SH_ERANGE,
                                 "tokenizer: %zu bytes need more than %zu ids (at most %zu bytes "
                                 "per id)",
                                 len, o->max_ids, per);
        }
    }
    sh__tok_work w = {.e = e, .max_out = o->max_ids};
    sh_err err = encode_work(t, text, len, o->flags, o->special, o->n_special, &w, e);
    if (!err) {
        // One id of room past the end, so callers may append (and an empty result is not NULL).
        void *p = w.out;
        err = sh__tok_reserve(&p, &w.out_cap, w.n_out + 1, sizeof(int32_t));
        w.out = p;
        if (err)
            err = sh__error_set(e, err, "tokenizer: out of memory for %zu ids", w.n_out + 1);
    }
    if (!err) {
        *ids = w.out;
        *n_ids = w.n_out;
        w.out = NULL;
    } else if (w.over) {
        *n_ids = o->max_ids + 1;
    }
    sh__tok_work_fini(&w);
    return err;
}
