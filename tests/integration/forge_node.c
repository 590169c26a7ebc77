/* A hostile test node (issue 25): connects to a cluster node's listener as an outsider and sends
 * frames whose envelope claims another node's identity, then exits. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "actors/actor_util.h"
#include "runtime/msg.h"
#include "runtime/proto.h"
#include "shoal/runtime.h"
#include "shoal/transport.h"

static void sleep_ms(long ms)
{
    struct timespec ts = {ms / 1000, (ms % 1000) * 1000000L};
    nanosleep(&ts, NULL);
}

/* Usage: shoal_test_forge AS_NODE TO_NODE URL KIND [ACTOR_LO ACTOR_HI [REPEAT]]
 * KIND: control_shutdown (CONTROL SHUTDOWN from AS_NODE's actor 1 to TO_NODE's hello actor),
 * metrics (a METRICS report with the series shoal_forged_total = 42 to TO_NODE's collector, from
 * each actor ACTOR_LO..ACTOR_HI of AS_NODE), step_epoch (a STEP with epoch 2^64-1 to each actor
 * ACTOR_LO..ACTOR_HI of TO_NODE, from AS_NODE's actor 1). Each is sent REPEAT times (default 5),
 * 100 ms apart. Exits 0 once sent, 1 when the link never came up. */
int main(int argc, char **argv)
{
    if (argc < 5) {
        fprintf(stderr, "usage: %s AS_NODE TO_NODE URL KIND [LO HI [REPEAT]]\n", argv[0]);
        return 2;
    }
    uint32_t as = (uint32_t)strtoul(argv[1], NULL, 10), to = (uint32_t)strtoul(argv[2], NULL, 10);
    const char *url = argv[3], *kind = argv[4];
    uint32_t lo = argc > 6 ? (uint32_t)strtoul(argv[5], NULL, 10) : 1;
    uint32_t hi = argc > 6 ? (uint32_t)strtoul(argv[6], NULL, 10) : 1;
    int repeat = argc > 7 ? atoi(argv[7]) : 5;
    sh_runtime_opts ro = {.node_id = as, .log_level = SH_LOG_LEVEL_ERROR};
    sh_runtime *rt = NULL;
    sh_error e = {0};
    if (sh_runtime_create(&ro, &rt, &e) != SH_OK) {
        fprintf(stderr, "runtime: %s\n", e.msg);
        return 1;
    }
    sh_transport_opts tpo = {.reconnect_max_ms = 100};
    sh_transport *tp = NULL;
    if (sh_transport_create(rt, &tpo, &tp, &e) != SH_OK ||
        sh_transport_peer_add(tp, to, url, &e) != SH_OK) {
        fprintf(stderr, "transport: %s\n", e.msg);
        return 1;
    }
    sh_transport_link l = {0};
    for (int i = 0; i < 100 && l.state != SH_LINK_STATE_UP; i++) {
        sleep_ms(50);
        (void)sh_transport_link_get(tp, to, &l);
    }
    if (l.state != SH_LINK_STATE_UP) {
        fprintf(stderr, "link to node %u (%s) never came up\n", (unsigned)to, url);
        return 1;
    }
    int sent = 0;
    for (int r = 0; r < repeat; r++) {
        for (uint32_t a = lo; a <= hi; a++) {
            sh_err err;
            if (!strcmp(kind, "control_shutdown")) {
                sh_proto_control c = {.op = SH_PROTO_CONTROL_OP_SHUTDOWN,
                                      .arg = {"forged by a test", 16}};
                err = sh__act_send(rt, sh_addr_make(as, a), sh_addr_make(to, 1), SH_MSG_CONTROL, 0,
                                   &c, &e);
            } else if (!strcmp(kind, "metrics")) {
                sh_proto_metric v = {.name = {"shoal_forged_total", 18}, .kind = 0, .value = 42};
                sh_proto_metrics m = {.at_us = 1, .values = {.v = &v, .n = 1}};
                err = sh__act_send(rt, sh_addr_make(as, a), sh_addr_make(to, 1), SH_MSG_METRICS, 0,
                                   &m, &e);
            } else if (!strcmp(kind, "step_epoch")) {
                sh_proto_step s = {.epoch = UINT64_MAX};
                err = sh__act_send(rt, sh_addr_make(as, 1), sh_addr_make(to, a), SH_MSG_STEP, 0, &s,
                                   &e);
            } else {
                fprintf(stderr, "unknown KIND '%s'\n", kind);
                return 2;
            }
            if (err == SH_OK)
                sent++;
            else
                fprintf(stderr, "send: %s\n", e.msg);
        }
        sleep_ms(100);
    }
    sleep_ms(200);
    printf("SENT %d\n", sent);
    sh_transport_destroy(tp);
    sh_runtime_destroy(rt);
    return 0;
}
