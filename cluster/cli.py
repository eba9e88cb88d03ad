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


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="tandem", description="Disaggregated, multi-replica LLM serving."
    )
    subparsers = parser.add_subparsers(title="commands", metavar="COMMAND")
    _add_model(subparsers)
    _add_generate(subparsers)
    _add_serve(subparsers)
    _add_gateway(subparsers)
    _add_stop(subparsers)
    return parser


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
    gen.add_argument("--max-tokens", type=int, default=32)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--chat", action="store_true", help="wrap each prompt in the chat template")
    gen.add_argument("--device", default="cpu")
    gen.add_argument("--dtype", default="float32")
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
    from cluster.serve import add_serve_args

    serve = subparsers.add_parser(
        "serve",
        help="start Redis, Ray workers and the OpenAI gateway on this machine",
        description="Serve a model over the OpenAI API: local Ray, prefill/decode (or colocated) "
        "workers, a Redis prefix index and the gateway; Ctrl-C stops everything.",
    )
    add_serve_args(serve)
    serve.set_defaults(handler=_cmd_serve)


def _cmd_serve(args: argparse.Namespace) -> int:
    from cluster import serve

    if args.detach:
        return serve.run_detached(args)
    return serve.run_serve(args)


def _add_stop(subparsers: argparse._SubParsersAction) -> None:
    stop = subparsers.add_parser("stop", help="stop a `tandem serve --detach`")
    stop.add_argument("--port", type=int, default=8000)
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
    stop.set_defaults(handler=lambda args: __import__("cluster.serve").serve.run_stop(args))


def _add_gateway(subparsers: argparse._SubParsersAction) -> None:
    from cluster.serve import add_gateway_args

    gw = subparsers.add_parser(
        "gateway",
        help="another OpenAI gateway over the workers a `tandem serve` started",
        description="Attach to a running tandem cluster (its Ray address and Redis URL) and "
        "serve the OpenAI API from this process too; gateways share the prefix index.",
    )
    gw.add_argument("--ray-address", default="auto", help="the Ray cluster `tandem serve` printed")
    gw.add_argument("--redis-url", default=None, help="the prefix index the workers publish to")
    gw.add_argument("--namespace", default="tandem")
    gw.add_argument("--cluster-id", default=None, help="which cluster (when several run)")
    gw.add_argument("--model", default="smollm2", help="the model id clients send")
    add_gateway_args(gw)
    gw.set_defaults(handler=lambda args: __import__("cluster.serve").serve.run_gateway(args))


if __name__ == "__main__":
    sys.exit(main())
