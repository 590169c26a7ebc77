/* The cluster key: HMAC-SHA256, nonces and the HELLO proofs (base/auth.h). */
#include "base/auth.h"

#include <ctype.h>
#include <errno.h>
#include <mbedtls/md.h>
#include <string.h>
#include <sys/random.h>
#include <unistd.h>

#include "base/error.h"
#include "base/file.h"

sh_err sh__auth_hmac(const void *key, size_t key_len, const void *msg, size_t msg_len,
                     uint8_t out[SH_AUTH_MAC_LEN])
{
    const mbedtls_md_info_t *md = mbedtls_md_info_from_type(MBEDTLS_MD_SHA256);
    if (!md || mbedtls_md_hmac(md, key, key_len, msg, msg_len, out) != 0)
        return SH_EIO;
    return SH_OK;
}

bool sh__auth_equal(const uint8_t *a, const uint8_t *b, size_t n)
{
    volatile uint8_t d = 0;
    for (size_t i = 0; i < n; i++)
        d |= (uint8_t)(a[i] ^ b[i]);
    return d == 0;
}

sh_err sh__auth_random(void *buf, size_t n, sh_error *e)
{
    uint8_t *p = buf;
    while (n > 0) {
        ssize_t r = getrandom(p, n, 0);
        if (r < 0 && errno == EINTR)
            continue;
        if (r <= 0)
            return sh__error_set(e, SH_EIO, "getrandom: %s", strerror(errno));
        p += r;
        n -= (size_t)r;
    }
    return SH_OK;
}

sh_err sh__auth_key_load(const char *path, sh_auth_key *out, sh_error *e)
{
    memset(out, 0, sizeof *out);
    int fd;
    uint64_t size;
    sh_err err = sh__file_open(path, &fd, &size, e);
    if (err)
        return err;
    if (size > SH_AUTH_KEY_MAX) {
        close(fd);
        return sh__error_set(e, SH_EINVAL,
                             "%s: a cluster key file holds at most %d bytes, this "
                             "one %llu",
                             path, SH_AUTH_KEY_MAX, (unsigned long long)size);
    }
    uint8_t buf[SH_AUTH_KEY_MAX + 1];
    size_t n = 0;
    for (;;) {
        ssize_t r = read(fd, buf + n, sizeof buf - n);
        if (r < 0 && errno == EINTR)
            continue;
        if (r < 0) {
            int saved = errno;
            close(fd);
            return sh__error_set(e, SH_EIO, "%s: cannot read: %s", path, strerror(saved));
        }
        if (r == 0 || (n += (size_t)r) == sizeof buf)
            break;
    }
    close(fd);
    if (n > SH_AUTH_KEY_MAX) /* it grew since the stat */
        return sh__error_set(e, SH_EINVAL, "%s: a cluster key file holds at most %d bytes", path,
                             SH_AUTH_KEY_MAX);
    while (n > 0 && isspace(buf[n - 1]))
        n--;
    if (n < SH_AUTH_KEY_MIN) {
        memset(buf, 0, sizeof buf);
        return sh__error_set(e, SH_EINVAL,
                             "%s: a cluster key must be at least %d bytes (this one has %zu); "
                             "make one with `head -c 32 /dev/urandom | base64 > FILE`",
                             path, SH_AUTH_KEY_MIN, n);
    }
    static const char label[] = "shoal cluster key v1";
    err = sh__auth_hmac(label, sizeof label - 1, buf, n, out->k);
    memset(buf, 0, sizeof buf);
    if (err)
        return sh__error_set(e, err, "%s: HMAC-SHA256 failed", path);
    out->set = true;
    return SH_OK;
}

sh_err sh__auth_proof(const sh_auth_key *key, char role, const uint8_t nonce_a[SH_AUTH_NONCE_LEN],
                      const uint8_t nonce_b[SH_AUTH_NONCE_LEN], const char *name_a,
                      const char *name_b, uint8_t out[SH_AUTH_MAC_LEN])
{
    static const char label[] = "shoal hello v1";
    uint8_t msg[sizeof label + 1 + 2 * SH_AUTH_NONCE_LEN + 2 * 256];
    size_t n = 0, la = strlen(name_a), lb = strlen(name_b);
    la = la > 255 ? 255 : la;
    lb = lb > 255 ? 255 : lb;
    memcpy(msg, label, sizeof label - 1);
    n += sizeof label - 1;
    msg[n++] = (uint8_t)role;
    memcpy(msg + n, nonce_a, SH_AUTH_NONCE_LEN);
    n += SH_AUTH_NONCE_LEN;
    memcpy(msg + n, nonce_b, SH_AUTH_NONCE_LEN);
    n += SH_AUTH_NONCE_LEN;
    msg[n++] = (uint8_t)la;
    memcpy(msg + n, name_a, la);
    n += la;
    msg[n++] = (uint8_t)lb;
    memcpy(msg + n, name_b, lb);
    n += lb;
    return sh__auth_hmac(key->k, sizeof key->k, msg, n, out);
}

void sh__auth_hex(const uint8_t *b, size_t n, char *hex)
{
    static const char digits[] = "0123456789abcdef";
    for (size_t i = 0; i < n; i++) {
        hex[2 * i] = digits[b[i] >> 4];
        hex[2 * i + 1] = digits[b[i] & 15];
    }
    hex[2 * n] = '\0';
}

static int nibble(char c)
{
    if (c >= '0' && c <= '9')
        return c - '0';
    if (c >= 'a' && c <= 'f')
        return c - 'a' + 10;
    if (c >= 'A' && c <= 'F')
        return c - 'A' + 10;
    return -1;
}

bool sh__auth_unhex(const char *s, size_t len, uint8_t *b, size_t n)
{
    if (len != 2 * n)
        return false;
    for (size_t i = 0; i < n; i++) {
        int hi = nibble(s[2 * i]), lo = nibble(s[2 * i + 1]);
        if (hi < 0 || lo < 0)
            return false;
        b[i] = (uint8_t)(hi << 4 | lo);
    }
    return true;
}
