/* For actors that run libuv I/O of their own (the gateway's HTTP server): the actor's loop. */
#ifndef SH_RUNTIME_ACTOR_UV_H
#define SH_RUNTIME_ACTOR_UV_H

#include <uv.h>

#include "shoal/runtime.h"

/* The libuv loop the calling actor runs on. Handles the actor opens on it run their callbacks on
 * the same thread as its vtable members, so they may use the actor's state freely. The actor must
 * start closing every handle it opened in its stop member; the loop keeps running until they are
 * closed before the runtime joins its thread. Loop thread only. */
uv_loop_t *sh__actor_uv_loop(sh_actor_ctx *ctx);

#endif
