/* The versions this node claims on the wire and in HELLO: the build's own, unless a testing aid
 * says otherwise (docs/cluster.md, "Testing aids"). */
#ifndef SH_BASE_VERSION_H
#define SH_BASE_VERSION_H

#include <stdint.h>

/* SH_VERSION_STRING, or the environment variable SHOAL_TEST_BUILD_VERSION when it is set to 1-31
 * printable characters. Read once, on the first call; any thread. */
const char *sh__version_build(void);

/* SH_PROTO_VERSION, or SHOAL_TEST_PROTO_VERSION when it is set to a whole number 1..65535. Every
 * frame this process writes carries it and every frame it reads must carry it (runtime/msg.c),
 * so the process behaves as a build of that protocol would. Read once; any thread. */
uint32_t sh__version_proto(void);

#endif
