/* A growing NUL-terminated string for building response bodies and prompts in net/. Appends
 * after an allocation failure do nothing and set oom; the owner frees p. */
#ifndef SH_NET_STRBUF_H
#define SH_NET_STRBUF_H

#include <stdbool.h>
#include <stddef.h>

typedef struct sh_strbuf {
    char *p; /* NULL until the first append */
    size_t len, cap;
    bool oom;
} sh_strbuf;

/* Appends s[0, n) (n may be 0). */
void sh_strbuf_addn(sh_strbuf *b, const char *s, size_t n);
/* Appends the NUL-terminated s. */
void sh_strbuf_add(sh_strbuf *b, const char *s);

#endif
