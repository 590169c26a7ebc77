/* Read-only memory mapping of a whole file, shared by the model loaders. */
#ifndef SH_RUNTIME_FILE_H
#define SH_RUNTIME_FILE_H

#include <stddef.h>
#include <stdint.h>

#include "shoal/err.h"

typedef struct sh_file_map {
    const uint8_t *data; /* (size) bytes, read-only; NULL for an empty file */
    size_t size;
} sh_file_map;

/* Maps `path` read-only and private. With `populate` set the kernel is asked to read the whole
 * file in now (MAP_POPULATE) so that no page fault lands later on a hot path. On failure returns
 * SH_EIO (open/stat/mmap failed, errno text in e) or SH_EINVAL (a directory or not a regular
 * file) and leaves *out zeroed. */
sh_err sh__file_map(const char *path, int populate, sh_file_map *out, sh_error *e);

/* Unmaps; accepts a zeroed map. Leaves *m zeroed. */
void sh__file_unmap(sh_file_map *m);

#endif
