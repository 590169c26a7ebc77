/* The growing string of net/strbuf.h. */
#include "net/strbuf.h"

#include <stdlib.h>
#include <string.h>

void sh_strbuf_addn(sh_strbuf *b, const char *s, size_t n)
{
    if (b->oom)
        return;
    if (b->len + n + 1 > b->cap) {
        size_t cap = b->cap ? b->cap : 256;
        while (cap < b->len + n + 1)
            cap *= 2;
        char *p = realloc(b->p, cap);
        if (!p) {
            b->oom = true;
            return;
        }
        b->p = p;
        b->cap = cap;
    }
    memcpy(b->p + b->len, s, n);
    b->len += n;
    b->p[b->len] = '\0';
}

void sh_strbuf_add(sh_strbuf *b, const char *s) { sh_strbuf_addn(b, s, strlen(s)); }
