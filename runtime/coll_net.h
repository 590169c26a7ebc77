/* The network collectives' wire format and codecs (runtime/coll_net.c), shared with the tests. */
#ifndef SH_RUNTIME_COLL_NET_H
#define SH_RUNTIME_COLL_NET_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "runtime/coll_int.h"

/* Every frame between ranks starts with this 44-byte header, little-endian:
 *   0 u32 magic SH__COLL_NET_MAGIC    4 u8 version   5 u8 type   6 u8 op   7 u8 compress
 *   8 u32 epoch                       12 u16 source rank           14 u16 group size
 *  16 u64 sequence (the call's c->seq; 0 in join frames)
 *  24 u64 total: the call's element count (all-reduce: floats; all-gather: bytes per rank;
 *         broadcast: bytes); in join frames, the group's max_bytes
 *  32 u32 index: (step << 16) | segment for the ring and chain; 0 for one-shot frames
 *  36 u32 count: elements (floats or bytes) in this frame's payload
 *  40 u32 CRC-32C over bytes 0..39 then the payload (bytes 44..)
 * The payload follows. A frame that is shorter than the header, or has another magic, version
 * or CRC, is dropped and counted. */
#define SH__COLL_NET_MAGIC 0x4c434853u /* "SHCL" */
#define SH__COLL_NET_VERSION 1u
#define SH__COLL_NET_HDR 44u

typedef enum sh__coll_net_type {
    SH__COLL_NET_HELLO = 1, /* join: payload = the sender's nonce (32 bytes) */
    SH__COLL_NET_PROOF,     /* join: payload = the echoed nonce | HMAC (32 bytes each) */
    SH__COLL_NET_DATA,      /* a contribution, a partial sum or a result */
    SH__COLL_NET_ACK,       /* a broadcast's receipt, sent to the root */
    SH__COLL_NET_NACK,      /* a resend request: seq and index of the frame wanted, its type in
                               count; no payload */
} sh__coll_net_type;

/* A frame sent again on a NACK has SH__COLL_NET_RESENT set in its type byte (a duplicate of one
 * the receiver has already taken is then let go without being counted as dropped). */
#define SH__COLL_NET_RESENT 0x80u

typedef struct sh__coll_net_hdr {
    uint8_t type, op, compress; /* type without SH__COLL_NET_RESENT */
    bool resent;                /* SH__COLL_NET_RESENT was set */
    uint32_t epoch;
    uint16_t src, size;
    uint64_t seq, total;
    uint32_t index, count;
} sh__coll_net_hdr;

/* Writes h's header into frame (whose payload, plen bytes, is already at frame + HDR) and seals it
 * with the CRC. */
void sh__coll_net_seal(const sh__coll_net_hdr *h, uint8_t *frame, size_t plen);

/* Parses and checks a frame of len bytes (magic, version, CRC). False when it fails a check. */
bool sh__coll_net_open(const uint8_t *frame, size_t len, sh__coll_net_hdr *h);

/* Bytes an all-reduce payload of n floats takes on the wire with compression cmp. */
size_t sh__coll_net_wire_size(sh_coll_compress cmp, size_t n);

/* Encodes n floats into out (wire_size bytes): f32 as they are; f16 (round to nearest even,
 * saturated to +-65504); int8: per block of at most 256 values one f32 scale (max |x| / 127)
 * then the values, rounded to nearest, as int8 in -127..127. */
void sh__coll_net_encode(sh_coll_compress cmp, const float *x, size_t n, uint8_t *out);

/* Decodes n floats from in into x (add: x += value; else x = value). */
void sh__coll_net_decode(sh_coll_compress cmp, const uint8_t *in, size_t n, float *x, bool add);

/* Frames this handle dropped (bad CRC, epoch, sequence, an unproved link, a full stash, a bad
 * join proof) since create: for the tests. */
uint64_t sh__coll_net_dropped(const sh_coll *c);

/* Resend requests this handle sent (a frame it waited for did not come), frames it sent again
 * when asked, and the bytes of both (counted in bytes_wire too), since create: for the tests.
 * A frame can be sent again when it was not lost (the request crossed it, or it was slow). */
void sh__coll_net_resends(const sh_coll *c, uint64_t *nacks, uint64_t *resent, uint64_t *bytes);

#endif
