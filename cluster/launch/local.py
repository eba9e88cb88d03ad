"""Start a cluster on Ray, or join one: the launcher's handle on the controller and workers.

``LocalCluster(num_prefill=N, num_decode=M, num_colocated=K)`` starts (or joins) a Ray cluster,
starts the controller (cluster/control/controller.py: a named, detached actor that starts and owns the
workers and their membership table) and asks it for the workers: one actor per worker, one GPU
each on CUDA; custom resources ``prefill`` / ``decode`` are requested when the cluster defines
them. ``stream`` / ``generate`` run requests through the router's dispatcher (router/dispatch.py:
reserve -> prefill -> stream -> retry) with least-loaded placement, for tests and scripts; the
gateway uses the full router (router/service.py) over the same membership.

``LocalCluster.attach(...)`` joins a running cluster through its controller.

A new local Ray (no ``ray_address``) listens on 127.0.0.1 only and asks every client for its
token (``init_local_ray``); a configured address is the operator's cluster, bound and
authenticated as they set it up. docs/security.md lists every port.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import logging
import os
import secrets
import time
from collections.abc import AsyncIterator, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from cluster.control.autoscaler import AutoscalerConfig
from cluster.control.controller import Controller, HealthConfig, WorkerSpec
from engine.messages import MigrationResult, control
from engine.model_hub import resolve_model
from engine.outputs import RequestOutput
from engine.sampling_params import SamplingParams
from engine.tokenizer import encode_prompt, load_tokenizer
from router.dispatch import Dispatcher
from router.errors import CapacityError, ClusterError, RequestError
from router.membership import MembershipView, WorkerRef
from router.outputs import Answer
from router.routed import RoutedRequest
from router.service import ClusterBackend

logger = logging.getLogger(__name__)

__all__ = [
    "CapacityError",
    "ClusterConfig",
    "ClusterError",
    "LocalCluster",
    "RequestError",
    "WorkerRef",
]

CONTROLLER = "controller"
# Prefill and decode workers on CUDA move KV over NCCL through cupy, which no default install
# brings: say so before any worker starts (a worker would fail on its import, deep in Ray).
NO_CUPY = (
    "prefill/decode workers on CUDA stream KV over NCCL, which needs cupy, not installed here: "
    'pip install -e ".[gpu]" (torch built for CUDA 13) or ".[gpu-cu12]" (CUDA 12; '
    "torch.version.cuda says which); or serve colocated workers (tandem serve --colocated N), "
    "or use transport='tcp' (python -m cluster.launch.local --transport tcp)"
)
SCALE_HEADROOM = 8  # workers a new local Ray has room for beyond those it starts with
# Secrets `tandem serve` takes from the environment: never copied into a Ray runtime_env.
SECRET_ENV = frozenset(
    {"TANDEM_API_KEY", "TANDEM_ADMIN_KEY", "TANDEM_REDIS_URL", "TANDEM_OPERATOR_TOKEN"}
)


def init_local_ray(**options: Any) -> None:
    """Start a new single-node Ray of our own: every Ray server on 127.0.0.1, token auth on.

    Token auth is forced (``RAY_AUTH_MODE=token`` for this process and the Ray processes it
    starts), whatever this Ray version's default or the caller's environment says. The token is
    Ray's own file, ``~/.ray/auth_token``, made readable by its owner alone (Ray writes it with
    the umask's mode); ``RAY_AUTH_TOKEN`` / ``RAY_AUTH_TOKEN_PATH`` are the operator's choice.
    Loopback: Ray's GCS, raylet, object manager, agents and workers bind the node address,
    127.0.0.1 here (``_loopback_stays_loopback``).

    No idle workers started ahead: tandem runs actors, each started on demand in its own
    process, and every prestarted Python worker wakes a hundred times a second (its core
    worker's signal check), beside the engine on the same cores. On the 2-core dev host that
    was 2 processes and ~1 % of a core while idle; the CPU burst's A/B moved +3 %, inside that
    host's noise (benchmarks/NOTES.md).
    """
    import ray

    _force_token_auth()
    system = {"enable_worker_prestart": False, "prestart_worker_first_driver": False}
    options["_system_config"] = {**system, **options.get("_system_config", {})}
    with _loopback_stays_loopback():
        # "local": a new Ray of our own, never a cluster another process left running
        ray.init(address="local", _node_ip_address="127.0.0.1", **options)


@contextlib.contextmanager
def _loopback_stays_loopback() -> Iterator[None]:
    """Around a ``ray.init``: Ray's multi-machine mode (its default on Linux) replaces a node or
    GCS address of 127.0.0.1 with this machine's IP, where a loopback-only Ray does not listen;
    without it (Ray's default on macOS and Windows) loopback stays loopback. Addresses of other
    machines are never rewritten, so joining a multi-node cluster is unchanged."""
    from ray._private import ray_constants

    multi_machine = ray_constants.ENABLE_RAY_CLUSTER
    ray_constants.ENABLE_RAY_CLUSTER = False
    try:
        yield
    finally:
        ray_constants.ENABLE_RAY_CLUSTER = multi_machine


def _force_token_auth() -> None:
    try:
        from ray._raylet import AuthenticationMode, Config, get_authentication_mode
    except ImportError:  # Ray < 2.52 has no token auth: loopback is all the protection
        logger.warning("this Ray has no token auth (2.52+ has): its ports take any local client")
        return
    if os.environ.get("RAY_AUTH_MODE", "token").lower() != "token":
        logger.warning(
            "RAY_AUTH_MODE=%s ignored: a local tandem Ray always asks for its token",
            os.environ["RAY_AUTH_MODE"],
        )
    os.environ["RAY_AUTH_MODE"] = "token"
    Config.initialize("")  # Ray read its config at import: make it see the mode
    if get_authentication_mode() != AuthenticationMode.TOKEN:
        raise RuntimeError("could not turn on Ray's token auth (RAY_AUTH_MODE=token)")
    if os.environ.get("RAY_AUTH_TOKEN") or os.environ.get("RAY_AUTH_TOKEN_PATH"):
        return
    path = Path.home() / ".ray" / "auth_token"
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    try:  # a new token, created 0600 (ray.init would write it with the umask's mode)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        if path.stat().st_mode & 0o077:
            logger.warning("%s was readable by others: now 0600", path)
            path.chmod(0o600)
        return
    with os.fdopen(fd, "w") as f:
        f.write(secrets.token_hex(32))


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
    max_resumes: int = 2  # a request continues elsewhere this often after its worker failed
    stall_timeout_s: float = 10.0  # a worker's stream silent this long: hung
    hang_timeout_s: float = 60.0  # one engine step running this long: its thread is stuck
    dead_after_s: float = 60.0  # a worker suspect (unresponsive) this long is killed
    ray_address: str | None = None
    # custom resources `prefill` / `decode` on worker actors: "on" (a `ray up` cluster's
    # autoscaler starts a node of the role's type for them), "off", or "auto" (when the
    # cluster has both now)
    role_resources: str = "auto"
    namespace: str = "tandem"  # Ray namespace of the named actors (gateways attach by it)
    index_url: str | None = None  # Redis of the global prefix index (None: workers publish nothing)
    engine: dict[str, Any] = field(default_factory=dict)  # EngineConfig fields for every worker
    prefill_engine: dict[str, Any] = field(default_factory=dict)  # overrides for prefill
    decode_engine: dict[str, Any] = field(default_factory=dict)  # overrides for decode
    gpus: dict[str, float] = field(default_factory=dict)  # GPUs per worker by role (default 1)
    migration: dict[str, Any] = field(default_factory=dict)  # MigrationConfig fields (decode)
    # AutoscalerConfig fields (cluster/control/autoscaler.py; a pool's as a dict under its role): off
    # unless ``enabled``
    autoscale: dict[str, Any] = field(default_factory=dict)
    # prefill and decode workers that can switch roles without reloading weights (FlexWorker,
    # named flex-N; the controller's switch_role, and the autoscaler when a pool has one spare)
    role_switching: bool = False

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
        if (
            self.transport == "nccl"
            and self.num_prefill + self.num_decode > 0
            and self.ray_address is None  # a joined cluster's nodes have their own Python
            and importlib.util.find_spec("cupy") is None
        ):
            raise ValueError(NO_CUPY)
        if self.role_resources not in ("auto", "on", "off"):
            raise ValueError(f"role_resources must be auto, on or off, got {self.role_resources!r}")
        try:
            AutoscalerConfig(**self.autoscale)  # its errors here, not in the controller actor
        except TypeError as exc:
            raise ValueError(f"autoscale: {exc}") from None

    def role_engine(self, role: str) -> dict[str, Any]:
        """The EngineConfig fields a worker of ``role`` gets over the defaults (a flex worker,
        ``role_switching``, takes decode's over prefill's)."""
        if role == "colocated":
            return dict(self.engine)
        if self.role_switching:
            return {**self.engine, **self.prefill_engine, **self.decode_engine}
        return {**self.engine, **(self.prefill_engine if role == "prefill" else self.decode_engine)}


def _use_role_resources(mode: str, resources: dict[str, float]) -> bool:
    """Whether worker actors ask for the custom resource of their role (``prefill`` /
    ``decode``): always ("on"), never ("off"), or when the cluster has both now ("auto")."""
    if mode == "auto":
        return bool(resources.get("prefill") and resources.get("decode"))
    return mode == "on"


def _init_ray(cfg: ClusterConfig, workers: int) -> None:
    """Start (or, with ``ray_address``, join) the Ray this cluster runs on. The job's
    runtime_env is stored in Ray's job table and shown by its dashboard: settings only, never a
    secret."""
    import ray

    env = {"NCCL_NVLS_ENABLE": "0"}
    env.update(
        {
            k: v
            for k, v in os.environ.items()
            if k.startswith(("TANDEM_", "TRITON_", "NCCL_")) and k not in SECRET_ENV
        }
    )
    options = {
        "include_dashboard": False,
        "runtime_env": {"env_vars": env},
        "logging_level": logging.WARNING,
        "log_to_driver": os.environ.get("TANDEM_WORKER_LOGS", "1") != "0",
        "namespace": cfg.namespace,
    }
    if cfg.ray_address:  # the operator's cluster: its binding and its auth
        with _loopback_stays_loopback():
            ray.init(address=cfg.ray_address, **options)
    else:
        # one logical CPU per worker actor, and room for `tandem scale` to add some
        cpus = max(os.cpu_count() or 1, workers) + SCALE_HEADROOM
        init_local_ray(num_cpus=cpus, **options)


class LocalCluster:
    def __init__(self, config: ClusterConfig | None = None, **kwargs: Any) -> None:
        import ray

        self.config = cfg = config or ClusterConfig(**kwargs)
        self.model_dir = str(resolve_model(cfg.model))
        self.tokenizer = load_tokenizer(self.model_dir)
        # Actor names are "<cluster id>/<name>": unique per cluster, so clusters sharing a Ray
        # namespace or a prefix index never mix; a gateway attaches by the id.
        self.cluster_id = secrets.token_hex(3)
        # one process (and a logical CPU) per rank: a worker of tensor_parallel_size N has N
        workers = sum(
            count * cfg.role_engine(role).get("tensor_parallel_size", 1)
            for role, count in (
                ("prefill", cfg.num_prefill),
                ("decode", cfg.num_decode),
                ("colocated", cfg.num_colocated),
            )
        )
        self._owns_ray = not ray.is_initialized()
        self._owns_workers = True
        if self._owns_ray:
            _init_ray(cfg, workers)
        resources = ray.cluster_resources()
        spec = WorkerSpec(
            model_dir=self.model_dir,
            device=cfg.device,
            transport=cfg.transport,
            host=cfg.host,
            transfer_timeout_s=cfg.transfer_timeout_s,
            token=secrets.token_hex(16),
            cluster_id=self.cluster_id,
            index_url=cfg.index_url,
            index_namespace=f"{cfg.namespace}:{os.path.basename(self.model_dir.rstrip('/'))}",
            engine=cfg.engine,
            prefill_engine=cfg.prefill_engine,
            decode_engine=cfg.decode_engine,
            gpus=cfg.gpus,
            migration=cfg.migration,
            role_switching=cfg.role_switching,
            use_role_resources=_use_role_resources(cfg.role_resources, resources),
            # a local CPU cluster shares this machine's cores among its workers
            cpu_threads=None if cfg.ray_address else max(1, (os.cpu_count() or 1) // workers),
        )
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        self.controller = (
            ray.remote(Controller)
            .options(
                name=f"{self.cluster_id}/{CONTROLLER}",
                lifetime="detached",
                num_cpus=0,
                max_concurrency=1000,
                # on this node: its operator API listens where `tandem serve` runs
                scheduling_strategy=NodeAffinitySchedulingStrategy(
                    ray.get_runtime_context().get_node_id(), soft=False
                ),
            )
            .remote(
                spec,
                HealthConfig(hang_after_s=cfg.hang_timeout_s, dead_after_s=cfg.dead_after_s),
                cfg.autoscale,
            )
        )
        t0 = time.perf_counter()
        table = ray.get(
            self.controller.start.remote(cfg.num_prefill, cfg.num_decode, cfg.num_colocated)
        )
        self._join(table)
        logger.info("%d workers ready in %.1f s", len(self.workers), time.perf_counter() - t0)

    @classmethod
    def attach(
        cls, ray_address: str = "auto", namespace: str = "tandem", cluster_id: str | None = None
    ) -> LocalCluster:
        """Join a cluster another process started (a second gateway over the same workers)
        through its controller (``cluster_id``: the only cluster in ``namespace`` when None).
        The attached cluster routes requests; it never starts, kills or shuts down workers."""
        import ray

        if not ray.is_initialized():
            with _loopback_stays_loopback():
                ray.init(
                    address=ray_address,
                    namespace=namespace,
                    logging_level=logging.WARNING,
                    include_dashboard=False,
                )
        ids = sorted(
            n.partition("/")[0]
            for n in ray.util.list_named_actors()
            if n.endswith(f"/{CONTROLLER}")
        )
        if cluster_id is None:
            if len(ids) != 1:
                raise ClusterError(
                    f"namespace {namespace!r} holds {len(ids)} tandem clusters ({ids}): pick one"
                )
            cluster_id = ids[0]
        if cluster_id not in ids:
            raise ClusterError(f"no cluster {cluster_id!r} in namespace {namespace!r}")
        self = cls.__new__(cls)
        self.cluster_id = cluster_id
        self._owns_ray = self._owns_workers = False
        self.controller = ray.get_actor(f"{cluster_id}/{CONTROLLER}")
        table = ray.get(self.controller.members.remote())
        self.model_dir = table.model_dir
        self.tokenizer = load_tokenizer(self.model_dir)
        self._join(table)
        roles = [w.role for w in self.workers]
        self.config = ClusterConfig(
            model=self.model_dir,
            num_prefill=roles.count("prefill"),
            num_decode=roles.count("decode"),
            num_colocated=roles.count("colocated"),
            namespace=namespace,
            index_url=table.index_url,
        )
        return self

    def _join(self, table) -> None:
        if not table.workers:
            raise ClusterError(f"cluster {self.cluster_id!r} has no workers")
        self.members = MembershipView(table, self.controller)
        self.block_size = table.block_size
        self.max_model_len = table.max_model_len
        self.index_url = table.index_url
        self.index_namespace = table.index_namespace
        self._router: ClusterBackend | None = None
        self._router_loop: asyncio.AbstractEventLoop | None = None

    @property
    def prefill(self) -> list[WorkerRef]:
        return self.members.prefill

    @property
    def decode(self) -> list[WorkerRef]:
        return self.members.decode

    @property
    def colocated(self) -> list[WorkerRef]:
        return self.members.colocated

    @property
    def workers(self) -> list[WorkerRef]:
        return self.members.workers

    def refresh(self) -> None:
        """Take the controller's newest membership table now."""
        import ray

        self.members.apply(ray.get(self.controller.members.remote()))

    # -- requests (tests and scripts), through the gateway's own router (router/service.py) ----

    def router(self) -> ClusterBackend:
        """This process's router (made on first use, inside the running event loop): the
        gateway's own (router/service.py ``ClusterBackend``: admission, the length predictor,
        the placement policy, the prefix index, dispatch) over this cluster's workers."""
        loop = asyncio.get_running_loop()
        if self._router is None or self._router_loop is not loop:
            self._router_loop = loop
            for w in self.members.all_workers:  # the old loop's streams are gone, and with
                self.members.clear(w.name, "stream")  # them what they suspected
            cfg = self.config
            index = None
            if cfg.index_url:
                from engine.prefix_index import PrefixIndex

                index = PrefixIndex(cfg.index_url, self.index_namespace)
            self._router = ClusterBackend(
                self.members,
                tokenizer=self.tokenizer,
                index=index,
                reserve_timeout_s=cfg.reserve_timeout_s,
                max_resumes=cfg.max_resumes,
                stall_timeout_s=cfg.stall_timeout_s,
                hang_timeout_s=cfg.hang_timeout_s,
            )
            self._router.watch()
        return self._router

    def dispatcher(self) -> Dispatcher:
        """The router's dispatcher (its resume log, its in-flight requests)."""
        return self.router().dispatcher

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
        priority: int = 0,
        cache_salt: str | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Outputs of one request as they come (cumulative, the router's steps folded into one
        ``RequestOutput`` built in place: each choice's ``delta_*`` is what the last step
        added; the last has ``finished``). Closing the iterator early aborts the request
        everywhere. It takes the gateway's path through the router (``router()``): admitted,
        placed by the policy. ``prefill`` / ``decode`` pin the first attempt to the named
        workers instead (a colocated request is pinned by either), and ``mode`` picks the
        colocated or the disaggregated pool of a cluster with both; such a request skips
        admission and the policy, and its retries are placed by the policy."""
        params = params or SamplingParams()
        rid = request_id or f"req-{secrets.token_hex(4)}"
        ids = self._encode(prompt)
        text = prompt if isinstance(prompt, str) else None
        answer = Answer(rid, ids, params.n, params.logprobs is not None, prompt=text)
        router = self.router()
        if prefill is None and decode is None and mode == "auto":
            generation = await router.open(
                rid, ids, params, prompt=text, priority=priority, cache_salt=cache_salt
            )
            try:
                async for step in generation.outputs():
                    yield answer.add(step)
            finally:
                await generation.aclose()
            return
        if mode == "auto":
            mode = "disagg" if self.prefill else "colocated"
        if mode == "disagg" and self.prefill and self.decode:
            p, d = self._pick(self.prefill, prefill), self._pick(self.decode, decode)
        elif mode == "colocated" and self.colocated:
            p, d = None, self._pick(self.colocated, decode or prefill)
        else:
            raise RequestError(f"mode {mode!r} has no workers in this cluster")
        req = RoutedRequest(rid, ids, params, p, d, priority=priority, cache_salt=cache_salt)
        async for step in router.dispatcher.run(req):
            yield answer.add(step)

    @staticmethod
    def _pick(pool: list[WorkerRef], pin: str | None) -> str:
        """The first attempt's worker: the pinned one, else the least loaded."""
        if pin is not None:
            if not any(w.name == pin for w in pool):
                raise RequestError(f"no worker named {pin!r} in this cluster")
            return pin
        if not pool:
            raise ClusterError("no live workers")
        return min(pool, key=lambda w: w.outstanding).name

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
            last = None
            async for out in self.stream(prompt, p, mode=mode):
                last = out
            return last

        async def run() -> list[RequestOutput]:
            try:
                return list(
                    await asyncio.gather(*(one(x, p) for x, p in zip(prompts, params, strict=True)))
                )
            finally:
                await self._close_router()

        return asyncio.run(run())

    async def _close_router(self) -> None:
        if self._router is not None:
            await self._router.aclose()
            self._router = None

    # -- operations ------------------------------------------------------------------------------

    def stats(self) -> list[dict[str, Any]]:
        import ray

        return ray.get([control(w.handle.stats).remote() for w in self.workers])

    def check_idle(self) -> dict[str, str | None]:
        """Per worker: None when idle with exact block accounting, else what is wrong."""
        import ray

        return dict(
            zip(
                [w.name for w in self.workers],
                ray.get([control(w.handle.check_idle).remote() for w in self.workers]),
                strict=True,
            )
        )

    def migrate(self, request_id: str | None = None, **kwargs: Any) -> list[MigrationResult]:
        """Live-migrate a running request (or ``from_=..., count=N``) through the controller;
        see Controller.migrate. Safe to call from a thread while requests stream."""
        import ray

        return ray.get(self.controller.migrate.remote(request_id, **kwargs))

    def drain(self, worker: str, deadline_s: float = 60.0) -> dict[str, Any]:
        import ray

        report = ray.get(self.controller.drain.remote(worker, deadline_s))
        self.refresh()
        return report

    def undrain(self, worker: str) -> None:
        import ray

        ray.get(self.controller.undrain.remote(worker))
        self.refresh()

    def start_operator(self, token: str, **options: Any) -> str:
        """Serve the gRPC operator API from the controller (Controller.start_operator:
        ``host``, ``port``, ``tls_cert``, ``tls_key``, ``audit_log``); returns its address."""
        import ray

        return ray.get(self.controller.start_operator.remote(token=token, **options))

    def forget(self, name: str) -> None:
        """Stop routing to a worker (its actor died)."""
        self.members.forget(name, "forgotten by the caller")

    def kill(self, name: str) -> None:
        """Kill one worker's actor through the controller (fault tests, drain later)."""
        import ray

        if self.members.get(name) is None:
            raise ValueError(f"no worker named {name!r}")
        ray.get(self.controller.kill.remote(name))
        self.refresh()

    def shutdown(self) -> None:
        import ray

        if self._owns_workers:
            try:
                ray.get(self.controller.shutdown.remote(), timeout=30)
            except Exception as exc:  # noqa: BLE001 - best effort: the actors go with Ray anyway
                logger.warning("controller shutdown failed: %s", exc)
            ray.kill(self.controller, no_restart=True)
        self._owns_workers = False
        if self._owns_ray:
            ray.shutdown()
            self._owns_ray = False

    def __enter__(self) -> LocalCluster:
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m cluster.launch.local [--prefill N --decode M | --colocated K] PROMPT...``: start a
    local Ray cluster, generate every prompt through it (streaming the first one), shut down."""
    import argparse
    import sys

    ap = argparse.ArgumentParser(prog="python -m cluster.launch.local", description=main.__doc__)
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
