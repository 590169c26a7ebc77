/* Tensor parallelism of the Llama-family model: a rank's share of the heads, FFN rows,
 * vocabulary and experts (sh_llama_tp), and its slices of the weights, for the loader. */
#ifndef SH_MODEL_LLAMA_TP_H
#define SH_MODEL_LLAMA_TP_H

#include "kernels/backend.h"
#include "model/llama.h"

/* Plans rank `rank` of `size` from m->hp, m->first and m->last into m->tp (size 0 or 1: the whole
 * stage). Refuses what cannot be split (see sh_llama_load_opts): SH_EINVAL or SH_EUNSUPPORTED
 * with e filled, m->tp left whole. */
sh_err sh__llama_tp_plan(sh_llama *m, int32_t rank, int32_t size, sh_error *e);

/* Replaces the whole-model views that the loader bound (layers [first, last) and the head) by
 * this rank's slices: views for the column-parallel matrices and experts, copies of the column
 * slices of wo and w_down (only the slice is read from the mapping, whose pages of w are dropped
 * after; sh__llama_tp_hold). A slice that cuts a block:
 * SH_EINVAL naming the tensor, its width, the slice and the block. SH_ENOMEM. Nothing to do for a
 * size of 1. */
sh_err sh__llama_tp_slice(sh_llama *m, sh_error *e);

/* Rank r's share [*start, *start + *count) of n items cut into `size` balanced contiguous
 * shares, the larger ones first (the split of heads and vocabulary rows). */
void sh__llama_tp_rows(int32_t n, int32_t r, int32_t size, int32_t *start, int32_t *count);

/* Whether p is one of the rank's own copies (sh__llama_tp_hold prepares those, not the
 * loader's each-matrix pass). */
bool sh__llama_tp_owns(const sh_llama *m, const void *p);

/* A context's hold on the rank's copies: each is refilled if it was dropped, then, with
 * `prepare`, handed to sh_backend_weight_prepare; one the backend now holds a copy of is no
 * longer read by this context, and its pages are dropped when no other live context reads it.
 * *holds (the caller frees it with sh__llama_tp_let_go, also after a failure) says what was
 * done to each. SH_ENOMEM, or the prepare's error (not SH_EUNSUPPORTED: that copy is read as it
 * is), with e filled. */
sh_err sh__llama_tp_hold(const sh_llama *m, sh_backend *be, bool prepare, uint8_t **holds,
                         sh_error *e);

/* Ends a context's hold: releases what it prepared, drops copies no live context reads. */
void sh__llama_tp_let_go(const sh_llama *m, sh_backend *be, uint8_t *holds);

/* Unmaps the copies. */
void sh__llama_tp_free(sh_llama *m);

#endif
