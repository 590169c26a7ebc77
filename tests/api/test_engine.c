/* The embedding API of include/shoal.h on the tiny real stories260K model (tests/data): the
 * engine against `shoal run`, concurrent and cancelled requests, misuse, the memory budget,
 * silence on stdout/stderr, and open/close cycles. */
#include <dirent.h>
#include <fcntl.h>
#include <jansson.h>
#include <poll.h>
#include <pthread.h>
#include <sched.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "sh_test.h"
#include "shoal.h"

#define MODEL "tests/data/stories260K/stories260K.gguf"
#define CHAT_MODEL "models/smollm2-135m-instruct-q4_1.gguf"
#define MAX_IDS 512

/* What the callbacks saw of one request. */
typedef struct seen {
    sh_engine *eng;
    int32_t ids[MAX_IDS];
    int32_t n_ids;
    char text[4096];
    size_t text_len;
    int n_token_calls, n_done, n_error;
    bool index_ok;
    sh_done_info done;
    sh_err code;
    char msg[256];
    /* re-entrancy probes */
    bool cancel_at_first;
    sh_err cancel_rc, cancel2_rc, poll_rc, close_rc, submit_rc;
    uint64_t child;
    struct seen *child_seen;
} seen;

static void on_token(void *user, uint64_t id, const sh_token_event *ev)
{
    (void)id;
    seen *s = user;
    if (ev->n_ids > 0 && ev->index != s->n_ids)
        s->index_ok = false;
    for (int32_t i = 0; i < ev->n_ids && s->n_ids < MAX_IDS; i++)
        s->ids[s->n_ids++] = ev->ids[i];
    if (s->text_len + ev->text_len < sizeof s->text) {
        memcpy(s->text + s->text_len, ev->text, ev->text_len);
        s->text_len += ev->text_len;
        s->text[s->text_len] = '\0';
    }
    if (s->n_token_calls++ == 0 && s->cancel_at_first) {
        s->poll_rc = sh_poll(s->eng, 0, NULL);
        s->close_rc = sh_engine_close(s->eng);
        s->cancel_rc = sh_cancel(s->eng, id, NULL);
        s->cancel2_rc = sh_cancel(s->eng, id, NULL);
        if (s->child_seen) {
            sh_request_opts r = sh_request_opts_default();
            r.prompt = "The dog";
            r.max_tokens = 4;
            sh_callbacks cb = {on_token, NULL, NULL};
            extern void test_on_done(void *, uint64_t, const sh_done_info *);
            extern void test_on_error(void *, uint64_t, sh_err, const char *);
            cb.on_done = test_on_done;
            cb.on_error = test_on_error;
            s->submit_rc = sh_submit(s->eng, &r, &cb, s->child_seen, &s->child, NULL);
        }
    }
}

void test_on_done(void *user, uint64_t id, const sh_done_info *info);
void test_on_done(void *user, uint64_t id, const sh_done_info *info)
{
    seen *s = user;
    s->n_done++;
    s->done = *info;
    // The request is over: its id is unknown from now on.
    s->cancel2_rc = sh_cancel(s->eng, id, NULL);
}

void test_on_error(void *user, uint64_t id, sh_err code, const char *msg);
void test_on_error(void *user, uint64_t id, sh_err code, const char *msg)
{
    (void)id;
    seen *s = user;
    s->n_error++;
    s->code = code;
    snprintf(s->msg, sizeof s->msg, "%s", msg ? msg : "(null)");
    if (s->eng) {
        uint64_t x = 0;
        sh_request_opts r = sh_request_opts_default();
        r.prompt = "x";
        sh_callbacks cb = {NULL, NULL, NULL};
        s->submit_rc = sh_submit(s->eng, &r, &cb, NULL, &x, NULL);
    }
}

static const sh_callbacks CB = {on_token, test_on_done, test_on_error};

static bool have_model(void)
{
    FILE *f = fopen(sh_test_path(MODEL), "rb");
    if (f)
        fclose(f);
    return f != NULL;
}

static sh_engine *open_tiny_seqs(int32_t threads, int32_t max_queue, int32_t max_seqs)
{
    sh_engine_opts o = sh_engine_opts_default();
    o.model_path = sh_test_path(MODEL);
    o.threads = threads;
    o.kv_bytes = 4u << 20;
    o.max_queue = max_queue;
    o.max_seqs = max_seqs;
    sh_engine *eng = NULL;
    sh_error e = {0};
    sh_err rc = sh_engine_open(&o, &eng, &e);
    if (rc)
        fprintf(stderr, "open: %s: %s\n", sh_strerror(rc), e.msg);
    CHECK_OK(rc);
    return eng;
}

static sh_engine *open_tiny(int32_t threads, int32_t max_queue)
{
    return open_tiny_seqs(threads, max_queue, 0);
}

static void init_seen(seen *s, sh_engine *eng)
{
    memset(s, 0, sizeof *s);
    s->eng = eng;
    s->index_ok = true;
}

/* Polls until every request of eng is over (or 120 s pass: sanitizer builds on a loaded machine
 * are slow). */
static void run_all(sh_engine *eng)
{
    for (int i = 0; i < 12000 && sh_pending(eng) > 0; i++)
        CHECK_OK(sh_poll(eng, 10, NULL));
    CHECK_INT_EQ(sh_pending(eng), 0);
}

static uint64_t submit_prompt(sh_engine *eng, const char *prompt, int32_t max_tokens, seen *s)
{
    sh_request_opts r = sh_request_opts_default();
    r.prompt = prompt;
    r.max_tokens = max_tokens;
    uint64_t id = 0;
    sh_error e = {0};
    sh_err rc = sh_submit(eng, &r, &CB, s, &id, &e);
    if (rc)
        fprintf(stderr, "submit: %s\n", e.msg);
    CHECK_OK(rc);
    CHECK(id != 0);
    return id;
}

/* `shoal run`'s greedy token ids for prompt (the real program, F16 KV as the engine). */
static int32_t run_ids(const char *prompt, int32_t n, int32_t *ids)
{
    const char *shoal = getenv("SH_SHOAL");
    if (!shoal)
        return -1;
    char cmd[2048];
    snprintf(cmd, sizeof cmd,
             "'%s' run -m '%s' -p '%s' -n %d --temp 0 --ids -t 1 --kv-f16 2>/dev/null", shoal,
             sh_test_path(MODEL), prompt, (int)n);
    FILE *p = popen(cmd, "r");
    if (!p)
        return -1;
    int32_t k = 0;
    int v;
    while (k < MAX_IDS && fscanf(p, "%d", &v) == 1)
        ids[k++] = v;
    return pclose(p) == 0 ? k : -1;
}

static void test_greedy_matches_run(void)
{
    static const char *const prompts[] = {"Once upon a time", "The little cat"};
    sh_engine *eng = open_tiny(1, 0);
    if (!eng)
        return;
    for (int i = 0; i < 2; i++) {
        int32_t want[MAX_IDS];
        int32_t n = run_ids(prompts[i], 40, want);
        CHECK(n > 8);
        seen s;
        init_seen(&s, eng);
        submit_prompt(eng, prompts[i], 40, &s);
        run_all(eng);
        CHECK_INT_EQ(s.n_done, 1);
        CHECK_INT_EQ(s.n_error, 0);
        CHECK(s.index_ok);
        CHECK_INT_EQ(s.n_ids, n);
        CHECK_INT_EQ(s.done.completion_tokens, n);
        CHECK_INT_EQ(s.done.finish, n == 40 ? SH_FINISH_LENGTH : SH_FINISH_STOP);
        for (int32_t k = 0; k < n && k < s.n_ids; k++)
            if (s.ids[k] != want[k]) {
                CHECK_INT_EQ(s.ids[k], want[k]);
                break;
            }
        // The streamed text is the detokenized ids.
        char text[4096];
        size_t len = 0;
        CHECK_OK(sh_detokenize(eng, s.ids, s.n_ids, text, sizeof text, &len, NULL));
        CHECK_UINT_EQ(len, s.text_len);
        CHECK(memcmp(text, s.text, len < s.text_len ? len : s.text_len) == 0);
        CHECK_INT_EQ(s.cancel2_rc, SH_ENOTFOUND);
    }
    CHECK_OK(sh_engine_close(eng));
}

static void test_concurrent_equal_alone(void)
{
    static const char *const prompts[4] = {"Once upon a time", "The little cat", "Tim and Sue",
                                           "One day, a big"};
    sh_engine *eng = open_tiny(2, 0);
    if (!eng)
        return;
    static seen alone[4], together[4];
    for (int i = 0; i < 4; i++) {
        init_seen(&alone[i], eng);
        submit_prompt(eng, prompts[i], 48, &alone[i]);
        run_all(eng);
    }
    for (int i = 0; i < 4; i++) {
        init_seen(&together[i], eng);
        submit_prompt(eng, prompts[i], 48, &together[i]);
    }
    CHECK_INT_EQ(sh_pending(eng), 4);
    run_all(eng);
    for (int i = 0; i < 4; i++) {
        CHECK_INT_EQ(together[i].n_done, 1);
        CHECK_INT_EQ(together[i].n_ids, alone[i].n_ids);
        CHECK(memcmp(together[i].ids, alone[i].ids, (size_t)alone[i].n_ids * 4) == 0);
        CHECK_STR_EQ(together[i].text, alone[i].text);
    }
    sh_engine_stats st;
    CHECK_OK(sh_engine_stats_get(eng, &st));
    CHECK_UINT_EQ(st.requests_total, 8);
    CHECK_INT_EQ(st.pending, 0);
    uint64_t toks = 0;
    for (int i = 0; i < 4; i++)
        toks += (uint64_t)(alone[i].n_ids + together[i].n_ids);
    CHECK_UINT_EQ(st.tokens_generated_total, toks);
    CHECK(st.kv_blocks_total > 0);
    CHECK_OK(sh_engine_close(eng));
}

/* A callback cancels its own request (re-entrantly, twice), submits another, and finds sh_poll
 * and sh_engine_close refused. */
static void test_cancel_reentrant(void)
{
    sh_engine *eng = open_tiny(1, 0);
    if (!eng)
        return;
    seen s, child;
    init_seen(&s, eng);
    init_seen(&child, eng);
    s.cancel_at_first = true;
    s.child_seen = &child;
    sh_request_opts r = sh_request_opts_default();
    r.prompt = "Once upon a time";
    r.max_tokens = 400;
    r.ignore_eos = true;
    uint64_t id = 0;
    CHECK_OK(sh_submit(eng, &r, &CB, &s, &id, NULL));
    run_all(eng);
    CHECK_INT_EQ(s.cancel_rc, SH_OK);
    CHECK_INT_EQ(s.cancel2_rc, SH_ENOTFOUND); /* overwritten by on_done: the id is over */
    CHECK_INT_EQ(s.poll_rc, SH_EBUSY);
    CHECK_INT_EQ(s.close_rc, SH_EBUSY);
    CHECK_INT_EQ(s.submit_rc, SH_OK);
    CHECK_INT_EQ(s.n_done, 1);
    CHECK_INT_EQ(s.n_error, 0);
    CHECK_INT_EQ(s.done.finish, SH_FINISH_CANCEL);
    CHECK(s.done.completion_tokens < 400);
    CHECK_INT_EQ(child.n_done, 1);
    CHECK(child.n_ids >= 1);
    CHECK(s.child != 0 && s.child != id);
    sh_error e = {0};
    CHECK_INT_EQ(sh_cancel(eng, id, &e), SH_ENOTFOUND);
    CHECK(strstr(e.msg, "no request") != NULL);
    CHECK_INT_EQ(sh_cancel(eng, 12345678, NULL), SH_ENOTFOUND);

    // Cancel from the host, twice, before any token was polled.
    init_seen(&s, eng);
    CHECK_OK(sh_submit(eng, &r, &CB, &s, &id, NULL));
    CHECK_OK(sh_cancel(eng, id, NULL));
    CHECK_INT_EQ(sh_cancel(eng, id, &e), SH_ECANCELED);
    run_all(eng);
    CHECK_INT_EQ(s.n_done + s.n_error, 1);
    CHECK_INT_EQ(s.done.finish, SH_FINISH_CANCEL);
    CHECK_OK(sh_engine_close(eng));
}

static void *poll_thread(void *arg)
{
    sh_engine *eng = arg;
    return (void *)(intptr_t)sh_poll(eng, 400, NULL);
}

static void sleep_ms(int ms)
{
    struct timespec ts = {ms / 1000, (long)(ms % 1000) * 1000000};
    nanosleep(&ts, NULL);
}

static void test_misuse(void)
{
    sh_error e = {0};
    sh_engine *out = (sh_engine *)&e;
    // Opening.
    CHECK_INT_EQ(sh_engine_open(NULL, &out, &e), SH_EINVAL);
    CHECK(out == NULL);
    sh_engine_opts o = sh_engine_opts_default();
    CHECK_INT_EQ(sh_engine_open(&o, NULL, &e), SH_EINVAL);
    CHECK_INT_EQ(sh_engine_open(&o, &out, &e), SH_EINVAL); /* no model, no script */
    CHECK(strstr(e.msg, "model_path") != NULL);
    o.model_path = sh_test_path(MODEL);
    o.cluster_script = "lua/cluster/x.lua";
    CHECK_INT_EQ(sh_engine_open(&o, &out, &e), SH_EINVAL); /* both */
    o.cluster_script = NULL;
    o.threads = -1;
    CHECK_INT_EQ(sh_engine_open(&o, &out, &e), SH_EINVAL);
    CHECK(strstr(e.msg, "threads") != NULL);
    o.threads = 1;
    o.struct_size = 0;
    CHECK_INT_EQ(sh_engine_open(&o, &out, &e), SH_EINVAL);
    CHECK(strstr(e.msg, "struct_size") != NULL);
    o = sh_engine_opts_default();
    o.model_path = "tests/data/no-such-model.gguf";
    CHECK(sh_engine_open(&o, &out, &e) != SH_OK);
    CHECK(out == NULL);
    CHECK(strstr(e.msg, "no-such-model") != NULL);
    // NULL engines.
    CHECK_INT_EQ(sh_engine_close(NULL), SH_OK);
    CHECK_INT_EQ(sh_poll(NULL, 0, NULL), SH_EINVAL);
    CHECK_INT_EQ(sh_fd(NULL), -1);
    CHECK_INT_EQ(sh_pending(NULL), 0);
    CHECK(sh_engine_fault(NULL) == NULL);
    sh_model_info mi;
    CHECK_INT_EQ(sh_model_info_get(NULL, &mi), SH_EINVAL);
    uint64_t id = 7;
    sh_request_opts r = sh_request_opts_default();
    r.prompt = "Once";
    CHECK_INT_EQ(sh_submit(NULL, &r, &CB, NULL, &id, &e), SH_EINVAL);
    CHECK_UINT_EQ(id, 0);
    CHECK_INT_EQ(sh_cancel(NULL, 1, &e), SH_EINVAL);

    sh_engine *eng = open_tiny_seqs(1, 2, 1);
    if (!eng)
        return;
    CHECK(sh_fd(eng) >= 0);
    CHECK_INT_EQ(sh_submit(eng, NULL, &CB, NULL, &id, &e), SH_EINVAL);
    CHECK_INT_EQ(sh_submit(eng, &r, NULL, NULL, &id, &e), SH_EINVAL);
    CHECK_INT_EQ(sh_submit(eng, &r, &CB, NULL, NULL, &e), SH_EINVAL);
    CHECK_INT_EQ(sh_model_info_get(eng, NULL), SH_EINVAL);
    // Prompt forms.
    static const int32_t toks[] = {1, 400, 401};
    static const sh_chat_message msgs[] = {{"user", "hi"}};
    sh_request_opts bad = r;
    bad.prompt_tokens = toks;
    bad.n_prompt_tokens = 3;
    CHECK_INT_EQ(sh_submit(eng, &bad, &CB, NULL, &id, &e), SH_EINVAL);
    CHECK(strstr(e.msg, "exactly one") != NULL);
    bad = sh_request_opts_default();
    CHECK_INT_EQ(sh_submit(eng, &bad, &CB, NULL, &id, &e), SH_EINVAL);
    CHECK(strstr(e.msg, "no prompt") != NULL);
    bad.prompt_tokens = toks;
    CHECK_INT_EQ(sh_submit(eng, &bad, &CB, NULL, &id, &e), SH_EINVAL); /* n_prompt_tokens 0 */
    bad.n_prompt_tokens = 3;
    int32_t oob[] = {1, 99999};
    bad.prompt_tokens = oob;
    bad.n_prompt_tokens = 2;
    CHECK_INT_EQ(sh_submit(eng, &bad, &CB, NULL, &id, &e), SH_EINVAL);
    CHECK(strstr(e.msg, "vocabulary") != NULL);
    bad = sh_request_opts_default();
    bad.messages = msgs;
    bad.n_messages = 1;
    CHECK_INT_EQ(sh_submit(eng, &bad, &CB, NULL, &id, &e), SH_EINVAL); /* no template */
    CHECK(strstr(e.msg, "chat template") != NULL);
    // Ranges.
#define BAD_FIELD(field, value, word)                                                              \
    do {                                                                                           \
        sh_request_opts rq_ = r;                                                                   \
        rq_.field = value;                                                                         \
        CHECK_INT_EQ(sh_submit(eng, &rq_, &CB, NULL, &id, &e), SH_EINVAL);                         \
        CHECK(strstr(e.msg, word) != NULL);                                                        \
        CHECK_UINT_EQ(id, 0);                                                                      \
    } while (0)
    BAD_FIELD(max_tokens, -1, "max_tokens");
    BAD_FIELD(temperature, 2.5f, "temperature");
    BAD_FIELD(temperature, NAN, "temperature");
    BAD_FIELD(top_p, 1.5f, "top_p");
    BAD_FIELD(top_k, -3, "top_k");
    BAD_FIELD(min_p, -0.1f, "min_p");
    BAD_FIELD(presence_penalty, 3.0f, "presence_penalty");
    BAD_FIELD(priority, 300, "priority");
    BAD_FIELD(top_logprobs, 21, "top_logprobs");
    BAD_FIELD(n_stop, 5, "n_stop");
    BAD_FIELD(struct_size, 0, "struct_size");
    // Invalid UTF-8: in the prompt (a lone continuation byte, an overlong form, a surrogate, a
    // cut sequence) and in a stop string.
    static const char *const bad_utf8[] = {"abc\x80", "\xC0\xAF", "\xED\xA0\x80", "ok \xE2\x82"};
    for (int i = 0; i < 4; i++)
        BAD_FIELD(prompt, bad_utf8[i], "UTF-8");
    const char *stops[] = {"\xFF"};
    sh_request_opts bs = r;
    bs.stop = stops;
    bs.n_stop = 1;
    CHECK_INT_EQ(sh_submit(eng, &bs, &CB, NULL, &id, &e), SH_EINVAL);
    CHECK(strstr(e.msg, "UTF-8") != NULL);
    // A prompt longer than the context (512 positions).
    static char longp[8192];
    for (size_t i = 0; i + 1 < sizeof longp; i++)
        longp[i] = "ab c"[i % 4];
    BAD_FIELD(prompt, longp, "context");
    CHECK_INT_EQ(sh_pending(eng), 0);

    // The queue: max_seqs 1 running and max_queue 2 waiting.
    seen s1, s2, s3;
    init_seen(&s1, eng);
    init_seen(&s2, eng);
    init_seen(&s3, eng);
    r.max_tokens = 8;
    uint64_t id1 = 0, id2 = 0, id3 = 0;
    CHECK_OK(sh_submit(eng, &r, &CB, &s1, &id1, &e));
    CHECK_OK(sh_submit(eng, &r, &CB, &s2, &id2, &e));
    CHECK_OK(sh_submit(eng, &r, &CB, &s3, &id3, &e));
    CHECK(id2 > id1 && id3 > id2);
    CHECK_INT_EQ(sh_submit(eng, &r, &CB, NULL, &id, &e), SH_EBUSY);
    CHECK(strstr(e.msg, "pending") != NULL);
    // Polling from a second thread while one polls: refused, as is closing meanwhile.
    run_all(eng);
    pthread_t th;
    pthread_create(&th, NULL, poll_thread, eng);
    sleep_ms(100);
    uint32_t ran = 99;
    CHECK_INT_EQ(sh_poll(eng, 0, &ran), SH_EBUSY);
    CHECK_UINT_EQ(ran, 0);
    CHECK_INT_EQ(sh_engine_close(eng), SH_EBUSY);
    void *trc = NULL;
    pthread_join(th, &trc);
    CHECK_INT_EQ((intptr_t)trc, SH_OK);
    // Nothing due: sh_poll waits its timeout and runs nothing.
    CHECK_OK(sh_poll(eng, 20, &ran));
    CHECK_UINT_EQ(ran, 0);
    CHECK_INT_EQ(s1.n_done, 1);
    CHECK_INT_EQ(sh_cancel(eng, id1, &e), SH_ENOTFOUND); /* a handle after its request ended */
    CHECK_OK(sh_engine_close(eng));
}

/* Closing with requests in flight: each ends with on_error(SH_ECLOSED) once, before close
 * returns; a submit from that callback is refused. */
static void test_close_in_flight(void)
{
    sh_engine *eng = open_tiny(1, 0);
    if (!eng)
        return;
    seen s[3];
    sh_request_opts r = sh_request_opts_default();
    r.prompt = "Once upon a time";
    r.max_tokens = 400;
    r.ignore_eos = true;
    for (int i = 0; i < 3; i++) {
        init_seen(&s[i], eng);
        uint64_t id;
        CHECK_OK(sh_submit(eng, &r, &CB, &s[i], &id, NULL));
    }
    CHECK_OK(sh_poll(eng, 50, NULL)); /* some tokens, maybe */
    CHECK_OK(sh_engine_close(eng));
    for (int i = 0; i < 3; i++) {
        CHECK_INT_EQ(s[i].n_error, 1);
        CHECK_INT_EQ(s[i].n_done, 0);
        CHECK_INT_EQ(s[i].code, SH_ECLOSED);
        CHECK_INT_EQ(s[i].submit_rc, SH_ECLOSED);
    }
}

/* A closed handle is refused by every call, a second close included, without touching the
 * freed engine (ASan would report a use after free); a pointer that never was an engine too. */
static void test_closed_handle(void)
{
    sh_engine *eng = open_tiny(1, 0);
    if (!eng)
        return;
    CHECK_OK(sh_engine_close(eng));
    sh_request_opts r = sh_request_opts_default();
    r.prompt = "Once";
    uint64_t id = 7;
    sh_error e = {0};
    CHECK_INT_EQ(sh_submit(eng, &r, &CB, NULL, &id, &e), SH_EINVAL);
    CHECK(strstr(e.msg, "not an open engine") != NULL);
    CHECK(id == 0);
    CHECK_INT_EQ(sh_cancel(eng, 1, &e), SH_EINVAL);
    CHECK_INT_EQ(sh_poll(eng, 0, NULL), SH_EINVAL);
    CHECK_INT_EQ(sh_fd(eng), -1);
    CHECK_INT_EQ(sh_pending(eng), 0);
    sh_model_info mi;
    CHECK_INT_EQ(sh_model_info_get(eng, &mi), SH_EINVAL);
    int32_t ids[8], n = 0;
    CHECK_INT_EQ(sh_tokenize(eng, "Once", 4, true, false, ids, 8, &n, &e), SH_EINVAL);
    char text[64];
    size_t len = 0;
    CHECK_INT_EQ(sh_detokenize(eng, ids, 0, text, sizeof text, &len, &e), SH_EINVAL);
    sh_chat_message m = {"user", "hi"};
    CHECK_INT_EQ(sh_chat_apply(eng, &m, 1, text, sizeof text, &len, &e), SH_EINVAL);
    sh_engine_stats st;
    CHECK_INT_EQ(sh_engine_stats_get(eng, &st), SH_EINVAL);
    CHECK_INT_EQ(sh_metrics_snapshot(eng, text, sizeof text, &len), SH_EINVAL);
    CHECK(sh_engine_fault(eng) == NULL);
    CHECK_INT_EQ(sh_engine_close(eng), SH_EINVAL);
    int not_an_engine = 0;
    CHECK_INT_EQ(sh_poll((sh_engine *)&not_an_engine, 0, NULL), SH_EINVAL);
    CHECK_INT_EQ(sh_engine_close((sh_engine *)&not_an_engine), SH_EINVAL);
}

/* The placement options reach every thread the engine starts: the CPU backend's pool and queue
 * threads and the runtime's loop and watchdog threads (a host that keeps its own thread off the
 * engine's CPUs needs all of them there, not only the compute threads). Linux only. */
static void test_thread_placement(void)
{
#ifdef __linux__
    int before[128], n_before = 0;
    DIR *d = opendir("/proc/self/task");
    struct dirent *de;
    while (d && (de = readdir(d)) && n_before < 128)
        if (de->d_name[0] != '.')
            before[n_before++] = atoi(de->d_name);
    if (d)
        closedir(d);
    sh_engine_opts o = sh_engine_opts_default();
    o.model_path = sh_test_path(MODEL);
    o.threads = 2;
    o.kv_bytes = 4u << 20;
    o.cpu_mask = 1;
    o.sched = SH_ENGINE_SCHED_IDLE;
    o.no_spin = 1;
    sh_engine *eng = NULL;
    sh_error e = {0};
    CHECK_OK(sh_engine_open(&o, &eng, &e));
    if (!eng)
        return;
    int placed = 0;
    d = opendir("/proc/self/task");
    while (d && (de = readdir(d))) {
        const int tid = atoi(de->d_name);
        bool old = de->d_name[0] == '.';
        for (int i = 0; i < n_before && !old; i++)
            old = before[i] == tid;
        if (old)
            continue;
        cpu_set_t set;
        CHECK(sched_getaffinity(tid, sizeof set, &set) == 0);
        if (CPU_COUNT(&set) != 1 || !CPU_ISSET(0, &set) || sched_getscheduler(tid) != SCHED_IDLE)
            SH_FAIL_("engine thread %d: %d CPUs, policy %d (want CPU 0 only, SCHED_IDLE)", tid,
                     CPU_COUNT(&set), sched_getscheduler(tid));
        placed++;
    }
    if (d)
        closedir(d);
    /* pool helper, queue thread, the runtime's loop and its watchdog */
    CHECK(placed >= 4);
    CHECK_INT_EQ(sched_getscheduler(0), SCHED_OTHER); /* the host's thread is left alone */
    /* and it still generates */
    seen s;
    init_seen(&s, eng);
    sh_request_opts r = sh_request_opts_default();
    r.prompt = "Once upon a time";
    r.max_tokens = 8;
    uint64_t id;
    CHECK_OK(sh_submit(eng, &r, &CB, &s, &id, NULL));
    for (int i = 0; i < 500 && !s.n_done && !s.n_error; i++)
        CHECK_OK(sh_poll(eng, 20, NULL));
    CHECK_INT_EQ(s.n_done, 1);
    CHECK_OK(sh_engine_close(eng));
#endif
}

static void test_memory_budget(void)
{
    sh_engine_opts o = sh_engine_opts_default();
    o.model_path = sh_test_path(MODEL);
    o.memory_budget = 100000; /* the weights alone take about 1 MB */
    sh_engine *eng = (sh_engine *)&o;
    sh_error e = {0};
    CHECK_INT_EQ(sh_engine_open(&o, &eng, &e), SH_ENOMEM);
    CHECK(eng == NULL);
    CHECK(strstr(e.msg, "100000") != NULL && strstr(e.msg, "weights") != NULL);
    // Weights and an explicit KV size over the budget: both figures named.
    o.memory_budget = 2u << 20;
    o.kv_bytes = 8u << 20;
    CHECK_INT_EQ(sh_engine_open(&o, &eng, &e), SH_ENOMEM);
    CHECK(strstr(e.msg, "2097152") != NULL && strstr(e.msg, "KV") != NULL);
    // Without a KV size the default fits what the weights leave.
    o.kv_bytes = 0;
    CHECK_OK(sh_engine_open(&o, &eng, &e));
    if (!eng)
        return;
    sh_model_info mi;
    CHECK_OK(sh_model_info_get(eng, &mi));
    CHECK(mi.weight_bytes + mi.kv_bytes <= o.memory_budget);
    CHECK(mi.kv_bytes > 0);
    CHECK_INT_EQ(mi.n_vocab, 512);
    CHECK_INT_EQ(mi.n_layers, 5);
    CHECK_INT_EQ(mi.dim, 64);
    CHECK_INT_EQ(mi.n_ctx, mi.n_ctx_train < 8192 ? mi.n_ctx_train : 8192);
    CHECK_STR_EQ(mi.arch, "llama");
    CHECK_STR_EQ(mi.weight_type, "F32");
    CHECK(mi.n_params > 200000 && mi.n_params < 400000);
    CHECK(!mi.has_chat_template);
    CHECK_OK(sh_engine_close(eng));
}

static void test_tokenizer_and_metrics(void)
{
    sh_engine *eng = open_tiny(1, 0);
    if (!eng)
        return;
    sh_error e = {0};
    const char *text = "Once upon a time";
    int32_t n = 0, ids[64];
    CHECK_INT_EQ(sh_tokenize(eng, text, strlen(text), true, false, NULL, 0, &n, &e), SH_ERANGE);
    CHECK(n > 2);
    int32_t need = n;
    CHECK_OK(sh_tokenize(eng, text, strlen(text), true, false, ids, 64, &n, &e));
    CHECK_INT_EQ(n, need);
    sh_model_info mi;
    CHECK_OK(sh_model_info_get(eng, &mi));
    CHECK_INT_EQ(ids[0], mi.bos);
    char out[256];
    size_t len = 0;
    CHECK_INT_EQ(sh_detokenize(eng, ids + 1, n - 1, out, 2, &len, &e), SH_ERANGE);
    CHECK_OK(sh_detokenize(eng, ids + 1, n - 1, out, sizeof out, &len, &e));
    CHECK(len >= strlen(text) && strstr(out, text) != NULL);
    int32_t badid = 100000;
    CHECK_INT_EQ(sh_detokenize(eng, &badid, 1, out, sizeof out, &len, &e), SH_EINVAL);
    CHECK_INT_EQ(sh_tokenize(eng, "\xC3(", 2, false, false, ids, 64, &n, &e), SH_EINVAL);
    CHECK_INT_EQ(sh_tokenize(eng, NULL, 3, false, false, ids, 64, &n, &e), SH_EINVAL);
    static const sh_chat_message msgs[] = {{"user", "hi"}};
    CHECK_INT_EQ(sh_chat_apply(eng, msgs, 1, out, sizeof out, &len, &e), SH_EUNSUPPORTED);

    seen s;
    init_seen(&s, eng);
    submit_prompt(eng, text, 6, &s);
    run_all(eng);
    sh_engine_stats st;
    CHECK_OK(sh_engine_stats_get(eng, &st));
    CHECK_UINT_EQ(st.requests_total, 1);
    CHECK_UINT_EQ(st.prompt_tokens_total, (uint64_t)need);
    CHECK_UINT_EQ(st.tokens_generated_total, (uint64_t)s.n_ids);
    static char m[1 << 16];
    CHECK_INT_EQ(sh_metrics_snapshot(eng, m, 16, &len), SH_ERANGE);
    CHECK(len > 16);
    CHECK_OK(sh_metrics_snapshot(eng, m, sizeof m, &len));
    CHECK(strstr(m, "shoal_kv_blocks_total") != NULL);
    CHECK(strstr(m, "shoal_generation_tokens_total") != NULL);
    struct sh_fault *f = sh_engine_fault(eng);
    CHECK(f != NULL);
    CHECK(sh_engine_fault(eng) == f);
    CHECK_OK(sh_engine_close(eng));
}

/* The chat template of the default model (skipped without it). */
static void test_chat(void)
{
    FILE *fp = fopen(sh_test_path(CHAT_MODEL), "rb");
    if (!fp) {
        fprintf(stderr, "  (chat: %s absent, not checked)\n", CHAT_MODEL);
        return;
    }
    fclose(fp);
    sh_engine_opts o = sh_engine_opts_default();
    o.model_path = sh_test_path(CHAT_MODEL);
    o.kv_bytes = 8u << 20;
    o.threads = 1;
    sh_engine *eng = NULL;
    CHECK_OK(sh_engine_open(&o, &eng, NULL));
    if (!eng)
        return;
    static const sh_chat_message msgs[] = {{"system", "Be brief."}, {"user", "Say hi."}};
    char out[1024];
    size_t len = 0;
    CHECK_OK(sh_chat_apply(eng, msgs, 2, out, sizeof out, &len, NULL));
    CHECK_STR_EQ(out, "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nSay "
                      "hi.<|im_end|>\n<|im_start|>assistant\n");
    static const sh_chat_message badrole[] = {{"robot", "x"}};
    sh_error e = {0};
    CHECK_INT_EQ(sh_chat_apply(eng, badrole, 1, out, sizeof out, &len, &e), SH_EINVAL);
    seen s;
    init_seen(&s, eng);
    sh_request_opts r = sh_request_opts_default();
    r.messages = msgs;
    r.n_messages = 2;
    r.max_tokens = 2;
    uint64_t id;
    CHECK_OK(sh_submit(eng, &r, &CB, &s, &id, &e));
    static const sh_chat_message badutf[] = {{"user", "\xF5x"}};
    r.messages = badutf;
    r.n_messages = 1;
    CHECK_INT_EQ(sh_submit(eng, &r, &CB, NULL, &id, &e), SH_EINVAL);
    run_all(eng);
    CHECK_INT_EQ(s.n_done, 1);
    CHECK(s.n_ids >= 1);
    int32_t n = 0;
    CHECK_OK(sh_chat_apply(eng, msgs, 2, out, sizeof out, &len, NULL));
    CHECK_INT_EQ(sh_tokenize(eng, out, len, false, true, NULL, 0, &n, NULL), SH_ERANGE);
    CHECK_INT_EQ(s.done.prompt_tokens, n);
    sh_model_info mi;
    CHECK_OK(sh_model_info_get(eng, &mi));
    CHECK(mi.has_chat_template);
    CHECK_STR_EQ(mi.weight_type, "Q4_1");
    CHECK_OK(sh_engine_close(eng));
}

/* Open, submit, poll to the end, close: 100 times (the ASan suite checks for leaks). */
static void test_open_close_100(void)
{
    for (int i = 0; i < 100; i++) {
        sh_engine *eng = open_tiny(1, 0);
        if (!eng)
            return;
        seen s;
        init_seen(&s, eng);
        submit_prompt(eng, "Once upon a time", 2, &s);
        if (i % 2 == 0)
            run_all(eng); /* every other one closes with its request in flight */
        CHECK_OK(sh_engine_close(eng));
        CHECK_INT_EQ(s.n_done + s.n_error, 1);
    }
}

static void count_line(void *user, int level, const char *line)
{
    (void)level;
    if (line && line[0])
        __atomic_add_fetch((int *)user, 1, __ATOMIC_RELAXED);
}

/* Nothing on stdout or stderr from open, requests, errors and close; log lines go to the log
 * callback when one is given. */
static void test_silent(void)
{
    fflush(stdout);
    fflush(stderr);
    char path[] = "/tmp/shoal-engine-silent-XXXXXX";
    int fd = mkstemp(path);
    CHECK(fd >= 0);
    if (fd < 0)
        return;
    int save1 = dup(1), save2 = dup(2);
    dup2(fd, 1);
    dup2(fd, 2);
    sh_engine_opts o = sh_engine_opts_default();
    o.model_path = "tests/data/no-such-model.gguf";
    sh_engine *eng = NULL;
    sh_err bad = sh_engine_open(&o, &eng, NULL);
    eng = open_tiny(1, 0);
    seen s;
    init_seen(&s, eng);
    if (eng) {
        submit_prompt(eng, "Once upon a time", 12, &s);
        run_all(eng);
        submit_prompt(eng, "Once upon a time", 300, &s);
        sh_engine_close(eng);
    }
    int lines = 0;
    o.model_path = sh_test_path(MODEL);
    o.kv_bytes = 4u << 20;
    o.log = count_line;
    o.log_user = &lines;
    o.log_level = SH_ENGINE_LOG_DEBUG;
    eng = NULL;
    sh_err good = sh_engine_open(&o, &eng, NULL);
    sh_engine_close(eng);
    fflush(stdout);
    fflush(stderr);
    dup2(save1, 1);
    dup2(save2, 2);
    close(save1);
    close(save2);
    off_t size = lseek(fd, 0, SEEK_END);
    close(fd);
    unlink(path);
    CHECK(bad != SH_OK);
    CHECK_INT_EQ(good, SH_OK);
    CHECK_INT_EQ(size, 0);
    CHECK(lines > 0);
}

static void write_text(const char *path, const char *text)
{
    FILE *f = fopen(path, "w");
    CHECK(f != NULL);
    if (f) {
        fputs(text, f);
        fclose(f);
    }
}

/* A cluster script whose one replica runs in this process is served like a model path, with the
 * script's model name and settings; a script the cluster check refuses (a stage on the front's
 * node beside a worker's) gets SH_EINVAL and a broken one SH_ELUA. Scripts with worker nodes are
 * served as a front: test_cluster_front. */
static void test_cluster_script(void)
{
    char dir[] = "/tmp/shoal-engine-script-XXXXXX";
    CHECK(mkdtemp(dir) != NULL);
    char path[128], src[2048];
    snprintf(path, sizeof path, "%s/c.lua", dir);
    snprintf(src, sizeof src,
             "local m = model { path = '%s', name = 'tiny-stories' }\n"
             "return cluster {\n"
             "  nodes = { node { name = 'local', listen = 'inproc://local' } },\n"
             "  gateway = { node = 'local', http = '127.0.0.1:8080' },\n"
             "  replicas = { replica { model = m, stages = pipeline(m, { 'local' }) } },\n"
             "  batcher = { max_seqs = 4 },\n"
             "  kv = { memory = '4MiB' },\n"
             "}\n",
             sh_test_path(MODEL));
    write_text(path, src);
    sh_engine_opts o = sh_engine_opts_default();
    o.cluster_script = path;
    o.threads = 1;
    sh_engine *eng = NULL;
    sh_error e = {0};
    CHECK_OK(sh_engine_open(&o, &eng, &e));
    if (eng) {
        sh_model_info mi;
        CHECK_OK(sh_model_info_get(eng, &mi));
        CHECK_STR_EQ(mi.name, "tiny-stories");
        CHECK(mi.kv_bytes <= (4u << 20) && mi.kv_bytes > (3u << 20));
        seen s;
        init_seen(&s, eng);
        submit_prompt(eng, "Once upon a time", 8, &s);
        run_all(eng);
        CHECK_INT_EQ(s.n_done, 1);
        CHECK(s.n_ids >= 1);
        CHECK_OK(sh_engine_close(eng));
    }
    // A worker script the cluster check refuses (a stage on the front's node beside a worker's).
    snprintf(src, sizeof src,
             "local m = model { path = '%s', name = 'stories' }\n"
             "return cluster {\n"
             "  nodes = { node { name = 'a', listen = 'ipc://%s/a' },\n"
             "            node { name = 'b', listen = 'ipc://%s/b' } },\n"
             "  gateway = { node = 'a', http = '127.0.0.1:8080' },\n"
             "  replicas = { replica { model = m, stages = pipeline(m, { 'a', 'b' }) } },\n"
             "}\n",
             sh_test_path(MODEL), dir, dir);
    write_text(path, src);
    eng = (sh_engine *)&o;
    CHECK_INT_EQ(sh_engine_open(&o, &eng, &e), SH_EINVAL);
    CHECK(eng == NULL);
    CHECK(strstr(e.msg, "runs the gateway and a stage") != NULL);
    write_text(path, "return cluster { nodes = 3 +\n");
    eng = (sh_engine *)&o;
    CHECK_INT_EQ(sh_engine_open(&o, &eng, &e), SH_ELUA);
    CHECK(eng == NULL);
    CHECK(strstr(e.msg, "c.lua") != NULL);
    unlink(path);
    rmdir(dir);
}

/* Runs the workers w0 and w1 of a script (replicas: its replicas{} text) as real `shoal node`
 * processes, opens an engine on it (the front, over ipc://), submits n requests of want's prompt
 * and checks that each one's greedy output equals want's. */
static void front_run(const char *replicas, int n, const seen *want)
{
    const char *shoal = getenv("SH_SHOAL");
    char dir[] = "/tmp/shoal-engine-front-XXXXXX";
    CHECK(mkdtemp(dir) != NULL);
    char path[128], src[2048];
    snprintf(path, sizeof path, "%s/c.lua", dir);
    snprintf(src, sizeof src,
             "local m = model { path = '%s', name = 'stories' }\n"
             "return cluster {\n"
             "  nodes = { node { name = 'front', listen = 'ipc://%s/front' },\n"
             "            node { name = 'w0', listen = 'ipc://%s/w0' },\n"
             "            node { name = 'w1', listen = 'ipc://%s/w1' } },\n"
             "  gateway = { node = 'front', http = '127.0.0.1:8080' },\n"
             "  replicas = { %s },\n"
             "  batcher = { max_seqs = 4 },\n"
             "  kv = { memory = '4MiB' },\n"
             "}\n",
             sh_test_path(MODEL), dir, dir, dir, replicas);
    write_text(path, src);
    pid_t workers[2];
    for (int i = 0; i < 2; i++) {
        workers[i] = fork();
        if (workers[i] == 0) {
            int null = open("/dev/null", O_WRONLY);
            dup2(null, 1);
            dup2(null, 2);
            execl(shoal, shoal, "node", "-c", path, "--name", i ? "w1" : "w0", "-t", "1",
                  (char *)NULL);
            _exit(127);
        }
        CHECK(workers[i] > 0);
    }
    sh_engine_opts o = sh_engine_opts_default();
    o.cluster_script = path;
    sh_engine *eng = NULL;
    sh_error e = {0};
    sh_err rc = sh_engine_open(&o, &eng, &e);
    if (rc)
        fprintf(stderr, "open: %s\n", e.msg);
    CHECK_OK(rc);
    if (eng) {
        sh_model_info mi;
        CHECK_OK(sh_model_info_get(eng, &mi));
        CHECK_STR_EQ(mi.name, "stories");
        CHECK_UINT_EQ(mi.weight_bytes, 0);
        CHECK_INT_EQ(mi.n_layers, 5);
        static seen s[4];
        for (int i = 0; i < n; i++) {
            init_seen(&s[i], eng);
            submit_prompt(eng, "Once upon a time", 24, &s[i]);
        }
        run_all(eng);
        uint64_t toks = 0;
        for (int i = 0; i < n; i++) {
            CHECK_INT_EQ(s[i].n_done, 1);
            CHECK_INT_EQ(s[i].n_ids, want->n_ids);
            CHECK(memcmp(s[i].ids, want->ids, (size_t)want->n_ids * 4) == 0);
            CHECK_STR_EQ(s[i].text, want->text);
            toks += (uint64_t)s[i].n_ids;
        }
        sh_engine_stats st;
        CHECK_OK(sh_engine_stats_get(eng, &st));
        CHECK(st.kv_blocks_total > 0);
        CHECK_UINT_EQ(st.tokens_generated_total, toks);
        struct sh_fault *f = sh_engine_fault(eng);
        CHECK(f != NULL);
        CHECK_OK(sh_engine_close(eng));
    }
    for (int i = 0; i < 2; i++) {
        if (workers[i] <= 0)
            continue;
        kill(workers[i], SIGTERM);
        int st = 0;
        waitpid(workers[i], &st, 0);
    }
    unlink(path);
    char sock[160];
    static const char *const names[] = {"front", "w0", "w1"};
    for (int i = 0; i < 3; i++) {
        snprintf(sock, sizeof sock, "%s/%s", dir, names[i]);
        unlink(sock);
    }
    rmdir(dir);
}

/* The front of a real cluster: `shoal node` worker processes hold the model (its two halves in a
 * pipeline; or a whole replica each, behind the front's router), and the engine's greedy output
 * equals the model run in this process. */
static void test_cluster_front(void)
{
    if (!getenv("SH_SHOAL")) {
        fprintf(stderr, "  (cluster_front: SH_SHOAL unset, not checked)\n");
        return;
    }
    sh_engine *local = open_tiny(1, 0);
    if (!local)
        return;
    seen want;
    init_seen(&want, local);
    submit_prompt(local, "Once upon a time", 24, &want);
    run_all(local);
    CHECK_OK(sh_engine_close(local));
    front_run("replica { model = m, stages = pipeline(m, { 'w0', 'w1' }) }", 2, &want);
    front_run("replica { model = m, stages = pipeline(m, { 'w0' }) }, "
              "replica { model = m, stages = pipeline(m, { 'w1' }) }",
              4, &want);
}

/* What a token event carried beyond ids and text (logprobs), for test_request_options. */
typedef struct lp_seen {
    seen s;
    int n_lp, n_top, top_n;
    bool lp_ok;
} lp_seen;

static void on_token_lp(void *user, uint64_t id, const sh_token_event *ev)
{
    lp_seen *l = user;
    on_token(&l->s, id, ev);
    if (ev->n_ids == 0)
        return;
    if (ev->logprobs) {
        l->n_lp += ev->n_ids;
        for (int32_t i = 0; i < ev->n_ids; i++)
            if (!(ev->logprobs[i] <= 0.0f))
                l->lp_ok = false;
    }
    if (ev->top_n) {
        l->top_n = ev->top_n;
        l->n_top += ev->n_ids;
        // The first alternative is the most likely token; greedy picked it.
        if (!ev->top_ids || ev->top_ids[0] != ev->ids[0] || !ev->top_logprobs ||
            ev->top_logprobs[0] < ev->top_logprobs[ev->top_n - 1])
            l->lp_ok = false;
    }
}

static void on_done_lp(void *user, uint64_t id, const sh_done_info *info)
{
    test_on_done(&((lp_seen *)user)->s, id, info);
}

static void on_error_lp(void *user, uint64_t id, sh_err code, const char *msg)
{
    test_on_error(&((lp_seen *)user)->s, id, code, msg);
}

/* The request fields beyond the prompt: logprobs and their alternatives, stop strings (the text
 * ends before them), a timeout (finish DEADLINE), seeded sampling (the same seed, the same
 * text) and the priority field. */
static void test_request_options(void)
{
    sh_engine *eng = open_tiny(1, 0);
    if (!eng)
        return;
    static const sh_callbacks lcb = {on_token_lp, on_done_lp, on_error_lp};
    sh_request_opts r = sh_request_opts_default();
    r.prompt = "Once upon a time";
    r.max_tokens = 12;
    lp_seen plain, lp;
    memset(&plain, 0, sizeof plain);
    memset(&lp, 0, sizeof lp);
    init_seen(&plain.s, eng);
    init_seen(&lp.s, eng);
    plain.lp_ok = lp.lp_ok = true;
    uint64_t id;
    CHECK_OK(sh_submit(eng, &r, &lcb, &plain, &id, NULL));
    r.logprobs = true;
    r.top_logprobs = 3;
    r.priority = 7;
    CHECK_OK(sh_submit(eng, &r, &lcb, &lp, &id, NULL));
    run_all(eng);
    CHECK_INT_EQ(plain.n_lp + plain.n_top, 0);
    CHECK_INT_EQ(lp.n_lp, lp.s.n_ids);
    CHECK_INT_EQ(lp.n_top, lp.s.n_ids);
    CHECK_INT_EQ(lp.top_n, 3);
    CHECK(lp.lp_ok);
    CHECK_STR_EQ(lp.s.text, plain.s.text);

    // A stop string from the middle of the greedy text: the text ends just before it.
    const char *cut = plain.s.text_len > 8 ? strchr(plain.s.text + 4, ' ') : NULL;
    CHECK(cut != NULL);
    if (cut) {
        char stop[8];
        snprintf(stop, sizeof stop, "%.4s", cut);
        const char *stops[] = {stop};
        sh_request_opts rs = sh_request_opts_default();
        rs.prompt = r.prompt;
        rs.max_tokens = 12;
        rs.stop = stops;
        rs.n_stop = 1;
        seen s;
        init_seen(&s, eng);
        CHECK_OK(sh_submit(eng, &rs, &CB, &s, &id, NULL));
        run_all(eng);
        CHECK_INT_EQ(s.done.finish, SH_FINISH_STOP);
        CHECK_UINT_EQ(s.text_len, (size_t)(cut - plain.s.text));
        CHECK(strncmp(s.text, plain.s.text, s.text_len) == 0);
    }

    // A timeout ends a long request with finish DEADLINE.
    sh_request_opts rt = sh_request_opts_default();
    rt.prompt = r.prompt;
    rt.max_tokens = 2000;
    rt.ignore_eos = true;
    rt.timeout_ms = 30;
    seen st;
    init_seen(&st, eng);
    CHECK_OK(sh_submit(eng, &rt, &CB, &st, &id, NULL));
    run_all(eng);
    CHECK_INT_EQ(st.n_done, 1);
    CHECK_INT_EQ(st.done.finish, SH_FINISH_DEADLINE);
    CHECK(st.done.completion_tokens < 2000);

    // Sampling: one seed gives one text; the default (seed 0) is a seed like any other.
    seen a, b;
    init_seen(&a, eng);
    init_seen(&b, eng);
    sh_request_opts rr = sh_request_opts_default();
    rr.prompt = r.prompt;
    rr.max_tokens = 24;
    rr.temperature = 1.0f;
    rr.top_k = 40;
    rr.seed = 1234;
    CHECK_OK(sh_submit(eng, &rr, &CB, &a, &id, NULL));
    CHECK_OK(sh_submit(eng, &rr, &CB, &b, &id, NULL));
    run_all(eng);
    CHECK_INT_EQ(a.n_ids, b.n_ids);
    CHECK(memcmp(a.ids, b.ids, (size_t)a.n_ids * 4) == 0);

    // typical_p and a whole-context penalty window sample (and reproduce); bad values refused.
    rr.typical_p = 0.5f;
    rr.repeat_penalty = 1.3f;
    rr.repeat_last_n = -1;
    init_seen(&a, eng);
    init_seen(&b, eng);
    CHECK_OK(sh_submit(eng, &rr, &CB, &a, &id, NULL));
    CHECK_OK(sh_submit(eng, &rr, &CB, &b, &id, NULL));
    run_all(eng);
    CHECK_INT_EQ(a.n_done + b.n_done, 2);
    CHECK(a.n_ids > 0 && a.n_ids == b.n_ids && memcmp(a.ids, b.ids, (size_t)a.n_ids * 4) == 0);
    sh_error e = {0};
    rr.typical_p = 1.5f;
    CHECK_INT_EQ(sh_submit(eng, &rr, &CB, &a, &id, &e), SH_EINVAL);
    CHECK(strstr(e.msg, "typical_p") != NULL);
    rr.typical_p = 0;
    rr.repeat_last_n = -2;
    CHECK_INT_EQ(sh_submit(eng, &rr, &CB, &a, &id, &e), SH_EINVAL);
    CHECK(strstr(e.msg, "repeat_last_n") != NULL);
    rr.repeat_last_n = 0;
    rr.min_tokens = -1;
    CHECK_INT_EQ(sh_submit(eng, &rr, &CB, &a, &id, &e), SH_EINVAL);
    CHECK(strstr(e.msg, "min_tokens") != NULL);

    // (min_tokens masking is checked in test_serve_sampling: this model's stories end with BOS,
    // which its GGUF does not call end-of-sequence, so there is nothing here to mask.)
    CHECK_OK(sh_engine_close(eng));
}

/* sh_fd is readable while callbacks are due, and only then (a host's epoll or select loop). */
static void test_fd_readable(void)
{
    sh_engine *eng = open_tiny(1, 0);
    if (!eng)
        return;
    int fd = sh_fd(eng);
    CHECK(fd >= 0);
    struct pollfd p = {.fd = fd, .events = POLLIN};
    CHECK_INT_EQ(poll(&p, 1, 0), 0); /* nothing due */
    seen s;
    init_seen(&s, eng);
    submit_prompt(eng, "Once upon a time", 6, &s);
    int32_t rounds = 0;
    while (sh_pending(eng) > 0 && rounds < 1000) {
        int n = poll(&p, 1, 5000);
        CHECK_INT_EQ(n, 1);
        if (n != 1)
            break;
        uint32_t ran = 0;
        CHECK_OK(sh_poll(eng, 0, &ran));
        rounds++;
    }
    CHECK_INT_EQ(s.n_done, 1);
    CHECK(rounds >= 1);
    CHECK_INT_EQ(poll(&p, 1, 0), 0); /* drained */
    CHECK_OK(sh_engine_close(eng));
}

/* The value of metric `name` (first sample) in a Prometheus text, or -1. */
static double metric_value(const char *text, const char *name)
{
    size_t n = strlen(name);
    for (const char *p = text; (p = strstr(p, name)) != NULL; p += n)
        if ((p == text || p[-1] == '\n') && p[n] == ' ')
            return strtod(p + n + 1, NULL);
    return -1;
}

/* Speculative decoding through the C API (opts.spec, spec_k, request no_spec, spec_n_max): bad
 * values fail the open; greedy ids with n-gram drafts equal an engine without them, drafts are
 * accepted on a prompt that repeats itself (some steps carry several), a request with no_spec
 * drafts nothing, one with spec_n_max 1 the same ids with one draft in every drafting step, and
 * a spec_n_max outside 0..16 fails sh_submit. Needs a stage that verifies drafts
 * (actors/stage.c). */
static void test_spec(void)
{
    sh_engine_opts o = sh_engine_opts_default();
    o.model_path = sh_test_path(MODEL);
    o.threads = 1;
    o.kv_bytes = 4u << 20;
    sh_engine *eng = NULL;
    sh_error e = {0};
    o.spec = 2;
    CHECK_INT_EQ(sh_engine_open(&o, &eng, &e), SH_EINVAL);
    CHECK(strstr(e.msg, "opts.spec") != NULL);
    o.spec = SH_ENGINE_SPEC_NGRAM;
    o.spec_k = 17;
    CHECK_INT_EQ(sh_engine_open(&o, &eng, &e), SH_EINVAL);
    CHECK(strstr(e.msg, "opts.spec_k") != NULL);
    static const char *const prompts[] = {
        ("Once upon a time, there was a little girl named Lily. Once upon a time, there was a "
         "little girl named Lily. Once upon a time, there was"),
        "The little cat", "Tim and Sue went to the park. Tim and Sue went to the"};
    enum { NP = 3 };
    static seen off[NP], on[NP], opt_out;
    sh_engine *plain = open_tiny(1, 0);
    if (!plain)
        return;
    for (int i = 0; i < NP; i++) {
        init_seen(&off[i], plain);
        submit_prompt(plain, prompts[i], 48, &off[i]);
        run_all(plain);
    }
    CHECK_OK(sh_engine_close(plain));
    o.spec_k = 4;
    CHECK_OK(sh_engine_open(&o, &eng, &e));
    if (!eng)
        return;
    for (int i = 0; i < NP; i++) {
        init_seen(&on[i], eng);
        submit_prompt(eng, prompts[i], 48, &on[i]);
        run_all(eng);
        CHECK_INT_EQ(on[i].n_done, 1);
        CHECK_INT_EQ(on[i].n_ids, off[i].n_ids);
        CHECK(memcmp(on[i].ids, off[i].ids, (size_t)off[i].n_ids * 4) == 0);
        CHECK_STR_EQ(on[i].text, off[i].text);
    }
    static char m[1 << 16];
    size_t len = 0;
    CHECK_OK(sh_metrics_snapshot(eng, m, sizeof m, &len));
    double drafted = metric_value(m, "shoal_spec_draft_tokens_total");
    double steps = metric_value(m, "shoal_spec_drafts_total");
    CHECK(drafted > 0);
    /* Uncapped, some steps carry more than one draft. The batcher's k follows the measured step
     * costs, so on a loaded machine (ASan beside other tests) a run may draft one token a step
     * throughout: the repetitive prompt is run again, up to 10 times in all, each run checked
     * against the plain output. */
    for (int run = 1; run < 10 && !(drafted > steps); run++) {
        static seen again;
        init_seen(&again, eng);
        submit_prompt(eng, prompts[0], 48, &again);
        run_all(eng);
        CHECK_INT_EQ(again.n_ids, off[0].n_ids);
        CHECK(memcmp(again.ids, off[0].ids, (size_t)off[0].n_ids * 4) == 0);
        CHECK_OK(sh_metrics_snapshot(eng, m, sizeof m, &len));
        drafted = metric_value(m, "shoal_spec_draft_tokens_total");
        steps = metric_value(m, "shoal_spec_drafts_total");
    }
    if (!(drafted > steps))
        SH_FAIL_("uncapped speculation: %g drafted tokens in %g drafting steps", drafted, steps);
    CHECK(metric_value(m, "shoal_spec_accepted_tokens_total") > 0);
    sh_request_opts r = sh_request_opts_default();
    r.prompt = prompts[0];
    r.max_tokens = 48;
    r.no_spec = true;
    uint64_t id = 0;
    init_seen(&opt_out, eng);
    CHECK_OK(sh_submit(eng, &r, &CB, &opt_out, &id, &e));
    run_all(eng);
    CHECK_INT_EQ(opt_out.n_ids, off[0].n_ids);
    CHECK(memcmp(opt_out.ids, off[0].ids, (size_t)off[0].n_ids * 4) == 0);
    CHECK_OK(sh_metrics_snapshot(eng, m, sizeof m, &len));
    CHECK(metric_value(m, "shoal_spec_draft_tokens_total") == drafted);
    static seen capped;
    r.no_spec = false;
    r.spec_n_max = 1;
    init_seen(&capped, eng);
    CHECK_OK(sh_submit(eng, &r, &CB, &capped, &id, &e));
    run_all(eng);
    CHECK_INT_EQ(capped.n_ids, off[0].n_ids);
    CHECK(memcmp(capped.ids, off[0].ids, (size_t)off[0].n_ids * 4) == 0);
    CHECK_OK(sh_metrics_snapshot(eng, m, sizeof m, &len));
    double d_steps = metric_value(m, "shoal_spec_drafts_total") - steps;
    double d_toks = metric_value(m, "shoal_spec_draft_tokens_total") - drafted;
    if (!(d_steps > 0 && d_toks == d_steps))
        SH_FAIL_("spec_n_max 1: %g drafted tokens in %g drafting steps", d_toks, d_steps);
    for (int bad = 0; bad < 2; bad++) {
        r.spec_n_max = bad ? -1 : 17;
        CHECK_INT_EQ(sh_submit(eng, &r, &CB, &capped, &id, &e), SH_EINVAL);
        CHECK(strstr(e.msg, "spec_n_max") != NULL);
    }
    CHECK_OK(sh_engine_close(eng));
}

/* Structured output through the C API (sh_request_opts.grammar, response_format): a greedy
 * request under a GBNF grammar gives text the grammar accepts (checked here by hand) and ends
 * with it (finish STOP); response_format's JSON schema gives a JSON object that the schema
 * accepts (parsed with jansson); a grammar with a syntax error, both fields at once, a
 * response_format that is not JSON and a schema keyword outside the coverage each fail sh_submit
 * with SH_EINVAL naming the problem (the grammar's line and column). */
static void test_grammar(void)
{
    sh_engine *eng = open_tiny(1, 0);
    if (!eng)
        return;
    static seen g, j;
    sh_request_opts r = sh_request_opts_default();
    r.prompt = "Once upon a time";
    r.max_tokens = 96;
    r.grammar = "root ::= (\" \" [a-z]{1,10}){3,6} \".\"";
    uint64_t id = 0;
    sh_error e = {0};
    init_seen(&g, eng);
    CHECK_OK(sh_submit(eng, &r, &CB, &g, &id, &e));
    run_all(eng);
    CHECK_INT_EQ(g.n_done, 1);
    CHECK_INT_EQ(g.done.finish, SH_FINISH_STOP);
    /* Three to six words of 1 to 10 lowercase letters, each after a space, then a full stop. */
    int words = 0, letters = 0;
    bool ok = g.text_len > 0 && g.text[g.text_len - 1] == '.';
    for (size_t i = 0; ok && i + 1 < g.text_len; i++) {
        char c = g.text[i];
        if (c == ' ') {
            ok = i == 0 || letters > 0;
            words++;
            letters = 0;
        } else {
            ok = c >= 'a' && c <= 'z' && words > 0 && ++letters <= 10;
        }
    }
    if (!(ok && letters > 0 && words >= 3 && words <= 6))
        SH_FAIL_("grammar output %s does not follow the grammar", g.text);

    r.grammar = NULL;
    r.max_tokens = 160; /* at most 20 white-space characters between tokens: it ends before */
    r.response_format = "{\"type\":\"json_schema\",\"json_schema\":{\"schema\":{\"type\":"
                        "\"object\",\"properties\":{\"n\":{\"type\":\"integer\",\"minimum\":0,"
                        "\"maximum\":9}},\"required\":[\"n\"]}}}";
    init_seen(&j, eng);
    CHECK_OK(sh_submit(eng, &r, &CB, &j, &id, &e));
    run_all(eng);
    CHECK_INT_EQ(j.n_done, 1);
    CHECK_INT_EQ(j.done.finish, SH_FINISH_STOP);
    json_error_t je;
    json_t *v = json_loads(j.text, 0, &je);
    json_t *n = json_object_get(v, "n");
    if (!json_is_object(v) || json_object_size(v) != 1 || !json_is_integer(n) ||
        json_integer_value(n) < 0 || json_integer_value(n) > 9)
        SH_FAIL_("response_format output %s does not follow the schema", j.text);
    json_decref(v);

    r.response_format = NULL;
    r.grammar = "root ::= \"a\"\nb ::= [a-";
    CHECK_INT_EQ(sh_submit(eng, &r, &CB, &j, &id, &e), SH_EINVAL);
    if (!strstr(e.msg, "line 2") || !strstr(e.msg, "column"))
        SH_FAIL_("a bad grammar's error names no line and column: %s", e.msg);
    r.grammar = "root ::= \"a\"";
    r.response_format = "{\"type\":\"json_object\"}";
    CHECK_INT_EQ(sh_submit(eng, &r, &CB, &j, &id, &e), SH_EINVAL);
    CHECK(strstr(e.msg, "together") != NULL);
    r.grammar = NULL;
    r.response_format = "{\"type\":";
    CHECK_INT_EQ(sh_submit(eng, &r, &CB, &j, &id, &e), SH_EINVAL);
    CHECK(strstr(e.msg, "not JSON") != NULL);
    r.response_format = "{\"type\":\"json_schema\",\"json_schema\":{\"schema\":{\"type\":"
                        "\"string\",\"if\":{}}}}";
    CHECK_INT_EQ(sh_submit(eng, &r, &CB, &j, &id, &e), SH_EINVAL);
    CHECK(strstr(e.msg, "'if'") != NULL);
    CHECK_INT_EQ(sh_pending(eng), 0);
    CHECK_OK(sh_engine_close(eng));
}

int main(int argc, char **argv)
{
    if (!have_model()) {
        fprintf(stderr, "skipped: %s absent\n", MODEL);
        return SH_TEST_SKIP;
    }
    static const sh_test_case tests[] = {{"greedy_matches_run", test_greedy_matches_run},
                                         {"concurrent_equal_alone", test_concurrent_equal_alone},
                                         {"cancel_reentrant", test_cancel_reentrant},
                                         {"misuse", test_misuse},
                                         {"request_options", test_request_options},
                                         {"fd_readable", test_fd_readable},
                                         {"close_in_flight", test_close_in_flight},
                                         {"closed_handle", test_closed_handle},
                                         {"thread_placement", test_thread_placement},
                                         {"memory_budget", test_memory_budget},
                                         {"tokenizer_and_metrics", test_tokenizer_and_metrics},
                                         {"chat", test_chat},
                                         {"open_close_100", test_open_close_100},
                                         {"silent", test_silent},
                                         {"cluster_script", test_cluster_script},
                                         {"cluster_front", test_cluster_front},
                                         {"spec", test_spec},
                                         {"grammar", test_grammar},
                                         {NULL, NULL}};
    return sh_test_main(argc, argv, tests);
}
