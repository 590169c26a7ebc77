"""A tensor-parallel group whose collective links run over tls+tcp:// (issue 26; docs/cluster.md
"Tensor parallelism", "TLS between nodes"), against real processes: `shoal node` ranks and a
`shoal serve -c` front on tls+tcp://127.0.0.1 with certificates the test makes with the openssl
CLI (skipped, 77, without it), in a keyed cluster.

Cases:
- stories260K, one stage of 2 ranks with `tp_link = "net"` (on one host the group would use
  shared memory otherwise): 16 prompts x 64 greedy tokens sent at once equal a single-process
  `shoal serve -m` (test_cluster_tp_eq.py's bounds: a split only at a near-tie, logprobs within
  5e-3); each rank logs a net group.
- w0's collective listener (its node port + 1000) speaks mutual TLS with w0's certificate: a
  client holding a certificate of the cluster's CA completes the handshake and is shown w0's; one
  without a certificate, or with one another CA signed, is refused in the handshake.
"""

import os
import shutil
import socket
import ssl
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import serve_util as su  # noqa: E402
from test_cluster_pipeline import PROMPTS  # noqa: E402
from test_cluster_tls import make_ca, make_node  # noqa: E402
from test_cluster_tp import STORIES, Cluster, at_once, complete_top  # noqa: E402
from test_cluster_tp_eq import EXACT_LP, NEAR_TIE, agree, free_ports, reference  # noqa: E402


def tls_script(d, ranks):
    """'front' and `ranks` on tls+tcp://127.0.0.1 (each node port P with P + 1000 free: a rank's
    collective link listens there), one stage of len(ranks) ranks linking over the network, a
    cluster key; certificates and key relative to the script."""
    ports = free_ports(1 + len(ranks), 1)
    ns = ",\n    ".join(f"node {{ name = '{n}', listen = 'tls+tcp://127.0.0.1:{p}', "
                        f"tls_cert = '{n}.pem', tls_key = '{n}.key' }}"
                        for n, p in zip(["front"] + list(ranks), ports))
    group = ", ".join(f"'{w}'" for w in ranks)
    with open(os.path.join(d, "cluster.key"), "w") as f:
        f.write("tp-tls-test-key-0123456789abcdef\n")
    os.chmod(os.path.join(d, "cluster.key"), 0o600)
    path = os.path.join(d, "tls.lua")
    with open(path, "w") as f:
        f.write(f"local m = model {{ path = '{STORIES}', name = 'm' }}\n"
                "return cluster {\n"
                f"  nodes = {{\n    {ns} }},\n"
                "  gateway = { node = 'front', http = '127.0.0.1:8080' },\n"
                f"  replicas = {{ replica {{ model = m, stages = pipeline(m, {{ {{ {group} }} }}), "
                "tp_link = 'net' } },\n"
                "  batcher = { max_seqs = 16, max_step_tokens = 512 },\n"
                "  kv = { memory = '32MiB' },\n"
                "  tls_ca = 'ca.pem',\n"
                "  key_file = 'cluster.key',\n"
                "}\n")
    su.log(f"note: tls+tcp ports {ports} (collective links on {[p + 1000 for p in ports[1:]]})")
    return path, ports


def handshake(port, d, cert):
    """A TLS handshake with 127.0.0.1:port trusting the cluster's CA, presenting `cert` (None: no
    certificate): the peer certificate's common name, or raises ssl.SSLError / OSError. Closes the
    connection at once (nothing of NNG's protocol is sent)."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.check_hostname = False
    ctx.load_verify_locations(os.path.join(d, "ca.pem"))
    if cert:
        ctx.load_cert_chain(os.path.join(d, cert + ".pem"), os.path.join(d, cert + ".key"))
    with socket.create_connection(("127.0.0.1", port), timeout=su.scaled(10)) as raw:
        with ctx.wrap_socket(raw) as s:
            # TLS 1.3 tells a client its certificate was refused only at its first read.
            s.settimeout(0.5)
            try:
                s.recv(1)
            except (socket.timeout, TimeoutError):
                pass
            subject = dict(x[0] for x in s.getpeercert()["subject"])
            return subject.get("commonName")


def probe(d, port):
    """w0's collective listener: mutual TLS with w0's certificate."""
    cn = handshake(port, d, "w1")
    assert cn == "w0", f"the collective listener on {port} showed {cn!r}, not w0's certificate"
    for cert in (None, "stranger"):
        try:
            got = handshake(port, d, cert)
        except (ssl.SSLError, OSError) as e:
            su.log(f"note: collective listener, client certificate {cert}: refused ({e})")
            continue
        raise AssertionError(f"a client with certificate {cert} completed the handshake ({got})")


def tls_group(d, want):
    path, ports = tls_script(d, ["w0", "w1"])
    c = Cluster(path, ["w0", "w1"])
    try:
        c.start()
        got = at_once(c.srv.url, PROMPTS, 64, complete_top)
        for w, nd in c.nodes.items():
            assert "event=tp_group" in nd.text() and "kind=net" in nd.text(), \
                f"{w} formed no net group:\n{nd.text()[-1500:]}"
        probe(d, ports[1] + 1000)  # the group's listeners exist from its first step on
        again = complete_top(c.srv.url, PROMPTS[0], 16)  # the probes disturbed nothing
        assert again[3] == got[0][3][:16], f"{again[3]} vs {got[0][3][:16]}"
    finally:
        c.stop()
    assert all(r[2] == 64 for r in got), [r[2] for r in got]
    agree(want, got, "s1x2tls", NEAR_TIE, EXACT_LP)


def main():
    if not os.path.exists(STORIES):
        su.skip(f"{STORIES} missing")
    if not shutil.which("openssl"):
        su.skip("no openssl CLI to make certificates")
    r = su.Runner("test_cluster_tp_tls")
    d = tempfile.mkdtemp(prefix="shtpt-", dir="/tmp")
    try:
        make_ca(d, "ca")
        make_ca(d, "other")
        for n in ("front", "w0", "w1"):
            make_node(d, "ca", n)
        make_node(d, "other", "stranger")
        want = reference(STORIES, PROMPTS, 64)
        r.case("stories260K: one stage of 2 ranks over the network collective on tls+tcp:// "
               "(keyed) equals one process; the collective listener is mutual TLS", tls_group, d,
               want)
    finally:
        shutil.rmtree(d, ignore_errors=True)
    r.finish()


if __name__ == "__main__":
    main()
