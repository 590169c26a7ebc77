/* A small test harness: cases registered in a table, checks that print both sides, exit code 77
 * for a skipped suite. Each test executable defines `static const sh_test_case tests[]` and calls
 * sh_test_main(argc, argv, tests). A single case runs with `./test_x case_name`. */
#ifndef SH_TEST_H
#define SH_TEST_H

#include <inttypes.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define SH_TEST_SKIP 77

typedef struct sh_test_case {
    const char *name;
    void (*fn)(void);
} sh_test_case;

/* Failures in the current case; checks keep going so one run shows every mismatch. */
static int sh_test_failures_;

#define SH_FAIL_(...)                                                                              \
    do {                                                                                           \
        fprintf(stderr, "%s:%d: ", __FILE__, __LINE__);                                            \
        fprintf(stderr, __VA_ARGS__);                                                              \
        fputc('\n', stderr);                                                                       \
        sh_test_failures_++;                                                                       \
    } while (0)

#define CHECK(cond)                                                                                \
    do {                                                                                           \
        if (!(cond))                                                                               \
            SH_FAIL_("check failed: %s", #cond);                                                   \
    } while (0)

#define CHECK_INT_EQ(a, b)                                                                         \
    do {                                                                                           \
        long long a_ = (long long)(a), b_ = (long long)(b);                                        \
        if (a_ != b_)                                                                              \
            SH_FAIL_("%s == %s: %lld != %lld", #a, #b, a_, b_);                                    \
    } while (0)

#define CHECK_UINT_EQ(a, b)                                                                        \
    do {                                                                                           \
        unsigned long long a_ = (unsigned long long)(a), b_ = (unsigned long long)(b);             \
        if (a_ != b_)                                                                              \
            SH_FAIL_("%s == %s: %llu != %llu", #a, #b, a_, b_);                                    \
    } while (0)

#define CHECK_STR_EQ(a, b)                                                                         \
    do {                                                                                           \
        const char *a_ = (a), *b_ = (b);                                                           \
        if (!a_ || !b_ || strcmp(a_, b_) != 0)                                                     \
            SH_FAIL_("%s == %s: \"%s\" != \"%s\"", #a, #b, a_ ? a_ : "(null)",                     \
                     b_ ? b_ : "(null)");                                                          \
    } while (0)

#define CHECK_NEAR(a, b, tol)                                                                      \
    do {                                                                                           \
        double a_ = (double)(a), b_ = (double)(b), t_ = (double)(tol);                             \
        if (!(fabs(a_ - b_) <= t_))                                                                \
            SH_FAIL_("%s ~= %s: %.9g vs %.9g (tolerance %.3g)", #a, #b, a_, b_, t_);               \
    } while (0)

/* Checks an sh_err-returning call; prints the code and, when given, the sh_error detail. */
#define CHECK_OK(call)                                                                             \
    do {                                                                                           \
        int rc_ = (int)(call);                                                                     \
        if (rc_ != 0)                                                                              \
            SH_FAIL_("%s failed: %s", #call, sh_strerror((sh_err)rc_));                            \
    } while (0)

/* Path of a file under the source tree (SH_SOURCE_DIR from ctest, else the working directory).
 * Returns a static buffer. */
static inline const char *sh_test_path(const char *rel)
{
    static char buf[4][1024];
    static int k;
    const char *root = getenv("SH_SOURCE_DIR");
    char *b = buf[k++ & 3];
    snprintf(b, sizeof buf[0], "%s/%s", root ? root : ".", rel);
    return b;
}

/* A wait of ms milliseconds stretched by SH_TEST_TIME_SCALE (a whole number above 1 in a slower
 * build's tests, ThreadSanitizer's: tests/CMakeLists.txt); ms as it is without it. For waits that
 * bound work (a model loading, a step computing), not for the time a check measures. */
static inline unsigned sh_test_ms(unsigned ms)
{
    const char *s = getenv("SH_TEST_TIME_SCALE");
    long k = s ? strtol(s, NULL, 10) : 1;
    return k > 1 && k <= 100 ? ms * (unsigned)k : ms;
}

static inline int sh_test_main(int argc, char **argv, const sh_test_case *cases)
{
    int failed = 0, ran = 0;
    for (const sh_test_case *c = cases; c->name; c++) {
        if (argc > 1 && strcmp(argv[1], c->name) != 0)
            continue;
        sh_test_failures_ = 0;
        c->fn();
        ran++;
        if (sh_test_failures_) {
            failed++;
            fprintf(stderr, "FAIL %s (%d checks)\n", c->name, sh_test_failures_);
        } else {
            fprintf(stderr, "ok   %s\n", c->name);
        }
    }
    if (ran == 0) {
        fprintf(stderr, "no test case matched\n");
        return 1;
    }
    fprintf(stderr, "%d passed, %d failed\n", ran - failed, failed);
    return failed ? 1 : 0;
}

#endif
