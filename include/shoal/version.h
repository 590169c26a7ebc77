/* Version of the Shoal library and of the wire protocol between nodes. */
#ifndef SHOAL_VERSION_H
#define SHOAL_VERSION_H

#ifdef __cplusplus
extern "C" {
#endif

#define SH_VERSION_MAJOR 0
#define SH_VERSION_MINOR 1
#define SH_VERSION_PATCH 0
#define SH_VERSION_STRING "0.1.0"

/* Every frame between nodes carries this magic and protocol version (DESIGN.md section 3). */
#define SH_PROTO_MAGIC 0x5348u /* "SH" */
#define SH_PROTO_VERSION 3u

/* The library's version string at run time ("MAJOR.MINOR.PATCH"); may differ from the header
 * a program was compiled against. Any thread. */
const char *sh_version(void);

#ifdef __cplusplus
}
#endif

#endif
