/* The wire envelope of every message between actors: encoding, strict decoding and counters. */
#ifndef SH_RUNTIME_MSG_H
#define SH_RUNTIME_MSG_H

#include <stddef.h>
#include <stdint.h>

#include "runtime/mpack_write.h"
#include "runtime/proto_table.h"
#include "shoal/addr.h"
#include "shoal/err.h"

/* A frame (DESIGN.md section 3) is one msgpack array of exactly eight values:
 *
 *     [magic, proto_version, type, session, src, dst, trace_id, body]
 *
 * magic (SH_PROTO_MAGIC), proto_version (SH_PROTO_VERSION), type (sh_msg_type), session, src,
 * dst (sh_addr) and trace_id are unsigned integers; body is a map whose layout the type fixes
 * (runtime/proto.h). Because the writer uses the shortest encodings, every frame starts with the
 * bytes 98 cd 53 48 (fixarray 8, uint16 0x5348), which makes frames easy to spot in a dump.
 * Nothing may follow the array. A frame that changes this layout needs a new SH_PROTO_VERSION.
 *
 * Between nodes a frame is sealed: the 4-byte CRC-32C (runtime/crc32c.h) of the array's bytes
 * follows it, little-endian (protocol version 2 on). The sender's runtime seals a frame for
 * another node before its send filter (the fault layer) sees it, and the receiver's runtime
 * checks and strips the trailer before anything reads the frame (sh__msg_unseal()), so bytes
 * changed anywhere in between, the trailer included, are caught: a frame that fails the check
 * is counted and dropped unread and unanswered, since none of its fields can be trusted. Frames
 * that stay on their node carry no trailer; sh__msg_decode() sees unsealed frames only.
 *
 * Error codes: SH_EFORMAT for bytes that are not a Shoal frame (msgpack errors, truncation, size
 * and depth limits, trailing bytes, a wrong envelope layout or magic); SH_EPROTO for a well-formed
 * frame that breaks the protocol (another protocol version, an unknown type, a body with wrong,
 * missing, duplicated or out-of-range fields). Every rejection fills the sh_error with one line
 * naming the field and byte offset, and counts one reason in the codec's stats. */

/* Message types; the values are wire ids, assigned once and never reused. */
typedef enum sh_msg_type {
#define SH__MSG_ENUM_(NAME, id, body) SH_MSG_##NAME = id,
    SH_PROTO_MESSAGES(SH__MSG_ENUM_)
#undef SH__MSG_ENUM_
        SH_MSG_TYPE_LIMIT_ /* one past the largest id; ids are appended in increasing order */
} sh_msg_type;

/* Why a frame or body was rejected; one counter each in sh_msg_stats. */
typedef enum sh_msg_reject {
    SH_MSG_REJECT_TRUNCATED,  /* a header, payload or declared count runs past the end */
    SH_MSG_REJECT_SYNTAX,     /* not msgpack (the reserved byte 0xc1) */
    SH_MSG_REJECT_OVERSIZE,   /* frame longer than the codec's max_frame */
    SH_MSG_REJECT_DEPTH,      /* containers nested deeper than the codec's max_depth */
    SH_MSG_REJECT_TRAILING,   /* bytes after the envelope array or the body map */
    SH_MSG_REJECT_ENVELOPE,   /* not an array of eight, or an envelope field of the wrong type */
    SH_MSG_REJECT_MAGIC,      /* magic is not SH_PROTO_MAGIC */
    SH_MSG_REJECT_VERSION,    /* proto_version is not SH_PROTO_VERSION */
    SH_MSG_REJECT_TYPE,       /* unknown message type */
    SH_MSG_REJECT_FIELD_TYPE, /* a body field or key of the wrong msgpack type */
    SH_MSG_REJECT_MISSING,    /* a required body field is absent */
    SH_MSG_REJECT_DUPLICATE,  /* a body key appears twice */
    SH_MSG_REJECT_RANGE,      /* a value, length or count outside the table's bounds */
    SH_MSG_REJECT_SHAPE,      /* a tensor's bytes or a list's length disagree with its shape */
    SH_MSG_REJECT_ARENA,      /* the caller's decode arena is too small (SH_ERANGE) */
    SH_MSG_REJECT_CHECKSUM,   /* a sealed frame's CRC-32C trailer does not match (or is cut) */
    SH_MSG_REJECT_COUNT_
} sh_msg_reject;

/* Counters of one codec. Each failed decode call counts exactly one reason; frames_ok counts
 * envelopes accepted by sh__msg_decode(), bodies_ok bodies accepted by the body decoder. */
typedef struct sh_msg_stats {
    uint64_t frames_ok;
    uint64_t bodies_ok;
    uint64_t ok_by_type[SH_MSG_TYPE_LIMIT_]; /* envelopes accepted, by type */
    uint64_t rejected[SH_MSG_REJECT_COUNT_];
} sh_msg_stats;

#define SH_MSG_MAX_FRAME_DEFAULT ((size_t)128 << 20) /* fits a 4096 x 8192 f16 activation */
#define SH_MSG_MAX_DEPTH_DEFAULT 16u                 /* the deepest body nests 7 containers */

/* Limits and counters for decoding. The caller owns it (one per loop or connection; there is no
 * global codec); it is not thread-safe. Change the limits between calls as needed. */
typedef struct sh_msg_codec {
    size_t max_frame;   /* frames (and bodies) longer than this are rejected */
    uint32_t max_depth; /* envelope array = 1, body map = 2; clamped to SH_MPACK_DEPTH_MAX */
    sh_msg_stats stats;
} sh_msg_codec;

/* Default limits and zeroed counters. */
void sh__msg_codec_init(sh_msg_codec *c);

/* The envelope fields a sender chooses. */
typedef struct sh_msg_hdr {
    sh_msg_type type;
    uint64_t session;  /* pairs a reply (or an ERROR) with its request; chosen by the requester */
    sh_addr src;       /* the sender; replies go here */
    sh_addr dst;       /* the receiving actor */
    uint64_t trace_id; /* carried unchanged through every message a request causes */
} sh_msg_hdr;

/* A decoded envelope. `body` points into the frame: it is valid while the frame is. */
typedef struct sh_msg_env {
    sh_msg_hdr hdr;
    const uint8_t *body; /* body_len bytes: one msgpack map, structurally checked */
    size_t body_len;
    /* Envelope fields read successfully, 0..8, also on failure: with n_fields >= 6 the header's
     * session, src and dst were read, so a receiver can answer an undeliverable frame with an
     * ERROR (after checking n_fields; the values are still the peer's claims). */
    uint32_t n_fields;
} sh_msg_env;

/* True when `t` is a known message type. */
int sh__msg_type_known(uint64_t t);

/* "SUBMIT", "STEP_DONE", ...; "?" for an unknown type. */
const char *sh__msg_type_name(uint64_t t);

/* "truncated", "depth", ...: the reason's name for logs and metrics. */
const char *sh__msg_reject_name(sh_msg_reject r);

/* Appends the first seven envelope fields and the array header to b; the caller appends exactly
 * one map (the body) next. Failure is sticky in b->failed. */
void sh__msg_put_header(sh_buf *b, const sh_msg_hdr *h);

/* Appends a whole frame whose body is already encoded (`body_len` bytes of one msgpack map, e.g.
 * forwarded from another frame). Returns SH_EINVAL for an unknown type, SH_ENOMEM when a growable
 * buffer cannot grow, SH_ERANGE when a fixed one is full; on failure b is as it was. */
sh_err sh__msg_encode_raw(sh_buf *b, const sh_msg_hdr *h, const void *body, size_t body_len,
                          sh_error *e);

/* Decodes the envelope of `len` bytes at `frame`: checks the size limit, the array of eight,
 * each field's type, magic, version and type, walks the body map (every length checked, depth
 * limited) and refuses trailing bytes. The frame is not copied; env->body points into it. The
 * body's fields are not decoded: runtime/proto.h does that. Returns SH_OK, SH_EFORMAT or
 * SH_EPROTO (see above) and counts the outcome in c->stats. */
sh_err sh__msg_decode(sh_msg_codec *c, const void *frame, size_t len, sh_msg_env *env, sh_error *e);

/* For a frame that sh__msg_decode() refused for its protocol version: reads the first six
 * envelope fields leniently, as another version wrote them (magic, version, type, session, src
 * and dst lead the envelope, and a new version must keep them there), into env->hdr (an unknown
 * type reads as SH_MSG_ERROR) with n_fields = 6, so that the receiver can name the sender and
 * answer a request with an ERROR. Returns the frame's version, or 0 (env untouched) when the
 * frame does not carry SH_PROTO_MAGIC, carries this node's version, or its header cannot be
 * read. */
uint64_t sh__msg_peek_foreign(const void *frame, size_t len, sh_msg_env *env);

/* For the transport's link table: when the frame is one sh__msg_peek_foreign() reads and names
 * a sender node, writes "peer speaks protocol N, this build speaks M" into text and returns that
 * node id; otherwise returns 0 and leaves text alone. */
uint32_t sh__msg_foreign_note(const void *frame, size_t len, char *text, size_t cap);

/* Bytes the seal adds after a frame between nodes. */
#define SH_MSG_SEAL_BYTES 4u

/* Seals the `len`-byte frame at `frame` for another node: writes the CRC-32C of those bytes,
 * little-endian, at frame + len. The caller owns at least len + SH_MSG_SEAL_BYTES bytes there
 * and sends len + SH_MSG_SEAL_BYTES. Any thread. */
void sh__msg_seal(uint8_t *frame, size_t len);

/* Checks a sealed frame of `len` bytes as it came off the wire: SH_OK when its last
 * SH_MSG_SEAL_BYTES are the CRC-32C of the bytes before them, with *inner_len set to that
 * length (the frame to decode); otherwise SH_EFORMAT (shorter than a seal, or a mismatch,
 * naming both values in e), counted as SH_MSG_REJECT_CHECKSUM, and *inner_len untouched. */
sh_err sh__msg_unseal(sh_msg_codec *c, const void *frame, size_t len, size_t *inner_len,
                      sh_error *e);

/* For a frame that failed sh__msg_unseal(): true when it is a whole unsealed frame of another
 * protocol version (one msgpack array spanning exactly `len` bytes that
 * sh__msg_peek_foreign() reads), i.e. from a peer older than the seal; it is then decoded as
 * is, so that the version mismatch is reported as such. A sealed frame with a corrupted version
 * byte is not one: its array ends SH_MSG_SEAL_BYTES before len. */
int sh__msg_foreign_unsealed(const void *frame, size_t len);

/* Counts one rejection for `why` (used by the body decoder). */
void sh__msg_count_reject(sh_msg_codec *c, sh_msg_reject why);

/* The reason for a failure of the msgpack reader (an sh_mpack_fail value). */
sh_msg_reject sh__msg_reject_from_mpack(int fail);

#endif
