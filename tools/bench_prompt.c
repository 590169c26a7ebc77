/* `shoal bench`'s synthetic prompts: words of a fixed vocabulary drawn from a seeded generator,
 * and the JSON bodies of completion and chat requests. */
#include <stdlib.h>
#include <string.h>

#include "tools/bench.h"

/* Common English words. With the space before them, each is a single token in the BPE
 * vocabularies of Llama 2 and 3, GPT-2/4, Mistral, Qwen and SmolLM, so n words make about n
 * prompt tokens (chat templates add a few more). */
static const char *const vocab[] = {
    "the",      "of",         "and",     "to",      "in",      "is",      "was",     "for",
    "that",     "with",       "as",      "on",      "by",      "at",      "from",    "his",
    "her",      "they",       "we",      "you",     "this",    "are",     "be",      "had",
    "have",     "not",        "but",     "one",     "all",     "were",    "which",   "she",
    "he",       "their",      "there",   "been",    "when",    "would",   "who",     "will",
    "more",     "no",         "if",      "out",     "so",      "said",    "what",    "up",
    "its",      "about",      "into",    "than",    "them",    "can",     "only",    "other",
    "new",      "some",       "could",   "time",    "these",   "two",     "may",     "then",
    "do",       "first",      "any",     "my",      "now",     "such",    "like",    "our",
    "over",     "man",        "me",      "even",    "most",    "made",    "after",   "also",
    "did",      "many",       "before",  "must",    "through", "back",    "years",   "where",
    "much",     "your",       "way",     "well",    "down",    "should",  "because", "each",
    "just",     "those",      "people",  "how",     "too",     "little",  "state",   "good",
    "very",     "make",       "world",   "still",   "own",     "see",     "men",     "work",
    "long",     "get",        "here",    "between", "both",    "life",    "being",   "under",
    "never",    "day",        "same",    "another", "know",    "while",   "last",    "might",
    "us",       "great",      "old",     "year",    "off",     "come",    "since",   "against",
    "go",       "came",       "right",   "used",    "take",    "three",   "house",   "water",
    "small",    "found",      "place",   "voice",   "home",    "part",    "school",  "city",
    "number",   "island",     "night",   "light",   "music",   "river",   "market",  "table",
    "garden",   "paper",      "story",   "money",   "family",  "friend",  "letter",  "window",
    "street",   "morning",    "summer",  "winter",  "road",    "field",   "power",   "change",
    "order",    "point",      "hand",    "door",    "head",    "line",    "form",    "group",
    "word",     "name",       "side",    "case",    "week",    "company", "system",  "program",
    "question", "government", "problem", "service", "area",    "country", "energy",  "history",
    "color",    "doctor",     "animal",  "mother",  "father",  "child",   "car",     "book",
    "food",     "game",       "film",    "art",     "bird",    "tree",    "fire",    "sun",
    "moon",     "star",       "sea",     "hill",    "stone",   "rain",    "snow",    "wind",
    "green",    "blue",       "red",     "black",   "white",   "young",   "high",    "open",
    "early",    "late",       "real",    "free",    "full",    "hard",    "clear",   "strong",
    "simple",   "quiet",      "bright",  "warm",    "cold",    "short",   "large",   "quick",
    "slow",     "happy",      "ready",
};

#define N_VOCAB (sizeof vocab / sizeof vocab[0])

uint64_t sh__bench_prompt_rand(uint64_t *s)
{
    uint64_t z = (*s += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

int32_t sh__bench_prompt_draw(const sh__bench_dist *d, uint64_t *s)
{
    if (d->hi <= d->lo)
        return d->lo;
    uint64_t span = (uint64_t)(d->hi - d->lo) + 1;
    return d->lo + (int32_t)(sh__bench_prompt_rand(s) % span);
}

char *sh__bench_prompt_words(int32_t n_words, uint64_t *s)
{
    size_t cap = 1, len = 0;
    for (size_t i = 0; i < N_VOCAB; i++)
        if (strlen(vocab[i]) + 1 > cap)
            cap = strlen(vocab[i]) + 1;
    char *out = malloc(cap * (size_t)(n_words > 0 ? n_words : 0) + 1);
    if (!out)
        return NULL;
    for (int32_t i = 0; i < n_words; i++) {
        const char *w = vocab[sh__bench_prompt_rand(s) % N_VOCAB];
        size_t n = strlen(w);
        if (i > 0)
            out[len++] = ' ';
        memcpy(out + len, w, n);
        len += n;
    }
    out[len] = '\0';
    return out;
}

char *sh__bench_prompt_body(const sh__bench_opts *o, const char *model, const char *prefix,
                            int64_t index, int64_t *prompt_words)
{
    // Each request draws from its own stream, so request i is the same whatever the order of
    // completion and whatever the concurrency.
    uint64_t s = o->seed ^ ((uint64_t)index * 0xd1342543de82ef95ull + 0x632be59bd9b4e019ull);
    sh__bench_prompt_rand(&s);
    int32_t n_prompt = sh__bench_prompt_draw(&o->prompt_tokens, &s);
    int32_t n_out = sh__bench_prompt_draw(&o->output_tokens, &s);
    char *unique = sh__bench_prompt_words(n_prompt, &s);
    if (!unique)
        return NULL;
    *prompt_words = n_prompt + (prefix ? o->shared_prefix : 0);
    json_t *root = json_object();
    char *text = NULL;
    if (o->chat) {
        json_t *msgs = json_array();
        if (prefix) {
            json_t *sys = json_object();
            json_object_set_new(sys, "role", json_string("system"));
            json_object_set_new(sys, "content", json_string(prefix));
            json_array_append_new(msgs, sys);
        }
        json_t *user = json_object();
        json_object_set_new(user, "role", json_string("user"));
        json_object_set_new(user, "content", json_string(unique));
        json_array_append_new(msgs, user);
        json_object_set_new(root, "messages", msgs);
    } else {
        size_t pn = prefix ? strlen(prefix) : 0, un = strlen(unique);
        text = malloc(pn + un + 2);
        if (!text) {
            json_decref(root);
            free(unique);
            return NULL;
        }
        memcpy(text, prefix ? prefix : "", pn);
        if (pn)
            text[pn++] = ' ';
        memcpy(text + pn, unique, un + 1);
        json_object_set_new(root, "prompt", json_string(text));
    }
    json_object_set_new(root, "model", json_string(model));
    json_object_set_new(root, "max_tokens", json_integer(n_out));
    json_object_set_new(root, "temperature", json_real(o->temperature));
    json_object_set_new(root, "stream", json_boolean(o->stream));
    if (o->stream) {
        json_t *so = json_object();
        json_object_set_new(so, "include_usage", json_true());
        json_object_set_new(root, "stream_options", so);
    }
    if (o->ignore_eos) { // vLLM and llama.cpp extensions: generate exactly max_tokens
        json_object_set_new(root, "ignore_eos", json_true());
        json_object_set_new(root, "min_tokens", json_integer(n_out));
    }
    char *body = json_dumps(root, JSON_COMPACT | JSON_REAL_PRECISION(9));
    json_decref(root);
    free(text);
    free(unique);
    return body;
}
