/* The stop-string streamer: matches split across pieces, overlapping prefixes, UTF-8, flushing. */
#include "net/openai.h"
#include "sh_test.h"
#include "shoal/err.h"

/* Feeds the pieces and returns everything emitted (static buffer); *stopped tells the outcome. */
static const char *run(const char *const *stops, int n_stops, const char *const *pieces,
                       bool *stopped, int *max_hold)
{
    static char out[1024];
    size_t o = 0;
    sh_openai_stopper s;
    CHECK_OK(sh_openai_stopper_init(&s, stops, n_stops));
    *stopped = false;
    if (max_hold)
        *max_hold = 0;
    size_t fed = 0;
    for (int i = 0; pieces[i]; i++) {
        const char *p;
        size_t len;
        bool st;
        CHECK_OK(sh_openai_stopper_feed(&s, pieces[i], strlen(pieces[i]), &p, &len, &st));
        fed += strlen(pieces[i]);
        memcpy(out + o, p, len);
        o += len;
        if (max_hold && !st && (int)(fed - o) > *max_hold)
            *max_hold = (int)(fed - o);
        if (st)
            *stopped = true;
    }
    if (!*stopped) {
        const char *p;
        size_t len;
        sh_openai_stopper_flush(&s, &p, &len);
        memcpy(out + o, p, len);
        o += len;
    }
    out[o] = '\0';
    sh_openai_stopper_fini(&s);
    return out;
}

#define P(...) ((const char *const[]){__VA_ARGS__, NULL})

static void test_split_across_three(void)
{
    bool st;
    const char *stops[] = {"<END>"};
    CHECK_STR_EQ(run(stops, 1, P("Hello <E", "N", "D> tail"), &st, NULL), "Hello ");
    CHECK(st);
    CHECK_STR_EQ(run(stops, 1, P("a<", "EN", "D>"), &st, NULL), "a");
    CHECK(st);
}

static void test_no_stop_flushes_all(void)
{
    bool st;
    const char *stops[] = {"<END>"};
    /* A partial match at the very end is not a stop: flush emits it. */
    CHECK_STR_EQ(run(stops, 1, P("abc", "<EN"), &st, NULL), "abc<EN");
    CHECK(!st);
    /* A broken partial match is released as soon as it cannot match. */
    sh_openai_stopper s;
    CHECK_OK(sh_openai_stopper_init(&s, stops, 1));
    const char *p;
    size_t len;
    CHECK_OK(sh_openai_stopper_feed(&s, "x<E", 3, &p, &len, &st));
    CHECK_INT_EQ(len, 1);
    CHECK_OK(sh_openai_stopper_feed(&s, "Nx", 2, &p, &len, &st));
    CHECK_INT_EQ(len, 4);
    CHECK(strncmp(p, "<ENx", 4) == 0);
    sh_openai_stopper_fini(&s);
    /* Text that cannot start a stop string is never held. */
    int hold;
    CHECK_STR_EQ(run(stops, 1, P("plain ", "text ", "here"), &st, &hold), "plain text here");
    CHECK_INT_EQ(hold, 0);
}

static void test_overlapping_prefixes(void)
{
    bool st;
    /* "aab" inside "aaab": the naive restart after "aa" + "a" would miss it. */
    const char *s1[] = {"aab"};
    CHECK_STR_EQ(run(s1, 1, P("xa", "a", "a", "b", "zz"), &st, NULL), "xa");
    CHECK(st);
    /* Two stop strings sharing a prefix: the earliest match wins. */
    const char *s2[] = {"abcd", "bc"};
    CHECK_STR_EQ(run(s2, 2, P("_a", "b", "cd"), &st, NULL), "_"); /* "abcd" starts first */
    CHECK_STR_EQ(run(s2, 2, P("_a", "b", "ce"), &st, NULL), "_a");
    CHECK(st);
    const char *s3[] = {"ab", "abc"};
    CHECK_STR_EQ(run(s3, 2, P("1a", "bc"), &st, NULL), "1");
    CHECK(st);
    /* A repeated-character stop string. */
    const char *s4[] = {"\n\n"};
    CHECK_STR_EQ(run(s4, 1, P("line\n", "more\n", "\nafter"), &st, NULL), "line\nmore");
    CHECK(st);
}

static void test_stop_at_start(void)
{
    bool st;
    const char *stops[] = {"STOP"};
    CHECK_STR_EQ(run(stops, 1, P("STOP and more"), &st, NULL), "");
    CHECK(st);
    CHECK_STR_EQ(run(stops, 1, P("S", "T", "O", "P"), &st, NULL), "");
    CHECK(st);
    /* After a stop nothing more comes out. */
    sh_openai_stopper s;
    CHECK_OK(sh_openai_stopper_init(&s, stops, 1));
    const char *p;
    size_t len;
    CHECK_OK(sh_openai_stopper_feed(&s, "STOP", 4, &p, &len, &st));
    CHECK_OK(sh_openai_stopper_feed(&s, "again", 5, &p, &len, &st));
    CHECK(st);
    CHECK_INT_EQ(len, 0);
    CHECK_INT_EQ(s.which, 0);
    sh_openai_stopper_flush(&s, &p, &len);
    CHECK_INT_EQ(len, 0);
    sh_openai_stopper_fini(&s);
}

static void test_utf8(void)
{
    bool st;
    /* A multibyte stop string split inside its characters. */
    const char *stops[] = {"終わ"}; /* e7 b5 82 e3 82 8f */
    CHECK_STR_EQ(run(stops, 1, P("はい\xe7\xb5", "\x82\xe3", "\x82\x8f", "!"), &st, NULL), "はい");
    CHECK(st);
    /* A character sharing the lead byte of the stop string is released whole. */
    const char *s2[] = {"é"}; /* c3 a9 */
    int hold;
    CHECK_STR_EQ(run(s2, 1, P("caf\xc3", "\xa8", "s"), &st, &hold), "cafès");
    CHECK(!st);
    /* Emitted text never ends inside a character, even when a piece does. */
    sh_openai_stopper s;
    const char *none[] = {"zz"};
    CHECK_OK(sh_openai_stopper_init(&s, none, 1));
    const char *p;
    size_t len;
    CHECK_OK(sh_openai_stopper_feed(&s, "a\xe2\x82", 3, &p, &len, &st));
    CHECK_INT_EQ(len, 1);
    CHECK_OK(sh_openai_stopper_feed(&s, "\xac", 1, &p, &len, &st));
    CHECK_INT_EQ(len, 3);
    CHECK(memcmp(p, "\xe2\x82\xac", 3) == 0);
    sh_openai_stopper_fini(&s);
}

static void test_no_stops_and_limits(void)
{
    bool st;
    CHECK_STR_EQ(run(NULL, 0, P("a", "b"), &st, NULL), "ab");
    const char *empty[] = {""};
    int hold;
    CHECK_STR_EQ(run(empty, 1, P("a", "b"), &st, &hold), "ab");
    CHECK_INT_EQ(hold, 0);
    sh_openai_stopper s;
    const char *five[] = {"a", "b", "c", "d", "e"};
    CHECK_INT_EQ(sh_openai_stopper_init(&s, five, 5), SH_EINVAL);
    /* Random pieces of a long text with stops never emit a stop string, whatever the split. */
    const char *stops[] = {"abab", "ba"};
    const char *text = "xxabaxxababxx";
    for (unsigned seed = 1; seed < 200; seed++) {
        sh_openai_stopper t;
        CHECK_OK(sh_openai_stopper_init(&t, stops, 2));
        char out[64];
        size_t o = 0, i = 0, n = strlen(text);
        unsigned r = seed;
        bool stopped = false;
        while (i < n && !stopped) {
            r = r * 1103515245u + 12345u;
            size_t k = 1 + (r >> 16) % 3;
            if (k > n - i)
                k = n - i;
            const char *p;
            size_t len;
            CHECK_OK(sh_openai_stopper_feed(&t, text + i, k, &p, &len, &stopped));
            memcpy(out + o, p, len);
            o += len;
            i += k;
        }
        out[o] = '\0';
        CHECK(stopped);
        CHECK_STR_EQ(out, "xxa"); /* "ba" at offset 3 is the earliest match */
        sh_openai_stopper_fini(&t);
    }
}

static const sh_test_case tests[] = {
    {"split_across_three", test_split_across_three},
    {"no_stop_flushes_all", test_no_stop_flushes_all},
    {"overlapping_prefixes", test_overlapping_prefixes},
    {"stop_at_start", test_stop_at_start},
    {"utf8", test_utf8},
    {"no_stops_and_limits", test_no_stops_and_limits},
    {NULL, NULL},
};

int main(int argc, char **argv) { return sh_test_main(argc, argv, tests); }
