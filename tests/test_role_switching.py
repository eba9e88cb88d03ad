"""Workers that switch roles without reloading weights (cluster/control/flex_worker.py): a real cluster of
three FlexWorkers (Ray actors on CPU, SmolLM2 fp32, TCP KV), two prefill and one decode.

A switched worker keeps its process (same pid, no second model load) and serves its new role
with transformers' greedy tokens: flex-1 decodes after prefilling, then prefills again after a
switch that migrated the request it was decoding (which ends HF-exact too). The last worker of
a role does not switch. Tests run in file order.
"""

from __future__ import annotations

import asyncio

import pytest
import torch
from cluster_checks import assert_idle
from hf_oracle import hf_greedy_ids

from engine import SamplingParams

ray = pytest.importorskip("ray")
transformers = pytest.importorskip("transformers")

pytestmark = pytest.mark.slow

N = 24


@pytest.fixture(scope="module")
def cluster(smollm2_dir):
    from cluster.launch.local import LocalCluster

    c = LocalCluster(
        model=str(smollm2_dir),
        num_prefill=2,
        num_decode=1,
        engine={
            "max_num_batched_tokens": 256,
            "num_kv_blocks": 128,
            "block_size": 16,
            "max_num_seqs": 8,
        },
        transfer_timeout_s=20,
        stall_timeout_s=6,
        migration={"last_stage_blocks": 2, "headroom_blocks": 2, "timeout_s": 10},
        role_switching=True,
    )
    yield c
    c.shutdown()


TOKEN = "role-switching-test-token"


@pytest.fixture(scope="module")
def operator(cluster):
    return cluster.start_operator(TOKEN)


def cli(operator, monkeypatch, *argv: str) -> int:
    from cluster.cli import main

    monkeypatch.setenv("TANDEM_OPERATOR_TOKEN", TOKEN)
    return main([*argv, "--address", operator, "--timeout", "120"])


@pytest.fixture(scope="module")
def hf(smollm2_dir):
    model = transformers.AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32)
    return model.eval()


def greedy(n: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)


def prompt(cluster, topic: str) -> list[int]:
    return cluster.tokenizer(f"A short note on {topic}:")["input_ids"]


async def run(cluster, ids, n, **pins) -> list[int]:
    last = None
    async for out in cluster.stream(ids, greedy(n), **pins):
        last = out
    return list(last.outputs[0].token_ids)


def pids(cluster) -> dict[str, int]:
    return {w["name"]: w["pid"] for w in ray.get(cluster.controller.status.remote())["workers"]}


def test_flex_workers_serve_their_first_roles(cluster, hf):
    assert [w.name for w in cluster.prefill] == ["flex-0", "flex-1"]
    assert [w.name for w in cluster.decode] == ["flex-2"]
    ids = prompt(cluster, "tides")
    got = asyncio.run(run(cluster, ids, N, prefill="flex-1", decode="flex-2"))
    assert got == hf_greedy_ids(hf, ids, N)


def test_an_aborted_gated_prefill_opens_its_gate(cluster):
    """A prefill whose decode reservation answered Full is aborted by the router after its
    prompt computed, its KV still gated: the gate opens at once (it held the channel to that
    decode worker for its whole timeout, every transfer queued behind it too)."""
    from engine.messages import PrefillDone, control

    workers = {w.name: w for w in ray.get(cluster.controller.members.remote()).workers}
    p, d = workers["flex-0"].handle, workers["flex-2"]
    ids = prompt(cluster, "harbours")
    done = ray.get(p.prefill.remote("gated-0", ids, greedy(4), d.endpoint, gated=True))
    assert isinstance(done, PrefillDone)  # computed; its KV waits for a release

    def gates(self):
        role = self.prefill_role
        held = {
            t: g.is_set()
            for s in role.connector._senders.values()
            for t, (g, _) in s._gates.items()
        }
        return "gated-0" in role._gates, held.get("gated-0")

    assert ray.get(p.__ray_call__.remote(gates)) == (True, False)
    ray.get(control(p.abort).remote("gated-0"))
    in_worker, held = ray.get(p.__ray_call__.remote(gates))
    assert not in_worker and held is not False  # open, or already gone from the channel


def test_a_prefill_worker_switches_to_decode_and_decodes_exactly(
    cluster, hf, operator, monkeypatch, capsys
):
    import json

    before = pids(cluster)
    assert cli(operator, monkeypatch, "switch", "flex-1", "--role", "decode", "-o", "json") == 0
    result = json.loads(capsys.readouterr().out)
    assert (result["from_role"], result["role"], result["aborted"]) == ("prefill", "decode", 0)
    cluster.refresh()
    assert [w.name for w in cluster.prefill] == ["flex-0"]
    assert [w.name for w in cluster.decode] == ["flex-1", "flex-2"]
    assert pids(cluster) == before  # the same processes: nothing restarted or reloaded
    ids = prompt(cluster, "lighthouses")
    got = asyncio.run(run(cluster, ids, N, prefill="flex-0", decode="flex-1"))
    assert got == hf_greedy_ids(hf, ids, N)
    stats = ray.get(cluster.controller.status.remote())
    row = next(w for w in stats["workers"] if w["name"] == "flex-1")
    assert row["role"] == "decode" and row["state"] == "active"
    events = ray.get(cluster.controller.events.remote(0, 0.0))["events"]
    switched = [e for e in events if e["type"] == "worker" and e["kind"] == "switched"]
    assert [(e["worker"], e["role"]) for e in switched] == [("flex-1", "decode")]
    assert switched[0]["reason"].startswith("prefill -> decode")


def test_the_last_worker_of_a_role_does_not_switch(cluster, operator, monkeypatch, capsys):
    from cluster.control.controller import Refused

    with pytest.raises(Refused, match="last prefill worker"):
        ray.get(cluster.controller.switch_role.remote("flex-0", "decode"))
    assert cli(operator, monkeypatch, "switch", "flex-0", "--role", "decode") == 5
    assert "last prefill worker" in capsys.readouterr().err
    cluster.refresh()
    assert [w.name for w in cluster.prefill] == ["flex-0"]


def test_switching_back_migrates_what_it_decodes_then_it_prefills_exactly(cluster, hf):
    n = 96
    ids = prompt(cluster, "glaciers")
    controller = cluster.controller

    async def main():
        progress = {"tokens": 0}

        async def long_one():
            last = None
            async for out in cluster.stream(ids, greedy(n), prefill="flex-0", decode="flex-1"):
                last = out
                progress["tokens"] = len(out.outputs[0].token_ids)
            return list(last.outputs[0].token_ids)

        streaming = asyncio.ensure_future(long_one())
        while progress["tokens"] < 4:
            await asyncio.sleep(0.02)
        result = await controller.switch_role.remote("flex-1", "prefill")
        return result, await streaming

    result, tokens = asyncio.run(main())
    assert (result["to"], result["migrated"], result["aborted"]) == ("prefill", 1, 0), result
    assert tokens == hf_greedy_ids(hf, ids, n)  # decoded on flex-1, then flex-2
    cluster.refresh()
    assert [w.name for w in cluster.prefill] == ["flex-0", "flex-1"]
    other = prompt(cluster, "orchards")
    got = asyncio.run(run(cluster, other, N, prefill="flex-1", decode="flex-2"))
    assert got == hf_greedy_ids(hf, other, N)
    stats = {w["name"]: w for w in ray.get(controller.status.remote())["workers"]}
    assert stats["flex-1"]["role"] == "prefill"
    assert_idle(cluster)
