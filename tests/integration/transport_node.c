/* A test node process: a runtime with a transport and an echo actor, until stdin closes. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "runtime/msg.h"
#include "shoal/runtime.h"
#include "shoal/transport.h"

static sh_msg_fate echo_handle(sh_actor_ctx *ctx, void *state, sh_msg *m)
{
    if (sh_msg_header(m)->type == SH_MSG_PING && sh_msg_header(m)->session != 0) {
        size_t n = 0;
        const void *b = sh_msg_body(m, &n);
        (void)sh_reply(ctx, m, SH_MSG_PONG, b, n, NULL);
    }
    return SH_MSG_FATE_DONE;
}
static const sh_actor_vtable echo_vt = {.name = "echo", .handle = echo_handle};

/* Usage: shoal_test_node NODE LISTEN_URL [PEER_ID=URL]...
 * Prints "READY <bound url> <echo address>" on stdout, then serves until stdin reaches EOF. */
int main(int argc, char **argv)
{
    if (argc < 3) {
        fprintf(stderr, "usage: %s NODE LISTEN_URL [ID=URL]...\n", argv[0]);
        return 2;
    }
    sh_runtime_opts ro = {.node_id = (uint32_t)strtoul(argv[1], NULL, 10),
                          .log_level = SH_LOG_LEVEL_ERROR};
    sh_runtime *rt = NULL;
    sh_error e = {0};
    if (sh_runtime_create(&ro, &rt, &e) != SH_OK) {
        fprintf(stderr, "runtime: %s\n", e.msg);
        return 1;
    }
    sh_transport_opts to = {.listen_url = argv[2], .reconnect_max_ms = 200};
    sh_transport *tp = NULL;
    if (sh_transport_create(rt, &to, &tp, &e) != SH_OK) {
        fprintf(stderr, "transport: %s\n", e.msg);
        sh_runtime_destroy(rt);
        return 1;
    }
    for (int i = 3; i < argc; i++) {
        char *eq = strchr(argv[i], '=');
        if (!eq || sh_transport_peer_add(tp, (uint32_t)strtoul(argv[i], NULL, 10), eq + 1, &e)) {
            fprintf(stderr, "peer %s: %s\n", argv[i], e.msg);
            return 1;
        }
    }
    sh_addr echo = 0;
    if (sh_runtime_register(rt, &echo_vt, &e) || sh_actor_spawn(rt, "echo", NULL, 0, &echo, &e)) {
        fprintf(stderr, "echo: %s\n", e.msg);
        return 1;
    }
    char url[256];
    sh_transport_listen_url(tp, url, sizeof url);
    printf("READY %s %llu\n", url, (unsigned long long)echo);
    fflush(stdout);
    char buf[64];
    while (read(0, buf, sizeof buf) > 0) {
    }
    sh_transport_close(tp);
    sh_runtime_destroy(rt);
    sh_transport_destroy(tp);
    return 0;
}
