"""Start workers on Ray and generate through them: the entry point the gateway builds on.

``LocalCluster(num_prefill=N, num_decode=M, num_colocated=K)`` starts (or joins) a Ray cluster,
places one actor per worker (one GPU each on CUDA; custom resources ``prefill`` / ``decode``
are requested when the cluster defines them) and routes each request:

* ``mode="disagg"``: reserve on the least-loaded decode worker and, at the same time, start
  the prompt on the least-loaded prefill worker (its KV waits at the channel until the
  reservation is confirmed; a full decode worker answers at once, the speculative prefill is
  dropped and the next decode worker is tried), then read the decode worker's stream. A
  transfer that fails before the first token is retried once on another pair (the same pair
  when there is no other), then ends in an error. A dead prefill worker is noticed through its
  call; a dead decode worker through its stream.
* ``mode="colocated"``: one colocated worker does it all (the baseline).
* ``mode="auto"``: disaggregated when there are prefill and decode workers, else colocated.

Errors: ``RequestError`` (invalid request, nothing was started), ``CapacityError`` (no
worker had room within ``reserve_timeout_s``), ``ClusterError`` (a failure after retrying).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import os
import secrets
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from cluster.worker import StreamError
from engine.model_hub import resolve_model
from engine.outputs import RequestOutput
from engine.sampling_params import SamplingParams
from engine.tokenizer import encode_prompt, load_tokenizer

logger = logging.getLogger(__name__)


class ClusterError(RuntimeError):
    """A request failed inside the cluster (after its retry)."""


class RequestError(ValueError):
    """The request is invalid; nothing was started."""


class CapacityError(ClusterError):
    """No worker could take the request in time (the gateway answers 503 + Retry-After)."""


@dataclass
class WorkerRef:
    name: str
    role: str
    handle: Any  # ray.actor.ActorHandle
    endpoint: str = ""
    outstanding: int = 0  # requests this driver has in flight on it
    pid: int = 0
    index_id: str = ""  # its name in the global prefix index ("" when it publishes nothing)


@dataclass
class ClusterConfig:
    model: str = "smollm2"
    num_prefill: int = 1
    num_decode: int = 1
    num_colocated: int = 0
    device: str = "cpu"
    transport: str = "auto"  # tcp | nccl | auto (nccl on cuda, tcp on cpu)
    host: str = (
        "127.0.0.1"  # where decode workers listen for KV; "node": the node's IP (multi-node)
    )
    transfer_timeout_s: float = 60.0
    reserve_timeout_s: float = 30.0
    ray_address: str | None = None
    namespace: str = "tandem"  # Ray namespace of the named worker actors (gateways attach by it)
    index_url: str | None = None  # Redis of the global prefix index (None: workers publish nothing)
    engine: dict[str, Any] = field(default_factory=dict)  # EngineConfig fields for every worker
    prefill_engine: dict[str, Any] = field(default_factory=dict)  # overrides for prefill
    decode_engine: dict[str, Any] = field(default_factory=dict)  # overrides for decode

    def __post_init__(self) -> None:
        for name in ("num_prefill", "num_decode", "num_colocated"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if (self.num_prefill > 0) != (self.num_decode > 0):
            raise ValueError(
                "disaggregated serving needs at least one prefill and one decode worker"
            )
        if self.num_prefill + self.num_colocated == 0:
            raise ValueError("no workers: set num_prefill/num_decode or num_colocated")
        if self.transport == "auto":
            self.transport = "nccl" if self.device == "cuda" else "tcp"
        if self.transport not in ("tcp", "nccl"):
            raise ValueError(f"transport must be tcp, nccl or auto, got {self.transport!r}")


class LocalCluster:
    def __init__(self, config: ClusterConfig | None = None, **kwargs: Any) -> None:
        import ray

        self.config = cfg = config or ClusterConfig(**kwargs)
        self.model_dir = str(resolve_model(cfg.model))
        self.tokenizer = load_tokenizer(self.model_dir)
        self._token = secrets.token_hex(16)  # KV channels refuse peers without it
        self._ids = itertools.count()
        # Actor names are "<cluster id>/<role>-<i>": unique per cluster, so clusters sharing a
        # Ray namespace or a prefix index never mix; a gateway attaches by the id.
        self.cluster_id = secrets.token_hex(3)
        env = {"NCCL_NVLS_ENABLE": "0"}
        env.update(
            {k: v for k, v in os.environ.items() if k.startswith(("TANDEM_", "TRITON_", "NCCL_"))}
        )
        workers = cfg.num_prefill + cfg.num_decode + cfg.num_colocated
        self._owns_ray = not ray.is_initialized()
        self._owns_workers = True
        if self._owns_ray:
            ray.init(
                # "local": a new Ray of our own, never a cluster another process left running
                address=cfg.ray_address or "local",
                num_cpus=None if cfg.ray_address else max(os.cpu_count() or 1, workers),
                include_dashboard=False,
                runtime_env={"env_vars": env},
                logging_level=logging.WARNING,
                namespace=cfg.namespace,
            )
        resources = ray.cluster_resources()
        self.prefill = [self._start("prefill", i, resources) for i in range(cfg.num_prefill)]
        self.decode = [self._start("decode", i, resources) for i in range(cfg.num_decode)]
        self.colocated = [self._start("colocated", i, resources) for i in range(cfg.num_colocated)]
        t0 = time.perf_counter()
        self._describe_workers()
        logger.info("%d workers ready in %.1f s", len(self.workers), time.perf_counter() - t0)

    @classmethod
    def attach(
        cls, ray_address: str = "auto", namespace: str = "tandem", cluster_id: str | None = None
    ) -> LocalCluster:
        """Join workers another process started (a second gateway over the same workers): finds
        the named actors of ``cluster_id`` (the only cluster in ``namespace`` when None). The
        attached cluster routes requests; it never starts, kills or shuts down workers."""
        import ray

        if not ray.is_initialized():
            ray.init(
                address=ray_address,
                namespace=namespace,
                logging_level=logging.WARNING,
                include_dashboard=False,
            )
        names = [n for n in ray.util.list_named_actors() if "/" in n]
        ids = sorted({n.partition("/")[0] for n in names})
        if cluster_id is None:
            if len(ids) != 1:
                raise ClusterError(
                    f"namespace {namespace!r} holds {len(ids)} tandem clusters ({ids}): pick one"
                )
            cluster_id = ids[0]
        self = cls.__new__(cls)
        self.cluster_id = cluster_id
        self._owns_ray = self._owns_workers = False
        self._token = ""
        self._ids = itertools.count()
        pools: dict[str, list[WorkerRef]] = {"prefill": [], "decode": [], "colocated": []}
        for actor in sorted(names):
            owner, _, name = actor.partition("/")
            role = name.rsplit("-", 1)[0]
            if owner == cluster_id and role in pools:
                pools[role].append(WorkerRef(name, role, ray.get_actor(actor)))
        self.prefill, self.decode, self.colocated = (
            pools["prefill"],
            pools["decode"],
            pools["colocated"],
        )
        if not self.workers:
            raise ClusterError(f"no workers of cluster {cluster_id!r} in namespace {namespace!r}")
        infos = self._describe_workers()
        self.model_dir = infos[0]["model_dir"]
        self.tokenizer = load_tokenizer(self.model_dir)
        self.config = ClusterConfig(
            model=self.model_dir,
            num_prefill=len(self.prefill),
            num_decode=len(self.decode),
            num_colocated=len(self.colocated),
            device=infos[0]["device"],
            namespace=namespace,
        )
        # In-flight counts of other gateways are not visible here; the router's load view
        # comes from the workers' own stats.
        return self

    def _describe_workers(self) -> list[dict[str, Any]]:
        import ray

        infos = ray.get([w.handle.ready.remote() for w in self.workers])
        for w, info in zip(self.workers, infos, strict=True):
            w.pid = info["pid"]
            w.index_id = info.get("index_id", "")
        for w in self.decode:
            w.endpoint = ray.get(w.handle.endpoint.remote())
        self.block_size = infos[0]["block_size"]
        self.max_model_len = min(info["max_model_len"] for info in infos)
        return infos

    @property
    def index_namespace(self) -> str:
        """Where this cluster's workers publish their blocks in the prefix index."""
        return f"{self.config.namespace}:{os.path.basename(self.model_dir.rstrip('/'))}"

    @property
    def workers(self) -> list[WorkerRef]:
        return self.prefill + self.decode + self.colocated

    def _start(self, role: str, index: int, resources: dict[str, float]) -> WorkerRef:
        import ray

        from cluster.colocated import ColocatedWorker
        from decode_worker.worker import DecodeWorker
        from prefill_worker.worker import PrefillWorker

        cfg = self.config
        engine = {"model_dir": self.model_dir, "device": cfg.device, **cfg.engine}
        kwargs: dict[str, Any] = {}
        if role == "prefill":
            # A prefill worker never decodes: no decode CUDA graphs to capture.
            cls, engine = PrefillWorker, {"enforce_eager": True, **engine, **cfg.prefill_engine}
            kwargs = {"token": self._token}
        elif role == "decode":
            cls, engine = DecodeWorker, {**engine, **cfg.decode_engine}
            kwargs = {
                "transport": cfg.transport,
                "token": self._token,
                "host": cfg.host,
                "transfer_timeout_s": cfg.transfer_timeout_s,
            }
        else:
            cls = ColocatedWorker
        name = f"{role}-{index}"
        actor_name = f"{self.cluster_id}/{name}"  # also its name in the prefix index
        if cfg.index_url and role != "decode":  # decode workers compute no prompt blocks
            kwargs["index"] = {
                "url": cfg.index_url,
                "namespace": self.index_namespace,
                "worker": actor_name,
            }
        options: dict[str, Any] = {"num_cpus": 1, "max_concurrency": 1000, "name": actor_name}
        if cfg.device == "cuda":
            options["num_gpus"] = 1
        if role in ("prefill", "decode") and resources.get(role):
            options["resources"] = {role: 1}
        handle = ray.remote(cls).options(**options).remote(engine, name, **kwargs)
        return WorkerRef(name, role, handle)

    # -- requests --------------------------------------------------------------------------------

    def _encode(self, prompt: str | Sequence[int]) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise RequestError("this model has no tokenizer: pass token ids")
            return encode_prompt(self.tokenizer, prompt)
        return list(prompt)

    async def stream(
        self,
        prompt: str | Sequence[int],
        params: SamplingParams | None = None,
        *,
        request_id: str | None = None,
        mode: str = "auto",
        prefill: str | None = None,
        decode: str | None = None,
        **kwargs: Any,
    ) -> AsyncIterator[RequestOutput]:
        """Outputs of one request as they come (the last has ``finished``). Closing the iterator
        early aborts the request everywhere. ``prefill`` / ``decode`` pin the first attempt to
        the named workers (a retry may go elsewhere); a colocated request is pinned by either."""
        params = params or SamplingParams()
        rid = request_id or f"req-{next(self._ids)}"
        ids = self._encode(prompt)
        if mode == "auto":
            mode = "disagg" if self.prefill else "colocated"
        if mode == "disagg" and self.prefill:
            gen = self._stream_disagg(rid, ids, params, kwargs, prefill, decode)
        elif mode == "colocated" and self.colocated:
            gen = self._stream_colocated(rid, ids, params, kwargs, decode or prefill)
        else:
            raise RequestError(f"mode {mode!r} has no workers in this cluster")
        async for out in gen:
            if isinstance(prompt, str):
                out = replace(out, prompt=prompt)
            yield out

    def generate(
        self,
        prompts: Sequence[str | Sequence[int]],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        mode: str = "auto",
    ) -> list[RequestOutput]:
        """Run every prompt concurrently; the final output of each, in order."""
        if not isinstance(params, Sequence):
            params = [params or SamplingParams()] * len(prompts)

        async def one(prompt, p) -> RequestOutput:
            outputs = [out async for out in self.stream(prompt, p, mode=mode)]
            return outputs[-1]

        async def run() -> list[RequestOutput]:
            return list(
                await asyncio.gather(*(one(x, p) for x, p in zip(prompts, params, strict=True)))
            )

        return asyncio.run(run())

    def _least_loaded(
        self, pool: list[WorkerRef], avoid: set[str], pin: str | None = None
    ) -> list[WorkerRef]:
        if pin is not None:
            pinned = [w for w in pool if w.name == pin]
            if not pinned:
                raise RequestError(f"no worker named {pin!r} in this cluster")
            return pinned
        preferred = [w for w in pool if w.name not in avoid] or pool
        return sorted(preferred, key=lambda w: w.outstanding)

    async def _reserve(self, rid, ids, params, kwargs, avoid: set[str], pin=None) -> WorkerRef:
        deadline = time.monotonic() + self.config.reserve_timeout_s
        delay = 0.005
        while True:
            for d in self._least_loaded(self.decode, avoid, pin):
                try:
                    res = await d.handle.reserve.remote(rid, ids, params, **kwargs)
                except Exception as exc:  # noqa: BLE001 - a dead decode worker: try the next
                    logger.warning("reserve on %s failed: %s", d.name, exc)
                    continue
                if res["ok"]:
                    return d
                if "error" in res:
                    raise RequestError(res["error"])
            if time.monotonic() > deadline:
                raise CapacityError(
                    f"no decode worker had room for a {len(ids)}-token prompt within "
                    f"{self.config.reserve_timeout_s:.0f} s"
                )
            await asyncio.sleep(delay)  # full everywhere: back off (the router queues instead)
            delay = min(delay * 2, 0.2)

    async def _start_pair(self, irid, ids, params, kwargs, avoid, pin_p, pin_d):
        """Reserve on a decode worker and start the prompt on a prefill worker. The first choice
        runs both at once (the prefill computes while the decode worker reserves; its KV waits
        at the channel until ``release``); if that decode worker is full the speculative prefill
        is dropped and the others are asked in turn (under a new id: the dropped one may still
        be finishing). Returns (decode, prefill, request id used, prefill ref)."""
        # Counted as soon as chosen, so concurrent requests spread over the workers.
        d = self._least_loaded(self.decode, avoid, pin_d)[0]
        p = self._least_loaded(self.prefill, avoid, pin_p)[0]
        d.outstanding += 1
        p.outstanding += 1
        try:
            pref = p.handle.prefill.remote(irid, ids, params, d.endpoint, gated=True, **kwargs)
            try:
                res = await d.handle.reserve.remote(irid, ids, params, **kwargs)
            except Exception as exc:  # noqa: BLE001 - a dead decode worker: as if full
                res = {"ok": False, "full": True, "why": str(exc)}
            if res["ok"]:
                _quietly(p.handle.release, irid)
                return d, p, irid, pref
            _quietly(p.handle.abort, irid)
            if "error" in res:
                raise RequestError(res["error"])
            avoid = avoid | {d.name}
            d.outstanding -= 1
            d = None  # counted again once another one has room
            irid = f"{irid}~r"
            d = await self._reserve(irid, ids, params, kwargs, avoid, pin_d)
            d.outstanding += 1
            return d, p, irid, p.handle.prefill.remote(irid, ids, params, d.endpoint, **kwargs)
        except BaseException:
            if d is not None:
                d.outstanding -= 1
            p.outstanding -= 1
            raise

    async def _stream_disagg(
        self, rid, ids, params, kwargs, pin_prefill=None, pin_decode=None
    ) -> AsyncIterator[RequestOutput]:
        import ray

        avoid: set[str] = set()
        error = "unknown"
        for attempt in range(2):
            irid = rid if attempt == 0 else f"{rid}~retry"
            first = attempt == 0
            d, p, irid, pref = await self._start_pair(
                irid,
                ids,
                params,
                kwargs,
                avoid,
                pin_prefill if first else None,
                pin_decode if first else None,
            )
            watch = asyncio.ensure_future(self._watch_prefill(pref, d, irid))
            produced = finished = False
            try:
                async for ref in d.handle.stream.options(num_returns="streaming").remote(irid):
                    item = await ref
                    if isinstance(item, StreamError):
                        if item.retryable and not produced:
                            error = item.message
                            break
                        raise ClusterError(item.message)
                    produced = True
                    finished = item.finished
                    yield replace(item, request_id=rid)
                    if finished:
                        return
                else:
                    error = "decode stream ended early"
            except ray.exceptions.RayActorError as exc:
                if produced:
                    raise ClusterError(f"decode worker {d.name} died mid-request: {exc}") from None
                error = f"decode worker {d.name} died: {exc}"
            finally:
                d.outstanding -= 1
                p.outstanding -= 1
                if not finished:
                    _quietly(p.handle.abort, irid)
                    _quietly(d.handle.abort, irid)
                    watch.cancel()
            logger.warning("request %s attempt %d failed: %s", rid, attempt + 1, error)
            avoid |= {d.name, p.name}
        raise ClusterError(f"request {rid} failed on two prefill/decode pairs: {error}")

    async def _watch_prefill(self, pref, d: WorkerRef, irid: str) -> None:
        try:
            res = await pref
        except Exception as exc:  # noqa: BLE001 - the prefill worker died or raised
            res = {"ok": False, "error": f"prefill worker failed: {exc}"}
        if not res["ok"]:
            _quietly(d.handle.fail_transfer, irid, res["error"])

    async def _stream_colocated(
        self, rid, ids, params, kwargs, pin=None
    ) -> AsyncIterator[RequestOutput]:
        c = self._least_loaded(self.colocated, set(), pin)[0]
        c.outstanding += 1
        finished = False
        try:
            try:
                await c.handle.generate.remote(rid, ids, params, **kwargs)
            except ValueError as exc:
                raise RequestError(str(exc).splitlines()[-1]) from None
            async for ref in c.handle.stream.options(num_returns="streaming").remote(rid):
                item = await ref
                if isinstance(item, StreamError):
                    raise ClusterError(item.message)
                finished = item.finished
                yield item
        finally:
            c.outstanding -= 1
            if not finished:
                _quietly(c.handle.abort, rid)

    # -- operations ------------------------------------------------------------------------------

    def stats(self) -> list[dict[str, Any]]:
        import ray

        return ray.get([w.handle.stats.remote() for w in self.workers])

    def check_idle(self) -> dict[str, str | None]:
        """Per worker: None when idle with exact block accounting, else what is wrong."""
        import ray

        return dict(
            zip(
                [w.name for w in self.workers],
                ray.get([w.handle.check_idle.remote() for w in self.workers]),
                strict=True,
            )
        )

    def forget(self, name: str) -> None:
        """Stop routing to a worker (its actor died); nothing is sent to it."""
        for pool in (self.prefill, self.decode, self.colocated):
            pool[:] = [w for w in pool if w.name != name]

    def kill(self, name: str) -> None:
        """Kill one worker's actor (fault tests, drain later)."""
        import ray

        worker = next((w for w in self.workers if w.name == name), None)
        if worker is None:
            raise ValueError(f"no worker named {name!r}")
        ray.kill(worker.handle, no_restart=True)
        self.forget(name)

    def shutdown(self) -> None:
        import ray

        if not self._owns_workers:  # attached: the workers belong to another process
            self.prefill, self.decode, self.colocated = [], [], []
            return
        for w in self.workers:
            _quietly(w.handle.shutdown)
        for w in self.workers:
            ray.kill(w.handle, no_restart=True)
        self.prefill, self.decode, self.colocated = [], [], []
        if self._owns_ray:
            ray.shutdown()

    def __enter__(self) -> LocalCluster:
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()


def _quietly(method, *args) -> None:
    """Fire-and-forget a Ray actor call (its failure is not the caller's concern)."""
    with contextlib.suppress(Exception):
        method.remote(*args)


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m cluster.local [--prefill N --decode M | --colocated K] PROMPT...``: start a
    local Ray cluster, generate every prompt through it (streaming the first one), shut down."""
    import argparse
    import sys

    ap = argparse.ArgumentParser(prog="python -m cluster.local", description=main.__doc__)
    ap.add_argument("prompts", nargs="+")
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--prefill", type=int, default=1)
    ap.add_argument("--decode", type=int, default=1)
    ap.add_argument("--colocated", type=int, default=0)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default=None)
    ap.add_argument("--transport", default="auto")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--temperature", type=float, default=0.0)
    args = ap.parse_args(argv)
    engine = {"dtype": args.dtype} if args.dtype else {}
    params = SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens)
    t0 = time.perf_counter()
    print(
        f"starting {args.prefill}P {args.decode}D {args.colocated}C on {args.device} ...",
        file=sys.stderr,
    )
    with LocalCluster(
        model=args.model,
        num_prefill=args.prefill,
        num_decode=args.decode,
        num_colocated=args.colocated,
        device=args.device,
        transport=args.transport,
        engine=engine,
    ) as cluster:
        print(f"ready in {time.perf_counter() - t0:.0f} s", file=sys.stderr)

        async def first() -> None:
            async for out in cluster.stream(args.prompts[0], params):
                print(out.outputs[0].delta_text, end="", flush=True)
            print()

        asyncio.run(first())
        for out in cluster.generate(args.prompts[1:], params) if args.prompts[1:] else []:
            print(out.outputs[0].text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
