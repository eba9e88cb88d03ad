"""The ranks of a tensor-parallel engine other than rank 0: their body, and the local way to
start and watch them (offline ``LLM``; under Ray the worker places them as actors instead,
engine/runtime.py).

A rank's life::

    1. started with the engine's settings, its rank and the rendezvous (a FileStore path)
    2. joins the group (TPGroup), builds its ModelRunner in step with rank 0's: loads its
       slice of the weights, agrees on the KV pool's size, allocates its KV heads' pool
    3. follow(): runs every step rank 0 sends, in lockstep, until rank 0 says stop
    4. any fault ends the process; rank 0's next collective then fails at once (RankFailure),
       and a watcher on the rank's process tells rank 0 even while it is idle
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing
import os
import shutil
import tempfile
import threading
from collections.abc import Callable
from multiprocessing.connection import wait

from engine.config import EngineConfig, ModelConfig
from engine.model_runner import ModelRunner
from engine.parallel import Rendezvous, TPGroup, default_threads, device_name, rank_device

logger = logging.getLogger(__name__)

STOP_TIMEOUT_S = 30.0  # a rank that has not exited this long after stop is terminated


def run_rank(
    cfg: EngineConfig, rank: int, rdv: Rendezvous, max_model_len: int, threads: int | None = None
) -> None:
    """Rank ``rank`` (> 0) of an engine whose rank 0 runs elsewhere: join, build, follow.
    Returns when rank 0 says stop; raises when the group fails. ``threads``: torch's on CPU
    (None: this node's cores shared by the ranks; TANDEM_TORCH_THREADS overrides)."""
    import torch

    if cfg.device == "cpu":
        override = os.environ.get("TANDEM_TORCH_THREADS")
        torch.set_num_threads(int(override or threads or default_threads(rdv.size)))
    tp = TPGroup(rdv, rank, cfg.device)
    runner = ModelRunner(cfg, ModelConfig.from_dir(cfg.model_dir), max_model_len, tp)
    runner.follow()


def _rank_process(
    cfg: EngineConfig, rank: int, rdv: Rendezvous, max_model_len: int, threads: int | None = None
) -> None:
    logging.basicConfig(level=logging.WARNING)
    try:
        run_rank(cfg, rank, rdv, max_model_len, threads)
    except Exception:
        logger.exception("tensor-parallel rank %d failed", rank)
        os._exit(1)  # no atexit, no flushing of torch's state: the group is gone anyway
    # Stopped by rank 0, the group released: end here rather than in the interpreter's
    # teardown, where a 2-GPU run sat in torch's destructors until rank 0's STOP_TIMEOUT_S
    # terminated it (benchmarks/NOTES.md). Nothing of this process outlives it.
    logging.shutdown()
    os._exit(0)


class LocalRanks:
    """Ranks 1 .. size-1 as child processes of this one (spawned: a fresh interpreter each,
    no forked torch state), watched: ``on_death`` is called (from a watcher thread) with a
    message naming the first rank that exits before ``close``."""

    def __init__(self, cfg: EngineConfig, max_model_len: int, size: int) -> None:
        self._device = cfg.device
        self._dir = tempfile.mkdtemp(prefix="tandem-tp-")
        self.rendezvous = Rendezvous(os.path.join(self._dir, "store"), size)
        ctx = multiprocessing.get_context("spawn")
        self.processes = [
            ctx.Process(
                target=_rank_process,
                args=(cfg, rank, self.rendezvous, max_model_len),
                name=f"tandem-tp-rank-{rank}",
                daemon=True,
            )
            for rank in range(1, size)
        ]
        for p in self.processes:
            p.start()
        self._closing = threading.Event()
        self.on_death: Callable[[str], None] | None = None
        self.died = threading.Event()  # set once a rank exited before close (after on_death)
        self._watcher = threading.Thread(target=self._watch, name="tp-rank-watch", daemon=True)
        self._watcher.start()

    def joined(self) -> None:
        """Every rank has joined the group (rank 0's runner is built, and that took a
        collective of all): the rendezvous file is not read again, remove it."""
        shutil.rmtree(self._dir, ignore_errors=True)

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.processes]

    def describe(self) -> list[dict[str, object]]:
        """Ranks 1 .. size-1: their process and device (``tandem status``)."""
        return [
            {"rank": rank, "pid": p.pid, "device": device_name(rank_device(self._device, rank))}
            for rank, p in enumerate(self.processes, start=1)
        ]

    def _watch(self) -> None:
        sentinels = {p.sentinel: (rank, p) for rank, p in enumerate(self.processes, start=1)}
        ready = wait(list(sentinels))
        if self._closing.is_set():
            return
        rank, proc = sentinels[ready[0]]
        proc.join(1.0)
        why = f"tensor-parallel rank {rank} (pid {proc.pid}) exited with code {proc.exitcode}"
        logger.error("%s", why)
        if self.on_death is not None:
            self.on_death(why)
        self.died.set()

    def close(self, stopped: bool = True) -> None:
        """Wait for the ranks to exit (``stopped``: rank 0 told them to), then terminate any
        left (at once when not told: they would wait for a step forever)."""
        self._closing.set()
        for p in self.processes:
            p.join(STOP_TIMEOUT_S if stopped else 0.0)
            if p.is_alive():
                p.terminate()
                p.join(5.0)
        with contextlib.suppress(OSError):
            shutil.rmtree(self._dir)


class RankActor:
    """One rank (> 0) of a worker as a Ray actor (the controller's placement group gives it a
    bundle beside its worker's, on the same node); ``run`` returns when rank 0 says stop. A
    fault ends the actor's process, which its worker's watcher sees."""

    def describe(self, device: str, rank: int) -> dict[str, object]:
        return {"rank": rank, "pid": os.getpid(), "device": device_name(device)}

    def run(
        self, cfg: EngineConfig, rank: int, rdv: Rendezvous, max_model_len: int, threads: int
    ) -> None:
        _rank_process(cfg, rank, rdv, max_model_len, threads)


class RayRanks:
    """Ranks 1 .. size-1 as ``RankActor``s in bundles 1 .. size-1 of the placement group this
    actor (rank 0) runs in, bundle 0. Watched like ``LocalRanks``: a rank actor whose ``run``
    ends before ``close`` calls ``on_death``. They die with their worker (Ray ends the actors an
    actor created) and with the placement group."""

    def __init__(self, cfg: EngineConfig, max_model_len: int, size: int) -> None:
        import ray
        import torch
        from ray.util import get_current_placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        group = get_current_placement_group()
        if group is None or len(group.bundle_specs) < size:
            raise RuntimeError(
                f"tensor_parallel_size={size} under Ray needs the worker in a placement group of "
                f"{size} bundles (cluster/control/spawn.py makes one)"
            )
        self._dir = tempfile.mkdtemp(prefix="tandem-tp-")  # one node: the group is packed
        self.rendezvous = Rendezvous(os.path.join(self._dir, "store"), size)
        gpus = 1 if cfg.device.startswith("cuda") else 0
        actor = ray.remote(RankActor)
        self.actors = [
            actor.options(
                num_cpus=group.bundle_specs[rank].get("CPU", 0),
                num_gpus=gpus,
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    group, placement_group_bundle_index=rank
                ),
            ).remote()
            for rank in range(1, size)
        ]
        # asked before ``run`` (which holds each actor for good), answered when read
        self._described = [a.describe.remote(cfg.device, r) for r, a in enumerate(self.actors, 1)]
        self._runs = [
            # as many torch threads as rank 0 (the worker's share of the node's cores)
            a.run.remote(cfg, rank, self.rendezvous, max_model_len, torch.get_num_threads())
            for rank, a in enumerate(self.actors, start=1)
        ]
        self._closing = threading.Event()
        self.on_death: Callable[[str], None] | None = None
        self.died = threading.Event()
        self._watcher = threading.Thread(target=self._watch, name="tp-rank-watch", daemon=True)
        self._watcher.start()

    def joined(self) -> None:
        """Every rank has joined the group (rank 0's runner is built, and that took a
        collective of all): the rendezvous file is not read again, remove it."""
        shutil.rmtree(self._dir, ignore_errors=True)

    def describe(self) -> list[dict[str, object]]:
        """Ranks 1 .. size-1: their process and device (``tandem status``)."""
        import ray

        return ray.get(self._described, timeout=30)

    def _watch(self) -> None:
        import ray

        done, _ = ray.wait(self._runs, num_returns=1, timeout=None)
        if self._closing.is_set():
            return
        rank = self._runs.index(done[0]) + 1
        try:
            ray.get(done[0])
            why = f"tensor-parallel rank {rank} stopped"
        except Exception as exc:  # noqa: BLE001 - how it ended is the message
            why = f"tensor-parallel rank {rank} died: {str(exc).splitlines()[0]}"
        logger.error("%s", why)
        if self.on_death is not None:
            self.on_death(why)
        self.died.set()

    def close(self, stopped: bool = True) -> None:
        import ray

        self._closing.set()
        if stopped:
            with contextlib.suppress(Exception):
                ray.wait(self._runs, num_returns=len(self._runs), timeout=STOP_TIMEOUT_S)
        for a in self.actors:
            with contextlib.suppress(Exception):
                ray.kill(a, no_restart=True)
        with contextlib.suppress(OSError):
            shutil.rmtree(self._dir)
