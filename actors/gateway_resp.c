/* The gateway's POST /v1/responses (and /responses): the request runs as the chat request it
 * amounts to (net/openai_responses.h parses it; tokenization, tools and grammar are chat's), and
 * what comes back is written as a response object or as the Responses API's typed events
 * instead of chat chunks. gateway.c calls these where a chat request would write its chunks.
 * Thread: the gateway's loop. */
#include <stdlib.h>
#include <string.h>

#include "actors/gateway_int.h"
#include "net/openai_responses.h"

struct gw_resp {
    sh_openai_resp s;
    bool started; /* response.created went out */
};

sh_err sh__gateway_resp_create(gw_req *r, const char *echo)
{
    gw_resp *p = calloc(1, sizeof *p);
    if (!p)
        return SH_ENOMEM;
    if (sh_openai_resp_init(&p->s, r->id_str, r->created, r->m->name, echo)) {
        free(p);
        return SH_ENOMEM;
    }
    r->resp = p;
    return SH_OK;
}

void sh__gateway_resp_free(gw_resp *p)
{
    if (!p)
        return;
    sh_openai_resp_fini(&p->s);
    free(p);
}

/* Writes events to the stream; NULL (out of memory) writes nothing and the stream goes on. */
static void put(gw_req *r, const char *ev)
{
    if (ev && ev[0] && r->http)
        sh_http_stream_write(r->http, ev, strlen(ev));
}

static void start(gw_req *r)
{
    if (!r->resp->started) {
        r->resp->started = true;
        put(r, sh_openai_resp_start(&r->resp->s));
    }
}

void sh__gateway_resp_piece(gw_req *r, sh_openai_toolstream *ts, const char *text, size_t len,
                            bool last)
{
    start(r);
    if (!r->tools) {
        put(r, sh_openai_resp_text(&r->resp->s, text, len));
        return;
    }
    const char *content = NULL, *deltas = NULL;
    if (sh_openai_toolstream_feed(ts, text, len, last, &content, &deltas))
        return; // out of memory: this piece is lost, the stream goes on
    if (content)
        put(r, sh_openai_resp_text(&r->resp->s, content, strlen(content)));
    if (deltas)
        put(r, sh_openai_resp_calls(&r->resp->s, deltas));
}

void sh__gateway_resp_finish(gw_req *r, const char *text, size_t len, sh_openai_finish finish,
                             const sh_openai_usage *usage)
{
    sh_openai_resp *s = &r->resp->s;
    if (r->stream) {
        start(r);
        put(r, sh_openai_resp_end(s, finish, usage));
        sh_http_stream_end(r->http);
        return;
    }
    char *content = NULL, *calls = NULL;
    bool ok = true;
    if (r->tools) {
        // The same call ids a chat response would carry (gateway.c's seed for choice 0).
        uint64_t seed = r->id * 0x9E3779B97F4A7C15ull ^ (uint64_t)r->created;
        ok = sh_openai_tools_parse(r->tool_style, text ? text : "", len, seed, &content, &calls) ==
             SH_OK;
        if (ok && content)
            ok = sh_openai_resp_text(s, content, strlen(content)) != NULL;
        if (ok && calls)
            ok = sh_openai_resp_calls(s, calls) != NULL;
    } else if (len) {
        ok = sh_openai_resp_text(s, text, len) != NULL;
    }
    char *body = ok ? sh_openai_resp_json(s, finish, usage) : NULL;
    free(content);
    free(calls);
    if (!body) {
        static const char oom[] = "{\"error\":{\"message\":\"out of memory\",\"type\":"
                                  "\"server_error\",\"param\":null,\"code\":null}}";
        sh_http_respond(r->http, 500, "application/json", oom, sizeof oom - 1);
        return;
    }
    sh_http_respond(r->http, 200, "application/json", body, strlen(body));
    free(body);
}

bool sh__gateway_resp_fail(gw_req *r, const sh_openai_error *err)
{
    if (!r->resp || !r->stream || !r->stream_started || !r->http)
        return false;
    start(r);
    put(r, sh_openai_resp_fail(&r->resp->s, err));
    sh_http_stream_end(r->http);
    return true;
}
