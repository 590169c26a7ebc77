/* Reference greedy continuations from llama.cpp (its public C API, llama.h), written as JSON for
 * Shoal's comparison tests: per prompt, llama.cpp's prompt token ids and, per generated token, the
 * chosen id and the top log-probabilities (log-softmax of the logits) with their ids.
 *
 * Not part of Shoal's build: llama.cpp is built by hand and never committed. Build and run (see
 * tests/data/gemma3/README.md for the exact llama.cpp build):
 *
 *   LL=/path/to/llama.cpp; B=$LL/build
 *   gcc -O2 -std=c11 -Wall -Wextra -I$LL/include -I$LL/ggml/include \
 *       tests/reference/llamacpp_ref.c -o /tmp/llamacpp_ref \
 *       -L$B/bin -lllama -lggml -lggml-base -Wl,-rpath,$B/bin -lm
 *   /tmp/llamacpp_ref -m MODEL.gguf -f PROMPTS.txt -n 24 -t 2 > OUT.json
 *
 * PROMPTS.txt holds one prompt per line; the two characters backslash-n in a line stand for a
 * newline (so code prompts fit on one line) and backslash-backslash for a backslash. Tokenization
 * is llama.cpp's own with add_special (BOS where the vocabulary asks for it) and without parsing
 * special tokens in the text, unless --special is given: then control-token text such as Gemma's
 * <start_of_turn> becomes its id (chat-formatted prompts; the JSON's "parse_special" says which).
 * The prompt is fed as one batch, then one token per step; the chosen token is the argmax of the
 * logits (lowest id on an exact tie, as a greedy sampler that scans upwards). A step that picks an
 * end-of-generation token is recorded and ends that prompt, as a greedy generator stops there. */
#include "llama.h"

#include <math.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define TOP_N 5

static void usage(void)
{
    fprintf(stderr, "usage: llamacpp_ref -m MODEL.gguf -f PROMPTS.txt [-n N_PREDICT] [-t THREADS] "
                    "[-c N_CTX] [--special]\n");
}

/* Writes s[0, n) as a JSON string; bytes that do not form valid UTF-8 become U+FFFD so that any
 * token piece (byte-fallback tokens hold lone continuation bytes) still makes valid JSON. */
static void json_str(FILE *f, const char *s, size_t n)
{
    const unsigned char *p = (const unsigned char *)s;
    fputc('"', f);
    for (size_t i = 0; i < n;) {
        unsigned c = p[i];
        if (c < 0x80) {
            if (c == '"' || c == '\\')
                fprintf(f, "\\%c", c);
            else if (c == '\n')
                fputs("\\n", f);
            else if (c == '\t')
                fputs("\\t", f);
            else if (c < 0x20 || c == 0x7f)
                fprintf(f, "\\u%04x", c);
            else
                fputc((int)c, f);
            i++;
            continue;
        }
        size_t len = c >= 0xf0 && c < 0xf5 ? 4 : c >= 0xe0 ? 3 : c >= 0xc2 && c < 0xe0 ? 2 : 0;
        bool ok = len > 0 && i + len <= n;
        for (size_t k = 1; ok && k < len; k++)
            ok = (p[i + k] & 0xc0) == 0x80;
        if (ok) {
            fwrite(p + i, 1, len, f);
            i += len;
        } else {
            fputs("\\ufffd", f);
            i++;
        }
    }
    fputc('"', f);
}

/* Decodes the escapes of a prompt line in place: backslash-n -> newline, backslash-backslash ->
 * backslash. */
static void unescape(char *s)
{
    char *w = s;
    for (const char *r = s; *r; r++) {
        if (r[0] == '\\' && r[1] == 'n') {
            *w++ = '\n';
            r++;
        } else if (r[0] == '\\' && r[1] == '\\') {
            *w++ = '\\';
            r++;
        } else {
            *w++ = *r;
        }
    }
    *w = '\0';
}

static void piece(FILE *f, const struct llama_vocab *vocab, llama_token id)
{
    char buf[256];
    int32_t n = llama_token_to_piece(vocab, id, buf, (int32_t)sizeof buf, 0, true);
    json_str(f, buf, n > 0 ? (size_t)n : 0);
}

/* One prompt: tokenize, feed, decode greedily; writes the prompt's JSON object. Returns 0, or 1
 * after printing an error. */
static int run_prompt(struct llama_context *ctx, const struct llama_vocab *vocab, const char *text,
                      int n_predict, bool special, double *lp, FILE *out)
{
    int32_t n_vocab = llama_vocab_n_tokens(vocab);
    int32_t need = -llama_tokenize(vocab, text, (int32_t)strlen(text), NULL, 0, true, special);
    llama_token *ids = malloc((size_t)(need > 0 ? need : 1) * sizeof *ids);
    if (!ids ||
        llama_tokenize(vocab, text, (int32_t)strlen(text), ids, need, true, special) != need) {
        fprintf(stderr, "error: could not tokenize prompt '%s'\n", text);
        free(ids);
        return 1;
    }
    llama_memory_clear(llama_get_memory(ctx), true);

    fputs("    {\"prompt\": ", out);
    json_str(out, text, strlen(text));
    fputs(",\n     \"prompt_ids\": [", out);
    for (int32_t i = 0; i < need; i++)
        fprintf(out, i ? ", %d" : "%d", ids[i]);
    fputs("],\n     \"steps\": [", out);

    llama_token tok = 0;
    struct llama_batch batch = llama_batch_get_one(ids, need);
    bool eog = false;
    for (int step = 0; step < n_predict && !eog; step++) {
        if (llama_decode(ctx, batch)) {
            fprintf(stderr, "error: llama_decode failed at step %d of '%s'\n", step, text);
            free(ids);
            return 1;
        }
        const float *logits = llama_get_logits_ith(ctx, -1);
        /* log-softmax in double: lp[i] = logit[i] - max - log(sum exp(logit - max)). */
        double mx = -INFINITY, sum = 0;
        for (int32_t i = 0; i < n_vocab; i++)
            mx = logits[i] > mx ? logits[i] : mx;
        for (int32_t i = 0; i < n_vocab; i++)
            sum += exp((double)logits[i] - mx);
        double lse = mx + log(sum);
        for (int32_t i = 0; i < n_vocab; i++)
            lp[i] = (double)logits[i] - lse;
        /* Top TOP_N by a selection pass each (TOP_N is small); ties go to the lower id. */
        int32_t top[TOP_N];
        for (int k = 0; k < TOP_N; k++) {
            int32_t best = -1;
            for (int32_t i = 0; i < n_vocab; i++) {
                bool taken = false;
                for (int j = 0; j < k; j++)
                    taken |= top[j] == i;
                if (!taken && (best < 0 || lp[i] > lp[best]))
                    best = i;
            }
            top[k] = best;
        }
        tok = top[0];
        eog = llama_vocab_is_eog(vocab, tok);
        fprintf(out, "%s\n       {\"id\": %d, \"piece\": ", step ? "," : "", tok);
        piece(out, vocab, tok);
        fputs(", \"top\": [", out);
        for (int k = 0; k < TOP_N; k++)
            fprintf(out, "%s[%d, %.6f]", k ? ", " : "", top[k], lp[top[k]]);
        fputs("]}", out);
        batch = llama_batch_get_one(&tok, 1);
    }
    fprintf(out, "],\n     \"stopped_at_eog\": %s}", eog ? "true" : "false");
    free(ids);
    return 0;
}

static void quiet_log(enum ggml_log_level level, const char *text, void *user)
{
    (void)user;
    if (level == GGML_LOG_LEVEL_ERROR)
        fputs(text, stderr);
}

int main(int argc, char **argv)
{
    const char *model_path = NULL, *prompts_path = NULL;
    int n_predict = 24, threads = 2, n_ctx = 512;
    bool special = false;
    for (int i = 1; i < argc; i++) {
        if (i + 1 < argc && !strcmp(argv[i], "-m"))
            model_path = argv[++i];
        else if (i + 1 < argc && !strcmp(argv[i], "-f"))
            prompts_path = argv[++i];
        else if (i + 1 < argc && !strcmp(argv[i], "-n"))
            n_predict = atoi(argv[++i]);
        else if (i + 1 < argc && !strcmp(argv[i], "-t"))
            threads = atoi(argv[++i]);
        else if (i + 1 < argc && !strcmp(argv[i], "-c"))
            n_ctx = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--special"))
            special = true;
        else {
            usage();
            return 2;
        }
    }
    if (!model_path || !prompts_path || n_predict < 1 || threads < 1 || n_ctx < 16) {
        usage();
        return 2;
    }
    FILE *pf = fopen(prompts_path, "r");
    if (!pf) {
        fprintf(stderr, "error: cannot open %s\n", prompts_path);
        return 2;
    }

    llama_log_set(quiet_log, NULL);
    llama_backend_init();
    struct llama_model_params mp = llama_model_default_params();
    mp.n_gpu_layers = 0;
    struct llama_model *model = llama_model_load_from_file(model_path, mp);
    if (!model) {
        fprintf(stderr, "error: llama.cpp could not load %s\n", model_path);
        return 2;
    }
    struct llama_context_params cp = llama_context_default_params();
    cp.n_ctx = (uint32_t)n_ctx;
    cp.n_batch = (uint32_t)n_ctx;
    cp.n_ubatch = (uint32_t)n_ctx;
    cp.n_threads = threads;
    cp.n_threads_batch = threads;
    cp.no_perf = true;
    struct llama_context *ctx = llama_init_from_model(model, cp);
    if (!ctx) {
        fprintf(stderr, "error: llama.cpp could not create a context\n");
        return 2;
    }
    const struct llama_vocab *vocab = llama_model_get_vocab(model);
    int32_t n_vocab = llama_vocab_n_tokens(vocab);
    double *lp = malloc((size_t)n_vocab * sizeof *lp);
    if (!lp)
        return 2;

    FILE *out = stdout;
    char desc[256];
    llama_model_desc(model, desc, sizeof desc);
    fputs("{\"generator\": \"tests/reference/llamacpp_ref.c\",\n \"model_desc\": ", out);
    json_str(out, desc, strlen(desc));
    fputs(",\n \"system_info\": ", out);
    const char *sys = llama_print_system_info();
    json_str(out, sys, strlen(sys));
    fprintf(out,
            ",\n \"n_vocab\": %d, \"n_predict\": %d, \"threads\": %d, \"n_ctx\": %d, \"top_n\": %d,"
            "\n \"bos_id\": %d, \"add_bos\": %s, \"parse_special\": %s,\n \"eog_ids\": [",
            n_vocab, n_predict, threads, n_ctx, TOP_N, llama_vocab_bos(vocab),
            llama_vocab_get_add_bos(vocab) ? "true" : "false", special ? "true" : "false");
    for (int32_t i = 0, k = 0; i < n_vocab; i++)
        if (llama_vocab_is_eog(vocab, i))
            fprintf(out, k++ ? ", %d" : "%d", i);
    fputs("],\n \"prompts\": [\n", out);

    char line[4096];
    int n = 0, rc = 0;
    while (rc == 0 && fgets(line, sizeof line, pf)) {
        line[strcspn(line, "\r\n")] = '\0';
        if (!line[0])
            continue;
        unescape(line);
        if (n++)
            fputs(",\n", out);
        rc = run_prompt(ctx, vocab, line, n_predict, special, lp, out);
    }
    fputs("\n ]}\n", out);
    fclose(pf);
    free(lp);
    llama_free(ctx);
    llama_model_free(model);
    llama_backend_free();
    return rc ? 1 : 0;
}
