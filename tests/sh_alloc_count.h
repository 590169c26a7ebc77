/* A counting allocator for no-allocation tests: malloc, calloc, realloc, posix_memalign and
 * aligned_alloc of the whole process (every thread) go through wrappers that count calls in
 * n_allocs before forwarding to glibc. Include in exactly one file of a test program. Under ASan
 * or TSan, which own the allocator, SH_NOALLOC_SKIP is defined instead and nothing is replaced. */
#ifndef SH_TESTS_ALLOC_COUNT_H
#define SH_TESTS_ALLOC_COUNT_H

#include <stdatomic.h>
#include <stddef.h>
#include <stdlib.h>

#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
#define SH_NOALLOC_SKIP 1 /* the sanitizers own the allocator */
#elif defined(__has_feature)
#if __has_feature(address_sanitizer) || __has_feature(thread_sanitizer)
#define SH_NOALLOC_SKIP 1
#endif
#endif

#ifndef SH_NOALLOC_SKIP
/* glibc's own entry points, which the wrappers forward to. */
extern void *__libc_malloc(size_t n);
extern void *__libc_calloc(size_t n, size_t k);
extern void *__libc_realloc(void *p, size_t n);
extern void *__libc_memalign(size_t align, size_t n);
extern void __libc_free(void *p);

static atomic_long n_allocs;

void *malloc(size_t n)
{
    atomic_fetch_add_explicit(&n_allocs, 1, memory_order_relaxed);
    return __libc_malloc(n);
}
void *calloc(size_t n, size_t k)
{
    atomic_fetch_add_explicit(&n_allocs, 1, memory_order_relaxed);
    return __libc_calloc(n, k);
}
void *realloc(void *p, size_t n)
{
    atomic_fetch_add_explicit(&n_allocs, 1, memory_order_relaxed);
    return __libc_realloc(p, n);
}
int posix_memalign(void **out, size_t align, size_t n)
{
    atomic_fetch_add_explicit(&n_allocs, 1, memory_order_relaxed);
    void *p = __libc_memalign(align, n);
    if (!p)
        return 12; /* ENOMEM */
    *out = p;
    return 0;
}
void *aligned_alloc(size_t align, size_t n)
{
    atomic_fetch_add_explicit(&n_allocs, 1, memory_order_relaxed);
    return __libc_memalign(align, n);
}
void free(void *p) { __libc_free(p); }
#endif /* SH_NOALLOC_SKIP */

#endif
