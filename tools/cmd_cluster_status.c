/* `shoal cluster status [URL]`: fetches a serving process's GET /admin/cluster over plain
 * HTTP/1.1 and prints the cluster's nodes, stages and load as tables (tools/cluster_status.h). */
#include <errno.h>
#include <fcntl.h>
#include <http_parser.h>
#include <jansson.h>
#include <netdb.h>
#include <poll.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#include "shoal/version.h"
#include "tools/cluster_status.h"
#include "tools/cmd_util.h"

#define DEFAULT_URL "http://127.0.0.1:8080"
#define KEY_ENV "SHOAL_API_KEY"
#define MAX_ANSWER (16u << 20)

static void usage(FILE *f)
{
    fprintf(f, "usage: shoal cluster status [URL] [--api-key KEY] [--json] [--timeout S]\n\n"
               "Asks a running `shoal serve` (a cluster's front, or a single process) for its\n"
               "topology and load (GET URL/admin/cluster) and prints: every node (role, URL,\n"
               "whether it joined, its link's state: self, up, down or connecting, reconnects,\n"
               "the link's last error), every stage with its node and layer range [first, last),\n"
               "and each replica's load (running and waiting requests, KV blocks used/total,\n"
               "steps and tokens so far).\n\n"
               "  URL            the server's HTTP address (default " DEFAULT_URL "; the port\n"
               "                 defaults to 8080, the scheme to http://)\n"
               "  --api-key KEY  the bearer key when the server requires keys (default: the\n"
               "                 first key of " KEY_ENV ", without :PRIORITY, :admin)\n"
               "  --json         print the server's JSON document as it came\n"
               "  --timeout S    seconds to connect and read the answer (default 10)\n\n"
               "Exit status: 0, 2 when the server cannot be reached or refuses the key (one\n"
               "`error:` line naming the URL) or on bad usage, 1 when the answer is not a status\n"
               "document.\n");
}

/* ---- the request -------------------------------------------------------------------------- */

typedef struct target {
    char url[512];  /* as given, for messages */
    char host[256]; /* without brackets */
    char port[8];
    char path[512]; /* the URL's path without a trailing '/', then /admin/cluster */
} target;

/* Splits [http://]HOST[:PORT][/PATH] into t; 2 with an error line for anything else. */
static int parse_url(const char *url, target *t)
{
    snprintf(t->url, sizeof t->url, "%s", url);
    const char *p = url;
    const char *scheme = strstr(url, "://");
    if (scheme) {
        if (scheme - url != 4 || strncmp(url, "http", 4))
            return sh__cmd_fail("%s: only http:// URLs are supported (plain HTTP/1.1)", url);
        p = scheme + 3;
    }
    const char *host = p, *host_end;
    if (*p == '[') { /* [::1]:8080 */
        host = p + 1;
        host_end = strchr(host, ']');
        if (!host_end)
            return sh__cmd_fail("%s: an IPv6 address needs its closing ']'", url);
        p = host_end + 1;
    } else {
        host_end = p + strcspn(p, ":/");
        p = host_end;
    }
    if (host_end == host || (size_t)(host_end - host) >= sizeof t->host)
        return sh__cmd_fail("%s: no host in the URL (want http://HOST:PORT)", url);
    memcpy(t->host, host, (size_t)(host_end - host));
    t->host[host_end - host] = '\0';
    snprintf(t->port, sizeof t->port, "8080");
    if (*p == ':') {
        size_t n = strcspn(p + 1, "/");
        char buf[16] = "";
        int64_t port = 0;
        if (n < sizeof buf)
            memcpy(buf, p + 1, n), buf[n] = '\0';
        if (!n || n >= sizeof buf || !sh__cmd_parse_i64(buf, 1, 65535, &port))
            return sh__cmd_fail("%s: the port must be a number from 1 to 65535", url);
        snprintf(t->port, sizeof t->port, "%d", (int)port);
        p += 1 + n;
    }
    if (*p && *p != '/')
        return sh__cmd_fail("%s: not a URL (want http://HOST:PORT)", url);
    size_t plen = strlen(p);
    while (plen && p[plen - 1] == '/')
        plen--;
    for (size_t i = 0; i < plen; i++)
        if ((unsigned char)p[i] <= ' ' || p[i] == 0x7f)
            return sh__cmd_fail("%s: the URL's path contains a space or control character", url);
    if (plen + sizeof "/admin/cluster" > sizeof t->path)
        return sh__cmd_fail("%s: the URL is too long", url);
    snprintf(t->path, sizeof t->path, "%.*s/admin/cluster", (int)plen, p);
    return 0;
}

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

/* Waits until fd is ready for `events` or the deadline passes; false on timeout. */
static bool wait_fd(int fd, short events, double deadline)
{
    for (;;) {
        double left = deadline - now_s();
        if (left <= 0)
            return false;
        struct pollfd pfd = {.fd = fd, .events = events};
        int r = poll(&pfd, 1, (int)(left * 1000.0) + 1);
        if (r > 0)
            return true;
        if (r < 0 && errno != EINTR)
            return true; /* the next call on fd reports the error */
    }
}

/* Connects to any address of t's host (non-blocking, within the deadline). Returns the socket,
 * or -1 with why in err. */
static int dial(const target *t, double deadline, char *err, size_t cap)
{
    struct addrinfo hints = {.ai_family = AF_UNSPEC, .ai_socktype = SOCK_STREAM}, *ai = NULL;
    int gai = getaddrinfo(t->host, t->port, &hints, &ai);
    if (gai) {
        snprintf(err, cap, "cannot resolve %s: %s", t->host, gai_strerror(gai));
        return -1;
    }
    int fd = -1;
    snprintf(err, cap, "no address for %s", t->host);
    for (struct addrinfo *a = ai; a && fd < 0; a = a->ai_next) {
        fd = socket(a->ai_family, a->ai_socktype | SOCK_CLOEXEC | SOCK_NONBLOCK, a->ai_protocol);
        if (fd < 0) {
            snprintf(err, cap, "socket: %s", strerror(errno));
            continue;
        }
        int rc = connect(fd, a->ai_addr, a->ai_addrlen), so = 0;
        if (rc < 0 && errno == EINPROGRESS) {
            socklen_t sl = sizeof so;
            if (!wait_fd(fd, POLLOUT, deadline))
                so = ETIMEDOUT;
            else if (getsockopt(fd, SOL_SOCKET, SO_ERROR, &so, &sl) < 0)
                so = errno;
            rc = so ? -1 : 0;
            errno = so;
        }
        if (rc < 0) {
            snprintf(err, cap, "cannot connect: %s", strerror(errno));
            close(fd);
            fd = -1;
        }
    }
    freeaddrinfo(ai);
    return fd;
}

/* The answer as http_parser reads it. */
typedef struct answer {
    char *body;
    size_t len, cap;
    bool complete, too_big;
} answer;

static int on_body(http_parser *p, const char *at, size_t n)
{
    answer *a = p->data;
    if (a->len + n + 1 > MAX_ANSWER) {
        a->too_big = true;
        return 1;
    }
    if (a->len + n + 1 > a->cap) {
        size_t c = a->cap ? a->cap * 2 : 16384;
        while (c < a->len + n + 1)
            c *= 2;
        char *q = realloc(a->body, c);
        if (!q) {
            a->too_big = true;
            return 1;
        }
        a->body = q;
        a->cap = c;
    }
    memcpy(a->body + a->len, at, n);
    a->len += n;
    a->body[a->len] = '\0';
    return 0;
}

static int on_complete(http_parser *p)
{
    ((answer *)p->data)->complete = true;
    return 0;
}

static const http_parser_settings settings = {.on_body = on_body,
                                              .on_message_complete = on_complete};

/* GETs t's status document. Returns 0 with the HTTP status in *status and the body in a (the
 * caller frees a->body), or 2 with one error line naming the URL. */
static int fetch(const target *t, const char *key, double timeout_s, int *status, answer *a)
{
    double deadline = now_s() + timeout_s;
    char err[320];
    int fd = dial(t, deadline, err, sizeof err);
    if (fd < 0)
        return sh__cmd_fail("%s: %s (is `shoal serve` running there?)", t->url, err);
    bool v6 = strchr(t->host, ':') != NULL;
    char req[2048];
    int n = snprintf(req, sizeof req,
                     "GET %s HTTP/1.1\r\nHost: %s%s%s:%s\r\nUser-Agent: shoal/" SH_VERSION_STRING
                     "\r\nAccept: application/json\r\nConnection: close\r\n%s%s%s\r\n",
                     t->path, v6 ? "[" : "", t->host, v6 ? "]" : "", t->port,
                     key ? "Authorization: Bearer " : "", key ? key : "", key ? "\r\n" : "");
    if (n < 0 || (size_t)n >= sizeof req) {
        close(fd);
        return sh__cmd_fail("%s: the request does not fit (is the API key that long?)", t->url);
    }
    for (size_t off = 0; off < (size_t)n;) {
        ssize_t w = send(fd, req + off, (size_t)n - off, MSG_NOSIGNAL);
        if (w < 0 && (errno == EAGAIN || errno == EINTR)) {
            if (!wait_fd(fd, POLLOUT, deadline)) {
                close(fd);
                return sh__cmd_fail("%s: timed out sending the request", t->url);
            }
            continue;
        }
        if (w < 0) {
            close(fd);
            return sh__cmd_fail("%s: send: %s", t->url, strerror(errno));
        }
        off += (size_t)w;
    }
    http_parser hp;
    http_parser_init(&hp, HTTP_RESPONSE);
    hp.data = a;
    char buf[16384];
    const char *why = NULL;
    while (!a->complete && !why) {
        if (!wait_fd(fd, POLLIN, deadline)) {
            why = "timed out waiting for the answer";
            break;
        }
        ssize_t r = recv(fd, buf, sizeof buf, 0);
        if (r < 0 && (errno == EAGAIN || errno == EINTR))
            continue;
        if (r < 0) {
            why = strerror(errno);
            break;
        }
        size_t used = http_parser_execute(&hp, &settings, buf, (size_t)r);
        if (a->too_big)
            why = "the answer is larger than 16 MiB";
        else if (hp.http_errno != HPE_OK)
            why = http_errno_description(HTTP_PARSER_ERRNO(&hp));
        else if (r == 0 && !a->complete)
            why = "the connection closed before the answer was complete";
        (void)used;
    }
    close(fd);
    if (why)
        return sh__cmd_fail("%s: %s", t->url, why);
    *status = (int)hp.status_code;
    return 0;
}

/* ---- the tables --------------------------------------------------------------------------- */

#define MAX_COLS 12

/* A table printed with columns as wide as their widest cell, two spaces apart. */
typedef struct table {
    int n_cols, n_rows, cap_rows;
    char **cells; /* n_rows * n_cols, row 0 the header */
    bool oom;
} table;

/* Adds one row of n_cols strings (NULL prints as "-"). */
static void row_add(table *t, ...)
{
    if (t->n_rows == t->cap_rows) {
        int c = t->cap_rows ? t->cap_rows * 2 : 8;
        char **q = realloc(t->cells, (size_t)c * (size_t)t->n_cols * sizeof *q);
        if (!q) {
            t->oom = true;
            return;
        }
        t->cells = q;
        t->cap_rows = c;
    }
    va_list ap;
    va_start(ap, t);
    for (int i = 0; i < t->n_cols; i++) {
        const char *s = va_arg(ap, const char *);
        char *d = strdup(s && *s ? s : "-");
        t->oom |= !d;
        t->cells[t->n_rows * t->n_cols + i] = d;
    }
    va_end(ap);
    t->n_rows++;
}

static void table_free(table *t)
{
    for (int i = 0; i < t->n_rows * t->n_cols; i++)
        free(t->cells[i]);
    free(t->cells);
    memset(t, 0, sizeof *t);
}

/* Prints and frees t; false when a cell could not be stored (out of memory). */
static bool table_print(table *t)
{
    int w[MAX_COLS] = {0};
    for (int r = 0; r < t->n_rows; r++)
        for (int c = 0; c < t->n_cols; c++) {
            const char *s = t->cells[r * t->n_cols + c];
            int l = s ? (int)strlen(s) : 0;
            w[c] = l > w[c] ? l : w[c];
        }
    for (int r = 0; r < t->n_rows; r++) {
        for (int c = 0; c < t->n_cols; c++) {
            const char *s = t->cells[r * t->n_cols + c];
            if (c + 1 < t->n_cols)
                printf("%-*s  ", w[c], s ? s : "");
            else
                printf("%s\n", s ? s : "");
        }
    }
    bool ok = !t->oom;
    table_free(t);
    return ok;
}

static const char *jstr(const json_t *o, const char *k)
{
    const char *s = json_string_value(json_object_get(o, k));
    return s ? s : "";
}

static long long jint(const json_t *o, const char *k)
{
    return (long long)json_integer_value(json_object_get(o, k));
}

static const char *fmt_ll(char *buf, size_t cap, long long v)
{
    snprintf(buf, cap, "%lld", v);
    return buf;
}

/* Prints the document; 1 with an error line when it is not a status document. */
static int print_doc(const target *t, const json_t *doc)
{
    const json_t *nodes = json_object_get(doc, "nodes"), *reps = json_object_get(doc, "replicas");
    if (strcmp(jstr(doc, "object"), "shoal.cluster") || !json_is_array(nodes) ||
        !json_is_array(reps))
        return (sh__cmd_fail("%s: the answer is not a cluster status document", t->url), 1);
    const json_t *model = json_object_get(doc, "model");
    bool single = !strcmp(jstr(doc, "mode"), "single");
    printf("%s: shoal %s, model %s (%lld layers), %s\n\n", t->url, jstr(doc, "version"),
           jstr(model, "name"), jint(model, "layers"),
           single ? "one process (no worker nodes)" : "a cluster fronted by this node");
    char a[32], b[32], c[64], d[32], e[32], f[32], g[32], h[32], p[32];
    bool ok = true;
    table tb = {.n_cols = 7};
    row_add(&tb, "NODE", "ROLE", "URL", "JOINED", "LINK", "RECONNECTS", "LAST ERROR");
    size_t i;
    json_t *n;
    json_array_foreach(nodes, i, n)
    {
        bool self = !strcmp(jstr(n, "state"), "self");
        snprintf(c, sizeof c, "%s%s", jstr(n, "state"),
                 json_is_true(json_object_get(n, "lost")) ? " (lost)" : "");
        row_add(&tb, jstr(n, "name"), jstr(n, "role"), jstr(n, "url"),
                self                                         ? NULL
                : json_is_true(json_object_get(n, "joined")) ? "yes"
                                                             : "no",
                c, self ? NULL : fmt_ll(a, sizeof a, jint(n, "reconnects")), jstr(n, "last_error"));
    }
    ok &= table_print(&tb);
    printf("\n");
    tb = (table){.n_cols = 5};
    row_add(&tb, "REPLICA", "STAGE", "NODE", "LAYERS", "COUNT");
    json_t *r, *s;
    json_array_foreach(reps, i, r)
    {
        size_t k;
        json_array_foreach(json_object_get(r, "stages"), k, s)
        {
            long long first = jint(s, "first_layer"), last = jint(s, "last_layer");
            snprintf(c, sizeof c, "[%lld, %lld)", first, last);
            // A tensor-parallel group: its ranks' who, leader first, joined by '+'.
            char who[256] = "";
            size_t q;
            json_t *rk;
            json_array_foreach(json_object_get(s, "ranks"), q, rk)
            {
                size_t l = strlen(who);
                if (json_is_string(rk))
                    snprintf(who + l, sizeof who - l, "%s%s", q ? "+" : "", json_string_value(rk));
            }
            row_add(&tb, fmt_ll(a, sizeof a, jint(r, "replica")),
                    fmt_ll(b, sizeof b, jint(s, "stage")), who[0] ? who : jstr(s, "node"), c,
                    fmt_ll(d, sizeof d, last - first));
        }
    }
    ok &= table_print(&tb);
    printf("\n");
    tb = (table){.n_cols = 9};
    row_add(&tb, "REPLICA", "RUNNING", "WAITING", "KV BLOCKS USED/TOTAL", "CACHED", "STEPS",
            "PROMPT TOKENS", "GENERATED", "PREEMPTED");
    json_array_foreach(reps, i, r)
    {
        long long used = jint(r, "kv_blocks_used"), total = jint(r, "kv_blocks_total");
        snprintf(c, sizeof c, "%lld/%lld (%.0f%%)", used, total,
                 total > 0 ? 100.0 * (double)used / (double)total : 0.0);
        row_add(&tb, fmt_ll(a, sizeof a, jint(r, "replica")),
                fmt_ll(b, sizeof b, jint(r, "running")), fmt_ll(d, sizeof d, jint(r, "waiting")), c,
                fmt_ll(e, sizeof e, jint(r, "kv_blocks_cached")),
                fmt_ll(f, sizeof f, jint(r, "steps")),
                fmt_ll(g, sizeof g, jint(r, "prompt_tokens")),
                fmt_ll(h, sizeof h, jint(r, "generation_tokens")),
                fmt_ll(p, sizeof p, jint(r, "preemptions")));
    }
    ok &= table_print(&tb);
    // The router's view, with several replicas.
    tb = (table){.n_cols = 10};
    row_add(&tb, "REPLICA", "HEALTHY", "LOAD", "WEIGHT", "REQUESTS", "ROUTED", "REDISPATCHED",
            "AFFINITY HITS", "LONG/SHORT/SCRIPT", "SHAPE");
    char shape[48], by[96];
    bool routed = false;
    json_array_foreach(reps, i, r)
    {
        const json_t *ro = json_object_get(r, "router");
        if (!json_is_object(ro))
            continue;
        routed = true;
        snprintf(c, sizeof c, "%.2f", json_number_value(json_object_get(ro, "weight")));
        // Its shape: ranks per stage (tp) by stages.
        long long tp = jint(r, "tp");
        snprintf(shape, sizeof shape, "tp %lld x %zu", tp > 0 ? tp : 1,
                 json_array_size(json_object_get(r, "stages")));
        const json_t *bc = json_object_get(ro, "routed_by_class");
        snprintf(by, sizeof by, "%lld/%lld/%lld", jint(bc, "long"), jint(bc, "short"),
                 jint(bc, "script"));
        row_add(&tb, fmt_ll(a, sizeof a, jint(r, "replica")),
                json_is_false(json_object_get(r, "healthy")) ? "no" : "yes",
                fmt_ll(b, sizeof b, jint(ro, "load")), c, fmt_ll(d, sizeof d, jint(ro, "requests")),
                fmt_ll(e, sizeof e, jint(ro, "routed")),
                fmt_ll(f, sizeof f, jint(ro, "redispatched")),
                fmt_ll(g, sizeof g, jint(ro, "affinity_hits")), by, shape);
    }
    if (routed) {
        printf("\n");
        ok &= table_print(&tb);
        const json_t *rt = json_object_get(doc, "routing");
        if (json_is_object(rt))
            printf(
                "\nrouting: prompts over %lld tokens go to the tensor-parallel replicas (tp > 1) "
                "of a model that has both shapes, the others to the rest%s\n",
                jint(rt, "long_prompt"),
                json_is_true(json_object_get(rt, "route")) ? "; the script's route() comes first"
                                                           : "");
    } else {
        table_free(&tb);
    }
    if (!ok)
        return (sh__cmd_fail("out of memory"), 1);
    return 0;
}

/* ---- the command -------------------------------------------------------------------------- */

/* The error message of an OpenAI-shaped error body, or "". */
static const char *error_message(const json_t *doc)
{
    return jstr(json_object_get(doc, "error"), "message");
}

int sh__cmd_cluster_status(int argc, char **argv)
{
    const char *url = NULL, *key = NULL;
    bool raw = false;
    double timeout_s = 10;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        if (!strcmp(a, "-h") || !strcmp(a, "--help")) {
            usage(stdout);
            return 0;
        }
        if (!strcmp(a, "--json")) {
            raw = true;
        } else if (!strcmp(a, "--api-key") || !strcmp(a, "--timeout")) {
            if (i + 1 >= argc)
                return sh__cmd_fail("option '%s' needs a value (see shoal cluster status --help)",
                                    a);
            const char *v = argv[++i];
            if (!strcmp(a, "--api-key"))
                key = v;
            else if (!sh__cmd_parse_f64(v, 0.1, 3600, &timeout_s))
                return sh__cmd_fail("bad value '%s' for --timeout: want seconds from 0.1 to 3600",
                                    v);
        } else if (a[0] == '-' && a[1]) {
            return sh__cmd_fail("unknown option '%s' (see shoal cluster status --help)", a);
        } else if (url) {
            return sh__cmd_fail("one URL at most ('%s' and '%s' given)", url, a);
        } else {
            url = a;
        }
    }
    target t;
    if (parse_url(url ? url : DEFAULT_URL, &t))
        return 2;
    char *ekey = key ? NULL : sh__cmd_env_key();
    if (ekey)
        key = ekey;
    if (key && key[strcspn(key, "\r\n")]) {
        free(ekey);
        return sh__cmd_fail("the API key contains a line break");
    }
    answer ans = {0};
    int status = 0;
    int rc = fetch(&t, key, timeout_s, &status, &ans);
    free(ekey);
    if (rc) {
        free(ans.body);
        return rc;
    }
    json_error_t je;
    json_t *doc = ans.body ? json_loadb(ans.body, ans.len, 0, &je) : NULL;
    if (status == 401 || status == 403) {
        rc = sh__cmd_fail("%s: %d %s (give --api-key KEY or set " KEY_ENV ")", t.url, status,
                          *error_message(doc) ? error_message(doc) : "the key was refused");
    } else if (status == 404) {
        rc = (sh__cmd_fail("%s: %s answers 404: this server does not serve the cluster status "
                           "(an older shoal, or not shoal?)",
                           t.url, t.path),
              1);
    } else if (status != 200) {
        rc = (sh__cmd_fail("%s: HTTP %d%s%s", t.url, status, *error_message(doc) ? ": " : "",
                           error_message(doc)),
              1);
    } else if (raw) {
        fwrite(ans.body ? ans.body : "", 1, ans.len, stdout);
        printf("\n");
        rc = doc ? 0 : (sh__cmd_fail("%s: the answer is not JSON", t.url), 1);
    } else if (!doc) {
        rc = (sh__cmd_fail("%s: the answer is not JSON: %s", t.url, je.text), 1);
    } else {
        rc = print_doc(&t, doc);
    }
    json_decref(doc);
    free(ans.body);
    fflush(stdout);
    return rc;
}
