/* A test node process holding one pipeline stage: a runtime with a transport and a stage actor
 * over a layer range of a model, until stdin closes (tests/integration/test_stage_pipeline.c). */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "actors/serve.h"
#include "kernels/backend.h"
#include "model/llama.h"
#include "shoal/runtime.h"
#include "shoal/transport.h"

/* Usage: shoal_test_stage_node NODE LISTEN_URL MODEL FIRST LAST NEXT [PEER_ID=URL]...
 * NEXT is the next stage's address (0 on the last stage). Prints "READY <bound url> <stage
 * address>" on stdout, then serves until stdin reaches EOF. The stage's context matches the
 * test's: 2 threads, 256 rows, 8 sequences, 4096 positions of KV. */
int main(int argc, char **argv)
{
    if (argc < 7) {
        fprintf(stderr, "usage: %s NODE LISTEN_URL MODEL FIRST LAST NEXT [ID=URL]...\n", argv[0]);
        return 2;
    }
    sh_error e = {0};
    sh_llama *m = NULL;
    sh_backend *be = NULL;
    sh_llama_ctx *c = NULL;
    sh_llama_load_opts lo = {.first = atoi(argv[4]), .last = atoi(argv[5])};
    sh_backend_cpu_opts bo = {.n_threads = 2};
    sh_llama_ctx_opts co = {.max_tokens = 256, .max_seqs = 8, .kv_tokens = 4096};
    if (sh_llama_load(argv[3], &lo, &m, &e) || sh_backend_cpu_create(&bo, &be, &e) ||
        sh_llama_ctx_create(m, be, &co, &c, &e)) {
        fprintf(stderr, "model: %s\n", e.msg);
        return 1;
    }
    sh_runtime_opts ro = {.node_id = (uint32_t)strtoul(argv[1], NULL, 10),
                          .n_loops = 2,
                          .log_level = SH_LOG_LEVEL_WARN};
    sh_runtime *rt = NULL;
    if (sh_runtime_create(&ro, &rt, &e) != SH_OK) {
        fprintf(stderr, "runtime: %s\n", e.msg);
        return 1;
    }
    sh_transport_opts to = {.listen_url = argv[2], .reconnect_max_ms = 200};
    sh_transport *tp = NULL;
    if (sh_transport_create(rt, &to, &tp, &e) != SH_OK) {
        fprintf(stderr, "transport: %s\n", e.msg);
        return 1;
    }
    for (int i = 7; i < argc; i++) {
        char *eq = strchr(argv[i], '=');
        if (!eq || sh_transport_peer_add(tp, (uint32_t)strtoul(argv[i], NULL, 10), eq + 1, &e)) {
            fprintf(stderr, "peer %s: %s\n", argv[i], e.msg);
            return 1;
        }
    }
    sh_stage_args sa = {
        .model = m, .ctx = c, .max_seqs = 8, .next = (sh_addr)strtoull(argv[6], NULL, 10)};
    sh_addr stage = 0;
    if (sh_runtime_register(rt, &sh__stage_vtable, &e) ||
        sh_actor_spawn(rt, "stage", &sa, 1, &stage, &e)) {
        fprintf(stderr, "stage: %s\n", e.msg);
        return 1;
    }
    char url[256];
    sh_transport_listen_url(tp, url, sizeof url);
    printf("READY %s %llu\n", url, (unsigned long long)stage);
    fflush(stdout);
    char buf[64];
    while (read(0, buf, sizeof buf) > 0) {
    }
    sh_transport_close(tp);
    sh_runtime_destroy(rt);
    sh_transport_destroy(tp);
    sh_llama_ctx_destroy(c);
    sh_backend_destroy(be);
    sh_llama_destroy(m);
    return 0;
}
