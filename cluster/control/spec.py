"""How the controller starts every worker of a cluster: ``WorkerSpec`` (built by LocalCluster,
cluster/launch/local.py, from ClusterConfig), read by the membership table (the model and the
prefix index it publishes) and by the spawner (cluster/control/spawn.py: each worker's actor
options and engine settings)."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

ROLES = ("prefill", "decode", "colocated")


def engine_pairs(pairs: Sequence[str], flag: str = "--engine") -> dict[str, str]:
    """``["KEY=VALUE", ...]`` as a mapping (values still strings); ValueError for one
    without ``=``."""
    out: dict[str, str] = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise ValueError(f"{flag} wants KEY=VALUE, got {pair!r}")
        out[key] = value
    return out


def json_values(values: Mapping[str, str]) -> dict[str, Any]:
    """Engine settings given as strings (``--engine KEY=VALUE``, the operator API's maps):
    each value as JSON where it parses (``2``, ``true``, ``0.5``), else the string itself."""
    out: dict[str, Any] = {}
    for key, value in values.items():
        try:
            out[key] = json.loads(value)
        except json.JSONDecodeError:
            out[key] = value
    return out


def tp_group_name(actor_name: str) -> str:
    """The name of the placement group of a worker's tensor-parallel ranks (the spawner makes
    it, the membership table removes it with the worker)."""
    return f"{actor_name}/ranks"


@dataclass
class WorkerSpec:
    """How to start every worker of a cluster (built by LocalCluster from ClusterConfig)."""

    model_dir: str
    device: str = "cpu"
    transport: str = "tcp"
    host: str = "127.0.0.1"
    transfer_timeout_s: float = 60.0
    token: str = ""  # KV channels refuse peers without it
    cluster_id: str = ""
    index_url: str | None = None
    index_namespace: str = ""
    engine: dict[str, Any] = field(default_factory=dict)
    prefill_engine: dict[str, Any] = field(default_factory=dict)
    decode_engine: dict[str, Any] = field(default_factory=dict)
    use_role_resources: bool = False  # the cluster defines `prefill` / `decode` resources
    cpu_threads: int | None = None  # CPU: torch threads per worker (its share of the cores)
    # CUDA: GPUs per worker by role (default 1); a fraction lets workers share a GPU (each then
    # sizes its KV cache with kv_cache_memory_gb rather than the GPU's free memory)
    gpus: dict[str, float] = field(default_factory=dict)
    migration: dict[str, Any] = field(default_factory=dict)  # MigrationConfig fields (decode)
    # a worker added by scale() that has not answered after this long is killed (no node with
    # its resources came up, say)
    start_timeout_s: float = 900.0
    # prefill and decode workers are FlexWorkers (cluster/control/flex_worker.py, named flex-N): either
    # role, switched by switch_role() without reloading weights
    role_switching: bool = False
