/* An edge gateway: answers requests read from stdin (one prompt per line) with a model running
 * in this process, and sends a request to a remote cluster instead when the local queue is long
 * (sh_pending() of the local engine at or above --threshold). The remote is another engine,
 * opened on a cluster script (include/shoal.h: cluster_script), whose nodes run elsewhere.
 *
 * One thread, one poll() over stdin and both engines' sh_fd(). Every answer is printed as one
 * line: "<n>\t<local|remote>\t<finish>\t<text>", n being the input line number (from 1).
 * When the cluster cannot be opened the gateway says so once, on stderr and in its summary, and
 * answers everything locally: the fallback is reported unavailable, never pretended.
 *
 * Usage: edge_gateway -m MODEL [--cluster SCRIPT] [--threshold N] [--threads N]
 *                     [--max-tokens T] < prompts.txt */
#define _POSIX_C_SOURCE 200809L

#include <errno.h>
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <shoal.h>

typedef struct answer {
    long line;  /* input line number */
    int remote; /* 1: sent to the cluster */
    char *text; /* grown as tokens come */
    size_t len;
} answer;

typedef struct gateway {
    long answered, failed, local_n, remote_n;
} gateway;

static void on_token(void *user, uint64_t id, const sh_token_event *ev)
{
    answer *a = (answer *)user;
    (void)id;
    char *p = (char *)realloc(a->text, a->len + ev->text_len + 1);
    if (!p)
        return;
    memcpy(p + a->len, ev->text, ev->text_len);
    a->len += ev->text_len;
    p[a->len] = '\0';
    a->text = p;
}

static gateway G;

static void print_answer(answer *a, const char *finish)
{
    for (size_t i = 0; i < a->len; i++)
        if (a->text[i] == '\n' || a->text[i] == '\t')
            a->text[i] = ' ';
    printf("%ld\t%s\t%s\t%s\n", a->line, a->remote ? "remote" : "local", finish,
           a->text ? a->text : "");
    fflush(stdout);
    free(a->text);
    free(a);
}

static void on_done(void *user, uint64_t id, const sh_done_info *info)
{
    static const char *const why[] = {"stop", "length", "cancel", "deadline", "tool_calls"};
    (void)id;
    G.answered++;
    print_answer((answer *)user, why[info->finish]);
}

static void on_error(void *user, uint64_t id, sh_err code, const char *message)
{
    answer *a = (answer *)user;
    (void)id;
    fprintf(stderr, "edge_gateway: line %ld (%s) failed: %s: %s\n", a->line,
            a->remote ? "remote" : "local", sh_strerror(code), message);
    G.failed++;
    print_answer(a, "error");
}

static int submit(sh_engine *eng, answer *a, const char *prompt, int max_tokens)
{
    sh_request_opts r = sh_request_opts_default();
    sh_chat_message m[1];
    m[0].role = "user";
    m[0].content = prompt;
    r.messages = m;
    r.n_messages = 1;
    r.max_tokens = max_tokens;
    sh_callbacks cb = {on_token, on_done, on_error};
    uint64_t id;
    sh_error err;
    if (sh_submit(eng, &r, &cb, a, &id, &err) != SH_OK) {
        fprintf(stderr, "edge_gateway: line %ld: %s\n", a->line, err.msg);
        return -1;
    }
    return 0;
}

int main(int argc, char **argv)
{
    const char *model = getenv("SHOAL_MODEL"), *cluster = NULL;
    int threshold = 2, threads = 1, max_tokens = 24;
    for (int i = 1; i < argc; i++) {
        const char *v = i + 1 < argc ? argv[i + 1] : NULL;
        if (strcmp(argv[i], "-m") == 0 && v) {
            model = v;
        } else if (strcmp(argv[i], "--cluster") == 0 && v) {
            cluster = v;
        } else if (strcmp(argv[i], "--threshold") == 0 && v) {
            threshold = atoi(v);
        } else if (strcmp(argv[i], "--threads") == 0 && v) {
            threads = atoi(v);
        } else if (strcmp(argv[i], "--max-tokens") == 0 && v) {
            max_tokens = atoi(v);
        } else {
            fprintf(stderr, "usage: edge_gateway -m MODEL [--cluster SCRIPT] [--threshold N] "
                            "[--threads N] [--max-tokens T] < prompts\n");
            return 2;
        }
        i++;
    }
    if (!model || threshold < 1) {
        fprintf(stderr, "edge_gateway: need -m MODEL (or SHOAL_MODEL) and --threshold >= 1\n");
        return 2;
    }

    sh_error err;
    sh_engine_opts o = sh_engine_opts_default();
    o.model_path = model;
    o.threads = threads;
    sh_engine *local = NULL, *remote = NULL;
    if (sh_engine_open(&o, &local, &err) != SH_OK) {
        fprintf(stderr, "edge_gateway: cannot open %s: %s\n", model, err.msg);
        return 1;
    }
    const char *fallback = "none (no --cluster)";
    char why[400];
    if (cluster) {
        sh_engine_opts c = sh_engine_opts_default();
        c.cluster_script = cluster;
        if (sh_engine_open(&c, &remote, &err) != SH_OK) {
            snprintf(why, sizeof why, "unavailable: %s: %s", sh_strerror(err.code), err.msg);
            fallback = why;
            fprintf(stderr, "edge_gateway: remote fallback %s; answering everything locally\n",
                    why);
            remote = NULL;
        } else {
            fallback = cluster;
        }
    }

    char line[4096];
    size_t have = 0;
    long lineno = 0;
    int eof = 0, rc = 0, skipping = 0; /* skipping: the rest of an over-long line */
    while (!eof || sh_pending(local) > 0 || (remote && sh_pending(remote) > 0)) {
        struct pollfd fds[3];
        nfds_t n = 0;
        fds[n].fd = sh_fd(local);
        fds[n++].events = POLLIN;
        if (remote) {
            fds[n].fd = sh_fd(remote);
            fds[n++].events = POLLIN;
        }
        if (!eof) {
            fds[n].fd = STDIN_FILENO;
            fds[n++].events = POLLIN;
        }
        if (poll(fds, n, 1000) < 0 && errno != EINTR) {
            perror("edge_gateway: poll");
            rc = 1;
            break;
        }
        sh_poll(local, 0, NULL);
        if (remote)
            sh_poll(remote, 0, NULL);
        if (eof || !(fds[n - 1].revents & (POLLIN | POLLHUP)))
            continue;
        ssize_t got = read(STDIN_FILENO, line + have, sizeof line - 1 - have);
        if (got <= 0) {
            if (got < 0 && errno == EINTR)
                continue;
            eof = 1;
            if (have == 0)
                continue;
            line[have++] = '\n'; /* a last line without its newline */
        } else {
            have += (size_t)got;
        }
        /* Submit every complete line. */
        char *start = line, *nl;
        while ((nl = (char *)memchr(start, '\n', have - (size_t)(start - line))) != NULL) {
            *nl = '\0';
            lineno++;
            if (skipping) {
                skipping = 0;
            } else if (*start) {
                answer *a = (answer *)calloc(1, sizeof *a);
                if (!a) {
                    rc = 1;
                    break;
                }
                a->line = lineno;
                /* The routing decision: the local queue's length. */
                a->remote = remote && sh_pending(local) >= threshold;
                if (submit(a->remote ? remote : local, a, start, max_tokens) != 0) {
                    G.failed++;
                    free(a);
                } else if (a->remote) {
                    G.remote_n++;
                } else {
                    G.local_n++;
                }
            }
            start = nl + 1;
        }
        have -= (size_t)(start - line);
        memmove(line, start, have);
        if (have == sizeof line - 1) {
            fprintf(stderr, "edge_gateway: line %ld is longer than %zu bytes: dropped\n",
                    lineno + 1, sizeof line - 1);
            have = 0;
            skipping = 1;
            G.failed++;
        }
    }
    fprintf(stderr,
            "edge_gateway: %ld answered (%ld local, %ld remote), %ld failed; remote fallback: "
            "%s\n",
            G.answered, G.local_n, G.remote_n, G.failed, fallback);
    sh_engine_close(remote);
    sh_engine_close(local);
    return rc || G.failed ? 1 : 0;
}
