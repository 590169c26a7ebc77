/* Unit tests of the cluster key (base/auth.h): HMAC-SHA256 against RFC 4231's known answers, the
 * HELLO proofs, key files and hex. */
#include <fcntl.h>
#include <stdio.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "base/auth.h"
#include "sh_test.h"

/* RFC 4231, section 4: HMAC-SHA-256 test cases 1-7 (case 5's output is truncated to 128 bits). */
static void test_rfc4231(void)
{
    static const char tc7_data[] =
        "This is a test using a larger than block-size key and a larger than block-size data. The "
        "key needs to be hashed before being used by the HMAC algorithm.";
    static const char tc6_data[] = "Test Using Larger Than Block-Size Key - Hash Key First";
    uint8_t k0b[20], kaa20[20], kaa131[131], k25[25], k0c[20], ddd[50], dcd[50];
    memset(k0b, 0x0b, sizeof k0b);
    memset(kaa20, 0xaa, sizeof kaa20);
    memset(kaa131, 0xaa, sizeof kaa131);
    memset(k0c, 0x0c, sizeof k0c);
    memset(ddd, 0xdd, sizeof ddd);
    memset(dcd, 0xcd, sizeof dcd);
    for (int i = 0; i < 25; i++)
        k25[i] = (uint8_t)(i + 1);
    const struct {
        const void *key;
        size_t key_len;
        const void *data;
        size_t data_len;
        const char *mac; /* hex; case 5 gives only the first 16 bytes */
    } cases[] = {
        {k0b, 20, "Hi There", 8,
         "b0344c61d8db38535ca8afceaf0bf12b881dc200c9833da726e9376c2e32cff7"},
        {"Jefe", 4, "what do ya want for nothing?", 28,
         "5bdcc146bf60754e6a042426089575c75a003f089d2739839dec58b964ec3843"},
        {kaa20, 20, ddd, 50, "773ea91e36800e46854db8ebd09181a72959098b3ef8c122d9635514ced565fe"},
        {k25, 25, dcd, 50, "82558a389a443c0ea4cc819899f2083a85f0faa3e578f8077a2e3ff46729665b"},
        {k0c, 20, "Test With Truncation", 20, "a3b6167473100ee06e0c796c2955552b"},
        {kaa131, 131, tc6_data, sizeof tc6_data - 1,
         "60e431591ee0b67f0d8a26aacbf5b77f8e0bc6213728c5140546040f0ee37f54"},
        {kaa131, 131, tc7_data, sizeof tc7_data - 1,
         "9b09ffa71b942fcb27635fbcd5b0e944bfdc63644f0713938a7f51535c3a35e2"},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        uint8_t mac[SH_AUTH_MAC_LEN];
        CHECK_OK(
            sh__auth_hmac(cases[i].key, cases[i].key_len, cases[i].data, cases[i].data_len, mac));
        char hex[2 * SH_AUTH_MAC_LEN + 1];
        sh__auth_hex(mac, SH_AUTH_MAC_LEN, hex);
        size_t want = strlen(cases[i].mac);
        if (strncmp(hex, cases[i].mac, want) != 0)
            SH_FAIL_("RFC 4231 case %zu: got %.*s, want %s", i + 1, (int)want, hex, cases[i].mac);
    }
}

static void test_equal_and_hex(void)
{
    uint8_t a[4] = {1, 2, 3, 4}, b[4] = {1, 2, 3, 4};
    CHECK(sh__auth_equal(a, b, 4));
    b[3] = 5;
    CHECK(!sh__auth_equal(a, b, 4));
    b[3] = 4;
    b[0] = 0;
    CHECK(!sh__auth_equal(a, b, 4));
    char hex[9];
    sh__auth_hex(a, 4, hex);
    CHECK_STR_EQ(hex, "01020304");
    uint8_t back[4];
    CHECK(sh__auth_unhex("0A0b0c0D", 8, back, 4));
    CHECK_UINT_EQ(back[0], 10);
    CHECK_UINT_EQ(back[3], 13);
    CHECK(!sh__auth_unhex("0a0b0c0", 7, back, 4));
    CHECK(!sh__auth_unhex("0a0b0c0g", 8, back, 4));
    uint8_t r1[32] = {0}, r2[32] = {0};
    CHECK_OK(sh__auth_random(r1, sizeof r1, NULL));
    CHECK_OK(sh__auth_random(r2, sizeof r2, NULL));
    CHECK(!sh__auth_equal(r1, r2, sizeof r1));
}

static char dir[64];

static void write_file(const char *name, const char *content, char *path, size_t cap)
{
    snprintf(path, cap, "%s/%s", dir, name);
    FILE *f = fopen(path, "wb");
    CHECK(f != NULL);
    if (!f)
        return;
    fputs(content, f);
    fclose(f);
}

static void test_key_files(void)
{
    snprintf(dir, sizeof dir, "/tmp/shoal-test-auth-XXXXXX");
    CHECK(mkdtemp(dir) != NULL);
    char p1[128], p2[128], p3[128], p4[128], p5[128], fifo[128];
    write_file("a.key", "0123456789abcdef-secret\n", p1, sizeof p1);
    write_file("b.key", "0123456789abcdef-secret", p2, sizeof p2);
    write_file("c.key", "0123456789abcdef-other", p3, sizeof p3);
    write_file("short.key", "short \n", p4, sizeof p4);
    char big[SH_AUTH_KEY_MAX + 2];
    memset(big, 'k', sizeof big - 1);
    big[sizeof big - 1] = '\0';
    write_file("big.key", big, p5, sizeof p5);
    snprintf(fifo, sizeof fifo, "%s/fifo.key", dir);
    CHECK_INT_EQ(mkfifo(fifo, 0600), 0);

    sh_auth_key a, b, c, x;
    sh_error e = {0};
    CHECK_OK(sh__auth_key_load(p1, &a, &e));
    CHECK_OK(sh__auth_key_load(p2, &b, &e));
    CHECK_OK(sh__auth_key_load(p3, &c, &e));
    CHECK(a.set && b.set && c.set);
    CHECK(sh__auth_equal(a.k, b.k, sizeof a.k)); /* the trailing newline is not part of the key */
    CHECK(!sh__auth_equal(a.k, c.k, sizeof a.k));
    CHECK_INT_EQ(sh__auth_key_load(p4, &x, &e), SH_EINVAL);
    CHECK(!x.set);
    CHECK(strstr(e.msg, "short.key: a cluster key must be at least 16 bytes (this one has 5)"));
    CHECK_INT_EQ(sh__auth_key_load(p5, &x, &e), SH_EINVAL);
    CHECK(strstr(e.msg, "big.key: a cluster key file holds at most 4096 bytes"));
    CHECK_INT_EQ(sh__auth_key_load(fifo, &x, &e), SH_EINVAL); /* and it did not block */
    CHECK(strstr(e.msg, "fifo.key: not a regular file (a FIFO)"));
    CHECK_INT_EQ(sh__auth_key_load(dir, &x, &e), SH_EINVAL);
    CHECK_INT_EQ(sh__auth_key_load("/nonexistent/shoal.key", &x, &e), SH_EIO);
    CHECK(strstr(e.msg, "/nonexistent/shoal.key: cannot open"));

    /* Proofs: the same inputs give the same proof; any change of key, role, nonce or name gives
     * another. */
    uint8_t na[32], nb[32], p[32], q[32];
    memset(na, 1, sizeof na);
    memset(nb, 2, sizeof nb);
    CHECK_OK(sh__auth_proof(&a, 'W', na, nb, "front", "w0", p));
    CHECK_OK(sh__auth_proof(&b, 'W', na, nb, "front", "w0", q));
    CHECK(sh__auth_equal(p, q, 32));
    CHECK_OK(sh__auth_proof(&c, 'W', na, nb, "front", "w0", q));
    CHECK(!sh__auth_equal(p, q, 32));
    CHECK_OK(sh__auth_proof(&a, 'F', na, nb, "front", "w0", q));
    CHECK(!sh__auth_equal(p, q, 32));
    CHECK_OK(sh__auth_proof(&a, 'W', nb, na, "front", "w0", q));
    CHECK(!sh__auth_equal(p, q, 32));
    CHECK_OK(sh__auth_proof(&a, 'W', na, nb, "front", "w1", q));
    CHECK(!sh__auth_equal(p, q, 32));
    /* Length-prefixed names: ("ab", "c") and ("a", "bc") differ. */
    CHECK_OK(sh__auth_proof(&a, 'W', na, nb, "ab", "c", p));
    CHECK_OK(sh__auth_proof(&a, 'W', na, nb, "a", "bc", q));
    CHECK(!sh__auth_equal(p, q, 32));

    unlink(p1);
    unlink(p2);
    unlink(p3);
    unlink(p4);
    unlink(p5);
    unlink(fifo);
    rmdir(dir);
}

static const sh_test_case tests[] = {
    {"rfc4231", test_rfc4231},
    {"equal_and_hex", test_equal_and_hex},
    {"key_files", test_key_files},
    {NULL, NULL},
};

int main(int argc, char **argv) { return sh_test_main(argc, argv, tests); }
