/* `shoal cluster policy reload [URL]`: one POST /admin/policy/reload over plain HTTP/1.1 and its
 * answer in one line (tools/cmd_cluster_policy.h). */
#include <errno.h>
#include <jansson.h>
#include <netdb.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <unistd.h>

#include "tools/cmd_cluster_policy.h"
#include "tools/cmd_util.h"

#define DEFAULT_URL "http://127.0.0.1:8080"
#define KEY_ENV "SHOAL_API_KEY"
#define MAX_ANSWER (1u << 20)

static void usage(FILE *f)
{
    fprintf(f, "usage: shoal cluster policy reload [URL] [--api-key KEY] [--timeout S]\n\n"
               "Asks a running `shoal serve` (a cluster's front, or a single process) to read its\n"
               "degradation policy script again (POST URL/admin/policy/reload; SIGHUP does the\n"
               "same). A script that does not load or fails its trial call is refused and the\n"
               "old one stays in force.\n\n"
               "  URL            the server's HTTP address (default " DEFAULT_URL ")\n"
               "  --api-key KEY  the bearer key when the server requires keys, an admin key\n"
               "                 (default: the first key of " KEY_ENV ", without its\n"
               "                 :PRIORITY and :admin)\n"
               "  --timeout S    seconds to connect and read the answer (default 10)\n\n"
               "Exit status: 0 reloaded, 1 the new script was refused (its error is printed),\n"
               "2 bad usage, the server not reachable, or the key refused.\n");
}

/* [http://]HOST[:PORT][/] into host and port; 2 with an error line for anything else. */
static int parse_url(const char *url, char *host, size_t cap, char *port)
{
    const char *p = strstr(url, "://");
    if (p && (p - url != 4 || strncmp(url, "http", 4)))
        return sh__cmd_fail("%s: only http:// URLs are supported", url);
    p = p ? p + 3 : url;
    const char *end;
    if (*p == '[') {
        end = strchr(++p, ']');
        if (!end)
            return sh__cmd_fail("%s: an IPv6 address needs its closing ']'", url);
    } else {
        end = p + strcspn(p, ":/");
    }
    if (end == p || (size_t)(end - p) >= cap)
        return sh__cmd_fail("%s: no host in the URL (want http://HOST:PORT)", url);
    memcpy(host, p, (size_t)(end - p));
    host[end - p] = '\0';
    p = *end == ']' ? end + 1 : end;
    strcpy(port, "8080");
    if (*p == ':') {
        int64_t n;
        char buf[16];
        size_t len = strcspn(p + 1, "/");
        if (!len || len >= sizeof buf)
            return sh__cmd_fail("%s: the port must be a number from 1 to 65535", url);
        memcpy(buf, p + 1, len);
        buf[len] = '\0';
        if (!sh__cmd_parse_i64(buf, 1, 65535, &n))
            return sh__cmd_fail("%s: the port must be a number from 1 to 65535", url);
        snprintf(port, 8, "%d", (int)n);
        p += 1 + len;
    }
    if (*p && strcmp(p, "/"))
        return sh__cmd_fail("%s: give the server's address only (http://HOST:PORT)", url);
    return 0;
}

/* Sends the request and reads the whole answer (the server closes after it). Returns the HTTP
 * status and the body in *body (malloc'd), or -1 with why in err. */
static int post(const char *host, const char *port, const char *key, double timeout_s, char **body,
                char *err, size_t cap)
{
    struct addrinfo hints = {.ai_family = AF_UNSPEC, .ai_socktype = SOCK_STREAM}, *ai = NULL;
    int gai = getaddrinfo(host, port, &hints, &ai);
    if (gai) {
        snprintf(err, cap, "cannot resolve %s: %s", host, gai_strerror(gai));
        return -1;
    }
    int fd = -1;
    struct timeval tv = {(time_t)timeout_s,
                         (suseconds_t)((timeout_s - (double)(time_t)timeout_s) * 1e6)};
    snprintf(err, cap, "no address for %s", host);
    for (struct addrinfo *a = ai; a && fd < 0; a = a->ai_next) {
        fd = socket(a->ai_family, a->ai_socktype | SOCK_CLOEXEC, a->ai_protocol);
        if (fd < 0)
            continue;
        setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
        setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof tv);
        if (connect(fd, a->ai_addr, a->ai_addrlen) != 0) {
            snprintf(err, cap, "cannot connect: %s", strerror(errno));
            close(fd);
            fd = -1;
        }
    }
    freeaddrinfo(ai);
    if (fd < 0)
        return -1;
    char req[1024];
    int n = snprintf(req, sizeof req,
                     "POST /admin/policy/reload HTTP/1.1\r\nHost: %s:%s\r\n%s%s%s"
                     "Content-Length: 0\r\nConnection: close\r\n\r\n",
                     host, port, key ? "Authorization: Bearer " : "", key ? key : "",
                     key ? "\r\n" : "");
    if (n < 0 || (size_t)n >= sizeof req || write(fd, req, (size_t)n) != n) {
        snprintf(err, cap, "cannot send the request: %s", strerror(errno));
        close(fd);
        return -1;
    }
    size_t len = 0, bcap = 4096;
    char *buf = malloc(bcap);
    for (;;) {
        if (!buf || len + 1 >= bcap) {
            char *p = buf && bcap < MAX_ANSWER ? realloc(buf, bcap *= 2) : NULL;
            if (!p) {
                free(buf);
                close(fd);
                snprintf(err, cap, "the answer is too large");
                return -1;
            }
            buf = p;
        }
        ssize_t got = read(fd, buf + len, bcap - len - 1);
        if (got == 0)
            break;
        if (got < 0) {
            if (errno == EINTR)
                continue;
            snprintf(err, cap, "no complete answer: %s", strerror(errno));
            free(buf);
            close(fd);
            return -1;
        }
        len += (size_t)got;
    }
    close(fd);
    buf[len] = '\0';
    int status = 0;
    const char *sep = strstr(buf, "\r\n\r\n");
    if (sscanf(buf, "HTTP/1.%*d %d", &status) != 1 || !sep) {
        snprintf(err, cap, "not an HTTP answer");
        free(buf);
        return -1;
    }
    *body = strdup(sep + 4);
    free(buf);
    return status;
}

int sh__cmd_cluster_policy(int argc, char **argv)
{
    if (argc < 2 || !strcmp(argv[1], "-h") || !strcmp(argv[1], "--help")) {
        usage(argc < 2 ? stderr : stdout);
        return argc < 2 ? 2 : 0;
    }
    if (strcmp(argv[1], "reload"))
        return sh__cmd_fail("unknown policy command '%s' (see shoal cluster policy --help)",
                            argv[1]);
    const char *url = DEFAULT_URL, *key = NULL;
    double timeout_s = 10;
    bool url_set = false;
    for (int i = 2; i < argc; i++) {
        if (!strcmp(argv[i], "-h") || !strcmp(argv[i], "--help")) {
            usage(stdout);
            return 0;
        }
        if (!strcmp(argv[i], "--api-key") || !strcmp(argv[i], "--timeout")) {
            if (i + 1 >= argc)
                return sh__cmd_fail("option '%s' needs a value", argv[i]);
            if (!strcmp(argv[i], "--api-key"))
                key = argv[++i];
            else if (!sh__cmd_parse_f64(argv[++i], 0.1, 3600, &timeout_s))
                return sh__cmd_fail("--timeout '%s': want seconds from 0.1 to 3600", argv[i]);
        } else if (argv[i][0] == '-' || url_set) {
            return sh__cmd_fail("unexpected argument '%s' (see shoal cluster policy --help)",
                                argv[i]);
        } else {
            url = argv[i];
            url_set = true;
        }
    }
    char host[256], port[8], err[512];
    if (parse_url(url, host, sizeof host, port))
        return 2;
    char *ekey = key ? NULL : sh__cmd_env_key();
    char *body = NULL;
    int status = post(host, port, key ? key : ekey, timeout_s, &body, err, sizeof err);
    free(ekey);
    if (status < 0)
        return sh__cmd_fail("%s: %s", url, err);
    json_t *doc = json_loads(body ? body : "", 0, NULL);
    const char *msg = NULL;
    if (status == 200)
        msg = json_string_value(json_object_get(doc, "message"));
    else
        msg = json_string_value(json_object_get(json_object_get(doc, "error"), "message"));
    int rc = 0;
    if (status == 200) {
        printf("%s: policy %s (level %lld now)\n", url, msg ? msg : "reloaded",
               (long long)json_integer_value(json_object_get(doc, "level")));
    } else {
        fprintf(stderr, "error: %s: %d: %s\n", url, status,
                msg ? msg : (body ? body : "no answer"));
        rc = status == 422 ? 1 : 2;
    }
    json_decref(doc);
    free(body);
    return rc;
}
