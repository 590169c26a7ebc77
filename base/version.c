/* The versions this node claims (base/version.h). The two environment variables exist only so
 * that tests can start a node of "another" build or protocol; they are read here and nowhere
 * else. */
#include "base/version.h"

#include <pthread.h>
#include <stdbool.h>
#include <stdlib.h>
#include <string.h>

#include "shoal/version.h"

static pthread_once_t once = PTHREAD_ONCE_INIT;
static char build[32] = SH_VERSION_STRING;
static uint32_t proto = SH_PROTO_VERSION;

static void read_env(void)
{
    const char *b = getenv("SHOAL_TEST_BUILD_VERSION");
    size_t n = b ? strlen(b) : 0;
    bool ok = n > 0 && n < sizeof build;
    for (size_t i = 0; ok && i < n; i++)
        ok = b[i] > ' ' && b[i] < 127;
    if (ok)
        memcpy(build, b, n + 1);
    const char *p = getenv("SHOAL_TEST_PROTO_VERSION");
    if (p && *p) {
        char *end;
        unsigned long v = strtoul(p, &end, 10);
        if (!*end && v >= 1 && v <= 65535)
            proto = (uint32_t)v;
    }
}

const char *sh__version_build(void)
{
    pthread_once(&once, read_env);
    return build;
}

uint32_t sh__version_proto(void)
{
    pthread_once(&once, read_env);
    return proto;
}
