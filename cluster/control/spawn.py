"""Spawning workers: one Ray actor per worker, of its role's class, with its engine settings.

spawn(role)          prefill: PrefillWorker; decode: DecodeWorker; colocated:
                     ColocatedWorker; with role switching, prefill and decode are
                     FlexWorkers (cluster/control/flex_worker.py, named flex-N); on a node with
                     the role's resource when the cluster has them -> STARTING in the table
                     (the caller waits for ``ready()`` and activates it); a worker of
                     tensor_parallel_size N gets a placement group of N bundles packed on one
                     node (``tp_group_name``), itself in bundle 0, its other ranks' actors
                     (engine/tp_ranks.py) in the rest; the group goes when the worker does
connect_kv_pairs()   every active prefill worker forms its KV channels to every active decode
                     worker (at start, and in the background when workers join or switch)
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

from cluster.control.membership import MembershipTable
from cluster.control.spec import WorkerSpec, tp_group_name
from engine.aio import within
from engine.messages import (
    CONTROL_CONCURRENCY,
    CONTROL_GROUP,
    WorkerInfo,
    WorkerState,
    brief,
)

logger = logging.getLogger(__name__)


# The engine settings one worker may have of its own (``tandem scale --engine``): its size
# (tensor-parallel ranks) and its capacity. The rest stay the cluster's: the model, dtypes and
# block size are what the KV channels between workers and the global prefix index agree on.
WORKER_ENGINE_KEYS = frozenset({
    "tensor_parallel_size",
    "max_num_seqs",
    "max_num_batched_tokens",
    "num_kv_blocks",
    "kv_cache_memory_gb",
    "gpu_memory_utilization",
    "cuda_graph_max_batch",
    "enable_prefix_caching",
})  # fmt: skip


def check_engine_overrides(overrides: dict[str, Any]) -> None:
    """ValueError for a key a worker may not set for itself, or a tensor-parallel size that
    is not a positive integer (the engine checks the rest when the worker starts)."""
    bad = sorted(set(overrides) - WORKER_ENGINE_KEYS)
    if bad:
        raise ValueError(
            f"a worker cannot set {', '.join(bad)} for itself (the cluster's engine settings "
            f"hold them); per worker: {', '.join(sorted(WORKER_ENGINE_KEYS))}"
        )
    tp = overrides.get("tensor_parallel_size", 1)
    if isinstance(tp, bool) or not isinstance(tp, int) or tp < 1:
        raise ValueError(f"tensor_parallel_size must be an integer >= 1, got {tp!r}")


class Spawner:
    """Starts worker actors from the cluster's ``WorkerSpec`` into the membership table."""

    def __init__(self, spec: WorkerSpec, membership: MembershipTable) -> None:
        self.spec = spec
        self.membership = membership
        self._counters = {"prefill": 0, "decode": 0, "colocated": 0, "flex": 0}

    def spawn(self, role: str, engine_overrides: dict[str, Any] | None = None) -> str:
        """Start one worker actor of ``role`` (its name: ``<kind>-<n>``, also its Ray actor
        name under the cluster id); STARTING in the table (the caller publishes).
        ``engine_overrides``: this worker's own engine settings over its role's
        (``check_engine_overrides`` first)."""
        import ray

        from decode_worker.colocated import ColocatedWorker
        from decode_worker.worker import DecodeWorker
        from prefill_worker.worker import PrefillWorker

        spec = self.spec
        flex = spec.role_switching and role in ("prefill", "decode")
        kind = "flex" if flex else role
        index = self._counters[kind]
        self._counters[kind] += 1
        name = f"{kind}-{index}"
        actor_name = f"{spec.cluster_id}/{name}"  # also its name in the prefix index
        base = {"model_dir": spec.model_dir, "device": spec.device, **spec.engine}
        if spec.device == "cpu" and spec.cpu_threads:
            base["cpu_threads"] = spec.cpu_threads
        decode_kwargs = {
            "transport": spec.transport,
            "token": spec.token,
            "host": spec.host,
            "transfer_timeout_s": spec.transfer_timeout_s,
            "migration": spec.migration,
        }
        if flex:
            from cluster.control.flex_worker import FlexWorker

            # either role: the decode side's engine settings win over the prefill side's
            cls, engine = FlexWorker, {**base, **spec.prefill_engine, **spec.decode_engine}
            kwargs = {"role": role, **decode_kwargs}
        elif role == "prefill":
            # A prefill worker never decodes: no decode CUDA graphs to capture (its prompt
            # chunks replay the piecewise graphs, the layer-wise KV sends between their pieces).
            cls, engine = PrefillWorker, {"cuda_graph_max_batch": 0, **base, **spec.prefill_engine}
            kwargs = {"token": spec.token}
        elif role == "decode":
            cls, engine = DecodeWorker, {**base, **spec.decode_engine}
            kwargs = decode_kwargs
        else:
            cls, engine, kwargs = ColocatedWorker, base, {}
        engine = {**engine, **(engine_overrides or {})}
        # every worker publishes what it holds: a decode worker's conversations (prompts and
        # answers) are where the router may prefill their next turns (local_prefill_tokens)
        if spec.index_url:
            kwargs["index"] = {
                "url": spec.index_url,
                "namespace": spec.index_namespace,
                "worker": actor_name,
            }
        options: dict[str, Any] = {
            "num_cpus": 1,
            "max_concurrency": 1000,
            "name": actor_name,
        }
        if spec.device == "cuda":
            options["num_gpus"] = spec.gpus.get(role, 1)
        if role in ("prefill", "decode") and spec.use_role_resources:
            options["resources"] = {role: 1}
        tp = int(engine.get("tensor_parallel_size", 1))
        if tp > 1:
            options["scheduling_strategy"] = self._rank_bundles(actor_name, tp, options)
        actor = ray.remote(concurrency_groups={CONTROL_GROUP: CONTROL_CONCURRENCY})(cls)
        handle = actor.options(**options).remote(engine, name, **kwargs)
        where = f"on a node with the {role!r} resource" if "resources" in options else ""
        info = WorkerInfo(name, role, handle, WorkerState.STARTING)
        self.membership.add(info, f"actor requested {where}".strip())
        return name

    def _rank_bundles(self, actor_name: str, tp: int, options: dict[str, Any]) -> Any:
        """A placement group of ``tp`` bundles, one per rank, all on one node (STRICT_PACK:
        the ranks meet through a file and talk over loopback or NVLink), each with the CPU
        and GPU one rank takes; the worker's actor goes to bundle 0 (its role's resource
        too). Returns the worker's scheduling strategy."""
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        bundle = {"CPU": float(options["num_cpus"])}
        if "num_gpus" in options:
            bundle["GPU"] = float(options["num_gpus"])
        first = {**bundle, **options.pop("resources", {})}
        group = placement_group(
            [first] + [bundle] * (tp - 1), strategy="STRICT_PACK", name=tp_group_name(actor_name)
        )
        return PlacementGroupSchedulingStrategy(group, placement_group_bundle_index=0)

    async def connect_kv_pairs(self) -> None:
        """Every active prefill worker forms its KV channels to every active decode worker now
        (``connect_kv``), so that no request waits for a channel to form: at start, and in the
        background when workers join or switch roles. Failures are logged, never raised: a
        channel that did not form is formed again by the first request that needs it."""
        active = [w for w in self.membership.workers.values() if w.state == WorkerState.ACTIVE]
        endpoints = [w.endpoint for w in active if w.role == "decode" and w.endpoint]
        prefill = [w for w in active if w.role == "prefill"]
        if not endpoints or not prefill:
            return
        t0 = time.monotonic()

        async def connect(w: WorkerInfo) -> dict[str, str]:
            return await within(w.handle.connect_kv.remote(endpoints), 90.0)

        outcomes = await asyncio.gather(*(connect(w) for w in prefill), return_exceptions=True)
        for w, out in zip(prefill, outcomes, strict=True):
            bad = (
                {"call": brief(out)}
                if isinstance(out, BaseException)
                else {ep: why for ep, why in out.items() if why != "ok"}
            )
            if bad:
                logger.warning("KV channels of %s not formed: %s", w.name, bad)
        logger.info(
            "KV channels formed: %d prefill x %d decode workers in %.2f s",
            len(prefill),
            len(endpoints),
            time.monotonic() - t0,
        )
