/* llama.cpp's side of issue 28's grammar comparison: the grammar work per decoded token that
 * llama-server's sampler does, on the same grammar (or the same JSON schema, converted by
 * llama.cpp's own json_schema_to_grammar) and the same token sequence as bench/bench_grammar.c.
 *
 * Not part of Shoal's build: bench/llama-grammar.py compiles it against a llama.cpp build
 * (libllama and the common library, which holds json_schema_to_grammar) in .cache/.
 *
 * Per token k of the document, as common/sampling.cpp's common_sampler_sample does it:
 *   check  - llama_sampler_apply on a 1-element array holding the sampled token (the check that
 *            runs first; when it passes, that is all the grammar does before accept);
 *   full   - llama_sampler_apply on the full-vocabulary array (what runs when the sampled token
 *            was refused: every token's piece against the grammar's stacks);
 *   accept - llama_sampler_accept (the grammar advances its stacks by the token's bytes).
 * Filling the llama_token_data array is not timed (llama-server refills it from the logits
 * either way).
 *
 * Usage: llama_grammar_ref (--gbnf FILE | --schema FILE) --ids FILE [--doc FILE] MODEL.gguf
 *   --ids  the token ids to feed (one JSON array, as bench_grammar --print-ids writes them)
 *   --doc  the document text: llama.cpp's own tokenization of it is compared with --ids
 * Prints one JSON line. */
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "json-schema-to-grammar.h"
#include "json.h"
#include "llama.h"

static std::string slurp(const char *path)
{
    std::ifstream f(path, std::ios::binary);
    if (!f)
        throw std::runtime_error(std::string("cannot read ") + path);
    std::stringstream ss;
    ss << f.rdbuf();
    return ss.str();
}

static double now()
{
    return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch())
        .count();
}

/* Same rank rule as bench_grammar.c's pct(). */
static double pct(std::vector<double> v, double p)
{
    std::sort(v.begin(), v.end());
    size_t k = (size_t)(p * (double)(v.size() - 1) + 0.5);
    return v[std::min(k, v.size() - 1)];
}

/* Percentile of the per-token sums a[k] + b[k]. */
static double pct_sum(const std::vector<double> &a, const std::vector<double> &b, double p)
{
    std::vector<double> s(a.size());
    for (size_t k = 0; k < a.size(); k++)
        s[k] = a[k] + b[k];
    return pct(s, p);
}

static void quiet(ggml_log_level level, const char *text, void *)
{
    if (level == GGML_LOG_LEVEL_ERROR)
        fputs(text, stderr);
}

int main(int argc, char **argv)
{
    const char *gbnf_file = nullptr, *schema_file = nullptr, *ids_file = nullptr,
               *doc_file = nullptr, *model = nullptr;
    for (int k = 1; k < argc; k++) {
        std::string a = argv[k];
        if (a == "--gbnf" && k + 1 < argc)
            gbnf_file = argv[++k];
        else if (a == "--schema" && k + 1 < argc)
            schema_file = argv[++k];
        else if (a == "--ids" && k + 1 < argc)
            ids_file = argv[++k];
        else if (a == "--doc" && k + 1 < argc)
            doc_file = argv[++k];
        else if (a[0] != '-' && !model)
            model = argv[k];
        else {
            model = nullptr;
            break;
        }
    }
    if (!model || !ids_file || !gbnf_file == !schema_file) {
        fprintf(stderr, "usage: llama_grammar_ref (--gbnf FILE | --schema FILE) --ids FILE "
                        "[--doc FILE] MODEL.gguf\n");
        return 2;
    }
    try {
        llama_log_set(quiet, nullptr);
        llama_backend_init();
        llama_model_params mp = llama_model_default_params();
        mp.vocab_only = true;
        llama_model *m = llama_model_load_from_file(model, mp);
        if (!m)
            throw std::runtime_error(std::string("cannot load ") + model);
        const llama_vocab *vocab = llama_model_get_vocab(m);
        const int32_t n_vocab = llama_vocab_n_tokens(vocab);

        /* The grammar: the GBNF text as given, or the schema as llama-server converts it. */
        double t0 = now();
        std::string grammar;
        if (schema_file) {
            common_json schema = common_json::parse(slurp(schema_file));
            grammar = json_schema_to_grammar(schema);
        } else
            grammar = slurp(gbnf_file);
        double t_convert = now() - t0;
        t0 = now();
        llama_sampler *g = llama_sampler_init_grammar(vocab, grammar.c_str(), "root");
        if (!g)
            throw std::runtime_error("llama_sampler_init_grammar refused the grammar");
        double t_init = now() - t0;

        std::vector<llama_token> ids;
        {
            std::string s = slurp(ids_file);
            for (char &c : s)
                if (c == '[' || c == ']' || c == ',')
                    c = ' ';
            std::istringstream in(s);
            long v;
            while (in >> v)
                ids.push_back((llama_token)v);
        }
        if (ids.empty())
            throw std::runtime_error("no token ids");
        for (llama_token t : ids)
            if (t < 0 || t >= n_vocab)
                throw std::runtime_error("token id out of the vocabulary");

        /* llama.cpp's own tokenization of the document (no BOS, specials as text), compared. */
        int tok_same = -1, tok_n = -1;
        if (doc_file) {
            std::string doc = slurp(doc_file);
            std::vector<llama_token> mine(doc.size() + 8);
            int n = llama_tokenize(vocab, doc.data(), (int32_t)doc.size(), mine.data(),
                                   (int32_t)mine.size(), false, false);
            if (n < 0)
                throw std::runtime_error("llama_tokenize failed");
            mine.resize((size_t)n);
            tok_n = n;
            tok_same = mine == ids;
        }

        std::vector<llama_token_data> cur((size_t)n_vocab);
        std::vector<double> full, check, accept;
        size_t allowed_sum = 0;
        for (size_t k = 0; k < ids.size(); k++) {
            llama_token id = ids[k];
            llama_token_data one = {id, 1.0f, 0.0f};
            llama_token_data_array one_arr = {&one, 1, -1, false};
            double a = now();
            llama_sampler_apply(g, &one_arr);
            check.push_back(now() - a);
            if (one.logit == -INFINITY)
                throw std::runtime_error("token " + std::to_string(k) + " (" + std::to_string(id) +
                                         ") refused by the check");

            for (int32_t i = 0; i < n_vocab; i++)
                cur[(size_t)i] = {i, 0.0f, 0.0f};
            llama_token_data_array arr = {cur.data(), cur.size(), -1, false};
            a = now();
            llama_sampler_apply(g, &arr);
            full.push_back(now() - a);
            for (const llama_token_data &d : cur)
                allowed_sum += d.logit != -INFINITY;
            if (cur[(size_t)id].logit == -INFINITY)
                throw std::runtime_error("token " + std::to_string(k) + " (" + std::to_string(id) +
                                         ") is not in the mask");

            a = now();
            llama_sampler_accept(g, id);
            accept.push_back(now() - a);
        }
        /* The grammar must be complete: end-of-generation allowed now. */
        llama_token_data eog = {llama_vocab_eos(vocab), 1.0f, 0.0f};
        llama_token_data_array eog_arr = {&eog, 1, -1, false};
        llama_sampler_apply(g, &eog_arr);
        if (eog.logit == -INFINITY)
            throw std::runtime_error("the document did not end the grammar");

        const char *name = strrchr(model, '/') ? strrchr(model, '/') + 1 : model;
        printf("{\"model\": \"%s\", \"engine\": \"llama.cpp\", \"n_vocab\": %d, \"steps\": %zu, "
               "\"convert_ms\": %.2f, \"init_ms\": %.2f, \"grammar_bytes\": %zu, "
               "\"mean_allowed\": %.0f, \"tokenize_same\": %d, \"tokenize_n\": %d, "
               "\"full_ms\": {\"p50\": %.3f, \"p99\": %.3f, \"max\": %.3f}, "
               "\"check_us\": {\"p50\": %.2f, \"p99\": %.2f, \"max\": %.2f}, "
               "\"accept_us\": {\"p50\": %.2f, \"p99\": %.2f, \"max\": %.2f}, "
               "\"check_accept_us\": {\"p50\": %.2f, \"p99\": %.2f}}\n",
               name, (int)n_vocab, ids.size(), 1e3 * t_convert, 1e3 * t_init, grammar.size(),
               (double)allowed_sum / (double)ids.size(), tok_same, tok_n, 1e3 * pct(full, 0.5),
               1e3 * pct(full, 0.99), 1e3 * pct(full, 1.0), 1e6 * pct(check, 0.5),
               1e6 * pct(check, 0.99), 1e6 * pct(check, 1.0), 1e6 * pct(accept, 0.5),
               1e6 * pct(accept, 0.99), 1e6 * pct(accept, 1.0), 1e6 * pct_sum(check, accept, 0.5),
               1e6 * pct_sum(check, accept, 0.99));
        llama_sampler_free(g);
        llama_model_free(m);
        llama_backend_free();
    } catch (const std::exception &ex) {
        fprintf(stderr, "llama_grammar_ref: %s: %s\n", model, ex.what());
        return 1;
    }
    return 0;
}
