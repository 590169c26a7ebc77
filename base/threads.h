/* Fan-out of a few jobs onto short-lived threads, for one-shot batch work (model writing and
 * conversion) that has no worker pool of its own. */
#ifndef SH_BASE_THREADS_H
#define SH_BASE_THREADS_H

#include <stddef.h>
#include <stdint.h>

/* Most jobs sh__threads_run takes. */
#define SH_THREADS_MAX 64

/* The number of jobs to split n_units of work into for `requested` threads: clamped to
 * [1, SH_THREADS_MAX] and to at most n_units (at least 1). */
int sh__threads_count(int requested, uint64_t n_units);

/* Runs fn(job i) for the n jobs laid out in `jobs` (job i at (char *)jobs + i * job_size),
 * n in [1, SH_THREADS_MAX]: job 0 on the calling thread, each other one on a thread of its own,
 * and on the calling thread instead any job whose thread cannot be started. Returns when every
 * job has finished; fn's return value is ignored (jobs report through their own fields). Blocks;
 * any thread. */
void sh__threads_run(int n, void *(*fn)(void *), void *jobs, size_t job_size);

#endif
