/* A node bombarded with garbage, truncated and bit-flipped frames keeps serving real traffic. */
#include <stdbool.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <sys/un.h>
#include <unistd.h>

#include "runtime/msg.h"
#include "test_transport_util.h"

static uint64_t rng_state = 0x1234567887654321ull;
static uint64_t rnd(void)
{
    rng_state ^= rng_state << 13;
    rng_state ^= rng_state >> 7;
    rng_state ^= rng_state << 17;
    return rng_state;
}

/* A valid PING frame for node 2's echo from a made-up requester on node `from`. */
static size_t valid_frame(uint8_t *out, size_t cap, sh_addr dst, uint32_t from, uint64_t session)
{
    uint8_t body[13];
    body_make(body, 9, 9);
    sh_buf b;
    sh__buf_init_fixed(&b, out, cap);
    sh_msg_hdr h = {
        .type = SH_MSG_PING, .session = session, .src = sh_addr_make(from, 5), .dst = dst};
    if (sh__msg_encode_raw(&b, &h, body, sizeof body, NULL) != SH_OK)
        return 0;
    return b.len;
}

/* The attacker speaks NNG's ipc framing itself over a plain UNIX socket instead of using an NNG
 * push socket: it reconnects at once when the node drops it (oversize frames, broken framing),
 * it can also break the framing layer (bad handshakes, absurd lengths, stray bytes), and it does
 * not depend on how an NNG sender behaves when its pipe is closed under it. The framing: each
 * side first sends 8 bytes {0, 'S', 'P', 0, protocol (2 bytes, big-endian), 0, 0}; then every
 * message is 1 byte (1), its length as 8 bytes big-endian, and the bytes. push0 is 0x50. */
typedef struct raw_peer {
    const char *path;
    int fd;
    long reconnects;
} raw_peer;

static bool write_all(int fd, const void *p, size_t n)
{
    const uint8_t *b = p;
    while (n) {
        ssize_t w = send(fd, b, n, MSG_NOSIGNAL);
        if (w <= 0)
            return false;
        b += w;
        n -= (size_t)w;
    }
    return true;
}

static void raw_close(raw_peer *r)
{
    if (r->fd >= 0)
        close(r->fd);
    r->fd = -1;
}

/* Connects and handshakes as a push0 peer; with `bad_handshake` sends a wrong header instead. */
static bool raw_connect(raw_peer *r, bool bad_handshake)
{
    raw_close(r);
    int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    struct sockaddr_un sa = {.sun_family = AF_UNIX};
    size_t plen = strlen(r->path);
    if (plen >= sizeof sa.sun_path) {
        if (fd >= 0)
            close(fd);
        return false;
    }
    memcpy(sa.sun_path, r->path, plen + 1);
    if (fd < 0 || connect(fd, (struct sockaddr *)&sa, sizeof sa) != 0) {
        if (fd >= 0)
            close(fd);
        return false;
    }
    struct timeval tv = {.tv_sec = 1};
    setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
    setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof tv);
    uint8_t hs[8] = {0, 'S', 'P', 0, 0x00, 0x50, 0, 0};
    if (bad_handshake)
        hs[rnd() % 8] ^= (uint8_t)(1 + rnd() % 255);
    uint8_t peer[8];
    if (!write_all(fd, hs, sizeof hs) || recv(fd, peer, sizeof peer, MSG_WAITALL) != 8) {
        close(fd);
        return false;
    }
    r->fd = fd;
    r->reconnects++;
    return true;
}

/* Sends one message (or, with `stray`, raw bytes with no framing); reconnects when dropped. */
static void raw_send(raw_peer *r, const uint8_t *p, size_t n, bool stray)
{
    for (int attempt = 0; attempt < 2; attempt++) {
        if (r->fd < 0 && !raw_connect(r, false)) {
            sleep_ms(2);
            continue;
        }
        uint8_t head[9] = {1};
        for (int i = 0; i < 8; i++)
            head[1 + i] = (uint8_t)((uint64_t)n >> (56 - 8 * i));
        if ((stray || write_all(r->fd, head, sizeof head)) && write_all(r->fd, p, n))
            return;
        raw_close(r); /* the node dropped us: redial and try once more */
    }
}

static void test_bombard(void)
{
    char dir[64], u1[128], u2[128];
    tmpdir_make(dir, sizeof dir);
    snprintf(u1, sizeof u1, "ipc://%s/n1", dir);
    snprintf(u2, sizeof u2, "ipc://%s/n2", dir);
    test_rt r1, r2;
    rt_start(&r1, 1, 1, NULL);
    rt_start(&r2, 2, 2, NULL);
    CHECK_OK(sh_runtime_register(r1.rt, &req_vt, NULL));
    CHECK_OK(sh_runtime_register(r2.rt, &echo_vt, NULL));
    sh_transport *t1 = NULL, *t2 = NULL;
    sh_transport_opts o1 = {.listen_url = u1};
    sh_transport_opts o2 = {.listen_url = u2, .max_frame = 64 * 1024};
    CHECK_OK(sh_transport_create(r1.rt, &o1, &t1, NULL));
    CHECK_OK(sh_transport_create(r2.rt, &o2, &t2, NULL));
    CHECK_OK(sh_transport_peer_add(t1, 2, u2, NULL));
    CHECK_OK(sh_transport_peer_add(t2, 1, u1, NULL));
    sh_addr echo;
    CHECK_OK(sh_actor_spawn(r2.rt, "echo", NULL, 0, &echo, NULL));

    raw_peer raw = {u2 + strlen("ipc://"), -1, 0};

    static uint8_t buf[128 * 1024];
    uint8_t good[256];
    long pongs = 0, rounds = 0, kinds[8] = {0};
    for (int round = 0; round < 20; round++) {
        for (int i = 0; i < 100; i++) {
            size_t n = 0;
            int kind = (int)(rnd() % 8);
            bool stray = false;
            size_t g = valid_frame(good, sizeof good, echo, (uint32_t)(1 + rnd() % 8), rnd());
            switch (kind) {
            case 0: /* random bytes */
                n = rnd() % 300;
                for (size_t k = 0; k < n; k++)
                    buf[k] = (uint8_t)rnd();
                break;
            case 1: /* a valid frame cut short */
                n = g ? rnd() % g : 0;
                memcpy(buf, good, n);
                break;
            case 2: /* a valid frame with bits flipped */
                memcpy(buf, good, g);
                n = g;
                for (int k = 0; k < 1 + (int)(rnd() % 4); k++)
                    buf[rnd() % g] ^= (uint8_t)(1u << (rnd() % 8));
                break;
            case 3: /* a valid frame for another node, or a dead actor */
                n = valid_frame(buf, sizeof buf,
                                rnd() % 2 ? sh_addr_make(3, 1) : sh_addr_make(2, 999), 1, 0);
                break;
            case 4: /* over max_frame: the receiver drops the connection, the dialer redials */
                n = 100 * 1024;
                memset(buf, 0x98, n);
                break;
            case 5: /* framing broken: stray bytes, or a length far beyond any limit */
                n = 1 + rnd() % 64;
                for (size_t k = 0; k < n; k++)
                    buf[k] = (uint8_t)rnd();
                if (rnd() % 2)
                    buf[0] = 1, memset(buf + 1, 0x7f, 8 < n - 1 ? 8 : n - 1);
                stray = true;
                break;
            case 6: /* a connection with a corrupted handshake */
                raw_connect(&raw, true);
                n = 0;
                break;
            default: /* an empty frame */
                n = 0;
                break;
            }
            kinds[kind]++;
            raw_send(&raw, buf, n, stray);
        }
        req_cfg c;
        pongs += ping_many(r1.rt, echo, 10, 5000, 10000, &c);
        rounds++;
    }
    CHECK_INT_EQ(pongs, rounds * 10); /* well-formed traffic was served throughout */
    sh_transport_stats st;
    sh_transport_stats_get(t2, &st);
    fprintf(stderr,
            "bombard: recv=%llu rejected=%llu (kinds %ld %ld %ld %ld %ld %ld %ld %ld), "
            "attacker reconnects=%ld, pongs=%ld\n",
            (unsigned long long)st.frames_recv, (unsigned long long)st.rejected, kinds[0], kinds[1],
            kinds[2], kinds[3], kinds[4], kinds[5], kinds[6], kinds[7], raw.reconnects, pongs);
    /* Frames written just before the node drops a broken connection are lost with it, so only
     * part of the ~1000 malformed frames reach the decoder; a few hundred must have. */
    CHECK(st.rejected > 200);
    raw_close(&raw);
    sh_transport_close(t1);
    sh_transport_close(t2);
    rt_finish(&r1);
    rt_finish(&r2);
    sh_transport_destroy(t1);
    sh_transport_destroy(t2);
    char path[160];
    snprintf(path, sizeof path, "%s/n1", dir);
    unlink(path);
    snprintf(path, sizeof path, "%s/n2", dir);
    unlink(path);
    tmpdir_remove(dir);
}

static const sh_test_case tests[] = {
    {"bombard", test_bombard},
    {NULL, NULL},
};

int main(int argc, char **argv) { return sh_test_main(argc, argv, tests); }
