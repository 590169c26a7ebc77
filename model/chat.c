/* Chat templates rendered in C: detection from the Jinja text by marker tokens, and rendering. */
#include "model/chat.h"

#include <stdlib.h>
#include <string.h>

#include "base/error.h"

/* memmem without relying on its declaration being visible everywhere. */
static const char *find(const char *hay, size_t n, const char *needle)
{
    size_t m = strlen(needle);
    if (!hay || m > n)
        return NULL;
    for (size_t i = 0; i + m <= n; i++)
        if (memcmp(hay + i, needle, m) == 0)
            return hay + i;
    return NULL;
}

sh_chat_template sh_chat_detect(const char *tmpl, size_t len)
{
    // Each family's own special tokens identify it; Zephyr's <|user|> is the weakest marker
    // (a template may spell role names that way in a comment), so it is tried last.
    if (find(tmpl, len, "<|start_header_id|>"))
        return SH_CHAT_LLAMA3;
    if (find(tmpl, len, "<|im_start|>"))
        return SH_CHAT_CHATML;
    if (find(tmpl, len, "<start_of_turn>"))
        return SH_CHAT_GEMMA;
    if (find(tmpl, len, "[INST]"))
        return SH_CHAT_LLAMA2;
    if (find(tmpl, len, "<|end|>") &&
        (find(tmpl, len, "<|user|>") || find(tmpl, len, "<|assistant|>")))
        return SH_CHAT_PHI3; // Zephyr's role markers, with <|end|> closing each turn
    if (find(tmpl, len, "<|user|>"))
        return SH_CHAT_ZEPHYR;
    return SH_CHAT_CHATML;
}

sh_chat_template sh_chat_for_model(const char *tmpl, size_t len, const char *arch)
{
    if (tmpl && len)
        return sh_chat_detect(tmpl, len);
    if (arch && strcmp(arch, "gemma3") == 0)
        return SH_CHAT_GEMMA;
    return SH_CHAT_CHATML;
}

const char *sh_chat_name(sh_chat_template t)
{
    switch (t) {
    case SH_CHAT_CHATML:
        return "chatml";
    case SH_CHAT_LLAMA2:
        return "llama2";
    case SH_CHAT_LLAMA3:
        return "llama3";
    case SH_CHAT_ZEPHYR:
        return "zephyr";
    case SH_CHAT_GEMMA:
        return "gemma";
    case SH_CHAT_PHI3:
        return "phi3";
    }
    return "?";
}

bool sh_chat_default_system(const char *tmpl, size_t len, char *buf, size_t cap)
{
    if (cap > 0)
        buf[0] = '\0';
    const char *p = find(tmpl, len, "<|im_start|>system");
    if (!p)
        return false;
    p += strlen("<|im_start|>system");
    size_t rest = len - (size_t)(p - tmpl);
    // The Jinja string literal holds either a real newline or the two characters '\' 'n'.
    if (rest >= 1 && *p == '\n')
        p++, rest--;
    else if (rest >= 2 && p[0] == '\\' && p[1] == 'n')
        p += 2, rest -= 2;
    else
        return false;
    const char *end = find(p, rest, "<|im_end|>");
    if (!end || end == p)
        return false;
    size_t k = 0;
    for (const char *q = p; q < end; q++) {
        char ch = *q;
        if (ch == '\\' && q + 1 < end && q[1] == 'n')
            ch = '\n', q++;
        else if (ch == '\'' || ch == '{' || ch == '}')
            return false; // not a plain literal (an expression): do not guess
        if (k + 1 >= cap)
            return false;
        buf[k++] = ch;
    }
    buf[k] = '\0';
    return true;
}

/* An append-only writer that counts what it could not store, for the ERANGE contract, and
 * records the template's own text as spans. */
typedef struct out {
    char *buf;
    size_t cap, len;
    sh_tokenizer_span *spans;
    size_t span_cap, n_spans;
    size_t span_end; /* where the last span ends (0 before the first) */
} out;

static void put_text(out *o, const char *s, bool tmpl)
{
    size_t n = strlen(s);
    if (o->len + n < o->cap)
        memcpy(o->buf + o->len, s, n);
    if (tmpl && n) {
        if (o->n_spans && o->span_end == o->len) {
            if (o->n_spans <= o->span_cap)
                o->spans[o->n_spans - 1].len += n;
        } else if (o->n_spans++ < o->span_cap) {
            o->spans[o->n_spans - 1] = (sh_tokenizer_span){o->len, n};
        }
        o->span_end = o->len + n;
    }
    o->len += n;
}

/* Template text (markers, role names, separators). */
static void put(out *o, const char *s) { put_text(o, s, true); }
/* A message's content: plain text, whatever it holds. */
static void put_content(out *o, const char *s) { put_text(o, s, false); }

static void put3(out *o, const char *a, const char *content, const char *c)
{
    put(o, a);
    put_content(o, content);
    put(o, c);
}

sh_err sh_chat_render_spans(sh_chat_template t, const sh_chat_msg *msgs, size_t n,
                            const char *default_system, bool add_assistant, char *buf, size_t cap,
                            size_t *len, sh_tokenizer_span *spans, size_t span_cap, size_t *n_spans,
                            sh_error *e)
{
    for (size_t i = 0; i < n; i++)
        if (!msgs[i].role || !msgs[i].content)
            return sh__error_set(e, SH_EINVAL, "chat: message %zu has no role or content", i);
    if (t < SH_CHAT_CHATML || t > SH_CHAT_PHI3)
        return sh__error_set(e, SH_EINVAL, "chat: unknown template %d", (int)t);
    out o = {buf, cap, 0, spans, span_cap, 0, 0};
    bool has_sys = n > 0 && strcmp(msgs[0].role, "system") == 0;
    const char *sys = has_sys ? msgs[0].content : default_system;
    size_t i0 = has_sys ? 1 : 0;
    switch (t) {
    case SH_CHAT_CHATML:
        if (sys)
            put3(&o, "<|im_start|>system\n", sys, "<|im_end|>\n");
        for (size_t i = i0; i < n; i++) {
            put(&o, "<|im_start|>");
            put(&o, msgs[i].role);
            put3(&o, "\n", msgs[i].content, "<|im_end|>\n");
        }
        if (add_assistant)
            put(&o, "<|im_start|>assistant\n");
        break;
    case SH_CHAT_LLAMA3:
        if (sys)
            put3(&o, "<|start_header_id|>system<|end_header_id|>\n\n", sys, "<|eot_id|>");
        for (size_t i = i0; i < n; i++) {
            put(&o, "<|start_header_id|>");
            put(&o, msgs[i].role);
            put3(&o, "<|end_header_id|>\n\n", msgs[i].content, "<|eot_id|>");
        }
        if (add_assistant)
            put(&o, "<|start_header_id|>assistant<|end_header_id|>\n\n");
        break;
    case SH_CHAT_ZEPHYR:
    case SH_CHAT_PHI3: {
        const char *end = t == SH_CHAT_PHI3 ? "<|end|>\n" : "</s>\n";
        if (sys)
            put3(&o, "<|system|>\n", sys, end);
        for (size_t i = i0; i < n; i++) {
            put(&o, "<|");
            put(&o, msgs[i].role);
            put3(&o, "|>\n", msgs[i].content, end);
        }
        if (add_assistant)
            put(&o, "<|assistant|>\n");
        break;
    }
    case SH_CHAT_GEMMA:
        // No system role: the system prompt and a blank line open the first turn's text; the
        // assistant is "model".
        for (size_t i = i0; i < n; i++) {
            const char *role = msgs[i].role;
            put(&o, "<start_of_turn>");
            put(&o, strcmp(role, "assistant") == 0 ? "model" : role);
            put(&o, "\n");
            if (i == i0 && sys)
                put3(&o, "", sys, "\n\n");
            put3(&o, "", msgs[i].content, "<end_of_turn>\n");
        }
        if (add_assistant)
            put(&o, "<start_of_turn>model\n");
        break;
    case SH_CHAT_LLAMA2: {
        // The system prompt folds into the first user turn; every turn after the first opens
        // with a BOS text, answers close with EOS.
        bool first = true;
        for (size_t i = i0; i < n; i++) {
            if (strcmp(msgs[i].role, "assistant") == 0) {
                put3(&o, " ", msgs[i].content, " </s>");
                continue;
            }
            put(&o, first ? "[INST] " : "<s>[INST] ");
            if (first && sys)
                put3(&o, "<<SYS>>\n", sys, "\n<</SYS>>\n\n");
            put3(&o, "", msgs[i].content, " [/INST]");
            first = false;
        }
        (void)add_assistant; // the answer follows [/INST] directly
        break;
    }
    }
    *len = o.len;
    if (n_spans)
        *n_spans = o.n_spans;
    if (o.len >= cap || o.n_spans > span_cap)
        return SH_ERANGE;
    buf[o.len] = '\0';
    return SH_OK;
}

sh_err sh_chat_render(sh_chat_template t, const sh_chat_msg *msgs, size_t n,
                      const char *default_system, bool add_assistant, char *buf, size_t cap,
                      size_t *len, sh_error *e)
{
    // Spans are not kept here, so none can run short.
    size_t n_spans = 0;
    sh_err err = sh_chat_render_spans(t, msgs, n, default_system, add_assistant, buf, cap, len,
                                      NULL, 0, &n_spans, e);
    if (err == SH_ERANGE && *len < cap)
        err = SH_OK, buf[*len] = '\0';
    return err;
}

sh_err sh_chat_tokenize(const sh_tokenizer *tok, sh_chat_template t, const sh_chat_msg *msgs,
                        size_t n, const char *default_system, bool add_assistant, size_t max_ids,
                        int32_t **ids, size_t *n_ids, sh_error *e)
{
    *ids = NULL;
    *n_ids = 0;
    size_t len = 0, n_spans = 0;
    sh_err err = sh_chat_render_spans(t, msgs, n, default_system, add_assistant, NULL, 0, &len,
                                      NULL, 0, &n_spans, e);
    if (err && err != SH_ERANGE)
        return err;
    char *text = malloc(len + 1);
    sh_tokenizer_span *spans = malloc((n_spans + 1) * sizeof *spans);
    if (!text || !spans) {
        free(text);
        free(spans);
        return sh__error_set(e, SH_ENOMEM, "chat: out of memory for a %zu-byte prompt", len);
    }
    err = sh_chat_render_spans(t, msgs, n, default_system, add_assistant, text, len + 1, &len,
                               spans, n_spans + 1, &n_spans, e);
    if (!err) {
        sh_tokenize_opts o = {.flags = SH_TOKENIZE_PARSE_SPECIAL,
                              .special = spans,
                              .n_special = n_spans,
                              .max_ids = max_ids};
        if (sh_tokenizer_wants_bos(tok))
            o.flags |= SH_TOKENIZE_ADD_BOS;
        err = sh_tokenizer_encode_opts(tok, text, len, &o, ids, n_ids, e);
    }
    free(text);
    free(spans);
    return err;
}
