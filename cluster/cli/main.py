"""The ``tandem`` command line.

Each subcommand is a ``_add_<name>(subparsers)`` function that registers its parser and sets
``handler`` to a ``_cmd_<name>(args) -> int`` function; ``main`` dispatches on it. Heavy imports
(torch, transformers, the engine) happen inside the handlers so ``tandem --help`` stays instant.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parser.parse_args(argv)
    if not hasattr(args, "handler"):
        # `tandem` or `tandem model` alone: show the relevant help.
        getattr(args, "help_parser", parser).print_help(sys.stderr)
        return 2
    try:
        return args.handler(args)
    except KeyboardInterrupt:
        return 130
    except ValueError as exc:
        print(f"tandem: error: {exc}", file=sys.stderr)
        return 2


def version() -> str:
    """The installed distribution's version (the source tree's when run uninstalled)."""
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as dist_version

    try:
        return dist_version("tandem")
    except PackageNotFoundError:
        return "0.1.0+source"


class HelpFormatter(argparse.HelpFormatter):
    """Every option's help ends with its default, unless it says it already or has none to
    show (None, an off switch, an empty list)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        default = action.default
        if (
            action.option_strings
            and default not in (None, False, [], argparse.SUPPRESS)
            and "default" not in text
            and not isinstance(action, argparse._VersionAction)
        ):
            text = f"{text} (default: %(default)s)" if text else "(default: %(default)s)"
        return text


def _with_formatter(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """``HelpFormatter`` for ``parser`` and every subcommand's parser under it."""
    parser.formatter_class = HelpFormatter
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                _with_formatter(sub)
    return parser


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="tandem", description="Disaggregated, multi-replica LLM serving."
    )
    parser.add_argument("--version", action="version", version=f"tandem {version()}")
    subparsers = parser.add_subparsers(title="commands", metavar="COMMAND")
    _add_model(subparsers)
    _add_generate(subparsers)
    _add_serve(subparsers)
    _add_gateway(subparsers)
    _add_stop(subparsers)
    _add_status(subparsers)
    _add_scale(subparsers)
    _add_drain(subparsers)
    _add_undrain(subparsers)
    _add_switch(subparsers)
    _add_migrate(subparsers)
    _add_rebalance(subparsers)
    _add_policy(subparsers)
    _add_events(subparsers)
    return _with_formatter(parser)


# ----------------------------------------------------------------------------- tandem model


def _add_model(subparsers: argparse._SubParsersAction) -> None:
    model = subparsers.add_parser("model", help="fetch and list models")
    model.set_defaults(help_parser=model)
    actions = model.add_subparsers(title="model commands", metavar="ACTION")

    pull = actions.add_parser(
        "pull", help="convert a known model into the local cache (once) and print its folder"
    )
    pull.add_argument("alias", nargs="?", default="smollm2", help="model alias (default: smollm2)")
    pull.add_argument("--force", action="store_true", help="convert again even if cached")
    pull.set_defaults(handler=_cmd_model_pull)

    listing = actions.add_parser("list", help="known aliases and whether each is converted")
    listing.set_defaults(handler=_cmd_model_list)


def _cmd_model_pull(args: argparse.Namespace) -> int:
    from engine.model_hub import pull_model

    print(pull_model(args.alias, progress=True, force=args.force))
    return 0


def _cmd_model_list(args: argparse.Namespace) -> int:
    from engine.model_hub import MODELS, is_converted, model_dir

    for spec in MODELS.values():
        state = f"converted  {model_dir(spec.name)}" if is_converted(spec.name) else "not pulled"
        aliases = ", ".join(spec.names)
        print(f"{spec.name:<10} {spec.display_name:<24} {state}  (aliases: {aliases})")
    return 0


# ----------------------------------------------------------------------------- tandem generate


def _add_generate(subparsers: argparse._SubParsersAction) -> None:
    gen = subparsers.add_parser(
        "generate",
        help="offline generation for one or more prompts",
        description="Each PROMPT argument is one prompt; quote prompts that contain spaces.",
    )
    gen.add_argument("prompts", nargs="+", metavar="PROMPT")
    gen.add_argument("--model", default="smollm2", help="alias or local HF folder")
    gen.add_argument("--max-tokens", type=int, default=32, help="tokens to generate per prompt")
    gen.add_argument(
        "--temperature", type=float, default=0.0, help="sampling temperature (0: greedy)"
    )
    gen.add_argument("--chat", action="store_true", help="wrap each prompt in the chat template")
    gen.add_argument("--device", default="cpu", help="cpu or cuda")
    gen.add_argument("--dtype", default="float32", help="float32, bfloat16 or float16")
    gen.set_defaults(handler=_cmd_generate)


def _cmd_generate(args: argparse.Namespace) -> int:
    from engine import LLM, SamplingParams
    from engine.model_hub import resolve_model

    start = time.monotonic()
    folder = resolve_model(args.model)
    llm = LLM(model=str(folder), dtype=args.dtype, device=args.device)
    loaded = time.monotonic()
    params = SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens)
    if args.chat:
        outs = llm.chat([[{"role": "user", "content": p}] for p in args.prompts], params)
    else:
        outs = llm.generate(list(args.prompts), params)
    done = time.monotonic()
    for prompt, out in zip(args.prompts, outs, strict=True):
        print(f"=== {prompt}\n{out.outputs[0].text}")
    print(
        f"time to first output: {done - start:.2f}s "
        f"(load {loaded - start:.2f}s, generate {done - loaded:.2f}s)",
        file=sys.stderr,
    )
    return 0


# ----------------------------------------------------------------------------- tandem serve


def _add_serve(subparsers: argparse._SubParsersAction) -> None:
    from cluster.launch.serve_flags import add_serve_args

    serve = subparsers.add_parser(
        "serve",
        help="start Redis, Ray workers and the OpenAI gateway on this machine",
        description="Serve a model over the OpenAI API: local Ray, prefill/decode (or colocated) "
        "workers, a Redis prefix index and the gateway; Ctrl-C stops everything.",
    )
    add_serve_args(serve)
    serve.set_defaults(handler=_cmd_serve)


def _cmd_serve(args: argparse.Namespace) -> int:
    from cluster.launch import serve

    if args.detach:
        return serve.run_detached(args)
    return serve.run_serve(args)


def _serve_command(name: str):
    """A handler that runs ``cluster.launch.serve.<name>(args)``, importing it only then."""

    def handler(args: argparse.Namespace) -> int:
        from cluster.launch import serve

        return getattr(serve, name)(args)

    return handler


def _add_stop(subparsers: argparse._SubParsersAction) -> None:
    stop = subparsers.add_parser("stop", help="stop a `tandem serve --detach`")
    stop.add_argument("--port", type=int, default=8000, help="the --port it was started with")
    stop.add_argument(
        "--timeout",
        type=float,
        default=60.0,
        help="seconds to wait after SIGTERM (the server drains) before stopping it at once",
    )
    stop.add_argument(
        "--kill-after",
        type=float,
        default=30.0,
        help="seconds to wait after that before SIGKILL of its process group",
    )
    stop.set_defaults(handler=_serve_command("run_stop"))


def _add_gateway(subparsers: argparse._SubParsersAction) -> None:
    from cluster.launch.serve_flags import add_gateway_args

    gw = subparsers.add_parser(
        "gateway",
        help="another OpenAI gateway over the workers a `tandem serve` started",
        description="Attach to a running tandem cluster (its Ray address and Redis URL) and "
        "serve the OpenAI API from this process too; gateways share the prefix index.",
    )
    gw.add_argument("--ray-address", default="auto", help="the Ray cluster `tandem serve` printed")
    gw.add_argument("--redis-url", default=None, help="the prefix index the workers publish to")
    gw.add_argument("--namespace", default="tandem", help="the Ray namespace of the cluster")
    gw.add_argument("--cluster-id", default=None, help="which cluster (when several run)")
    gw.add_argument("--model", default="smollm2", help="the model id clients send")
    add_gateway_args(gw)
    gw.set_defaults(handler=_serve_command("run_gateway"))


# ----------------------------------------------------------------------------- operator commands
# status, scale, drain, undrain, migrate, rebalance, policy, events: calls on the controller's gRPC
# operator API (cluster/control/operator.py); cluster/cli/operator_client.py finds it, calls it and prints
# the answers (its docstring has the exit codes). grpc is imported there, inside the handlers.

OPERATOR_EPILOG = (
    "The operator API's address and token come from the file `tandem serve` writes "
    "($TANDEM_CACHE_DIR/run/operator-PORT.json), or --address and --token-file / "
    "TANDEM_OPERATOR_TOKEN. Exit codes: 0 done, 1 done in part, 2 bad argument, 3 no operator "
    "there, 4 token refused, 5 refused as things are (--force)."
)


def _operator_parser(subparsers: argparse._SubParsersAction, name: str, **kwargs):
    p = subparsers.add_parser(name, epilog=OPERATOR_EPILOG, **kwargs)
    c = p.add_argument_group("connection")
    c.add_argument("--address", default=None, metavar="HOST:PORT", help="the operator API")
    c.add_argument(
        "--serve-port",
        type=int,
        default=None,
        metavar="PORT",
        help="the `tandem serve` (by its gateway --port) whose connection file to read, when "
        "several run here",
    )
    c.add_argument(
        "--token-file", default=None, metavar="PATH", help="the bearer token (file mode 0600)"
    )
    c.add_argument(
        "--token",
        default=None,
        help="the bearer token (visible in process listings: prefer TANDEM_OPERATOR_TOKEN)",
    )
    c.add_argument(
        "--tls-ca", default=None, metavar="PEM", help="verify the server's TLS certificate"
    )
    c.add_argument(
        "--timeout", type=float, default=30.0, help="seconds a call may take (default: 30)"
    )
    return p


def _operator_handler(command: str):
    """``args -> exit code`` running ``cluster.cli.operator_client.<command>`` (imported then)."""

    def handler(args: argparse.Namespace) -> int:
        from cluster.cli import operator_client

        return operator_client.run(args, getattr(operator_client, command))

    return handler


def _output_arg(p: argparse.ArgumentParser, choices=("text", "json")) -> None:
    p.add_argument(
        "-o", "--output", default=choices[0], choices=list(choices), help="how to print it"
    )


def _add_status(subparsers: argparse._SubParsersAction) -> None:
    p = _operator_parser(
        subparsers,
        "status",
        help="every worker: role, node, state, load, KV use, TTFT / ITL, migrations",
    )
    _output_arg(p, ("table", "json"))
    p.set_defaults(handler=_operator_handler("status"))


def _add_scale(subparsers: argparse._SubParsersAction) -> None:
    p = _operator_parser(
        subparsers,
        "scale",
        help="add or remove workers of one role (removal drains first)",
        description="Start new workers (on nodes with the role's resource) until ROLE has N, "
        "or drain and stop the least loaded ones. Refused (exit 5) unless --force: below 1 "
        "worker of a role the cluster was started with, below the running load, a new prefill "
        "or decode pool without the other (no router would send it a request), and a role the "
        "cluster was not started with.",
    )
    p.add_argument(
        "--role", required=True, choices=["prefill", "decode", "colocated"], help="the pool"
    )
    p.add_argument(
        "--replicas", required=True, type=int, metavar="N", help="workers the pool should have"
    )
    p.add_argument("--wait", action="store_true", help="return once it is done")
    p.add_argument(
        "--force",
        action="store_true",
        help="go below 1 worker or the running load; start a pool the topology cannot route "
        "yet or of a role the cluster was not started with; stop a worker its drain could not "
        "empty",
    )
    p.add_argument(
        "--drain-deadline",
        type=float,
        default=60.0,
        metavar="S",
        help="seconds to empty each removed worker (default: 60)",
    )
    p.add_argument(
        "--engine",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="the added workers' own engine setting (repeatable; values as JSON), e.g. "
        "tensor_parallel_size=2 for a decode pool of TP 1 and TP 2 workers: size and capacity "
        "only (tensor_parallel_size, max_num_seqs, max_num_batched_tokens, num_kv_blocks, "
        "kv_cache_memory_gb, gpu_memory_utilization, cuda_graph_max_batch, "
        "enable_prefix_caching)",
    )
    _output_arg(p)
    p.set_defaults(handler=_operator_handler("scale"))


def _add_drain(subparsers: argparse._SubParsersAction) -> None:
    p = _operator_parser(
        subparsers,
        "drain",
        help="place nothing new on a worker and move its requests away",
        description="Exit code 1 when a request was left on the worker (still running at the "
        "deadline, or its move failed); the worker stays DRAINING until `tandem undrain`.",
    )
    p.add_argument("worker", metavar="WORKER")
    p.add_argument("--deadline", type=float, default=60.0, metavar="S", help="seconds to empty it")
    _output_arg(p)
    p.set_defaults(handler=_operator_handler("drain"))


def _add_undrain(subparsers: argparse._SubParsersAction) -> None:
    p = _operator_parser(subparsers, "undrain", help="place requests on a drained worker again")
    p.add_argument("worker", metavar="WORKER")
    _output_arg(p)
    p.set_defaults(handler=_operator_handler("undrain"))


def _add_switch(subparsers: argparse._SubParsersAction) -> None:
    p = _operator_parser(
        subparsers,
        "switch",
        help="make a flex worker (--role-switching) play another role, weights kept",
        description="Drains the worker in its old role (decode requests migrate away), then "
        "switches it; refused for the last worker of its role (exit 5) or when the drain "
        "leaves requests.",
    )
    p.add_argument("worker", metavar="WORKER")
    p.add_argument("--role", required=True, choices=["prefill", "decode"], help="its new role")
    p.add_argument("--deadline", type=float, default=60.0, metavar="S", help="seconds to drain it")
    _output_arg(p)
    p.set_defaults(handler=_operator_handler("switch"))


def _add_migrate(subparsers: argparse._SubParsersAction) -> None:
    p = _operator_parser(
        subparsers,
        "migrate",
        help="live-migrate running requests between decode workers",
        description="Exit code 1 unless every request picked was migrated.",
    )
    what = p.add_mutually_exclusive_group(required=True)
    what.add_argument("--request", default=None, metavar="ID", help="one running request")
    what.add_argument(
        "--from", dest="from_worker", default=None, metavar="WORKER", help="a worker's requests"
    )
    p.add_argument("--count", type=int, default=1, help="with --from: how many")
    p.add_argument(
        "--to", default=None, metavar="WORKER", help="the destination (default: the least loaded)"
    )
    _output_arg(p)
    p.set_defaults(handler=_operator_handler("migrate"))


def _add_rebalance(subparsers: argparse._SubParsersAction) -> None:
    p = _operator_parser(
        subparsers,
        "rebalance",
        help="one rebalance round now (moves from decode workers above the high KV mark)",
    )
    p.add_argument("--dry-run", action="store_true", help="show the moves, make none")
    _output_arg(p)
    p.set_defaults(handler=_operator_handler("rebalance"))


# `tandem policy`'s numeric settings: (flag, type, metavar, help). Each is None unless given
# (SetPolicy changes only what is given).
_POLICY_NUMBERS = (
    (
        "--rebalance-high",
        float,
        "USE",
        "KV use (0-1) above which a decode worker's requests move away",
    ),
    ("--rebalance-low", float, "USE", "KV use (0-1) below which a decode worker may receive them"),
    ("--rebalance-interval-s", float, "S", "seconds between the rebalancer's rounds"),
    ("--rebalance-max-moves", int, "N", "moves per rebalance round"),
    ("--health-interval-s", float, "S", "seconds between the controller's health checks"),
    ("--health-timeout-s", float, "S", "seconds a health check may take before it is missed"),
    ("--health-suspect-after", int, "N", "missed checks in a row that make a worker suspect"),
    ("--health-hang-after-s", float, "S", "an engine step this long makes its worker suspect"),
    ("--health-dead-after-s", float, "S", "seconds suspect before a worker is killed"),
    ("--autoscale-interval-s", float, "S", "seconds between the autoscaler's looks"),
)
_POOL_NUMBERS = (
    ("--min-replicas", int, "N", "the pool never shrinks below"),
    ("--max-replicas", int, "N", "the pool never grows above"),
    ("--high", float, "P", "pressure that grows the pool"),
    ("--low", float, "P", "pressure (a worker fewer) under which it shrinks"),
    ("--up-after-s", float, "S", "seconds the pressure must stay over --high to grow"),
    ("--down-after-s", float, "S", "seconds it must stay under --low to shrink"),
    ("--cooldown-s", float, "S", "seconds after a scale before the next decision"),
    ("--step", int, "N", "workers per scale-out"),
    ("--slo-s", float, "S", "TTFT / ITL p90 target (0: none)"),
    ("--queue-tokens", float, "TOKENS", "prefill: queued prompt tokens per worker = pressure 1"),
)


def _add_policy(subparsers: argparse._SubParsersAction) -> None:
    p = _operator_parser(
        subparsers,
        "policy",
        help="show or change the controller's settings (rebalancer, health checks, autoscaler)",
        description="Without flags: the settings in force. Each flag changes one setting and "
        "leaves the others as they are.",
    )
    p.add_argument(
        "--rebalance-mode",
        default=None,
        choices=["off", "on", "dry-run"],
        help="the rebalancer's loop (dry-run: log the moves it would make)",
    )
    p.add_argument("--autoscale", default=None, choices=["on", "off"], help="the autoscaler")
    for flag, kind, metavar, text in _POLICY_NUMBERS:
        p.add_argument(flag, type=kind, default=None, metavar=metavar, help=text)
    p.add_argument(
        "--pool",
        default=None,
        choices=["prefill", "decode", "colocated"],
        help="the pool whose autoscaling the next flags change",
    )
    for flag, kind, metavar, text in _POOL_NUMBERS:
        p.add_argument(flag, type=kind, default=None, metavar=metavar, help=text)
    _output_arg(p)
    p.set_defaults(handler=_operator_handler("policy"))


def _add_events(subparsers: argparse._SubParsersAction) -> None:
    p = _operator_parser(
        subparsers,
        "events",
        help="follow the cluster's events (workers, scaling, migrations) until Ctrl-C",
    )
    p.add_argument(
        "--since",
        type=int,
        default=None,
        metavar="SEQ",
        help="first replay the kept events after this sequence number (0: all kept)",
    )
    p.add_argument("--limit", type=int, default=0, metavar="N", help="stop after N events")
    _output_arg(p)
    p.set_defaults(handler=_operator_handler("events"))


if __name__ == "__main__":
    sys.exit(main())
