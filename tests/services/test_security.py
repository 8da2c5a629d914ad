"""What an attacker on this machine meets (docs/SECURITY.md), with real processes on loopback.

One `picovllm serve all` (its four children: the three gRPC services and the HTTP gateway)
with its defaults (the default ports when they are free), its Redis
URL with a password and its API key in the environment, TLS on the public API when openssl
is there to make a certificate:

- every socket the process tree listens on is a loopback one (read from /proc: the LISTEN
  sockets of /proc/net/tcp{,6} whose inodes the processes hold);
- no secret is in any process's argv; the children share one internal token made for this
  launch, each child holding only the secrets it needs;
- the internal services refuse Step, StepStream, GetState and ApplyStep without the token (or with a
  wrong one) with UNAUTHENTICATED and serve them with it; a reset asking for absurd pools is
  refused before it allocates; health stays open;
- the public API refuses a missing or wrong API key and serves the right one.
"""

from __future__ import annotations

import ipaddress
import os
import shutil
import subprocess
import sys
from pathlib import Path

import grpc
import pytest

from contracts.health import check_health
from contracts.rpc import why_not_listen
from protos.picovllm.kvcache.v1 import kvcache_pb2 as kv_pb
from protos.picovllm.kvcache.v1 import kvcache_pb2_grpc as kv_grpc
from protos.picovllm.model.v1 import model_pb2 as model_pb
from protos.picovllm.model.v1 import model_pb2_grpc as model_grpc
from scheduler_svc.client import Client
from tests.services.conftest import REPO, ServiceProcess, free_port, wait_for

REDIS_PASSWORD = "redis-secret-" + os.urandom(8).hex()
API_KEY = "api-key-secret-" + os.urandom(8).hex()
DEFAULTS = {
    "scheduler": "127.0.0.1:50051",
    "kvcache": "127.0.0.1:50052",
    "model": "127.0.0.1:50053",
    "metrics": "127.0.0.1:9400",
    "http": "127.0.0.1:8000",
}
CHILDREN = {"kvcache", "model", "scheduler", "http"}


# ----------------------------------------------------------------- /proc
def process_tree(root: int) -> list[int]:
    parents: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            parents[int(entry)] = int(stat.rpartition(")")[2].split()[1])
    tree, frontier = [root], [root]
    while frontier:
        frontier = [pid for pid, ppid in parents.items() if ppid in frontier]
        tree += frontier
    return tree


def socket_inodes(pid: int) -> set[str]:
    found = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            found.add(target[8:-1])
    return found


def _address(hex_addr: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address:
    raw = bytes.fromhex(hex_addr)
    if len(raw) == 4:
        return ipaddress.IPv4Address(raw[::-1])
    addr = ipaddress.IPv6Address(b"".join(raw[i : i + 4][::-1] for i in range(0, 16, 4)))  # four host-order words
    return addr.ipv4_mapped or addr


def listening_sockets() -> dict[str, tuple[str, int]]:
    """inode -> (address, port) of every TCP socket in LISTEN state."""
    found = {}
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] == "0A":  # TCP_LISTEN
                host, port = fields[1].split(":")
                found[fields[9]] = (str(_address(host)), int(port, 16))
    return found


def cmdline(pid: int) -> str:
    return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")


def environ(pid: int) -> dict[str, str]:
    pairs = (item.partition(b"=") for item in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0") if item)
    return {k.decode(): v.decode(errors="replace") for k, _, v in pairs}


# ----------------------------------------------------------------- the deployment
def start_redis(tmp: Path) -> tuple[subprocess.Popen, int]:
    """redis-server with a password, given as configuration on stdin (not in its argv)."""
    port = free_port()
    proc = subprocess.Popen(
        ["redis-server", "-"], stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT, cwd=tmp
    )
    proc.stdin.write(f'port {port}\nbind 127.0.0.1\nsave ""\nappendonly no\nrequirepass {REDIS_PASSWORD}\n'.encode())
    proc.stdin.close()
    return proc, port


def make_certificate(tmp: Path) -> tuple[str, str] | None:
    if shutil.which("openssl") is None:
        return None
    cert, key = tmp / "cert.pem", tmp / "key.pem"
    subprocess.run(
        [
            "openssl",
            "req",
            "-x509",
            "-newkey",
            "ec",
            "-pkeyopt",
            "ec_paramgen_curve:prime256v1",
            "-nodes",
            "-keyout",
            str(key),
            "-out",
            str(cert),
            "-days",
            "1",
            "-subj",
            "/CN=localhost",
            "-addext",
            "subjectAltName=IP:127.0.0.1,DNS:localhost",
        ],
        check=True,
        capture_output=True,
        timeout=30,
    )
    return str(cert), str(key)


@pytest.fixture(scope="module")
def deployment(tmp_path_factory):
    if shutil.which("redis-server") is None:
        pytest.skip("redis-server is not installed")
    tmp = tmp_path_factory.mktemp("security")
    redis, redis_port = start_redis(tmp)
    defaults = all(why_not_listen(a) is None for a in DEFAULTS.values())
    addr = dict(DEFAULTS) if defaults else {k: f"127.0.0.1:{free_port()}" for k in DEFAULTS}
    args = ["--device", "cpu", "--torch-threads", "1", "--num-gpu-blocks", "128", "--num-cpu-blocks", "16"]
    if not defaults:  # another server holds a default port: the same hosts, other ports
        args += [
            "--scheduler-addr",
            addr["scheduler"],
            "--kvcache-addr",
            addr["kvcache"],
            "--model-addr",
            addr["model"],
            "--metrics-port",
            addr["metrics"].rpartition(":")[2],
            "--port",
            addr["http"].rpartition(":")[2],
        ]
    tls = make_certificate(tmp)
    if tls is not None:
        args += ["--tls-cert", tls[0], "--tls-key", tls[1]]
    env = {
        "PICOVLLM_REDIS_URL": f"redis://:{REDIS_PASSWORD}@127.0.0.1:{redis_port}/0",
        "PICOVLLM_API_KEY": API_KEY,
        "PICOVLLM_DEPLOYMENT": "security",
        "PICOVLLM_INTERNAL_TOKEN": "",
    }  # no token: serve all makes one
    proc = ServiceProcess("all", args, tmp, env=env)
    try:
        root = Path(tls[0]).read_bytes() if tls else None
        wait_for(
            lambda: check_health(addr["scheduler"], timeout=0.5, root_certificates=root), 120, "serve all", proc.proc
        )
        children = {}
        for pid in process_tree(proc.proc.pid)[1:]:
            line = cmdline(pid)  # the scheduler's engine process is `python -m scheduler_svc.engine_core FD`
            kind = "engine" if "scheduler_svc.engine_core" in line else line.split(" serve ")[-1].split()[0]
            children[kind] = pid
        assert set(children) == CHILDREN | {"engine"}, children
        yield {
            "addr": addr,
            "proc": proc,
            "children": children,
            "tls": tls,
            "root": root,
            "token": environ(children["model"])["PICOVLLM_INTERNAL_TOKEN"],
        }
    finally:
        proc.kill()
        redis.kill()
        redis.wait(timeout=10)


# ----------------------------------------------------------------- listeners and secrets
def test_every_listener_is_on_loopback(deployment):
    tree = process_tree(deployment["proc"].proc.pid)
    listening = listening_sockets()
    mine = [listening[inode] for pid in tree for inode in socket_inodes(pid) if inode in listening]
    ports = {port for _, port in mine}
    expected = {int(a.rpartition(":")[2]) for a in deployment["addr"].values()}
    assert expected <= ports, (mine, expected)  # the gRPC servers, the metrics and the gateway are all seen
    outside = [(host, port) for host, port in mine if not ipaddress.ip_address(host).is_loopback]
    assert not outside, f"listening beyond loopback: {outside}"


def test_no_secret_in_any_argv_and_each_child_holds_only_its_own(deployment):
    children, token = deployment["children"], deployment["token"]
    assert len(token) >= 32  # made for this launch
    for pid in process_tree(deployment["proc"].proc.pid):
        line = cmdline(pid)
        for secret in (REDIS_PASSWORD, API_KEY, token):
            assert secret not in line, line
    envs = {kind: environ(pid) for kind, pid in children.items()}
    assert {envs[k]["PICOVLLM_INTERNAL_TOKEN"] for k in ("kvcache", "model", "scheduler")} == {token}
    assert "PICOVLLM_INTERNAL_TOKEN" not in envs["http"]  # the gateway calls the public API only
    assert not any(
        k.startswith(("PICOVLLM_INTERNAL_TOKEN", "PICOVLLM_API_KEY", "PICOVLLM_REDIS_URL")) for k in envs["engine"]
    )
    assert REDIS_PASSWORD in envs["kvcache"]["PICOVLLM_REDIS_URL"]
    assert not any("PICOVLLM_REDIS_URL" in envs[k] for k in ("model", "scheduler", "http"))
    assert envs["scheduler"]["PICOVLLM_API_KEY"] == envs["http"]["PICOVLLM_API_KEY"] == API_KEY
    assert "PICOVLLM_API_KEY" not in envs["model"] and "PICOVLLM_API_KEY" not in envs["kvcache"]


# ----------------------------------------------------------------- internal services
def _code(call) -> grpc.StatusCode:
    try:
        call()
    except grpc.RpcError as err:
        return err.code()
    return grpc.StatusCode.OK


def test_internal_services_need_the_token(deployment):
    addr, token = deployment["addr"], deployment["token"]
    good = (("authorization", f"Bearer {token}"),)
    bad = [None, (("authorization", "Bearer " + "x" * len(token)),), (("x-picovllm-token", token[:-1]),)]
    huge_reset = kv_pb.ApplyStepRequest(
        step=10**9,
        ops=[
            kv_pb.BlockOp(
                reset=kv_pb.ResetOp(
                    config=kv_pb.PoolConfig(num_device_blocks=2**31 - 1, num_host_blocks=2**31 - 1, block_size=16)
                )
            )
        ],
    )
    with grpc.insecure_channel(addr["model"]) as m, grpc.insecure_channel(addr["kvcache"]) as k:
        model, kv = model_grpc.ModelServiceStub(m), kv_grpc.KVCacheServiceStub(k)
        epoch = model.GetInfo(model_pb.GetInfoRequest(), timeout=10, metadata=good).epoch
        crafted = model_pb.StepRequest(expected_epoch=epoch, copies=model_pb.BlockCopies(src=[0, 1], dst=[2, 3]))
        for metadata in bad:
            assert (
                _code(lambda metadata=metadata: model.Step(crafted, timeout=10, metadata=metadata))
                == grpc.StatusCode.UNAUTHENTICATED
            )
            stream = lambda metadata=metadata: list(model.StepStream(iter([crafted]), timeout=10, metadata=metadata))  # noqa: E731
            assert _code(stream) == grpc.StatusCode.UNAUTHENTICATED
            assert (
                _code(lambda metadata=metadata: kv.GetState(kv_pb.GetStateRequest(), timeout=10, metadata=metadata))
                == grpc.StatusCode.UNAUTHENTICATED
            )
            assert (
                _code(lambda metadata=metadata: kv.ApplyStep(huge_reset, timeout=10, metadata=metadata))
                == grpc.StatusCode.UNAUTHENTICATED
            )
        # With the token the calls reach the services: an empty step runs, the state is read,
        # a step out of order is refused without change, and absurd pools are refused.
        assert (
            _code(lambda: model.Step(model_pb.StepRequest(expected_epoch=epoch), timeout=10, metadata=good))
            == grpc.StatusCode.OK
        )
        assert kv.GetState(kv_pb.GetStateRequest(), timeout=10, metadata=good).state.HasField("config")
        alt = (("x-picovllm-token", token),)
        assert (
            _code(lambda: kv.ApplyStep(kv_pb.ApplyStepRequest(step=10**9), timeout=10, metadata=alt))
            == grpc.StatusCode.FAILED_PRECONDITION
        )
        assert _code(lambda: kv.ApplyStep(huge_reset, timeout=10, metadata=good)) == grpc.StatusCode.INVALID_ARGUMENT
    for kind in ("model", "kvcache"):  # health needs no credential
        assert check_health(addr[kind], timeout=5)


# ----------------------------------------------------------------- public API
def test_public_api_needs_the_api_key(deployment):
    addr, root = deployment["addr"]["scheduler"], deployment["root"]
    for key in ("", "wrong-key-0123456789abcdef"):
        with Client(addr, timeout=10, api_key=key, tls_ca=root) as c:
            assert _code(lambda: c.complete("Once upon a time", max_tokens=2)) == grpc.StatusCode.UNAUTHENTICATED
            assert _code(lambda: c.model_info()) == grpc.StatusCode.UNAUTHENTICATED
            assert _code(lambda: c.abort("nobody")) == grpc.StatusCode.UNAUTHENTICATED
            assert c.wait_ready(5)  # health stays open
    with Client(addr, timeout=60, api_key=API_KEY, tls_ca=root) as c:
        text, ids, _ = c.complete("Once upon a time", max_tokens=8, temperature=0)
        assert len(ids) == 8 and text.startswith(", there was")
        assert _code(lambda: c.abort("nobody")) == grpc.StatusCode.NOT_FOUND
    if root is not None:  # TLS only: a plaintext client gets nowhere
        with Client(addr, timeout=5, api_key=API_KEY) as c:
            assert _code(lambda: c.model_info(timeout=5)) == grpc.StatusCode.UNAVAILABLE


def test_picovllm_client_takes_the_key_from_the_environment(deployment):
    addr, tls = deployment["addr"]["scheduler"], deployment["tls"]
    argv = [
        sys.executable,
        "-m",
        "scheduler_svc.cli",
        "client",
        "Once upon a time",
        "--max-tokens",
        "4",
        "--addr",
        addr,
    ]
    argv += ["--tls-ca", tls[0]] if tls else []
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    ok = subprocess.run(
        argv, env={**env, "PICOVLLM_API_KEY": API_KEY}, capture_output=True, text=True, timeout=60, cwd=REPO
    )
    assert ok.returncode == 0 and ok.stdout.startswith("Once upon a time, there"), ok.stderr
    refused = subprocess.run(
        argv,
        env={k: v for k, v in env.items() if k != "PICOVLLM_API_KEY"},
        capture_output=True,
        text=True,
        timeout=60,
        cwd=REPO,
    )
    assert refused.returncode == 1 and "PICOVLLM_API_KEY" in refused.stderr and len(refused.stderr.splitlines()) == 1


# ----------------------------------------------------------------- start-up refusals
def _run_cli(*argv: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    base = {k: v for k, v in os.environ.items() if not k.startswith("PICOVLLM_")}
    return subprocess.run(
        [sys.executable, "-m", "scheduler_svc.cli", *argv],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=REPO,
        env={**base, "PYTHONPATH": str(REPO), **(env or {})},
    )


def test_a_scheduler_with_another_token_stops_in_one_line(deployment):
    addr = deployment["addr"]
    out = _run_cli(
        "serve",
        "scheduler",
        "--scheduler-addr",
        f"127.0.0.1:{free_port()}",
        "--metrics-port",
        "0",
        "--kvcache-addr",
        addr["kvcache"],
        "--model-addr",
        addr["model"],
        env={"PICOVLLM_INTERNAL_TOKEN": "not-the-launch-token-0123456789"},
    )
    assert out.returncode == 2 and "PICOVLLM_INTERNAL_TOKEN" in out.stderr, out.stderr
    assert len(out.stderr.strip().splitlines()) == 1 and deployment["token"] not in out.stderr, out.stderr


def test_secrets_on_the_command_line_and_missing_tokens_are_refused_in_one_line():
    addr = f"127.0.0.1:{free_port()}"
    url = _run_cli(
        "serve", "kvcache", "--kvcache-addr", addr, "--redis-url", f"redis://:{REDIS_PASSWORD}@127.0.0.1:1/0"
    )
    assert url.returncode == 2 and "PICOVLLM_REDIS_URL" in url.stderr and REDIS_PASSWORD not in url.stderr
    no_token = _run_cli("serve", "kvcache", "--kvcache-addr", addr)
    assert (
        no_token.returncode == 2
        and "PICOVLLM_INTERNAL_TOKEN" in no_token.stderr
        and "--insecure-no-auth" in no_token.stderr
    )
    for out in (url, no_token):
        assert len(out.stderr.strip().splitlines()) == 1, out.stderr
