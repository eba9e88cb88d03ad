"""Tensor parallelism inside one worker: how a model splits over ``tp`` ranks, and the process
group its collectives run on.

The layout (Megatron's, as vLLM and SGLang run it), for rank ``r`` of ``tp``::

    embed_tokens  rows [r*V/tp, (r+1)*V/tp) of the vocabulary (padded up to a multiple of tp):
                  a token outside the rank's rows looks up zeros, then all-reduce (exact: one
                  rank adds the row, the others add 0)
    qkv_proj      column-parallel: the rank's H/tp query heads and its KV heads
    attention     local: each rank attends with its own heads over its own KV pool
    o_proj        row-parallel: a partial sum of the output, then all-reduce
    gate_up_proj  column-parallel: I/tp of the intermediate size
    down_proj     row-parallel, then all-reduce
    norms         replicated
    lm_head       the rank's vocabulary rows; local logits all-gathered (exact: no sums)

KV heads: split (``KVH % tp == 0``: KVH/tp per rank), or replicated (``tp % KVH == 0``: each rank
holds the one KV head its H/tp query heads read, and tp/KVH ranks hold each). Any other layout,
and query heads or intermediate size that do not divide by ``tp``, are refused at start
(``tp_layout``) with the sizes named.

Only the two row-parallel all-reduces sum floats in a different order from one device (each
rank's partial dot products, then the sum of ``tp`` partials), so logits differ from the
unsplit model's by fp32 rounding; embedding and LM head are exact.

Two process groups: ``cpu`` (gloo) carries each step's inputs from rank 0 to the others (host
tensors, a fixed header then one payload: no pickle); ``device`` carries the model's
collectives (NCCL on GPUs, where CUDA graphs capture them; the same gloo group on CPU). The
rendezvous is a ``FileStore`` (the ranks of a worker share a node): nothing listens on a port
but gloo's own pairs, bound to 127.0.0.1.
"""

from __future__ import annotations

import contextlib
import datetime
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

from engine.config import ModelConfig

# A collective of the model waits this long for its slowest rank before the step fails (a rank
# that died fails it at once: its sockets close). Step inputs wait without bound: an idle worker
# sends none.
COLLECTIVE_TIMEOUT_S = 300.0
_IDLE_TIMEOUT = datetime.timedelta(days=365)
START_TIMEOUT_S = 120.0  # the ranks of a worker meet within this long of its start


@dataclass(frozen=True)
class TPLayout:
    """What rank ``rank`` of ``size`` holds of a model (local sizes, and where its slices
    start in the full tensors)."""

    size: int
    rank: int
    num_heads: int  # query heads on this rank
    num_kv_heads: int  # KV heads on this rank (its KV pool's heads)
    kv_head_start: int  # first of them in the model's KV heads
    kv_replicas: int  # ranks that hold each KV head: 1 when split, tp / KVH when replicated
    intermediate_size: int
    vocab_size: int  # rows of the vocabulary on this rank (padded: the last rank's may be short)
    full_vocab_size: int

    @property
    def head_start(self) -> int:
        return self.rank * self.num_heads

    @property
    def vocab_start(self) -> int:
        return self.rank * self.vocab_size

    def vocab_rows(self) -> int:
        """Real vocabulary rows on this rank (the rest of its ``vocab_size`` is padding)."""
        return max(0, min(self.vocab_size, self.full_vocab_size - self.vocab_start))


def tp_layout(cfg: ModelConfig, size: int, rank: int = 0) -> TPLayout:
    """Rank ``rank``'s share of ``cfg`` at tensor-parallel size ``size``; ValueError naming the
    sizes when the model does not split ``size`` ways."""
    h, kvh, inter = cfg.num_heads, cfg.num_kv_heads, cfg.intermediate_size
    problems = []
    if h % size:
        problems.append(f"num_attention_heads={h} is not divisible by tensor_parallel_size={size}")
    if kvh % size and size % kvh:
        problems.append(
            f"num_key_value_heads={kvh} neither divides by tensor_parallel_size={size} (KV heads "
            f"split) nor divides it (KV heads replicated)"
        )
    if inter % size:
        problems.append(
            f"intermediate_size={inter} is not divisible by tensor_parallel_size={size}"
        )
    if problems:
        raise ValueError(f"this model cannot be split {size} ways: " + "; ".join(problems))
    if kvh % size == 0:
        kv_local, kv_start, replicas = kvh // size, rank * (kvh // size), 1
    else:  # replicated: the KV head of this rank's query heads (all in one group)
        kv_local, kv_start, replicas = 1, (rank * (h // size)) // (h // kvh), size // kvh
    return TPLayout(
        size=size,
        rank=rank,
        num_heads=h // size,
        num_kv_heads=kv_local,
        kv_head_start=kv_start,
        kv_replicas=replicas,
        intermediate_size=inter // size,
        vocab_size=-(-cfg.vocab_size // size),
        full_vocab_size=cfg.vocab_size,
    )


@dataclass(frozen=True)
class Rendezvous:
    """Where the ranks of one worker meet: a ``FileStore`` path on their node (every rank
    opens the same file), and how many ranks there are."""

    path: str
    size: int


class RankFailure(RuntimeError):
    """A tensor-parallel rank is gone (its process died, or a collective failed): the worker
    cannot step any more."""


class TPGroup:
    """The collectives of one rank of a worker, on process groups this rank owns (never
    torch.distributed's default group: offline, several engines may live in one process)."""

    def __init__(self, rdv: Rendezvous, rank: int, device: str) -> None:
        """``device``: the engine's (``cuda`` picks this rank's GPU: ``rank_device``)."""
        self.rank, self.size = rank, rdv.size
        self.device = torch.device(rank_device(device, rank))
        store = dist.FileStore(rdv.path, rdv.size)
        store.set_timeout(datetime.timedelta(seconds=START_TIMEOUT_S))
        self.cpu = _gloo(dist.PrefixStore("cpu", store), rank, rdv.size, _IDLE_TIMEOUT)
        timeout = datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S)
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
            opts = dist.ProcessGroupNCCL.Options()
            opts._timeout = timeout
            self.dev = dist.ProcessGroupNCCL(dist.PrefixStore("nccl", store), rank, self.size, opts)
            # NCCL makes its communicator at the first collective: here, never inside a CUDA
            # graph capture
            self.all_reduce(torch.zeros(1, device=self.device))
            torch.cuda.synchronize(self.device)
        else:
            self.dev = _gloo(dist.PrefixStore("dev", store), rank, self.size, timeout)
        self.failed: str | None = None  # why the group broke (a rank died): every step refuses
        self._released = False

    def release(self) -> None:
        """Let go of the device communicator now, waiting for no peer (idempotent; after the
        last collective, and after every CUDA graph that captured one is destroyed: NCCL
        waits for those first, without bound). Left to garbage collection, the teardown ran
        in torch's destructor at an arbitrary time, graphs still alive: a 2-GPU test hung
        there after its engine had closed."""
        if self._released:
            return
        self._released = True
        if self.device.type == "cuda":
            with contextlib.suppress(Exception):
                self.dev.abort()

    # -- the model's collectives (the device group) ---------------------------------------------

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum ``x`` over the ranks, in place; returns it."""
        self.dev.allreduce([x]).wait()
        return x

    def all_gather_last(self, x: torch.Tensor) -> torch.Tensor:
        """``[..., n]`` on every rank -> ``[..., size * n]``, rank 0's columns first."""
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(self.size)]
        self.dev.allgather([parts], [x]).wait()
        return torch.cat(parts, dim=-1)

    def broadcast_device(self, x: torch.Tensor) -> torch.Tensor:
        """Rank 0's ``x`` (a device tensor of the same shape on every rank) on every rank."""
        self.dev.broadcast([x], _root()).wait()
        return x

    def gather_device(self, x: torch.Tensor) -> list[torch.Tensor] | None:
        """Every rank's ``x`` (the same shape and dtype on each) at rank 0, in rank order;
        None on the other ranks. A gather (NCCL has had one since torch 1.11): only rank 0
        holds all parts, where an all-gather would put them on every rank."""
        x = x.contiguous()
        opts = dist.GatherOptions()
        opts.rootRank = 0
        if self.rank != 0:
            self.dev.gather([], [x], opts).wait()
            return None
        parts = [torch.empty_like(x) for _ in range(self.size)]
        self.dev.gather([parts], [x], opts).wait()
        return parts

    def scatter_device(self, parts: list[torch.Tensor] | None, out: torch.Tensor) -> torch.Tensor:
        """Rank 0's ``parts[r]`` into rank ``r``'s ``out`` (``parts``: rank 0 only, each the
        shape and dtype of ``out``); returns ``out``."""
        opts = dist.ScatterOptions()
        opts.rootRank = 0
        inputs = [[p.contiguous() for p in parts]] if self.rank == 0 else []
        self.dev.scatter([out], inputs, opts).wait()
        return out

    # -- step inputs (the cpu group) ------------------------------------------------------------

    def broadcast_cpu(self, x: torch.Tensor) -> torch.Tensor:
        """Rank 0's host tensor ``x`` into every rank's ``x`` (same shape and dtype)."""
        self.cpu.broadcast([x], _root()).wait()
        return x

    def min_int(self, value: int) -> int:
        """The smallest ``value`` over the ranks (the KV pool size every rank can hold)."""
        t = torch.tensor([value], dtype=torch.int64)
        opts = dist.AllreduceOptions()
        opts.reduceOp = dist.ReduceOp.MIN
        self.cpu.allreduce([t], opts).wait()
        return int(t.item())


def _gloo(store, rank: int, size: int, timeout: datetime.timedelta) -> dist.ProcessGroupGloo:
    opts = dist.ProcessGroupGloo._Options()
    opts._devices = [dist.ProcessGroupGloo.create_device(hostname="127.0.0.1")]
    opts._timeout = timeout
    return dist.ProcessGroupGloo(store, rank, size, opts)


def _root() -> dist.BroadcastOptions:
    opts = dist.BroadcastOptions()
    opts.rootRank = 0
    return opts


def rank_device(device: str, rank: int) -> str:
    """The device of ``rank``: on CUDA without an index, GPU ``rank`` when this process sees
    several (one process spawned them all), else the one it sees (a Ray actor per rank: its
    ``cuda:0``; ``torch.cuda.set_device`` wants an index)."""
    if device == "cuda" and torch.cuda.is_available():
        return f"cuda:{rank}" if torch.cuda.device_count() > 1 else "cuda:0"
    return device


def device_name(device: str) -> str:
    """``device`` (``cpu``, ``cuda``, ``cuda:N``: this process's view) as the machine names it,
    for ``tandem status``: ``cpu``, or ``cuda:<index>`` of the GPU among all the node's (through
    CUDA_VISIBLE_DEVICES, as a Ray actor sees only its own)."""
    if not device.startswith("cuda"):
        return device
    index = int(
        device.partition(":")[2]
        or (torch.cuda.current_device() if torch.cuda.is_available() else 0)
    )
    visible = [
        v.strip() for v in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if v.strip()
    ]
    return f"cuda:{visible[index]}" if index < len(visible) else f"cuda:{index}"


def default_threads(size: int) -> int:
    """torch threads per rank on CPU when none are set: the cores shared by the ranks."""
    return max(1, (os.cpu_count() or 1) // size)
