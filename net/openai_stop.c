/* Stop strings over streamed text, and bearer API key checks. */
#include <stdlib.h>
#include <string.h>
#include <strings.h>

#include "net/openai.h"

sh_err sh_openai_stopper_init(sh_openai_stopper *s, const char *const *stops, int n)
{
    memset(s, 0, sizeof *s);
    s->which = -1;
    if (n < 0 || n > SH_OPENAI_MAX_STOP)
        return SH_EINVAL;
    for (int i = 0; i < n; i++) {
        size_t len = stops[i] ? strlen(stops[i]) : 0;
        if (len == 0)
            continue;
        s->stop[s->n_stop] = malloc(len + 1);
        if (!s->stop[s->n_stop]) {
            sh_openai_stopper_fini(s);
            return SH_ENOMEM;
        }
        memcpy(s->stop[s->n_stop], stops[i], len + 1);
        s->stop_len[s->n_stop++] = len;
    }
    return SH_OK;
}

void sh_openai_stopper_fini(sh_openai_stopper *s)
{
    for (int i = 0; i < s->n_stop; i++)
        free(s->stop[i]);
    free(s->held);
    memset(s, 0, sizeof *s);
    s->which = -1;
}

/* Bytes at the end of t[0..n) that form an incomplete UTF-8 character (0 when none). */
static size_t utf8_partial_tail(const char *t, size_t n)
{
    for (size_t back = 1; back <= 3 && back <= n; back++) {
        unsigned char c = (unsigned char)t[n - back];
        if ((c & 0xc0) == 0x80)
            continue; /* a continuation byte: look further back for the lead */
        size_t need = c >= 0xf0 ? 4 : c >= 0xe0 ? 3 : c >= 0xc0 ? 2 : 1;
        return need > back ? back : 0;
    }
    return 0;
}

/* The longest k < len(stop) such that the text ends with the first k bytes of a stop string. */
static size_t partial_match(const sh_openai_stopper *s, const char *t, size_t n)
{
    size_t best = 0;
    for (int i = 0; i < s->n_stop; i++) {
        size_t max = s->stop_len[i] - 1 < n ? s->stop_len[i] - 1 : n;
        for (size_t k = max; k > best; k--) {
            if (memcmp(t + n - k, s->stop[i], k) == 0) {
                best = k;
                break;
            }
        }
    }
    return best;
}

sh_err sh_openai_stopper_feed(sh_openai_stopper *s, const char *piece, size_t len, const char **out,
                              size_t *out_len, bool *stopped)
{
    /* Drop what the previous call handed out. */
    if (s->out_len) {
        memmove(s->held, s->held + s->out_len, s->held_len - s->out_len);
        s->held_len -= s->out_len;
        s->out_len = 0;
    }
    *out = s->held ? s->held : "";
    *out_len = 0;
    *stopped = s->stopped;
    if (s->stopped || len == 0)
        return SH_OK;
    if (s->held_len + len > s->held_cap) {
        size_t cap = s->held_cap ? s->held_cap : 64;
        while (cap < s->held_len + len)
            cap *= 2;
        char *h = realloc(s->held, cap);
        if (!h)
            return SH_ENOMEM;
        s->held = h;
        s->held_cap = cap;
    }
    memcpy(s->held + s->held_len, piece, len);
    s->held_len += len;
    *out = s->held;

    /* Earliest complete match. Held text never contains a whole stop string before this piece,
     * so only matches ending in the new bytes are possible, but a plain search is simpler and the
     * held text is short (under the longest stop string plus one piece). */
    size_t first = SIZE_MAX;
    for (int i = 0; i < s->n_stop; i++) {
        const char *m = memmem(s->held, s->held_len, s->stop[i], s->stop_len[i]);
        if (m && (size_t)(m - s->held) < first) {
            first = (size_t)(m - s->held);
            s->which = i;
        }
    }
    if (first != SIZE_MAX) {
        s->stopped = true;
        *stopped = true;
        *out_len = first;
        s->out_len = s->held_len; /* everything is consumed: the rest is discarded */
        return SH_OK;
    }
    size_t hold = partial_match(s, s->held, s->held_len);
    size_t emit = s->held_len - hold;
    emit -= utf8_partial_tail(s->held, emit);
    *out_len = emit;
    s->out_len = emit;
    return SH_OK;
}

void sh_openai_stopper_flush(sh_openai_stopper *s, const char **out, size_t *out_len)
{
    if (s->out_len) {
        memmove(s->held, s->held + s->out_len, s->held_len - s->out_len);
        s->held_len -= s->out_len;
        s->out_len = 0;
    }
    *out = s->held ? s->held : "";
    *out_len = s->stopped ? 0 : s->held_len;
    s->out_len = s->held_len;
}

/* Compares in time that depends on the presented length only, never on where bytes differ. */
static int ct_equal(const char *given, size_t gl, const char *key)
{
    size_t kl = strlen(key);
    unsigned char diff = (unsigned char)(gl != kl);
    for (size_t i = 0; i < gl; i++)
        diff |= (unsigned char)given[i] ^ (unsigned char)(kl ? key[i % kl] : 0);
    return diff == 0;
}

sh_err sh_openai_auth_check(const sh_openai_key *keys, int32_t n_keys, const char *authorization,
                            int32_t default_priority, int32_t *priority, sh_openai_error *err)
{
    *priority = default_priority;
    if (n_keys <= 0)
        return SH_OK;
    const char *tok = NULL;
    if (authorization && strncasecmp(authorization, "Bearer ", 7) == 0) {
        tok = authorization + 7;
        while (*tok == ' ')
            tok++;
    }
    if (!tok || !*tok)
        return sh_openai_error_set(err, 401, "invalid_api_key", NULL,
                                   "You didn't provide an API key. Provide it in the "
                                   "Authorization header as 'Bearer YOUR_KEY'.");
    size_t tl = strlen(tok);
    while (tl > 0 && (tok[tl - 1] == ' ' || tok[tl - 1] == '\t'))
        tl--;
    int found = -1;
    for (int32_t i = 0; i < n_keys; i++) {
        /* No early exit: every key is compared whatever the outcome. */
        int eq = ct_equal(tok, tl, keys[i].key ? keys[i].key : "");
        found = (found < 0 && eq) ? i : found;
    }
    if (found < 0)
        return sh_openai_error_set(err, 401, "invalid_api_key", NULL,
                                   "Incorrect API key provided.");
    *priority = keys[found].priority;
    return SH_OK;
}

sh_err sh_openai_auth_admin(const sh_openai_key *keys, int32_t n_keys, const char *authorization,
                            sh_openai_error *err)
{
    int32_t prio;
    sh_err rc = sh_openai_auth_check(keys, n_keys, authorization, 0, &prio, err);
    if (rc != SH_OK || n_keys <= 0)
        return rc;
    /* The key matched; find it again (the check's constant time only guards the comparison of
     * an unknown token, and this one is known to be valid). */
    const char *tok = authorization + 7;
    while (*tok == ' ')
        tok++;
    size_t tl = strlen(tok);
    while (tl > 0 && (tok[tl - 1] == ' ' || tok[tl - 1] == '\t'))
        tl--;
    bool admin = false;
    for (int32_t i = 0; i < n_keys; i++)
        admin |= keys[i].admin && ct_equal(tok, tl, keys[i].key ? keys[i].key : "");
    if (!admin) {
        sh_openai_error_set(err, 403, "admin_key_required", NULL,
                            "This route changes the server and needs an admin API key (given "
                            "to the server as KEY:PRIORITY:admin); this key is not one.");
        return SH_EINVAL;
    }
    return SH_OK;
}
