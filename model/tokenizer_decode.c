/* Tokenizer decoding: token pieces, whole-sequence decode, and the streaming decoder that emits
 * only complete UTF-8 characters. */
#include <stdlib.h>
#include <string.h>

#include "base/error.h"
#include "model/tokenizer.h"
#include "model/tokenizer_internal.h"

/* ---- UTF-8 ---- */

/* The range the second byte of a sequence must fall in, by lead byte; this is what excludes
 * overlong forms (E0 80..9F, F0 80..8F), surrogates (ED A0..BF) and code points above U+10FFFF
 * (F4 90..BF). Returns the sequence length, 0 for a byte that cannot start one. */
static int utf8_lead(unsigned char c, unsigned char *lo, unsigned char *hi)
{
    *lo = 0x80;
    *hi = 0xBF;
    if (c < 0x80)
        return 1;
    if (c >= 0xC2 && c <= 0xDF)
        return 2;
    if (c >= 0xE0 && c <= 0xEF) {
        if (c == 0xE0)
            *lo = 0xA0;
        else if (c == 0xED)
            *hi = 0x9F;
        return 3;
    }
    if (c >= 0xF0 && c <= 0xF4) {
        if (c == 0xF0)
            *lo = 0x90;
        else if (c == 0xF4)
            *hi = 0x8F;
        return 4;
    }
    return 0;
}

size_t sh__tok_utf8_valid(const unsigned char *s, size_t n)
{
    size_t i = 0;
    while (i < n) {
        if (s[i] < 0x80) {
            i++;
            continue;
        }
        unsigned char lo, hi;
        int k = utf8_lead(s[i], &lo, &hi);
        if (k == 0 || n - i < (size_t)k || s[i + 1] < lo || s[i + 1] > hi)
            return i;
        for (int j = 2; j < k; j++)
            if ((s[i + j] & 0xC0) != 0x80)
                return i;
        i += (size_t)k;
    }
    return n;
}

/* ---- pieces and decode ---- */

size_t sh_tokenizer_piece(const sh_tokenizer *t, int32_t id, uint32_t flags, const char **piece)
{
    *piece = NULL;
    if (id < 0 || id >= t->n_vocab)
        return 0;
    if (!(flags & SH_DECODE_SPECIAL) && sh_tokenizer_is_control(t, id))
        return 0;
    if (t->piece_len[id] == 0)
        return 0;
    *piece = t->pool + t->piece_off[id];
    return t->piece_len[id];
}

size_t sh_tokenizer_max_piece(const sh_tokenizer *t) { return t->max_piece; }

/* Whether the STRIP_SPACE rule applies to this tokenizer at all. */
static bool strips(const sh_tokenizer *t, uint32_t flags)
{
    return (flags & SH_DECODE_STRIP_SPACE) && t->kind == SH_TOKENIZER_SPM && t->add_space_prefix;
}

sh_err sh_tokenizer_decode(const sh_tokenizer *t, const int32_t *ids, size_t n, uint32_t flags,
                           char *buf, size_t cap, size_t *len, sh_error *e)
{
    if (len)
        *len = 0;
    if (!t || !len || (!ids && n) || (!buf && cap))
        return sh__error_set(e, SH_EINVAL, "tokenizer: bad decode arguments");
    bool strip = strips(t, flags);
    size_t total = 0;
    for (size_t i = 0; i < n; i++) {
        if (ids[i] < 0 || ids[i] >= t->n_vocab)
            return sh__error_set(e, SH_EINVAL, "tokenizer: id %d at %zu is outside [0, %d)",
                                 (int)ids[i], i, (int)t->n_vocab);
        const char *p;
        size_t m = sh_tokenizer_piece(t, ids[i], flags, &p);
        if (strip && ids[i] != t->bos) {
            strip = false;
            if (m && p[0] == ' ') {
                p++;
                m--;
            }
        }
        if (m && total + m <= cap)
            memcpy(buf + total, p, m);
        total += m;
    }
    *len = total;
    if (total > cap)
        return sh__error_set(e, SH_ERANGE, "tokenizer: %zu bytes of text do not fit in %zu", total,
                             cap);
    if (total < cap)
        buf[total] = '\0';
    return SH_OK;
}

/* ---- streaming ---- */

struct sh_tokenizer_stream {
    const sh_tokenizer *t;
    uint32_t flags;
    bool strip; /* the STRIP_SPACE rule is still pending */
    /* The character in progress: its bytes so far, how many more it needs, and the range the
     * next byte must fall in. */
    unsigned char part[4];
    int n_part, need;
    unsigned char lo, hi;
    char *out; /* (cap) bytes; holds the text returned by the last call */
    size_t cap;
};

sh_err sh_tokenizer_stream_create(const sh_tokenizer *t, uint32_t flags, sh_tokenizer_stream **out,
                                  sh_error *e)
{
    if (!out)
        return sh__error_set(e, SH_EINVAL, "tokenizer stream: out is NULL");
    *out = NULL;
    if (!t)
        return sh__error_set(e, SH_EINVAL, "tokenizer stream: tokenizer is NULL");
    sh_tokenizer_stream *s = calloc(1, sizeof *s);
    /* Worst case per feed: every byte of the piece and of the held-back character becomes its own
     * U+FFFD (3 bytes). */
    size_t cap = 3 * (t->max_piece + 4);
    char *buf = s ? malloc(cap) : NULL;
    if (!buf) {
        free(s);
        return sh__error_set(e, SH_ENOMEM, "tokenizer stream: out of memory");
    }
    s->t = t;
    s->flags = flags;
    s->out = buf;
    s->cap = cap;
    sh_tokenizer_stream_reset(s);
    *out = s;
    return SH_OK;
}

void sh_tokenizer_stream_destroy(sh_tokenizer_stream *s)
{
    if (!s)
        return;
    free(s->out);
    free(s);
}

void sh_tokenizer_stream_reset(sh_tokenizer_stream *s)
{
    s->strip = strips(s->t, s->flags);
    s->n_part = 0;
    s->need = 0;
}

static void put_fffd(char *out, size_t *n)
{
    memcpy(out + *n, "\xEF\xBF\xBD", 3);
    *n += 3;
}

/* Runs one byte through the UTF-8 state machine, appending finished output to out. */
static void stream_byte(sh_tokenizer_stream *s, unsigned char c, size_t *n)
{
    for (;;) {
        if (s->need == 0) {
            int k = utf8_lead(c, &s->lo, &s->hi);
            if (k == 1) {
                s->out[(*n)++] = (char)c;
            } else if (k == 0) {
                put_fffd(s->out, n);
            } else {
                s->part[0] = c;
                s->n_part = 1;
                s->need = k - 1;
            }
            return;
        }
        if (c >= s->lo && c <= s->hi) {
            s->part[s->n_part++] = c;
            s->lo = 0x80;
            s->hi = 0xBF;
            if (--s->need == 0) {
                memcpy(s->out + *n, s->part, (size_t)s->n_part);
                *n += (size_t)s->n_part;
                s->n_part = 0;
            }
            return;
        }
        /* The sequence broke off: its bytes so far are one maximal invalid subpart, and c is
         * looked at again as a possible start. */
        put_fffd(s->out, n);
        s->n_part = 0;
        s->need = 0;
    }
}

sh_err sh_tokenizer_stream_feed(sh_tokenizer_stream *s, int32_t id, const char **text, size_t *len)
{
    *text = s->out;
    *len = 0;
    if (id < 0 || id >= s->t->n_vocab)
        return SH_EINVAL;
    const char *p;
    size_t m = sh_tokenizer_piece(s->t, id, s->flags, &p);
    if (s->strip && id != s->t->bos) {
        s->strip = false;
        if (m && p[0] == ' ') {
            p++;
            m--;
        }
    }
    size_t n = 0;
    for (size_t i = 0; i < m; i++)
        stream_byte(s, (unsigned char)p[i], &n);
    *len = n;
    return SH_OK;
}

void sh_tokenizer_stream_flush(sh_tokenizer_stream *s, const char **text, size_t *len)
{
    size_t n = 0;
    if (s->need > 0)
        put_fffd(s->out, &n);
    sh_tokenizer_stream_reset(s);
    *text = s->out;
    *len = n;
}
