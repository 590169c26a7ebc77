/* Test node processes (shoal_test_node) for the multi-process transport tests. */
#ifndef SH_TEST_PROC_UTIL_H
#define SH_TEST_PROC_UTIL_H

#include <dirent.h>
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>

#include "test_transport_util.h"

extern char **environ;

typedef struct child {
    pid_t pid;
    int in_fd; /* closing it stops the child cleanly */
    char url[256];
    sh_addr echo;
} child;

/* Starts shoal_test_node NODE LISTEN PEERS... and waits for its READY line. */
static inline int child_start(child *c, const char *const *args)
{
    int in[2], out[2];
    if (pipe(in) || pipe(out))
        return -1;
    posix_spawn_file_actions_t fa;
    posix_spawn_file_actions_init(&fa);
    posix_spawn_file_actions_adddup2(&fa, in[0], 0);
    posix_spawn_file_actions_adddup2(&fa, out[1], 1);
    posix_spawn_file_actions_addclose(&fa, in[1]);
    posix_spawn_file_actions_addclose(&fa, out[0]);
    char *argv[16];
    int n = 0;
    argv[n++] = (char *)SH_TEST_NODE;
    for (; args[n - 1] && n < 15; n++)
        argv[n] = (char *)args[n - 1];
    argv[n] = NULL;
    int rv = posix_spawn(&c->pid, SH_TEST_NODE, &fa, NULL, argv, environ);
    posix_spawn_file_actions_destroy(&fa);
    close(in[0]);
    close(out[1]);
    c->in_fd = in[1];
    fcntl(c->in_fd, F_SETFD, FD_CLOEXEC);
    if (rv) {
        close(out[0]);
        return -1;
    }
    char line[512];
    size_t len = 0;
    uint64_t end = now_ms() + sh_test_ms(10000);
    while (len < sizeof line - 1 && now_ms() < end) {
        struct pollfd p = {.fd = out[0], .events = POLLIN};
        if (poll(&p, 1, 100) <= 0)
            continue;
        ssize_t k = read(out[0], line + len, 1);
        if (k <= 0)
            break;
        if (line[len++] == '\n')
            break;
    }
    line[len] = '\0';
    close(out[0]);
    unsigned long long echo = 0;
    if (sscanf(line, "READY %255s %llu", c->url, &echo) != 2) {
        fprintf(stderr, "child said: '%s'\n", line);
        return -1;
    }
    c->echo = (sh_addr)echo;
    return 0;
}

/* Clean stop: stdin EOF; the child must exit 0. */
static inline int child_stop(child *c)
{
    close(c->in_fd);
    int st = 0;
    waitpid(c->pid, &st, 0);
    return WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st);
}

static inline void child_kill(child *c)
{
    kill(c->pid, SIGKILL);
    close(c->in_fd);
    waitpid(c->pid, NULL, 0);
}

/* Open descriptors of this process (-1 when /proc is missing). */
static inline int fd_count(void)
{
    int n = 0;
    DIR *d = opendir("/proc/self/fd");
    if (!d)
        return -1;
    while (readdir(d))
        n++;
    closedir(d);
    return n;
}

#endif
