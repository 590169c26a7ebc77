/* The batcher's embeddings: a request with SUBMIT.embed is a prefill with no decode. Each step
 * of its sequence (step_seq.embed, never sampled) brings the chunk's pooled part from the last
 * stage (step_out.embd: actors/stage.c); they are combined here and, after the last chunk, the
 * L2-normalised vector goes to the gateway in DONE. The sequence takes nothing from the prefix
 * cache (its KV_ALLOCs carry no token ids), so it computes every position from 0 on each
 * admission (a preempted one starts over: admit clears emb_has). Thread: the batcher's loop. */
#include <inttypes.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "actors/batcher_int.h"

void sh__batcher_embed_answer(batcher *b, bseq *s, const sh_proto_step_out *o)
{
    breq *r = s->r;
    int32_t dim = (int32_t)o->embd.n;
    bool first = !s->emb_has;
    if (dim > 0) {
        if (!s->emb_sum) {
            s->emb_sum = calloc((size_t)dim, sizeof *s->emb_sum);
            s->emb_vec = calloc((size_t)dim, sizeof *s->emb_vec);
            if (!s->emb_sum || !s->emb_vec) {
                sh__batcher_req_fail(b, r, SH_ENOMEM, 503, "out of memory for an embedding");
                return;
            }
            s->emb_dim = dim;
        } else if (dim != s->emb_dim) {
            sh__batcher_req_fail(b, r, SH_EPROTO, 500,
                                 "the stage answered embedding parts of different widths");
            return;
        }
        for (int32_t j = 0; j < dim; j++) {
            double v = sh_f32s_at(o->embd, (uint32_t)j);
            /* mean adds the chunks' sums; cls keeps position 0's row; last the latest row */
            s->emb_sum[j] = r->embed == 1 && !first ? s->emb_sum[j] + v : v;
        }
        s->emb_has = true;
    }
    if (s->n_computed < s->n_toks)
        return; /* more chunks to come */
    if (!s->emb_has) {
        sh__batcher_req_fail(b, r, SH_EPROTO, 500,
                             "the last stage answered no embedding (an older stage?)");
        return;
    }
    double norm = 0;
    double div = r->embed == 1 ? (double)s->n_toks : 1.0;
    for (int32_t j = 0; j < s->emb_dim; j++) {
        double v = s->emb_sum[j] / div;
        norm += v * v;
    }
    norm = sqrt(norm);
    for (int32_t j = 0; j < s->emb_dim; j++)
        s->emb_vec[j] = (float)(norm > 0 ? s->emb_sum[j] / div / norm : 0.0);
    sh__batcher_seq_finish(b, s, SH_PROTO_FINISH_STOP);
}
