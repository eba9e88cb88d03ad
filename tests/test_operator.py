"""The gRPC operator API on a real cluster: 1 prefill + 1 decode worker (Ray actors on CPU,
SmolLM2 fp32, TCP KV), the controller serving ClusterOperator on a real 127.0.0.1 socket.

Every call goes through that socket, with the stubs of proto/ or through ``cluster.cli.main``:
calls without the token (or with another) are refused; Status lists the workers with their
nodes, load and latencies; Scale adds a decode worker that takes requests, then removes one
(drained first) while requests stream, none aborted; Drain's exit code says whether requests
were left behind; a request id replays its first answer; every mutating call is in the audit
log; Watch streams the events. Tests run in file order (the scale test leaves one decode
worker, as it found the cluster).
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
import uuid

import pytest
from cluster_checks import assert_idle

from engine import SamplingParams

ray = pytest.importorskip("ray")
grpc = pytest.importorskip("grpc")

pytestmark = pytest.mark.slow

TOKEN = "operator-test-token-3c1f"
MIGRATION = {"last_stage_blocks": 2, "headroom_blocks": 2, "chunk_tokens": 64, "timeout_s": 10}


@pytest.fixture(scope="module")
def cluster(smollm2_dir):
    from cluster.launch.local import LocalCluster

    c = LocalCluster(
        model=str(smollm2_dir),
        num_prefill=1,
        num_decode=1,
        engine={
            "max_num_batched_tokens": 256,
            "num_kv_blocks": 192,
            "block_size": 16,
            "max_num_seqs": 8,
        },
        transfer_timeout_s=20,
        stall_timeout_s=6,
        migration=MIGRATION,
    )
    yield c
    c.shutdown()


@pytest.fixture(scope="module")
def operator(cluster, tmp_path_factory):
    audit = tmp_path_factory.mktemp("operator") / "audit.jsonl"
    address = cluster.start_operator(TOKEN, audit_log=str(audit))
    return {"address": address, "audit": audit}


@pytest.fixture(scope="module")
def stub(operator):
    from proto import operator_pb2_grpc

    channel = grpc.insecure_channel(operator["address"])
    yield operator_pb2_grpc.ClusterOperatorStub(channel)
    channel.close()


AUTH = (("authorization", f"Bearer {TOKEN}"),)


def rid() -> str:
    return f"test-{uuid.uuid4()}"


def cli(operator, *argv: str) -> int:
    from cluster.cli import main

    return main([*argv, "--address", operator["address"], "--timeout", "120"])


@pytest.fixture(autouse=True)
def token_env(monkeypatch):
    monkeypatch.setenv("TANDEM_OPERATOR_TOKEN", TOKEN)


def greedy(n: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)


async def collect(cluster, prompt, n, rid, progress, decode=None):
    last = None
    async for out in cluster.stream(prompt, greedy(n), request_id=rid, decode=decode):
        last = out
        progress[rid] = len(out.outputs[0].token_ids)
    return list(last.outputs[0].token_ids), last.outputs[0].finish_reason


async def until(progress, rids, n, timeout=120.0):
    deadline = time.monotonic() + timeout
    while any(progress.get(r, 0) < n for r in rids):
        assert time.monotonic() < deadline, f"stuck: {progress}"
        await asyncio.sleep(0.02)


def prompts(cluster, k: int) -> list[list[int]]:
    topics = ["rivers", "bread", "copper", "owls", "lanterns", "harbors"]
    return [cluster.tokenizer(f"Tell me about {topics[i % 6]}:")["input_ids"] for i in range(k)]


# -- auth --------------------------------------------------------------------------------------


def test_calls_without_the_right_token_are_refused(stub, operator):
    from proto import operator_pb2 as pb

    for metadata in [(), (("authorization", "Bearer wrong-token"),), (("authorization", TOKEN),)]:
        with pytest.raises(grpc.RpcError) as err:
            stub.Status(pb.StatusRequest(), metadata=metadata, timeout=10)
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
        assert "token" in err.value.details()
    with pytest.raises(grpc.RpcError) as err:  # a mutating call: refused before any work
        stub.Scale(pb.ScaleRequest(request_id=rid(), role=pb.ROLE_DECODE, replicas=5), timeout=10)
    assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert len(stub.Status(pb.StatusRequest(), metadata=AUTH, timeout=10).workers) == 2
    audit = [json.loads(line) for line in operator["audit"].read_text().splitlines()]
    assert audit[-1]["method"] == "Scale" and audit[-1]["outcome"] == "UNAUTHENTICATED"


def test_the_cli_says_why_it_cannot_connect(operator, capsys, monkeypatch):
    from cluster.cli import main

    monkeypatch.setenv("TANDEM_OPERATOR_TOKEN", "wrong-token")
    assert main(["status", "--address", operator["address"]]) == 4
    assert "refused the token" in capsys.readouterr().err
    with __import__("socket").socket() as s:
        s.bind(("127.0.0.1", 0))
        closed = f"127.0.0.1:{s.getsockname()[1]}"
    assert main(["status", "--address", closed, "--timeout", "5"]) == 3
    assert f"no tandem operator at {closed}" in capsys.readouterr().err


# -- status ------------------------------------------------------------------------------------


def test_status_lists_every_worker(cluster, operator, capsys):
    assert cli(operator, "status", "-o", "json") == 0
    status = json.loads(capsys.readouterr().out)
    assert status["cluster_id"] == cluster.cluster_id
    rows = {w["name"]: w for w in status["workers"]}
    assert set(rows) == {"prefill-0", "decode-0"}
    for name, role in [("prefill-0", "prefill"), ("decode-0", "decode")]:
        w = rows[name]
        assert (w["role"], w["state"], w["error"]) == (role, "active", "")
        assert w["node_ip"] == "127.0.0.1" and len(w["node_id"]) == 56 and w["pid"] > 0
        assert w["kv_blocks_total"] == 192 and w["max_num_seqs"] == 8
        # one rank: the worker's own process, on this machine's CPU
        assert w["ranks"] == [{"rank": 0, "pid": w["pid"], "device": "cpu"}]
    assert status["policy"]["rebalance"]["mode"] == "off"
    assert cli(operator, "status") == 0
    table = capsys.readouterr().out.splitlines()
    assert table[1].split()[:5] == ["ROLE", "WORKER", "NODE", "STATE", "DEVICES"]
    assert [line.split()[:5] for line in table[2:]] == [
        ["prefill", "prefill-0", "127.0.0.1", "active", "cpu"],
        ["decode", "decode-0", "127.0.0.1", "active", "cpu"],
    ]


def test_the_status_table_shows_ranks_and_workers_without_figures():
    """A worker that did not answer (starting, unresponsive) keeps its row with the reason in
    the last column; a tensor-parallel worker's devices are its ranks'."""
    from cluster.cli.operator_client import status_table

    base = {"running": 1, "waiting": 0, "kv_use": 0.5, "migrations_out": 0, "migrations_in": 0}
    ranks = [{"rank": r, "pid": 10 + r, "device": f"cuda:{r + 2}"} for r in range(2)]
    cpu = [{"rank": r, "pid": 20 + r, "device": "cpu"} for r in range(3)]
    status = {
        "cluster_id": "c1",
        "model": "/models/m",
        "membership_version": 3,
        "migrations_in_flight": 0,
        "policy": {"rebalance": {"mode": "off"}},
        "scaling": [],
        "workers": [
            {
                "role": "colocated",
                "name": "colocated-0",
                "node_ip": "10.0.0.1",
                "state": "active",
                "error": "",
                "ranks": ranks,
                **base,
            },
            {
                "role": "colocated",
                "name": "colocated-1",
                "node_ip": "10.0.0.1",
                "state": "active",
                "error": "",
                "ranks": cpu,
                **base,
            },
            {
                "role": "colocated",
                "name": "colocated-2",
                "node_ip": "",
                "state": "starting",
                "error": "starting: loading its model",
            },
        ],
    }
    lines = status_table(status).splitlines()
    assert lines[2].split()[:5] == ["colocated", "colocated-0", "10.0.0.1", "active", "cuda:2,3"]
    assert lines[3].split()[4] == "cpu" and "cpu x3" in lines[3]
    assert lines[4].split()[:5] == ["colocated", "colocated-2", "-", "starting", "-"]
    assert lines[4].endswith("starting: loading its model")


# -- scale -------------------------------------------------------------------------------------


def test_scale_decode_out_and_back_in_under_streaming_load(cluster, stub, operator, capsys):
    """1 -> 2 while two requests stream: the new worker starts, joins, takes requests (its
    TTFT shows in Status). 2 -> 1 while four requests stream (two on each): the one removed is
    drained first, its requests migrate, and every request finishes with all its tokens."""
    from proto import operator_pb2 as pb

    n = 64
    ps = prompts(cluster, 6)

    def stream(i: int, name: str, decode: str, progress):
        return asyncio.ensure_future(collect(cluster, ps[i], n, name, progress, decode))

    async def main():
        progress = {}
        first = [stream(i, f"a{i}", "decode-0", progress) for i in range(2)]
        await until(progress, ["a0", "a1"], 2)
        code = await asyncio.to_thread(
            cli, operator, "scale", "--role", "decode", "--replicas", "2", "--wait"
        )
        assert code == 0, capsys.readouterr()
        assert "decode: 1 -> 2" in capsys.readouterr().out
        deadline = time.monotonic() + 30
        while "decode-1" not in {w.name for w in cluster.decode}:  # the router's view
            assert time.monotonic() < deadline, "the router never saw decode-1"
            await asyncio.sleep(0.05)
        # two on each worker, then scale in
        second = [stream(2 + i, f"b{i}", f"decode-{i % 2}", progress) for i in range(4)]
        await until(progress, [f"b{i}" for i in range(4)], 4)
        status = await asyncio.to_thread(stub.Status, pb.StatusRequest(), metadata=AUTH)
        rows = {w.name: w for w in status.workers}
        assert rows["decode-1"].state == pb.WORKER_STATE_ACTIVE
        assert rows["decode-1"].running >= 1 and rows["decode-1"].ttft.samples >= 1
        assert rows["decode-1"].node_ip == "127.0.0.1"
        request = pb.ScaleRequest(
            request_id=rid(), role=pb.ROLE_DECODE, replicas=1, wait=True, drain_deadline_s=90
        )
        scaled_in = await asyncio.to_thread(stub.Scale, request, metadata=AUTH, timeout=180)
        outs = await asyncio.gather(*first, *second)
        return scaled_in, outs

    scaled_in, outs = asyncio.run(main())
    assert scaled_in.done and not scaled_in.failed, scaled_in
    assert scaled_in.previous_replicas == 2 and len(scaled_in.removed) == 1, scaled_in
    assert scaled_in.aborted_requests == 0 and scaled_in.migrated_requests >= 1, scaled_in
    for tokens, finish in outs:
        assert len(tokens) == n and finish == "length"
    cluster.refresh()
    left = [n for n in ("decode-0", "decode-1") if n not in scaled_in.removed]
    assert [w.name for w in cluster.decode] == left
    assert_idle(cluster)


def test_scale_in_below_one_worker_is_refused(operator, capsys):
    assert cli(operator, "scale", "--role", "decode", "--replicas", "0") == 5
    assert "at least 1 stays" in capsys.readouterr().err
    assert cli(operator, "scale", "--role", "prefill", "--replicas", "1") == 0  # as it is
    assert "prefill: 1 -> 1" in capsys.readouterr().out


def test_scale_engine_settings_are_checked_before_anything_starts(cluster, operator, capsys):
    """A worker's own engine settings (`tandem scale --engine`) are size and capacity: a key
    the cluster holds, a bad TP size, or a scale that adds no worker is INVALID_ARGUMENT (exit
    2), and nothing starts."""
    scale = ["scale", "--role", "decode", "--replicas"]
    for replicas, pair, says in (
        ("2", "block_size=32", "cannot set block_size"),
        ("2", "kv_cache_dtype=fp8", "cannot set kv_cache_dtype"),
        ("2", "tensor_parallel_size=0", "tensor_parallel_size must be an integer >= 1"),
        ("1", "max_num_seqs=8", "this one adds none"),
        ("2", "tensor_parallel_size", "--engine wants KEY=VALUE"),
    ):
        assert cli(operator, *scale, replicas, "--engine", pair) == 2, pair
        assert says in capsys.readouterr().err, pair
    cluster.refresh()
    assert len(cluster.decode) == 1


def test_scale_refuses_a_pool_the_topology_cannot_route(cluster, operator, capsys):
    """This cluster runs prefill + decode: a colocated pool is a change of topology (exit 5,
    saying what to run instead) unless forced; a pool started at 0 may go back to 0."""
    assert cli(operator, "scale", "--role", "colocated", "--replicas", "1", "--wait") == 5
    err = capsys.readouterr().err
    assert "started without colocated workers" in err and "--force" in err
    assert cli(operator, "status", "-o", "json") == 0
    assert "colocated-" not in capsys.readouterr().out  # nothing was started
    assert (
        cli(operator, "scale", "--role", "colocated", "--replicas", "1", "--wait", "--force") == 0
    )
    assert "colocated: 0 -> 1" in capsys.readouterr().out
    assert cli(operator, "scale", "--role", "colocated", "--replicas", "0", "--wait") == 0
    assert "colocated: 1 -> 0" in capsys.readouterr().out
    cluster.refresh()
    assert cluster.colocated == [] and len(cluster.decode) == 1 and len(cluster.prefill) == 1


# -- drain -------------------------------------------------------------------------------------


def test_drain_exit_code_says_whether_requests_were_left(cluster, operator, capsys):
    """The only decode worker has nowhere to move its request: the drain's deadline passes
    with it still running there (exit 1); drained again once idle: exit 0."""
    (worker,) = [w.name for w in cluster.decode]
    prompt = prompts(cluster, 1)[0]

    async def main():
        progress = {}
        task = asyncio.ensure_future(collect(cluster, prompt, 48, "drained", progress))
        await until(progress, ["drained"], 2)
        code = await asyncio.to_thread(cli, operator, "drain", worker, "--deadline", "0.5")
        return code, await task

    try:
        code, (tokens, finish) = asyncio.run(main())
        assert code == 1
        out = capsys.readouterr().out
        assert f"{worker}: NOT idle" in out and "still running" in out
        assert len(tokens) == 48 and finish == "length"  # not aborted: it finished there
        assert cli(operator, "drain", worker, "--deadline", "10") == 0
        assert f"{worker}: idle" in capsys.readouterr().out
    finally:
        assert cli(operator, "undrain", worker) == 0
    assert f"{worker}: active" in capsys.readouterr().out
    assert cli(operator, "drain", "no-such-worker") == 2
    assert "no worker named 'no-such-worker'" in capsys.readouterr().err


# -- idempotency, audit, watch -----------------------------------------------------------------


def test_a_request_id_replays_its_first_answer(cluster, stub, operator):
    from proto import operator_pb2 as pb

    first_seq = stub.Status(pb.StatusRequest(), metadata=AUTH).last_event_seq
    key = rid()
    request = pb.SetPolicyRequest(request_id=key, rebalance_high=0.9, rebalance_low=0.5)
    one = stub.SetPolicy(request, metadata=AUTH)
    two = stub.SetPolicy(request, metadata=AUTH)
    assert one == two and one.policy.rebalance.high == pytest.approx(0.9)
    status = stub.Status(pb.StatusRequest(), metadata=AUTH)
    assert status.last_event_seq == first_seq + 1  # one policy change, not two
    other = pb.SetPolicyRequest(request_id=key, rebalance_high=0.95)
    with pytest.raises(grpc.RpcError) as err:
        stub.SetPolicy(other, metadata=AUTH)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    with pytest.raises(grpc.RpcError) as err:
        stub.SetPolicy(pb.SetPolicyRequest(rebalance_high=0.95), metadata=AUTH)  # no id
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    with pytest.raises(grpc.RpcError) as err:  # checked before anything changes
        stub.SetPolicy(pb.SetPolicyRequest(request_id=rid(), rebalance_low=0.99), metadata=AUTH)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "low (0.99) must be below high" in err.value.details()
    back = pb.SetPolicyRequest(request_id=rid(), rebalance_high=0.85, rebalance_low=0.6)
    assert stub.SetPolicy(back, metadata=AUTH).policy.rebalance.low == pytest.approx(0.6)


def test_every_mutating_call_is_in_the_audit_log(operator):
    lines = [json.loads(line) for line in operator["audit"].read_text().splitlines()]
    assert oct(operator["audit"].stat().st_mode & 0o777) == "0o600"
    for line in lines:
        assert set(line) >= {"time", "peer", "method", "request", "outcome", "replayed"}
        assert line["peer"].startswith(("ipv4:127.0.0.1:", "ipv6:[::1]:"))
    methods = {(x["method"], x["outcome"]) for x in lines}
    assert {("Scale", "OK"), ("Drain", "OK"), ("Undrain", "OK"), ("SetPolicy", "OK")} <= methods
    assert ("Scale", "FAILED_PRECONDITION") in methods and ("Drain", "INVALID_ARGUMENT") in methods
    replays = [x for x in lines if x["replayed"]]
    assert len(replays) == 1 and replays[0]["method"] == "SetPolicy"
    scale_in = next(
        x["request"]
        for x in lines
        if x["method"] == "Scale"
        and x["request"].get("role") == "ROLE_DECODE"
        and x["request"]["replicas"] == 1
    )
    assert scale_in["wait"] is True and scale_in["drain_deadline_s"] == 90


def test_watch_replays_then_follows_events(stub, operator, capsys):
    from proto import operator_pb2 as pb

    seen = [e for e in _watch(stub, pb.WatchRequest(since=0), until_quiet_s=1.0)]
    assert [e.seq for e in seen] == list(range(1, len(seen) + 1))
    workers = [(e.worker.worker, e.worker.kind) for e in seen if e.HasField("worker")]
    k = pb.WorkerEvent
    for name in ("prefill-0", "decode-0", "decode-1"):
        assert (name, k.KIND_STARTING) in workers and (name, k.KIND_UP) in workers
    assert any(kind == k.KIND_REMOVED for _, kind in workers)
    assert any(kind == k.KIND_DRAINING for _, kind in workers)
    phases = [(e.scale.phase, e.scale.to_replicas) for e in seen if e.HasField("scale")]
    p = pb.ScaleEvent
    assert {(p.PHASE_STARTED, 2), (p.PHASE_DONE, 2), (p.PHASE_DONE, 1)} <= set(phases)
    assert (p.PHASE_REFUSED, 0) in phases
    assert any(e.migration.outcome == "migrated" for e in seen if e.HasField("migration"))

    # live: a stream from now on gets the next event, and `tandem events` prints it
    got: list = []

    def follow():
        got.extend(_watch(stub, pb.WatchRequest(), 20, stop=lambda e: e.HasField("policy")))

    follower = threading.Thread(target=follow)
    follower.start()
    time.sleep(1.0)
    change = pb.SetPolicyRequest(request_id=rid(), health_timeout_s=2.5)
    stub.SetPolicy(change, metadata=AUTH)
    follower.join(30)
    assert got and got[-1].policy.policy.health.timeout_s == pytest.approx(2.5), got
    assert got[0].seq > seen[-1].seq
    assert cli(operator, "events", "--since", str(got[-1].seq - 1), "--limit", "1") == 0
    assert "policy rebalance mode=off" in capsys.readouterr().out


def _watch(stub, request, until_quiet_s: float, stop=lambda e: False) -> list:
    """Events of one Watch stream until one passes ``stop`` or none came for
    ``until_quiet_s``."""
    stream = stub.Watch(request, metadata=AUTH)
    events, timer = [], None

    def cancel():
        stream.cancel()

    try:
        timer = threading.Timer(until_quiet_s, cancel)
        timer.start()
        for event in stream:
            events.append(event)
            timer.cancel()
            if stop(event):
                break
            timer = threading.Timer(until_quiet_s, cancel)
            timer.start()
    except grpc.RpcError as exc:
        assert exc.code() == grpc.StatusCode.CANCELLED, exc
    finally:
        if timer is not None:
            timer.cancel()
        stream.cancel()
    return events


# -- the autoscaler ----------------------------------------------------------------------------


def test_the_autoscaler_grows_decode_under_load_then_drains_it_back(cluster, operator, capsys):
    """Turned on with marks this load crosses: four long streams on the decode worker's 8 slots
    (0.5 > 0.3, or their projected KV if that crosses first) grow the pool by a worker, which
    takes requests; with the marks raised (low 0.9: 2 workers' pressure as if one fewer is under
    it) the pool shrinks back by a drain that migrates the new worker's streams; every stream
    ends with all its tokens, none aborted. The first four run twice as long as the new
    worker's two, so they still run when the pool shrinks (the spawn takes seconds) and the
    new worker is the least loaded one."""
    # the pool shrank about 10 s in, the first four at ~160 of their tokens: 360 keep them running
    # for about twice that (480 spent 20 s more streaming after the shrink)
    n = 180
    ps = prompts(cluster, 6)
    controller = cluster.controller
    cluster.refresh()
    (first,) = [w.name for w in cluster.decode]  # the scale test may have kept either

    async def scale_events(since: int, phase: str) -> list[dict]:
        out = await controller.events.remote(since, 0.0)
        return [
            e
            for e in out["events"]
            if e["type"] == "scale"
            and e["phase"] == phase
            and e["reason"].startswith("autoscaler:")
        ]

    async def wait_for(since: int, phase: str, timeout: float = 120.0) -> dict:
        deadline = time.monotonic() + timeout
        while not (found := await scale_events(since, phase)):
            if time.monotonic() > deadline:
                stats = await controller.autoscale_stats.remote()
                tail = (await controller.events.remote(since, 0.0))["events"][-8:]
                pytest.fail(f"no autoscaler scale {phase} in {timeout} s: {stats} {tail}")
            await asyncio.sleep(0.2)
        return found[0]

    async def main():
        since = (await controller.events.remote(None))["last_seq"]
        code = await asyncio.to_thread(
            cli, operator, "policy", "--autoscale", "on", "--autoscale-interval-s", "0.5",
            "--pool", "decode", "--max-replicas", "2", "--high", "0.3", "--low", "0.05",
            "--up-after-s", "0", "--down-after-s", "0.5", "--cooldown-s", "0", "--slo-s", "0",
        )  # fmt: skip
        assert code == 0, capsys.readouterr()
        progress = {}
        streams = [
            asyncio.ensure_future(collect(cluster, ps[i], 2 * n, f"as{i}", progress, first))
            for i in range(4)
        ]
        grown = await wait_for(since, "done")
        assert grown["to_replicas"] == 2 and len(grown["added"]) == 1, grown
        new = grown["added"][0]
        deadline = time.monotonic() + 30
        while new not in {w.name for w in cluster.decode}:  # the router's view
            assert time.monotonic() < deadline, f"the router never saw {new}"
            await asyncio.sleep(0.05)
        streams += [
            asyncio.ensure_future(collect(cluster, ps[4 + i], n, f"an{i}", progress, new))
            for i in range(2)
        ]
        await until(progress, ["an0", "an1"], 2)
        mark = (await controller.events.remote(None))["last_seq"]
        code = await asyncio.to_thread(
            cli, operator, "policy", "--pool", "decode", "--high", "0.95", "--low", "0.9"
        )
        assert code == 0, capsys.readouterr()
        shrunk = await wait_for(mark, "done")
        outs = await asyncio.gather(*streams)
        events = (await controller.events.remote(since, 0.0))["events"]
        await asyncio.to_thread(cli, operator, "policy", "--autoscale", "off")
        return grown, shrunk, outs, events

    grown, shrunk, outs, events = asyncio.run(main())
    decisions = [e for e in events if e["type"] == "autoscale"]
    assert [e["direction"] for e in decisions[:2]] == ["out", "in"], decisions
    # each was driven by the pool's largest pressure; the load is streams in slots, so it is
    # theirs (slots) or their projected KV (demand: whichever crossed first as streams arrived)
    for e in decisions[:2]:
        pressures = e["inputs"]["pressures"]
        assert e["signal"] in ("slots", "demand"), e
        assert pressures[e["signal"]] == max(pressures.values()), e
    assert decisions[0]["inputs"]["pressures"][decisions[0]["signal"]] > 0.3, decisions[0]
    assert max(decisions[1]["inputs"]["pressures"].values()) * 2 < 0.9, decisions[1]
    assert shrunk["removed"] == grown["added"], (grown, shrunk)  # the least loaded went
    assert shrunk["aborted_requests"] == 0 and shrunk["migrated_requests"] == 2, shrunk
    for i, (tokens, finish) in enumerate(outs):  # the first four: twice as long
        assert len(tokens) == (2 * n if i < 4 else n) and finish == "length"
    cluster.refresh()
    assert [w.name for w in cluster.decode] == [first]
    assert_idle(cluster)
