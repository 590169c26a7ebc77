/* Typed message bodies generated from runtime/proto_table.h, and their encoder and decoder. */
#ifndef SH_RUNTIME_PROTO_H
#define SH_RUNTIME_PROTO_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include "runtime/msg.h"
#include "runtime/proto_table.h"
#include "shoal/addr.h"
#include "shoal/err.h"

/* Views point into the frame and are zero-copy: a decoded body is valid only while its frame (and
 * the arena, for lists) is. Element arrays are packed little-endian and NOT aligned (a bin's
 * payload starts wherever its header ends), so read elements with the accessors below, which
 * compile to plain unaligned loads. To encode, point a view at host arrays: Shoal requires a
 * little-endian host, where host order is wire order. */
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error                                                                                             \
    "the Shoal wire format maps packed little-endian arrays directly; big-endian hosts are unsupported"
#endif

typedef struct sh_strv {
    const char *ptr; /* len bytes, not NUL-terminated */
    uint32_t len;
} sh_strv;

typedef struct sh_i32s {
    const void *ptr; /* n packed little-endian int32 */
    uint32_t n;
} sh_i32s;

typedef struct sh_f32s {
    const void *ptr; /* n packed little-endian IEEE float32 */
    uint32_t n;
} sh_f32s;

typedef struct sh_u64s {
    const void *ptr; /* n packed little-endian uint64 */
    uint32_t n;
} sh_u64s;

typedef struct sh_f64s {
    const void *ptr; /* n packed little-endian IEEE float64 */
    uint32_t n;
} sh_f64s;

typedef struct sh_strv_list {
    const sh_strv *v; /* n entries, in the decode arena (or the caller's array when encoding) */
    uint32_t n;
} sh_strv_list;

/* Element i (< n) of a view. */
static inline int32_t sh_i32s_at(sh_i32s v, uint32_t i)
{
    int32_t x;
    memcpy(&x, (const char *)v.ptr + 4 * (size_t)i, 4);
    return x;
}
static inline float sh_f32s_at(sh_f32s v, uint32_t i)
{
    float x;
    memcpy(&x, (const char *)v.ptr + 4 * (size_t)i, 4);
    return x;
}
static inline uint64_t sh_u64s_at(sh_u64s v, uint32_t i)
{
    uint64_t x;
    memcpy(&x, (const char *)v.ptr + 8 * (size_t)i, 8);
    return x;
}
static inline double sh_f64s_at(sh_f64s v, uint32_t i)
{
    double x;
    memcpy(&x, (const char *)v.ptr + 8 * (size_t)i, 8);
    return x;
}

/* Tensor element types; the values are the GGUF / sh_dtype ids (model/dtype.h). */
enum {
    SH_PROTO_DTYPE_F32 = 0,
    SH_PROTO_DTYPE_F16 = 1,
    SH_PROTO_DTYPE_I8 = 24, /* ACT only: with one F32 scale per row (SH_PROTO_FIELDS_act) */
    SH_PROTO_DTYPE_BF16 = 30,
};
#define SH_PROTO_MAX_DIMS 4

/* A tensor travelling in a frame, row-major (shape[0] outermost). */
typedef struct sh_proto_tensor {
    uint32_t dtype;                    /* SH_PROTO_DTYPE_* */
    uint32_t ndim;                     /* 1..SH_PROTO_MAX_DIMS */
    uint64_t shape[SH_PROTO_MAX_DIMS]; /* each >= 1; entries past ndim are 0 */
    /* nbytes = product(shape) * element size, in the frame, unaligned; NULL (and nbytes 0) when
     * the data travels out of band (no such path exists yet) and only the shape is sent. */
    const void *data;
    uint64_t nbytes;
} sh_proto_tensor;

/* Bytes of one element of dtype, or 0 when the dtype may not travel. */
size_t sh__proto_dtype_size(uint32_t dtype);

/* Enumerations carried in U8 fields. */
typedef enum sh_proto_finish {
    SH_PROTO_FINISH_STOP = 0,     /* end-of-sequence token or a stop string */
    SH_PROTO_FINISH_LENGTH = 1,   /* max_tokens or the context length */
    SH_PROTO_FINISH_CANCEL = 2,   /* CANCEL or the client went away */
    SH_PROTO_FINISH_DEADLINE = 3, /* the deadline passed */
} sh_proto_finish;

typedef enum sh_proto_control_op {
    SH_PROTO_CONTROL_OP_PAUSE = 0,
    SH_PROTO_CONTROL_OP_RESUME = 1,
    SH_PROTO_CONTROL_OP_REROUTE = 2, /* targets: the new addresses */
    SH_PROTO_CONTROL_OP_DEGRADE = 3, /* level: the degradation level */
    SH_PROTO_CONTROL_OP_SHUTDOWN = 4,
    SH_PROTO_CONTROL_OP_RESET = 5, /* kvmgr: forget every sequence and cached block */
    /* a standby node's hello actor: take over the plan's stages listed in targets (each the
     * stage's index | the rank of its tensor-parallel group << 32, 0 for a stage of one node),
     * then answer HELLO with their new addresses */
    SH_PROTO_CONTROL_OP_PROMOTE = 6,
    /* the front's watchdog to its supervisor (actors/supervisor.h), within the process only:
     * node `level` (the script's index) was judged dead (arg: why), or answers again */
    SH_PROTO_CONTROL_OP_NODE_DEAD = 7,
    SH_PROTO_CONTROL_OP_NODE_ALIVE = 8,
    /* the front to every rank of a tensor-parallel stage after a standby took a rank's place:
     * targets are the group's rank addresses (rank order) then the lowest epoch the group may
     * form anew with, arg the ranks' network-collective URLs one per line ("" for a group over
     * shared memory); each rank forms its group anew with them at its next step */
    SH_PROTO_CONTROL_OP_REGROUP = 9,
} sh_proto_control_op;

typedef enum sh_proto_fault_action {
    SH_PROTO_FAULT_ACTION_DROP = 0,
    SH_PROTO_FAULT_ACTION_DELAY = 1,
    SH_PROTO_FAULT_ACTION_DUPLICATE = 2,
    SH_PROTO_FAULT_ACTION_CORRUPT = 3,
    SH_PROTO_FAULT_ACTION_PARTITION = 4,
} sh_proto_fault_action;

typedef enum sh_proto_health {
    SH_PROTO_HEALTH_OK = 0,
    SH_PROTO_HEALTH_DEGRADED = 1,
    SH_PROTO_HEALTH_FAILING = 2,
} sh_proto_health;

/* The C type of each field kind (see proto_table.h). */
#define SH__PROTO_CTYPE_BOOL(sub) bool
#define SH__PROTO_CTYPE_U8(sub) uint8_t
#define SH__PROTO_CTYPE_U32(sub) uint32_t
#define SH__PROTO_CTYPE_U64(sub) uint64_t
#define SH__PROTO_CTYPE_ADDR(sub) sh_addr
#define SH__PROTO_CTYPE_I32(sub) int32_t
#define SH__PROTO_CTYPE_I64(sub) int64_t
#define SH__PROTO_CTYPE_F32(sub) float
#define SH__PROTO_CTYPE_F64(sub) double
#define SH__PROTO_CTYPE_STR(sub) sh_strv
#define SH__PROTO_CTYPE_I32S(sub) sh_i32s
#define SH__PROTO_CTYPE_F32S(sub) sh_f32s
#define SH__PROTO_CTYPE_U64S(sub) sh_u64s
#define SH__PROTO_CTYPE_F64S(sub) sh_f64s
#define SH__PROTO_CTYPE_STRS(sub) sh_strv_list
#define SH__PROTO_CTYPE_TENSOR(sub) sh_proto_tensor
#define SH__PROTO_CTYPE_STRUCT(sub) sh_proto_##sub
#define SH__PROTO_CTYPE_LIST(sub) sh_proto_##sub##_list

/* sh_proto_<name> with one member per table line (the table documents them), and
 * sh_proto_<name>_list, the type of a LIST of them: `n` entries at `v`. */
#define SH__PROTO_MEMBER_(S, m, key, kind, sub, req, lo, hi) SH__PROTO_CTYPE_##kind(sub) m;
#define SH__PROTO_TYPEDEF_(name, chk)                                                              \
    typedef struct sh_proto_##name {                                                               \
        SH_PROTO_FIELDS_##name(SH__PROTO_MEMBER_, _)                                               \
    } sh_proto_##name;                                                                             \
    typedef struct sh_proto_##name##_list {                                                        \
        const sh_proto_##name *v;                                                                  \
        uint32_t n;                                                                                \
    } sh_proto_##name##_list;
SH_PROTO_STRUCTS(SH__PROTO_TYPEDEF_)
#undef SH__PROTO_TYPEDEF_
#undef SH__PROTO_MEMBER_

/* Any message body; the envelope's type says which member is live. */
typedef union sh_proto_body {
#define SH__PROTO_UNION_(NAME, id, body) sh_proto_##body body;
    SH_PROTO_MESSAGES(SH__PROTO_UNION_)
#undef SH__PROTO_UNION_
} sh_proto_body;

/* A bump allocator over caller memory for the parts of a body that cannot be views into the
 * frame: LIST entries and STRS entries. The decoder never allocates otherwise. */
typedef struct sh_proto_arena {
    uint8_t *mem;
    size_t cap;
    size_t used; /* a failed decode leaves it where it was */
} sh_proto_arena;

static inline void sh__proto_arena_init(sh_proto_arena *a, void *mem, size_t cap)
{
    a->mem = mem;
    a->cap = mem ? cap : 0;
    a->used = 0;
}

/* Forgets everything decoded into the arena. */
static inline void sh__proto_arena_reset(sh_proto_arena *a) { a->used = 0; }

/* An arena of this many bytes always suffices for a body of body_len bytes: every arena entry
 * costs at least one byte of the body, and no entry is larger than the largest list element. */
size_t sh__proto_arena_bound(size_t body_len);

/* Encodes a whole frame (envelope and body) of type h->type, `body` pointing to the matching
 * sh_proto_<body> struct, appended to b. Validates as the decoder does (types, bounds, tensor
 * sizes, cross-field rules), so it never produces a frame a receiver with default limits would
 * refuse for its contents. Returns SH_EINVAL (the offending field in e) for an invalid body or
 * unknown type, SH_ENOMEM when a growable buffer cannot grow, SH_ERANGE when a fixed one is full;
 * on failure b is left as it was. The buffer allocates only when it must grow. */
sh_err sh__proto_encode(sh_buf *b, const sh_msg_hdr *h, const void *body, sh_error *e);

/* Typed wrappers: the same, with hdr->type ignored and set from the function. */
#define SH__PROTO_ENCODE_DECL_(NAME, id, body)                                                     \
    sh_err sh__proto_encode_##body(sh_buf *b, const sh_msg_hdr *h, const sh_proto_##body *m,       \
                                   sh_error *e);
SH_PROTO_MESSAGES(SH__PROTO_ENCODE_DECL_)
#undef SH__PROTO_ENCODE_DECL_

/* Decodes a body of `type` (len bytes of one msgpack map, as sh__msg_decode() delimits it) into
 * *out. Strings, token arrays and tensors become views into the body; LIST and STRS entries go
 * to `arena`. Unknown keys are skipped; missing REQ fields, duplicated keys, wrong msgpack types,
 * out-of-bounds values or counts, tensor sizes that disagree with shape and dtype, and broken
 * cross-field rules are refused. Returns SH_OK, SH_EFORMAT (malformed msgpack, limits, trailing
 * bytes), SH_EPROTO (contents) or SH_ERANGE (the arena is too small), with one line in e, and
 * counts the outcome in c->stats. On failure *out is unspecified and the arena as it was. */
sh_err sh__proto_decode_body(sh_msg_codec *c, sh_msg_type type, const void *body, size_t len,
                             sh_proto_body *out, sh_proto_arena *arena, sh_error *e);

/* Reads only the unsigned integers of a body (len bytes of one msgpack map, as
 * sh__msg_decode() delimits it) whose top-level keys are keys[0..n-1] (n <= 32), skipping every
 * other value, without decoding or allocating: vals[i] gets key i's value. For a receiver's
 * loop thread, which must sort a frame before its worker decodes it whole. Returns the mask of
 * the keys found with an unsigned value (bit i: keys[i]); 0 also when the body is not a map or
 * is malformed before them (the full decode reports why). */
uint32_t sh__proto_peek_u64s(const void *body, size_t len, const char *const *keys, uint32_t n,
                             uint64_t *vals);

/* sh__msg_decode() then sh__proto_decode_body(): one frame to header and typed body. */
sh_err sh__proto_decode(sh_msg_codec *c, const void *frame, size_t len, sh_msg_env *env,
                        sh_proto_body *out, sh_proto_arena *arena, sh_error *e);

/* Appends an ERROR frame answering `req` (a request's header): same session and trace id, from
 * req->dst back to req->src, with `code` and `message` (truncated to SH_PROTO_MAX_MSG bytes).
 * Returns as sh__proto_encode(). */
sh_err sh__proto_encode_error_reply(sh_buf *b, const sh_msg_hdr *req, sh_err code,
                                    const char *message, sh_error *e);

#endif
