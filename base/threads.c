/* Fan-out of a few jobs onto short-lived threads (base/threads.h). */
#include "base/threads.h"

#include <pthread.h>
#include <stdbool.h>

int sh__threads_count(int requested, uint64_t n_units)
{
    int n = requested < 1 ? 1 : requested > SH_THREADS_MAX ? SH_THREADS_MAX : requested;
    if (n_units >= 1 && (uint64_t)n > n_units)
        n = (int)n_units;
    return n;
}

void sh__threads_run(int n, void *(*fn)(void *), void *jobs, size_t job_size)
{
    pthread_t th[SH_THREADS_MAX];
    bool started[SH_THREADS_MAX] = {false};
    char *base = jobs;
    if (n > SH_THREADS_MAX)
        n = SH_THREADS_MAX;
    for (int i = 1; i < n; i++)
        started[i] = pthread_create(&th[i], NULL, fn, base + (size_t)i * job_size) == 0;
    fn(base);
    for (int i = 1; i < n; i++) {
        if (started[i])
            pthread_join(th[i], NULL);
        else
            fn(base + (size_t)i * job_size);
    }
}
