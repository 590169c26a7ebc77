/* The cluster key: HMAC-SHA256 (mbedTLS's, the library NNG's TLS already brings), nonces from the
 * kernel, and the challenge-response proofs nodes exchange in HELLO (docs/cluster.md). */
#ifndef SH_BASE_AUTH_H
#define SH_BASE_AUTH_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "shoal/err.h"

#define SH_AUTH_MAC_LEN 32   /* HMAC-SHA256 output */
#define SH_AUTH_NONCE_LEN 32 /* random bytes per challenge */
#define SH_AUTH_KEY_MIN 16   /* bytes a key file must hold (after trailing white space) */
#define SH_AUTH_KEY_MAX 4096 /* a key file larger than this is refused */

/* A loaded cluster key: HMAC-SHA256 with the key "shoal cluster key v1" over the key file's
 * bytes, so that every key has the same length and the file's bytes are not kept. */
typedef struct sh_auth_key {
    bool set; /* false: no key (the cluster is open) */
    uint8_t k[SH_AUTH_MAC_LEN];
} sh_auth_key;

/* out = HMAC-SHA256(key, msg). SH_EIO when mbedTLS fails (it does not for these inputs). Any
 * thread. */
sh_err sh__auth_hmac(const void *key, size_t key_len, const void *msg, size_t msg_len,
                     uint8_t out[SH_AUTH_MAC_LEN]);

/* Compares n bytes in time that does not depend on where they differ. */
bool sh__auth_equal(const uint8_t *a, const uint8_t *b, size_t n);

/* Fills buf with n bytes from getrandom(2). SH_EIO when the kernel refuses. Any thread. */
sh_err sh__auth_random(void *buf, size_t n, sh_error *e);

/* Loads a cluster key file: a regular file (base/file.h: never a FIFO or a device) of at most
 * SH_AUTH_KEY_MAX bytes whose content, without trailing white space (a newline written by an
 * editor or `echo`), is at least SH_AUTH_KEY_MIN bytes; those bytes are the key. Errors name
 * the path: SH_EIO (cannot open or read), SH_EINVAL (not a regular file, too short, too long).
 * On failure *out is cleared (set = false). Any thread. */
sh_err sh__auth_key_load(const char *path, sh_auth_key *out, sh_error *e);

/* The proof one side of a HELLO gives that it holds the key:
 * HMAC-SHA256(key, "shoal hello v1" | role | nonce_a | nonce_b | len(name_a) | name_a |
 * len(name_b) | name_b), with role 'W' for the answering node's proof and 'F' for the greeting
 * node's, so that neither can be reflected as the other; nonce_a and name_a are the greeting
 * node's, nonce_b and name_b the answering node's (names at most 255 bytes, one length byte
 * each). Both nonces are fresh per exchange, so a recorded proof answers no later challenge.
 * Any thread. */
sh_err sh__auth_proof(const sh_auth_key *key, char role, const uint8_t nonce_a[SH_AUTH_NONCE_LEN],
                      const uint8_t nonce_b[SH_AUTH_NONCE_LEN], const char *name_a,
                      const char *name_b, uint8_t out[SH_AUTH_MAC_LEN]);

/* n bytes as 2n lowercase hex digits and a NUL (hex must hold 2n + 1). */
void sh__auth_hex(const uint8_t *b, size_t n, char *hex);

/* Parses exactly 2n hex digits (len of them at s) into b. False when the length or a digit is
 * wrong. */
bool sh__auth_unhex(const char *s, size_t len, uint8_t *b, size_t n);

#endif
