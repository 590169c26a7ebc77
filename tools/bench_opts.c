/* `shoal bench`'s command line: the usage text and the options, checked. */
#include <errno.h>
#include <stdarg.h>
#include <stdlib.h>
#include <string.h>

#include "base/error.h"
#include "tools/bench.h"
#include "tools/cmd_util.h"

void sh__bench_opts_usage(FILE *f)
{
    fprintf(
        f,
        "usage: shoal bench [--url URL] [--model NAME] [--endpoint completions|chat]\n"
        "                   [-c N] [-n N] [--prompt-tokens DIST] [--output-tokens DIST]\n"
        "                   [--shared-prefix N] [--seed S] [--api-key KEY] [--no-stream]\n"
        "                   [--temperature T] [--ignore-eos] [--json FILE] [--timeout S]\n"
        "                   [--warmup N] [--quiet]\n\n"
        "Load-tests an OpenAI-compatible server (shoal serve, vLLM, llama.cpp's llama-server)\n"
        "with synthetic prompts over N concurrent keep-alive HTTP/1.1 connections, then reports\n"
        "throughput, time to first token (TTFT), time per output token (TPOT), inter-token\n"
        "gaps (ITL) and end-to-end latency.\n\n"
        "  --url URL             http://HOST[:PORT][/PREFIX] (default http://127.0.0.1:8080)\n"
        "  --model NAME          model to ask for (default: the first id from GET /v1/models)\n"
        "  --endpoint E          completions (/v1/completions, default) or chat\n"
        "                        (/v1/chat/completions)\n"
        "  -c, --concurrency N   requests in flight at once, one connection each (default 8)\n"
        "  -n, --requests N      measured requests (default 64)\n"
        "  --prompt-tokens DIST  words of each prompt, about one token each: N, or A:B for a\n"
        "                        uniform draw (default 128)\n"
        "  --output-tokens DIST  max_tokens of each request: N or A:B (default 128)\n"
        "  --shared-prefix N     N words every prompt starts with (the system message with\n"
        "                        chat), before its own --prompt-tokens words (default 0)\n"
        "  --seed S              seed of the prompts and lengths (default 0)\n"
        "  --api-key KEY         sent as `Authorization: Bearer KEY`\n"
        "  --no-stream           ask for whole responses (TTFT is then the whole latency)\n"
        "  --temperature T       sampling temperature (default 0)\n"
        "  --ignore-eos          ask for exactly max_tokens tokens (sends ignore_eos and\n"
        "                        min_tokens, which vLLM and llama.cpp honour)\n"
        "  --json FILE           also write the report as JSON; `-` writes it to stdout and\n"
        "                        the text report to stderr\n"
        "  --timeout S           seconds allowed per request (default 600)\n"
        "  --warmup N            requests to send first, not measured (default 0)\n"
        "  --quiet               no progress on stderr\n\n"
        "Exit status: 0 when the run finished (even with some failed requests), 1 when every\n"
        "request failed or the server could not be asked for its models, 2 on bad options,\n"
        "130 when interrupted (the report then covers the requests that completed).\n");
}

/* DIST: `N` or `A:B` with lo <= A <= B <= hi. */
static bool parse_dist(const char *s, int32_t lo, int32_t hi, sh__bench_dist *d)
{
    char a[32];
    const char *colon = strchr(s, ':');
    int64_t x, y;
    if (!colon)
        return sh__cmd_parse_i64(s, lo, hi, &x) && ((d->lo = d->hi = (int32_t)x), true);
    size_t n = (size_t)(colon - s);
    if (n == 0 || n >= sizeof a)
        return false;
    memcpy(a, s, n);
    a[n] = '\0';
    if (!sh__cmd_parse_i64(a, lo, hi, &x) || !sh__cmd_parse_i64(colon + 1, lo, hi, &y) || x > y)
        return false;
    d->lo = (int32_t)x;
    d->hi = (int32_t)y;
    return true;
}

int sh__bench_opts_parse(int argc, char **argv, sh__bench_opts *o)
{
    *o = (sh__bench_opts){
        .url = "http://127.0.0.1:8080",
        .stream = true,
        .concurrency = 8,
        .requests = 64,
        .prompt_tokens = {128, 128},
        .output_tokens = {128, 128},
        .timeout_s = 600,
    };
    for (int i = 1; i < argc; i++) {
        char name[64];
        const char *a = argv[i], *v = NULL, *eq = strchr(a, '=');
        if (strncmp(a, "--", 2) == 0 && eq) { // --opt=value
            size_t n = (size_t)(eq - a);
            if (n >= sizeof name)
                return sh__cmd_fail("unknown option '%s' (see shoal bench --help)", a);
            memcpy(name, a, n);
            name[n] = '\0';
            a = name;
            v = eq + 1;
        }
        if (!strcmp(a, "-h") || !strcmp(a, "--help")) {
            sh__bench_opts_usage(stdout);
            return 1;
        }
        bool *flag = !strcmp(a, "--ignore-eos") ? &o->ignore_eos
                     : !strcmp(a, "--quiet")    ? &o->quiet
                                                : NULL;
        if (flag || !strcmp(a, "--no-stream")) {
            if (v)
                return sh__cmd_fail("option '%s' takes no value", a);
            if (flag)
                *flag = true;
            else
                o->stream = false;
            continue;
        }
        if (a[0] != '-')
            return sh__cmd_fail("unexpected argument '%s' (see shoal bench --help)", a);
        static const char *const known[] = {"--url",
                                            "--model",
                                            "--endpoint",
                                            "-c",
                                            "--concurrency",
                                            "-n",
                                            "--requests",
                                            "--prompt-tokens",
                                            "--output-tokens",
                                            "--shared-prefix",
                                            "--seed",
                                            "--api-key",
                                            "--temperature",
                                            "--json",
                                            "--timeout",
                                            "--warmup",
                                            NULL};
        bool is_known = false;
        for (int k = 0; known[k]; k++)
            is_known |= !strcmp(a, known[k]);
        if (!is_known)
            return sh__cmd_fail("unknown option '%s' (see shoal bench --help)", a);
        if (!v) {
            if (i + 1 >= argc)
                return sh__cmd_fail("option '%s' needs a value", a);
            v = argv[++i];
        }
        int64_t n;
        bool ok = true;
        if (!strcmp(a, "--url"))
            o->url = v;
        else if (!strcmp(a, "--model"))
            ok = *v && ((o->model = v), true);
        else if (!strcmp(a, "--endpoint"))
            ok = (!strcmp(v, "completions") || !strcmp(v, "chat")) &&
                 ((o->chat = !strcmp(v, "chat")), true);
        else if (!strcmp(a, "-c") || !strcmp(a, "--concurrency"))
            ok = sh__cmd_parse_i64(v, 1, 4096, &n) && ((o->concurrency = (int32_t)n), true);
        else if (!strcmp(a, "-n") || !strcmp(a, "--requests"))
            ok = sh__cmd_parse_i64(v, 1, 100000000, &n) && ((o->requests = n), true);
        else if (!strcmp(a, "--warmup"))
            ok = sh__cmd_parse_i64(v, 0, 100000000, &n) && ((o->warmup = n), true);
        else if (!strcmp(a, "--prompt-tokens"))
            ok = parse_dist(v, 1, 1 << 20, &o->prompt_tokens);
        else if (!strcmp(a, "--output-tokens"))
            ok = parse_dist(v, 1, 1 << 20, &o->output_tokens);
        else if (!strcmp(a, "--shared-prefix"))
            ok = sh__cmd_parse_i64(v, 0, 1 << 20, &n) && ((o->shared_prefix = (int32_t)n), true);
        else if (!strcmp(a, "--seed"))
            ok = sh__cmd_parse_i64(v, 0, INT64_MAX, &n) && ((o->seed = (uint64_t)n), true);
        else if (!strcmp(a, "--api-key"))
            ok = *v && !strpbrk(v, "\r\n") && ((o->api_key = v), true);
        else if (!strcmp(a, "--temperature"))
            ok = sh__cmd_parse_f64(v, 0.0, 100.0, &o->temperature);
        else if (!strcmp(a, "--json"))
            ok = *v && ((o->json_path = v), true);
        else if (!strcmp(a, "--timeout"))
            ok = sh__cmd_parse_f64(v, 0.001, 1e6, &o->timeout_s);
        if (!ok)
            return sh__cmd_fail("bad value '%s' for %s", v, a);
    }
    return 0;
}
