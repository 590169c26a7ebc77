/* Opening model, tokenizer and script files: only regular files, so that a FIFO or a device given
 * as a model cannot hang or exhaust the program; read-only mapping of a whole file. */
#ifndef SH_BASE_FILE_H
#define SH_BASE_FILE_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "shoal/err.h"

typedef struct sh_file_map {
    const uint8_t *data; /* (size) bytes, read-only; NULL for an empty file */
    size_t size;
} sh_file_map;

/* Opens `path` read-only if it is a regular file, without ever blocking: the type is checked
 * before the open and again on the descriptor. Success: *fd is the open descriptor (the caller
 * closes it) and *size the file's size. Failure: *fd is -1 and the error, which names the path,
 * is SH_EIO (stat/open failed, errno text in e) or SH_EINVAL ("PATH: not a regular file (a
 * FIFO)"; directories, devices and sockets likewise). Any thread. */
sh_err sh__file_open(const char *path, int *fd, uint64_t *size, sh_error *e);

/* Checks that `path` can be opened as sh__file_open would; the same errors. */
sh_err sh__file_check(const char *path, sh_error *e);

/* Reads up to `cap` bytes from the start of the regular file `path` into buf, *n the count (less
 * at the end of the file). Errors as sh__file_open's, or SH_EIO when a read fails. */
sh_err sh__file_read_head(const char *path, void *buf, size_t cap, size_t *n, sh_error *e);

/* Maps `path` read-only and private. With `populate` set the kernel is asked to read the whole
 * file in now (MAP_POPULATE) so that no page fault lands later on a hot path. On failure returns
 * the errors of sh__file_open, or SH_EIO when mmap fails, and leaves *out zeroed. */
sh_err sh__file_map(const char *path, int populate, sh_file_map *out, sh_error *e);

/* Drops this process's pages of the bytes [p, p + n) of a mapping made by sh__file_map: the
 * whole pages inside the range (the partial pages at its ends may hold a neighbour's bytes and
 * stay). The data does not change: a later read faults the page in again from the file (the
 * page cache), so this only lowers the resident set, e.g. once a backend holds its own copy of a
 * weight. The range is also marked no-huge (MADV_NOHUGEPAGE, its own VMA), so that a read of a
 * neighbour in the same 2 MiB cannot map a huge page cache folio over it again; a later read of
 * the range itself maps 4 KiB pages. Never call it on memory not mapped by sh__file_map (on
 * anonymous memory the bytes would read back as zeros). Best effort: a failing madvise leaves
 * the pages resident. */
void sh__file_drop(const void *p, size_t n);

/* Unmaps; accepts a zeroed map. Leaves *m zeroed. */
void sh__file_unmap(sh_file_map *m);

/* The SIGBUS guard, for programs (never the library, which installs no signal handler): a file
 * mapped by sh__file_map that is truncated while mapped makes the next read of a page past its
 * new end raise SIGBUS, which kills the process by default. With the guard installed, such a
 * fault turns the rest of that mapping into zero pages (the read goes on with zeros), writes one
 * line to stderr, and sh__file_damaged() answers true from then on, so that the reader can fail
 * its work with an error instead. A SIGBUS anywhere else keeps the default action. SH_EIO when
 * sigaction fails. Call once, early, from the main thread. */
sh_err sh__file_guard_install(void);

/* True once a guarded mapping faulted (see above); path (cap bytes, may be NULL) gets the first
 * such file's path. Any thread; cheap (one atomic load). */
bool sh__file_damaged(char *path, size_t cap);

#endif
