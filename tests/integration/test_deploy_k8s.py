"""`shoal cluster manifest k8s` and examples/deploy/kubernetes/ (issue 29, docs/deploy.md
"Kubernetes"), checked offline against the Kubernetes API's model classes (the `kubernetes`
Python package, pinned in tests/reference/requirements.txt): no cluster is contacted.

Cases:
- manifests for examples/cluster/pipeline-2stage.lua (defaults) and replicas-2x2stage.lua (a
  namespace, an image, a cluster key, other timeouts and threads): every document has a known
  apiVersion and kind, every field is one of its model's (recursively, with its type), and each
  deserializes into its model class (which checks required fields);
- what they say: a headless Service publishing not-ready pods, the worker StatefulSet with one
  pod per worker node started with --name-from HOSTNAME (HOSTNAME from the pod's name), the
  ConfigMap's script giving worker k the address of pod NAME-k (the --name-from rank rule) and
  the front NAME-front-0's, probes (/health, /admin/status, the node port),
  terminationGracePeriodSeconds above --drain-timeout and the workers' preStop wait, memory
  requests from the model file's size, the Secret holding the key file's bytes;
- examples/deploy/kubernetes/pipeline-2stage.yaml is exactly what the generator writes for
  examples/cluster/pipeline-2stage.lua (they cannot drift apart);
- the manifests run: in a network namespace of its own (unshare -n -m, root; else that case
  logs a skip) whose /etc/hosts maps the pod names of the headless Service to 127.x addresses,
  each StatefulSet pod's command runs with its environment (HOSTNAME from the pod's name), the
  ConfigMap's script and the Secret's key; greedy completions through the front equal one
  process, and what the probes ask answers (/health, /admin/status, the workers' node port);
- bad input: a script that does not load, a missing model file, a bad option value, `slurm`
  with the wrong number of hosts: one line on stderr, exit 2, nothing on stdout.
Skips (77) without the kubernetes package (scripts/test-venv.sh) or the model file.
"""

import base64
import math
import os
import re
import shutil
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import serve_util as su  # noqa: E402

try:
    import yaml
    from kubernetes import client
except ImportError:
    su.skip("the kubernetes Python package is missing (scripts/test-venv.sh installs it)")

EXAMPLE = "examples/deploy/kubernetes/pipeline-2stage.yaml"
KINDS = {("v1", "Service"): "V1Service", ("v1", "ConfigMap"): "V1ConfigMap",
         ("v1", "Secret"): "V1Secret", ("apps/v1", "StatefulSet"): "V1StatefulSet"}
DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
MIB = 1024 * 1024


def manifest(*args):
    return subprocess.run([su.shoal_binary(), "cluster", "manifest", *args], cwd=su.ROOT,
                          capture_output=True, text=True, timeout=60)


def strict(obj, typename, path, errors):
    """Checks obj against the client's model type `typename` field by field: an unknown field or
    a value of the wrong type is an error (the client's own deserializer ignores both)."""
    if obj is None:
        return
    m = re.match(r"^Optional\[(.*)\]$", typename)
    if m:
        typename = m.group(1)
    m = re.match(r"^(?:list|List)\[(.*)\]$", typename)
    if m:
        if not isinstance(obj, list):
            errors.append(f"{path}: want a list, got {type(obj).__name__}")
            return
        for i, x in enumerate(obj):
            strict(x, m.group(1), f"{path}[{i}]", errors)
        return
    m = re.match(r"^(?:dict\(([^,]*), (.*)\)|Dict\[([^,]*), (.*)\])$", typename)
    if m:
        if not isinstance(obj, dict):
            errors.append(f"{path}: want a map, got {type(obj).__name__}")
            return
        for k, v in obj.items():
            strict(v, m.group(2) or m.group(4), f"{path}.{k}", errors)
        return
    simple = {"str": str, "bool": bool, "float": (int, float), "datetime": str, "date": str,
              "bytes": str}  # a Secret's data: base64 text in YAML
    if typename == "int":
        if not isinstance(obj, int) or isinstance(obj, bool):
            errors.append(f"{path}: want an integer, got {obj!r}")
        return
    if typename in simple:
        if not isinstance(obj, simple[typename]):
            errors.append(f"{path}: want {typename}, got {obj!r}")
        return
    if typename == "object":  # IntOrString and the like
        if not isinstance(obj, (str, int, dict)):
            errors.append(f"{path}: want a string or number, got {obj!r}")
        return
    cls = getattr(client.models, typename)
    if not isinstance(obj, dict):
        errors.append(f"{path}: want a {typename} map, got {obj!r}")
        return
    fields = {v: k for k, v in cls.attribute_map.items()}
    for k, v in obj.items():
        if k not in fields:
            errors.append(f"{path}: {typename} has no field '{k}'")
        else:
            strict(v, cls.openapi_types[fields[k]], f"{path}.{k}", errors)


def documents(text):
    docs = [d for d in yaml.safe_load_all(text) if d is not None]
    errors = []
    api = client.ApiClient()
    for i, d in enumerate(docs):
        key = (d.get("apiVersion"), d.get("kind"))
        if key not in KINDS:
            errors.append(f"document {i}: unknown apiVersion/kind {key}")
            continue
        where = f"{d['kind']} {d.get('metadata', {}).get('name')}"
        strict(d, KINDS[key], where, errors)
        try:  # the model's constructors check required fields
            api._ApiClient__deserialize(d, KINDS[key])
        except (ValueError, TypeError) as exc:
            errors.append(f"{where}: {exc}")
        name = d.get("metadata", {}).get("name", "")
        if not DNS_LABEL.match(name) or len(name) > 63:
            errors.append(f"{where}: name '{name}' is not a DNS label")
    if errors:
        raise AssertionError("\n".join(errors[:20]))
    return docs


def by(docs, kind, name):
    found = [d for d in docs if d["kind"] == kind and d["metadata"]["name"] == name]
    if len(found) != 1:
        raise AssertionError(f"want one {kind} {name}, found {len(found)}")
    return found[0]


def container(sts):
    cs = sts["spec"]["template"]["spec"]["containers"]
    if len(cs) != 1:
        raise AssertionError(f"{sts['metadata']['name']}: {len(cs)} containers")
    return cs[0]


def check_layout(docs, name, workers, stages_per_worker_share, kv_mib, drain, ns=None):
    """What the manifests say, for a script with `workers` worker nodes each holding
    stages_per_worker_share of one model file's weights plus kv_mib of KV."""
    for d in docs:
        if d["metadata"].get("namespace") != ns:
            raise AssertionError(f"{d['kind']} {d['metadata']['name']}: namespace "
                                 f"{d['metadata'].get('namespace')!r}, want {ns!r}")
    svc = by(docs, "Service", name)
    if svc["spec"].get("clusterIP") != "None" or not svc["spec"].get("publishNotReadyAddresses"):
        raise AssertionError(f"Service {name} is not headless with publishNotReadyAddresses")
    front = by(docs, "StatefulSet", f"{name}-front")
    work = by(docs, "StatefulSet", name)
    for s in (front, work):
        if s["spec"]["serviceName"] != name:
            raise AssertionError(f"{s['metadata']['name']}: serviceName {s['spec']['serviceName']}")
        sel = s["spec"]["selector"]["matchLabels"]
        labels = s["spec"]["template"]["metadata"]["labels"]
        if any(labels.get(k) != v for k, v in sel.items()):
            raise AssertionError(f"{s['metadata']['name']}: selector {sel} misses {labels}")
        if not all(labels.get(k) == v for k, v in svc["spec"]["selector"].items()):
            raise AssertionError(f"Service {name} does not select {s['metadata']['name']}")
        grace = s["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
        if grace <= drain:
            raise AssertionError(f"{s['metadata']['name']}: grace {grace} <= drain {drain}")
    if work["spec"]["replicas"] != workers or front["spec"]["replicas"] != 1:
        raise AssertionError(f"replicas: workers {work['spec']['replicas']} (want {workers}), "
                             f"front {front['spec']['replicas']}")
    wc, fc = container(work), container(front)
    cmd = wc["command"]
    if cmd[:2] != ["shoal", "node"] or cmd[cmd.index("--name-from") + 1] != "HOSTNAME":
        raise AssertionError(f"worker command {cmd}")
    env = {e["name"]: e for e in wc["env"]}
    if env.get("HOSTNAME", {}).get("valueFrom", {}).get("fieldRef", {}).get("fieldPath") != \
            "metadata.name":
        raise AssertionError(f"worker HOSTNAME is not the pod's name: {env.get('HOSTNAME')}")
    fcmd = fc["command"]
    if fcmd[:2] != ["shoal", "serve"] or float(fcmd[fcmd.index("--drain-timeout") + 1]) != drain:
        raise AssertionError(f"front command {fcmd}")
    if wc["lifecycle"]["preStop"]["sleep"]["seconds"] < drain:
        raise AssertionError("workers do not wait for the front's drain")
    live = fc["livenessProbe"]
    live_ok = live.get("httpGet", {}).get("path") == "/admin/status" or \
        live.get("tcpSocket", {}).get("port") == "http"
    if fc["readinessProbe"]["httpGet"]["path"] != "/health" or not live_ok or \
            wc["readinessProbe"]["tcpSocket"]["port"] != "cluster" or \
            wc["startupProbe"]["tcpSocket"]["port"] != "cluster":
        raise AssertionError("probes: front readiness /health, liveness /admin/status (a TCP "
                             "probe with API keys); workers the node port")
    size = os.path.getsize(su.MODEL) / MIB
    want = math.ceil((size * stages_per_worker_share + kv_mib + 256) / 64) * 64
    got = wc["resources"]["requests"]["memory"]
    if got != f"{want}Mi":
        raise AssertionError(f"worker memory request {got}, want {want}Mi (model {size:.1f} MiB)")
    # The script's addresses follow the pods: worker k (the rank --name-from reads from the pod
    # name NAME-k) listens on NAME-k.NAME, the front on NAME-front-0.NAME.
    script = by(docs, "ConfigMap", f"{name}-script")["data"]["cluster.lua"]
    addr = dict(re.findall(r'\["([^"]+)"\] = "([^"]+)"', script))
    want_addr = {"front": f"tcp://{name}-front-0.{name}:7000"}
    for k in range(workers):
        want_addr[f"w{k}"] = f"tcp://{name}-{k}.{name}:7000"
    if workers == 1 and "w" in addr:  # a script whose nodes are "f" and "w"
        want_addr = {"f": want_addr["front"], "w": want_addr["w0"]}
    if addr != want_addr:
        raise AssertionError(f"addresses {addr}, want {want_addr}")
    return script


HOSTS = {"shoal-front-0.shoal": "127.0.1.1", "shoal-0.shoal": "127.0.2.1",
         "shoal-1.shoal": "127.0.2.2"}
PROMPTS = ["Once upon a time", "The capital of France is", "def add(a, b):"]


def greedy(url, prompt):
    status, parsed, raw = su.post_json(url, "/v1/completions", {
        "prompt": prompt, "max_tokens": 16, "temperature": 0, "ignore_eos": True})
    if status != 200:
        raise AssertionError(f"status {status}: {raw[:300]!r}")
    return parsed["choices"][0]["text"]


def pods(d):
    """Runs the manifests in d/k8s.yaml as the kubelet would, as far as a process goes: each
    StatefulSet pod's command with its environment (HOSTNAME from its name), the ConfigMap's
    script and the Secret's key as files in d instead of their mounts. Inside the network
    namespace, where /etc/hosts maps the pods' names to 127.x addresses."""
    import deploy_util as du
    with open(os.path.join(d, "k8s.yaml")) as f:
        docs = [x for x in yaml.safe_load_all(f) if x]
    with open(os.path.join(d, "cluster.lua"), "w") as f:
        f.write(by(docs, "ConfigMap", "shoal-script")["data"]["cluster.lua"])
    with open(os.path.join(d, "cluster.key"), "wb") as f:
        f.write(base64.b64decode(by(docs, "Secret", "shoal-cluster-key")["data"]["cluster.key"]))
    with su.server("-t", "2") as srv:
        want = [greedy(srv.url, p) for p in PROMPTS]
    procs = []
    try:
        for sts in ("shoal", "shoal-front"):
            spec = by(docs, "StatefulSet", sts)
            c = container(spec)
            for i in range(spec["spec"]["replicas"]):
                env = {}
                for e in c["env"]:
                    if "value" in e:
                        env[e["name"]] = e["value"].replace("/etc/shoal-key", d)
                    elif e["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name":
                        env[e["name"]] = f"{sts}-{i}"
                argv = [a.replace("/etc/shoal/", d + "/") for a in c["command"][1:]]
                procs.append(du.Proc(argv, f"{sts}-{i}", env=env))
        front = procs[-1]
        front.wait_for("listening on http://0.0.0.0:8080")
        url = "http://127.0.0.1:8080"
        got = [greedy(url, p) for p in PROMPTS]
        if got != want:
            raise AssertionError(f"through the pods' front {got!r} != one process {want!r}")
        for path in ("/health", "/admin/status"):  # what the front's probes ask
            status, _, _ = su.get(url, path)
            if status != 200:
                raise AssertionError(f"GET {path}: {status}")
        for name in ("shoal-0.shoal", "shoal-1.shoal"):  # the workers' TCP probes
            import socket
            socket.create_connection((name, 7000), timeout=5).close()
        for p in reversed(procs):
            p.stop()
        procs = []
        su.log("     the pods' commands ran the pipeline; greedy completions equal one process")
    finally:
        for p in procs:
            if p.proc.poll() is None:
                p.proc.kill()
                p.proc.wait()


def run_pods():
    """The manifests' commands, run in a network namespace of their own (unshare -n -m, root)
    whose /etc/hosts gives every pod name of the headless Service an address on lo."""
    if os.geteuid() != 0 or not shutil.which("unshare") or not shutil.which("ip") or \
            subprocess.run(["unshare", "-n", "-m", "true"], capture_output=True).returncode:
        su.log("     skipped: needs root and unshare -n -m")
        return
    d = tempfile.mkdtemp(prefix="shoal-k8s-")
    try:
        with open(os.path.join(d, "hosts"), "w") as f:
            f.write("127.0.0.1 localhost\n" + "".join(f"{a} {n}\n" for n, a in HOSTS.items()))
        with open(os.path.join(d, "key"), "w") as f:
            f.write("a-key-for-the-pods-of-this-test\n")
        out = manifest("k8s", "examples/cluster/pipeline-2stage.lua", "--model-dir",
                       os.path.join(su.ROOT, "models"), "--cluster-key-file",
                       os.path.join(d, "key"), "-t", "1")
        if out.returncode != 0:
            raise AssertionError(out.stderr)
        with open(os.path.join(d, "k8s.yaml"), "w") as f:
            f.write(out.stdout)
        cmd = (f"mount --bind {d}/hosts /etc/hosts && ip link set lo up && "
               f"exec {sys.executable} {os.path.abspath(__file__)} --pods {d}")
        p = subprocess.run(["unshare", "-n", "-m", "sh", "-c", cmd], capture_output=True,
                           text=True, timeout=su.scaled(240))
        sys.stdout.write(p.stdout)
        if p.returncode != 0:
            raise AssertionError(f"exit {p.returncode}:\n{p.stdout[-3000:]}{p.stderr[-3000:]}")
    finally:
        shutil.rmtree(d, ignore_errors=True)


def main():
    if len(sys.argv) == 3 and sys.argv[1] == "--pods":
        pods(sys.argv[2])
        return
    su.require_model()
    r = su.Runner("deploy_k8s")

    def pipeline():
        out = manifest("k8s", "examples/cluster/pipeline-2stage.lua")
        if out.returncode != 0:
            raise AssertionError(f"exit {out.returncode}: {out.stderr}")
        docs = documents(out.stdout)
        script = check_layout(docs, "shoal", 2, 0.5, 512, 30)
        with open(os.path.join(su.ROOT, "examples/cluster/pipeline-2stage.lua")) as f:
            original = "\n".join(ln.rstrip() for ln in f.read().splitlines())
        if not script.rstrip("\n").endswith(original.rstrip("\n")):
            raise AssertionError("the ConfigMap's script does not end with the original script")
        if '"/models/" .. t.path:match' not in script:
            raise AssertionError("the model paths are not set to /models")
        if any(d["kind"] == "Secret" for d in docs):
            raise AssertionError("a Secret was written without --cluster-key-file")
        with open(os.path.join(su.ROOT, EXAMPLE)) as f:
            if f.read() != out.stdout:
                raise AssertionError(f"{EXAMPLE} differs from `shoal cluster manifest k8s "
                                     "examples/cluster/pipeline-2stage.lua`: regenerate it")
    r.case("pipeline-2stage.lua: valid manifests, equal to the committed example", pipeline)

    def replicas():
        with tempfile.NamedTemporaryFile("w", suffix=".key", delete=False) as kf:
            kf.write("k" * 24 + "0123456789abcdef\n")
        try:
            out = manifest("k8s", "examples/cluster/replicas-2x2stage.lua", "--namespace", "ml",
                           "--image", "registry.example/shoal:0.1", "--name", "llm",
                           "--drain-timeout", "45", "-t", "4", "--cluster-key-file", kf.name)
        finally:
            os.unlink(kf.name)
        if out.returncode != 0:
            raise AssertionError(f"exit {out.returncode}: {out.stderr}")
        docs = documents(out.stdout)
        check_layout(docs, "llm", 4, 0.5, 512, 45, ns="ml")
        key = base64.b64decode(by(docs, "Secret", "llm-cluster-key")["data"]["cluster.key"])
        if key != b"k" * 24 + b"0123456789abcdef":
            raise AssertionError(f"Secret holds {key!r}")
        wc = container(by(docs, "StatefulSet", "llm"))
        if wc["image"] != "registry.example/shoal:0.1" or wc["resources"]["requests"]["cpu"] != "4":
            raise AssertionError(f"image {wc['image']}, cpu {wc['resources']['requests']['cpu']}")
    r.case("replicas-2x2stage.lua with options: valid manifests, a Secret", replicas)

    def keyed():
        d = tempfile.mkdtemp(prefix="shoal-manifest-")
        path = os.path.join(d, "keyed.lua")
        with open(path, "w") as f:
            f.write(f'local m = model {{ path = "{su.MODEL}", name = "m" }}\n'
                    'return cluster { nodes = { node { name = "w", listen = "ipc:///tmp/w" },'
                    ' node { name = "f", listen = "ipc:///tmp/f" } },'
                    ' gateway = { node = "f", http = "127.0.0.1:8080", api_keys = { "sk-1" } },'
                    ' replicas = { replica { model = m, stages = { { node = "w" } } } } }\n')
        try:
            out = manifest("k8s", path)
        finally:
            os.unlink(path)
            os.rmdir(d)
        if out.returncode != 0:
            raise AssertionError(out.stderr)
        docs = documents(out.stdout)
        # One worker holding the whole file, KV left to the node (512 MiB assumed); the gateway's
        # node listed second is still the front, and the worker rank 0.
        check_layout(docs, "shoal", 1, 1.0, 512, 30)
        live = container(by(docs, "StatefulSet", "shoal-front"))["livenessProbe"]
        if live.get("tcpSocket", {}).get("port") != "http" or "httpGet" in live:
            raise AssertionError(f"with API keys the front's liveness is {live}, want a TCP "
                                 "probe of the HTTP port (/admin/status needs a key)")
        if "sk-1" in out.stdout.split("kind: ConfigMap")[0]:
            raise AssertionError("an API key outside the ConfigMap")
    r.case("a script with API keys, one worker, KV unset: TCP liveness, sizes", keyed)

    def bad():
        d = tempfile.mkdtemp(prefix="shoal-manifest-")
        broken = os.path.join(d, "broken.lua")
        with open(broken, "w") as f:
            f.write("return cluster { nodes = { node { name = 'a' } } \n")
        nomodel = os.path.join(d, "nomodel.lua")
        with open(nomodel, "w") as f:
            f.write('local m = model { path = "missing.gguf", name = "m" }\n'
                    'return cluster { nodes = { node { name = "f", listen = "tcp://127.0.0.1:7000" },'
                    ' node { name = "w", listen = "tcp://127.0.0.1:7001" } },'
                    ' gateway = { node = "f", http = "127.0.0.1:8080" },'
                    ' replicas = { replica { model = m, stages = { { node = "w" } } } } }\n')
        cases = [
            (["k8s", broken], "broken.lua"),
            (["k8s", os.path.join(d, "absent.lua")], "absent.lua"),
            (["k8s", nomodel], "missing.gguf"),
            (["k8s", "examples/cluster/pipeline-2stage.lua", "--name", "Bad_Name"], "--name"),
            (["k8s", "examples/cluster/pipeline-2stage.lua", "--port", "0"], "--port"),
            (["slurm", "examples/cluster/pipeline-2stage.lua", "--hosts", "a,b"], "--ntasks=3"),
            (["slurm", "examples/cluster/pipeline-2stage.lua"], "--hosts"),
            (["helm", "examples/cluster/pipeline-2stage.lua"], "k8s or slurm"),
        ]
        problems = []
        for args, want in cases:
            out = manifest(*args)
            lines = out.stderr.strip().splitlines()
            if out.returncode != 2 or out.stdout or len(lines) != 1 or want not in lines[0]:
                problems.append(f"{args}: exit {out.returncode}, stdout {len(out.stdout)} bytes, "
                                f"stderr {out.stderr.strip()!r} (want one line naming {want!r})")
        for p in os.listdir(d):
            os.unlink(os.path.join(d, p))
        os.rmdir(d)
        if problems:
            raise AssertionError("\n".join(problems))
    r.case("bad input: one line, exit 2, nothing written", bad)
    r.case("the pods' commands, environment, script and key run the pipeline (network "
           "namespace, pod names in /etc/hosts): greedy output equals one process", run_pods)
    r.finish()


if __name__ == "__main__":
    main()
