"""`tandem serve`'s listening sockets and secrets, against the tables of docs/security.md.

One real server: SmolLM2 on CPU, 1 prefill + 1 decode worker, its own Redis and Ray, two API keys
(one in ``TANDEM_API_KEY``, one in a 0600 ``--api-key-file``). Every listening TCP socket of its
process tree is named from its process and, for Ray's, from the ports Ray's GCS reports for that
process; each must be a row of the doc's socket table and bind loopback, and every row the doc
says this setup opens must be there. No secret may be in a command line, a child's environment or
a Ray job's runtime_env. The doc is parsed here, so the two cannot drift apart.
"""

from __future__ import annotations

import argparse
import ipaddress
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

psutil = pytest.importorskip("psutil")
httpx = pytest.importorskip("httpx")
pytest.importorskip("ray")
from cli_process import free_port  # noqa: E402 - after the skips
from ray.autoscaler._private.constants import AUTOSCALER_METRIC_PORT  # noqa: E402 - 44217
from test_serve import ROOT, Proc  # noqa: E402

pytestmark = pytest.mark.slow

DOC = ROOT / "docs" / "security.md"
KEYS = ("env-key-5f1c0e", "file-key-9a27d4")
TOPOLOGY = ["--prefill", "1", "--decode", "1"]
OPENED_HERE = {"always", "local Ray", "local Redis", "disaggregated"}  # the doc's "opened" values

RAY_VIEW = """
import asyncio, json, sys
from ray._raylet import GcsClient

gcs = GcsClient(address=sys.argv[1])
async def actors():
    return await gcs.async_get_all_actor_info(timeout=10)
view = {
    "nodes": [
        {"node_manager": n.node_manager_port, "object_manager": n.object_manager_port,
         "runtime_env_agent": n.runtime_env_agent_port, "metrics_export": n.metrics_export_port}
        for n in gcs.get_all_node_info(timeout=10).values()
    ],
    "actors": {a.pid: a.address.port for a in asyncio.run(actors()).values() if a.pid},
    "jobs": [
        {"driver_pid": j.driver_pid, "driver_port": j.driver_address.port,
         "runtime_env": j.config.runtime_env_info.serialized_runtime_env}
        for j in gcs.get_all_job_info(timeout=10).values()
    ],
}
print(json.dumps(view))
"""


def doc_sockets() -> dict[str, str]:
    """The socket table of docs/security.md: name -> its "opened" cell."""
    text = DOC.read_text().split("## Listening sockets", 1)[1].split("\n## ", 1)[0]
    rows = {}
    for line in text.splitlines():
        if m := re.match(r"\| `([a-z0-9-]+)` \|", line):
            rows[m[1]] = line.rstrip(" |").rsplit("|", 1)[1].strip()
    assert rows, f"no socket table in {DOC}"
    return rows


def gcs_client_run(code: str, gcs: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    """``code`` in a fresh Python with ``gcs`` as its argument (Ray's token loader is global)."""
    return subprocess.run(
        [sys.executable, "-c", code, gcs], env=env, capture_output=True, text=True, timeout=60
    )


@pytest.fixture(scope="module")
def served(tmp_path_factory, smollm2_dir):
    key_file = tmp_path_factory.mktemp("keys") / "keys"
    key_file.write_text(KEYS[1] + "\n")
    key_file.chmod(0o600)
    port = free_port()
    env = {**os.environ, "TANDEM_TORCH_THREADS": "1", "PYTHONPATH": str(ROOT)}
    env["TANDEM_API_KEY"] = KEYS[0]
    env.pop("TANDEM_REDIS_URL", None)
    proc = Proc(
        [
            "serve",
            "--model",
            str(smollm2_dir),
            "--device",
            "cpu",
            *TOPOLOGY,
            "--port",
            str(port),
            "--api-key-file",
            str(key_file),
            "--engine",
            "kv_cache_memory_gb=0.25",
        ],
        env,
    )
    try:
        gcs = proc.wait_for(r"^ray: (\S+) ", 300)[1]
        proc.wait_for(r"^serving http://", 300)
        operator_port = int(proc.wait_for(r"^operator: 127\.0\.0\.1:(\d+) ", 1)[1])
        before = snapshot(proc.proc.pid)
        # one request: the router then reads the decode worker's output stream (its socket)
        auth = {"Authorization": f"Bearer {KEYS[0]}"}
        base = f"http://127.0.0.1:{port}/v1"
        model = httpx.get(f"{base}/models", headers=auth, timeout=30).json()["data"][0]["id"]
        done = httpx.post(
            f"{base}/completions",
            json={"model": model, "prompt": "Hi", "max_tokens": 2},
            headers=auth,
            timeout=120,
        )
        assert done.status_code == 200, done.text
        yield {
            "proc": proc,
            "port": port,
            "gcs": gcs,
            "operator_port": operator_port,
            "before": {(p["pid"], port) for p in before for _, port in p["listening"]},
            "snapshot": snapshot(proc.proc.pid),
        }
    finally:
        proc.stop()


def snapshot(root_pid: int) -> list[dict]:
    """Every process of the tree: its argv, environment (None for the root, whose environment
    is what its caller gave it) and listening TCP sockets."""
    root = psutil.Process(root_pid)
    out = []
    for p in [root, *root.children(recursive=True)]:
        try:
            listening = [
                (c.laddr.ip, c.laddr.port)
                for c in p.net_connections(kind="inet")
                if c.status == psutil.CONN_LISTEN
            ]
            out.append(
                {
                    "pid": p.pid,
                    "name": p.name(),
                    "cmdline": p.cmdline(),
                    "environ": None if p.pid == root_pid else p.environ(),
                    "listening": listening,
                }
            )
        except psutil.NoSuchProcess:
            continue
    return out


@pytest.fixture(scope="module")
def ray_view(served):
    env = {**os.environ, "RAY_AUTH_MODE": "token"}
    done = gcs_client_run(RAY_VIEW, served["gcs"], env)
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.splitlines()[-1])


def name_socket(proc: dict, port: int, served: dict, ray: dict) -> str | None:
    """The doc's name for ``proc``'s socket on ``port``, or None when nothing explains it."""
    argv0 = (proc["cmdline"] or [""])[0]
    node = ray["nodes"][0]
    if proc["pid"] == served["proc"].proc.pid:
        driver = {j["driver_port"] for j in ray["jobs"] if j["driver_pid"] == proc["pid"]}
        return "gateway" if port == served["port"] else "ray-driver" if port in driver else None
    if proc["name"] == "redis-server":
        return "redis"
    if proc["name"] == "gcs_server" and served["gcs"].endswith(f":{port}"):
        return "ray-gcs"
    if proc["name"] == "raylet":
        return {
            node["node_manager"]: "ray-node-manager",
            node["object_manager"]: "ray-object-manager",
        }.get(port)
    if argv0 == "ray::RuntimeEnvAgent" and port == node["runtime_env_agent"]:
        return "ray-runtime-env-agent"
    if any(a.endswith("monitor.py") for a in proc["cmdline"]) and port == AUTOSCALER_METRIC_PORT:
        return "ray-autoscaler-metrics"
    if any(a.endswith("dashboard/agent.py") for a in proc["cmdline"]):
        return "ray-metrics-export" if port == node["metrics_export"] else "ray-dashboard-agent"
    if argv0 == "ray::Controller" and port == served["operator_port"]:
        return "operator"
    if argv0.startswith("ray::"):
        grpc_port = ray["actors"].get(str(proc["pid"]))
        if grpc_port in (None, port):  # None: an idle worker, no actor yet
            return "ray-worker"
        if (proc["pid"], port) not in served["before"]:  # opened when the router came to read
            return "output-stream"
        return "kv-transfer" if argv0 == "ray::DecodeWorker" else None
    return None


def is_loopback(ip: str) -> bool:
    addr = ipaddress.ip_address(ip)
    mapped = getattr(addr, "ipv4_mapped", None)
    return (mapped or addr).is_loopback


def test_every_listening_socket_is_a_documented_kind_on_loopback(served, ray_view) -> None:
    rows = doc_sockets()
    seen: dict[str, list] = {}
    for proc in served["snapshot"]:
        for ip, port in proc["listening"]:
            name = name_socket(proc, port, served, ray_view)
            where = f"{proc['name']} (pid {proc['pid']}) on {ip}:{port}"
            assert name is not None, f"an unexplained listening socket: {where}"
            assert name in rows, f"{where} is a {name!r} socket, not in {DOC.name}'s table"
            assert is_loopback(ip), f"{where} ({name}) binds beyond loopback"
            seen.setdefault(name, []).append((proc["pid"], port))
    expected = {name for name, opened in rows.items() if opened in OPENED_HERE}
    assert expected <= set(seen), f"the doc's rows not opened: {sorted(expected - set(seen))}"
    decode_workers = [p for p in served["snapshot"] if p["cmdline"][:1] == ["ray::DecodeWorker"]]
    assert len(seen["kv-transfer"]) == len(decode_workers) == 1, seen["kv-transfer"]
    # the one router's stream of the one decode worker (the prefill worker streams to nobody)
    assert [pid for pid, _ in seen["output-stream"]] == [decode_workers[0]["pid"]]


def secrets_of(served) -> dict[str, str]:
    """Every secret the running server holds: the API keys, the Redis and Ray tokens."""
    redis = next(p for p in served["snapshot"] if p["name"] == "redis-server")
    # its config (0600, in its working dir, 0700); this test's user owns it
    conf = (Path(psutil.Process(redis["pid"]).cwd()) / "redis.conf").read_text()
    found = {f"api key {i}": key for i, key in enumerate(KEYS)}
    found["redis password"] = re.search(r"^requirepass (\S+)$", conf, re.M)[1]
    token_file = Path(os.environ.get("RAY_AUTH_TOKEN_PATH") or Path.home() / ".ray/auth_token")
    found["ray token"] = os.environ.get("RAY_AUTH_TOKEN") or token_file.read_text().strip()
    found["operator token"] = json.loads(operator_connection(served).read_text())["token"]
    return found


def operator_connection(served) -> Path:
    from cluster.launch.serve import operator_file

    return operator_file(served["port"])


def test_no_secret_in_argv_environment_or_runtime_env(served, ray_view) -> None:
    secrets = secrets_of(served)
    for proc in served["snapshot"]:
        who = f"{proc['name']} (pid {proc['pid']})"
        places = {"command line": " ".join(proc["cmdline"])}
        if proc["environ"] is not None:  # a child of `tandem serve`: nothing inherited
            places["environment"] = "\n".join(f"{k}={v}" for k, v in proc["environ"].items())
        for place, text in places.items():
            for what, secret in secrets.items():
                assert secret not in text, f"the {what} is in the {place} of {who}"
    assert ray_view["jobs"], "Ray's job table is empty"
    for job in ray_view["jobs"]:
        for what, secret in secrets.items():
            assert secret not in job["runtime_env"], f"the {what} is in a Ray runtime_env"
        assert "TANDEM_API_KEY" not in job["runtime_env"]


def test_ray_redis_and_the_gateway_refuse_clients_without_their_secret(served) -> None:
    gcs = served["gcs"]
    probe = "import sys\nfrom ray._raylet import GcsClient\nGcsClient(address=sys.argv[1])"
    for env in (
        {"RAY_AUTH_MODE": "disabled"},
        {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": "0" * 64},
    ):
        done = gcs_client_run(probe, gcs, {**os.environ, **env})
        assert done.returncode != 0 and "AuthenticationError" in done.stderr, (env, done.stderr)
    token_file = Path.home() / ".ray" / "auth_token"
    if not (os.environ.get("RAY_AUTH_TOKEN") or os.environ.get("RAY_AUTH_TOKEN_PATH")):
        assert token_file.stat().st_mode & 0o777 == 0o600

    import redis

    redis_proc = next(p for p in served["snapshot"] if p["name"] == "redis-server")
    port = redis_proc["listening"][0][1]
    with pytest.raises(redis.AuthenticationError):
        redis.Redis(port=port, socket_timeout=5).ping()

    from cluster.cli import main

    assert operator_connection(served).stat().st_mode & 0o777 == 0o600
    with pytest.MonkeyPatch.context() as mp:  # the CLI finds address and token in the file
        mp.delenv("TANDEM_OPERATOR_TOKEN", raising=False)
        assert main(["status", "--serve-port", str(served["port"])]) == 0
        mp.setenv("TANDEM_OPERATOR_TOKEN", "not-the-token")
        assert main(["status", "--serve-port", str(served["port"])]) == 4

    url = f"http://127.0.0.1:{served['port']}"
    assert httpx.get(url + "/v1/models").status_code == 401
    for key in KEYS:  # from TANDEM_API_KEY and from --api-key-file
        headers = {"Authorization": f"Bearer {key}"}
        assert httpx.get(url + "/v1/models", headers=headers).status_code == 200
    assert httpx.get(url + "/health").status_code == 200


# ---------------------------------------------------------------- secrets handling, no server


def serve_args(*argv: str) -> argparse.Namespace:
    from cluster.cli import build_parser

    return build_parser().parse_args(["serve", *argv])


def test_a_key_file_others_can_read_is_refused(tmp_path, monkeypatch) -> None:
    from cluster.launch.serve import _api_keys

    monkeypatch.delenv("TANDEM_API_KEY", raising=False)
    path = tmp_path / "keys"
    path.write_text("k1\n\nk2\n")
    path.chmod(0o644)
    with pytest.raises(ValueError, match=f"chmod 600 {path}"):
        _api_keys(serve_args("--api-key-file", str(path)))
    path.chmod(0o600)
    monkeypatch.setenv("TANDEM_API_KEY", "k3\nk4")
    assert _api_keys(serve_args("--api-key-file", str(path))) == ["k3", "k4", "k1", "k2"]
    assert "TANDEM_API_KEY" not in os.environ  # read once; no child inherits it


def test_detach_hands_secrets_to_the_server_in_its_environment(monkeypatch) -> None:
    from cluster.launch.serve import _child_argv, _secret_env

    monkeypatch.delenv("TANDEM_API_KEY", raising=False)
    monkeypatch.delenv("TANDEM_REDIS_URL", raising=False)
    url = "redis://:hunter2@10.0.0.5:6379/0"
    args = serve_args(
        "--detach", "--api-key", "kA", "--api-key=kB", "--redis-url", url, "--port", "9001",
        "--prefill", "2", "--decode", "1", "--engine", "a=1", "--engine", "b=x",
    )  # fmt: skip
    argv = _child_argv(args)
    assert not {"kA", "kB", url, "--detach", "--api-key", "--redis-url"} & set(argv), argv
    again = serve_args(*argv)
    assert (again.port, again.prefill, again.decode, again.engine) == (9001, 2, 1, ["a=1", "b=x"])
    assert _secret_env(args) == {"TANDEM_API_KEY": "kA\nkB", "TANDEM_REDIS_URL": url}
