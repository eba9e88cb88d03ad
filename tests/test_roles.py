"""A worker is an engine thread plus a list of roles (engine/runtime.py ``Role``): it asks each
role in turn, in one place each, to abort, tick, report stats, end what it holds after a fault
and close; the actors' public methods are their roles' own. In process, on a random tiny Llama.
"""

from __future__ import annotations

import asyncio
import inspect
import time

import pytest
import torch
import transformers

from engine.runtime import Role
from engine.sampling_params import SamplingParams


@pytest.fixture
def model_dir(tmp_path, tiny_cfg):
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(transformers.LlamaConfig(**tiny_cfg())).save_pretrained(tmp_path)
    return str(tmp_path)


class Recorder(Role):
    """A role that claims the requests in ``mine`` and records what the worker asked."""

    def __init__(self, worker, name, mine=(), wake=None, stats=None) -> None:
        super().__init__(worker)
        self.name, self.mine, self.wake, self._stats = name, set(mine), wake, stats or {}
        self.asked: list[tuple[str, str]] = []

    def abort(self, request_id: str) -> bool:
        self.asked.append(("abort", request_id))
        return request_id in self.mine

    def tick(self) -> float | None:
        self.asked.append(("tick", ""))
        return self.wake

    def stats(self) -> dict:
        return dict(self._stats)

    def fail_everything(self, why: str) -> None:
        self.asked.append(("fail_everything", why))

    def close(self) -> None:
        self.asked.append(("close", ""))


def test_a_worker_asks_its_roles_in_order_in_one_place(model_dir) -> None:
    from decode_worker.colocated import ColocatedWorker

    w = ColocatedWorker({"model_dir": model_dir, "num_kv_blocks": 16, "block_size": 4}, "c")
    soon = time.monotonic() + 5.0
    a = Recorder(w, "a", wake=soon + 10, stats={"kv_bytes_sent": 3, "only_a": 1})
    b = Recorder(w, "b", mine={"x"}, wake=soon, stats={"kv_bytes_sent": 4})
    w.roles = [a, b]
    # (the engine thread is not started: these run here, as they would on it)
    w.register("x", "")
    w.register("y", "")
    w._abort("x")  # b holds it: b ends it (here: keeps its record), the engine is not asked
    assert a.asked[-1] == ("abort", "x") and b.asked[-1] == ("abort", "x")
    assert "x" in w.requests
    w._abort("y")  # no role holds it: the worker ends it
    assert "y" not in w.requests

    w._tick()  # every role ticks; the earliest wake bounds the idle wait
    assert ("tick", "") in a.asked and ("tick", "") in b.asked
    assert 4.0 < w._wait_timeout() <= 5.0
    a.wake = b.wake = None
    w._tick()
    assert w._wait_timeout() is None

    stats = w._stats()  # a key two roles report is a counter: added up
    assert stats["kv_bytes_sent"] == 7 and stats["only_a"] == 1 and stats["role"] == "colocated"

    w._fail_everything("boom")  # every role first, then every tracked request
    assert a.asked[-1] == b.asked[-1] == ("fail_everything", "boom")
    assert not w.requests

    w.shutdown()
    assert a.asked[-1] == b.asked[-1] == ("close", "")


def test_the_actors_methods_are_their_roles_own() -> None:
    """Every public method a router, controller or test calls keeps its name and signature; the
    flex worker offers those of both actors (its ``kv_timings``: the prefill side's)."""
    from cluster.control.flex_worker import FlexWorker
    from decode_worker.decode import DecodeRole
    from decode_worker.migration import MigrationRole
    from decode_worker.worker import DecodeWorker
    from prefill_worker.worker import PrefillRole, PrefillWorker

    def public(cls) -> dict[str, inspect.Signature]:
        return {
            n: inspect.signature(m)
            for n, m in inspect.getmembers(cls, inspect.isfunction)
            if not n.startswith("_")
        }

    flex = public(FlexWorker)
    for worker in (PrefillWorker, DecodeWorker):
        for name, sig in public(worker).items():
            assert flex.get(name) is not None, name
            if name != "kv_timings":
                assert flex[name] == sig, name
    for role in (PrefillRole, DecodeRole, MigrationRole):
        for name, sig in public(role).items():
            if inspect.iscoroutinefunction(getattr(role, name)) and name != "kv_timings":
                assert flex[name] == sig, name  # delegated as it is
                assert inspect.iscoroutinefunction(getattr(FlexWorker, name)), name
    assert flex["kv_timings"] == public(PrefillRole)["kv_timings"]
    assert public(DecodeWorker)["kv_timings"] == public(DecodeRole)["kv_timings"]
    assert "set_role" in flex and "set_role" not in public(DecodeWorker)


def test_a_flex_worker_switches_only_when_no_role_holds_anything(model_dir) -> None:
    from cluster.control.flex_worker import FlexWorker

    cfg = {"model_dir": model_dir, "num_kv_blocks": 32, "block_size": 4}
    f = FlexWorker(cfg, transport="inproc")
    assert f.name == "decode"  # (its default name is its first role)
    assert [type(r).__name__ for r in f.roles] == ["PrefillRole", "DecodeRole", "MigrationRole"]
    f.start()
    try:

        async def main():
            switched = await f.set_role("prefill")
            assert f.engine.step_observer is f.prefill_role.streamer
            await f.reserve("r", [1, 2, 3, 4, 5], SamplingParams(max_tokens=2), "r")
            with pytest.raises(ValueError, match="transfers in 1"):
                await f.set_role("decode")
            await f.abort("r")  # a transfer arriving: the decode role cancels it
            for _ in range(200):
                if not f.decode_role.receiver.pending() and not f.requests:
                    break
                await asyncio.sleep(0.01)
            back = await f.set_role("decode")
            return switched, back, await f.stats()

        switched, back, stats = asyncio.run(main())
        assert (switched["from"], switched["role"], back["role"]) == ("decode", "prefill", "decode")
        assert f.engine.step_observer is None
        assert stats["role_switches"] == 2 and stats["transfers_pending"] == 0
        assert stats["kv_channels"] == 0 and stats["migrating"] == {"out": 0, "in": 0}
        assert asyncio.run(f.check_idle()) is None
    finally:
        f.shutdown()
