/* Internal: the field descriptors that proto.c generates from proto_table.h, shared by the
 * encoder (proto.c) and the decoder (proto_dec.c). */
#ifndef SH_RUNTIME_PROTO_DESC_H
#define SH_RUNTIME_PROTO_DESC_H

#include <stdbool.h>
#include <stdint.h>

#include "runtime/msg.h"

/* Field kinds (proto_table.h). */
typedef enum sh_proto_kind {
    SH_PROTO_KIND_BOOL,
    SH_PROTO_KIND_U8,
    SH_PROTO_KIND_U32,
    SH_PROTO_KIND_U64,
    SH_PROTO_KIND_ADDR,
    SH_PROTO_KIND_I32,
    SH_PROTO_KIND_I64,
    SH_PROTO_KIND_F32,
    SH_PROTO_KIND_F64,
    SH_PROTO_KIND_STR,
    SH_PROTO_KIND_I32S,
    SH_PROTO_KIND_F32S,
    SH_PROTO_KIND_U64S,
    SH_PROTO_KIND_F64S,
    SH_PROTO_KIND_STRS,
    SH_PROTO_KIND_TENSOR,
    SH_PROTO_KIND_STRUCT,
    SH_PROTO_KIND_LIST,
} sh_proto_kind;

typedef struct sh_proto_desc sh_proto_desc;

typedef struct sh_proto_field {
    const char *key;  /* on the wire */
    const char *name; /* the C member, for messages */
    uint8_t kind;
    uint8_t required;
    uint32_t offset;
    const sh_proto_desc *sub; /* STRUCT, LIST: the element's description */
    int64_t lo, hi; /* value bounds, or count bounds for STR, views, STRS, LIST; 0,0: none */
} sh_proto_field;

/* A cross-field rule, shared by both directions; on failure it fills e (code SH_EPROTO) and
 * *why, and returns false. */
typedef bool (*sh_proto_check_fn)(const void *s, sh_msg_reject *why, sh_error *e);

struct sh_proto_desc {
    const char *name;
    size_t size;
    const sh_proto_field *fields;
    uint32_t n_fields; /* <= 64: decoding tracks the keys seen in one 64-bit mask */
    sh_proto_check_fn check;
};

/* The description of a message type's body, or NULL for an unknown type. */
const sh_proto_desc *sh__proto_body_desc(uint64_t type);

/* Bytes of a tensor with this dtype and shape; false when the dtype may not travel, ndim or a
 * dimension is out of bounds, or the size overflows what one msgpack bin can hold. */
bool sh__proto_tensor_bytes(uint32_t dtype, uint32_t ndim, const uint64_t *shape, uint64_t *out);

/* Whether v lies within a field's bounds (always, when the field has none). */
static inline bool sh__proto_in_bounds(const sh_proto_field *f, int64_t v)
{
    return (f->lo == 0 && f->hi == 0) || (v >= f->lo && v <= f->hi);
}

#endif
