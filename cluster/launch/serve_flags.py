"""The flags of ``tandem serve`` and ``tandem gateway``, generated from ``ServeConfig``.

Each field of ``ServeConfig`` (cluster/launch/config_file.py) is one flag, ``--`` and the field's name
with ``-`` for ``_`` (dest: the field's name), and the field gives the rest:

- the default (a flag left out keeps it, unless a config file sets the key);
- what the flag accepts: an ``int`` or ``float`` within the field's bounds (``--port 0``:
  "must be >= 1"), a ``Literal``'s values as choices, a string, a ``bool`` as an on switch
  (``--reuse-port``; no setting defaults to on); ``X | None`` as ``X``, with None by default;
- the help: the field's description (``tandem``'s help formatter adds the default).

Where a flag differs from its field, ``FLAGS`` says how (a metavar, ``--engine``'s repeatable
``KEY=VALUE``, ``--log-level``'s case); ``NO_FLAG`` names the fields a config file alone sets;
``--detach``, ``--api-key`` and ``--config`` are flags with no field (how to run, a secret, the
file itself). A field of a kind with no flag (a mapping, a section) that is in neither table
stops the parser from being built, so a new setting cannot lose its flag unnoticed.

How the file and the command line combine (built-in defaults < the file < flags given):
``_read_config_first``.
"""

from __future__ import annotations

import argparse
import typing
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, Literal

from cluster.launch.config_file import ConfigError, ServeConfig, load_serve_config
from engine.settings import bound_problem


@dataclass(frozen=True)
class Flag:
    """Where a flag differs from its ``ServeConfig`` field."""

    metavar: str | None = None
    type: Callable[[str], Any] | None = None  # in place of the field's own conversion
    repeat: bool = False  # given once per value; collects a list (default: empty)


FLAGS: dict[str, Flag] = {
    # the mapping as KEY=VALUE strings, values as JSON (ServeConfig.as_defaults writes the same)
    "engine": Flag(metavar="KEY=VALUE", repeat=True),
    "log_level": Flag(type=str.lower),  # uvicorn lowers it: `--log-level WARNING` works too
    "kv_host": Flag(metavar="ADDR|node"),
    "predictor": Flag(metavar="NAME|PATH"),
    "gateways": Flag(metavar="N"),
    "api_key_file": Flag(metavar="PATH"),
    "admin_key_file": Flag(metavar="PATH"),
    "operator_token_file": Flag(metavar="PATH"),
    "operator_tls_cert": Flag(metavar="PEM"),
    "operator_tls_key": Flag(metavar="PEM"),
}

NO_FLAG = frozenset(
    {"prefill_engine", "decode_engine", "gpus", "migration", "rebalance", "autoscale"}
)

# The settings of one gateway process: `tandem gateway` takes these (in ServeConfig's order)
GATEWAY_SETTINGS = frozenset(
    {
        *("served_model_name", "host", "port", "reuse_port", "api_key_file", "admin_key_file"),
        *("log_level", "loop", "http", "max_concurrent", "max_body_bytes", "max_header_bytes"),
        *("body_timeout", "write_timeout", "shutdown_timeout"),
        *("tool_call_parser", "reasoning_parser"),
        *("policy", "local_prefill_tokens", "queue_policy", "predictor", "max_queue"),
        "slots_per_worker",
        *("queue_aging", "max_queue_wait", "reject_wait"),
        *("max_resumes", "stall_timeout", "hang_timeout"),
    }
)


def add_serve_args(p: argparse.ArgumentParser) -> None:
    """``tandem serve``'s flags: ``--detach``, one per ``ServeConfig`` field but ``NO_FLAG``,
    then ``--config`` (read before the rest)."""
    p.add_argument(
        "--detach",
        action="store_true",
        help="run in the background once it serves (log and pid under the tandem cache); "
        "`tandem stop` stops it",
    )
    _add_settings(p, (name for name in ServeConfig.model_fields if name not in NO_FLAG))
    p.add_argument(
        "--config",
        default=None,
        metavar="FILE",
        help="a YAML or JSON file of these settings (docs/config.md); flags given here win",
    )
    _read_config_first(p)


def add_gateway_args(p: argparse.ArgumentParser) -> None:
    """The flags of one gateway process (``tandem gateway``; ``tandem serve`` has them too)."""
    _add_settings(p, (name for name in ServeConfig.model_fields if name in GATEWAY_SETTINGS))


def _add_settings(p: argparse.ArgumentParser, names: Iterable[str]) -> None:
    for name in names:
        if name == "api_key_file":  # the flag with no key (keys on argv): beside its file
            _add_api_key(p)
        p.add_argument(flag_of(name), **argument(name))


def _add_api_key(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--api-key",
        action="append",
        default=[],
        help="accepted bearer key (repeatable; none: no auth). Visible to every local user in "
        "process listings: prefer TANDEM_API_KEY (one key per line) or --api-key-file",
    )


def flag_of(name: str) -> str:
    """The flag of the setting ``name``: ``max_queue`` -> ``--max-queue``."""
    return "--" + name.replace("_", "-")


def argument(name: str) -> dict[str, Any]:
    """``add_argument``'s keywords for the ``ServeConfig`` field ``name`` (its ``FLAGS`` entry
    over what the field gives). TypeError for a field no flag can set that is not in
    ``NO_FLAG`` or ``FLAGS``."""
    info = ServeConfig.model_fields[name]
    flag = FLAGS.get(name, Flag())
    kind = _without_none(info.annotation)
    default = info.get_default(call_default_factory=True)
    out: dict[str, Any] = {"dest": name, "default": default, "help": _help(info.description)}
    if flag.repeat:
        out.update(action="append", default=[])
    elif kind is bool:
        if default is not False:
            raise TypeError(f"ServeConfig.{name}: an on switch needs a default of False")
        out["action"] = "store_true"
    elif typing.get_origin(kind) is Literal:
        out["choices"] = list(typing.get_args(kind))
    elif kind in (int, float):
        out["type"] = _number(kind, _bounds(info.metadata))
    elif kind is not str:
        raise TypeError(
            f"ServeConfig.{name} ({kind}) has no flag of its own kind: say how in "
            "cluster/launch/serve_flags.py FLAGS, or that a file alone sets it (NO_FLAG)"
        )
    if flag.type is not None:
        out["type"] = flag.type
    if flag.metavar is not None:
        out["metavar"] = flag.metavar
    return out


def _without_none(ann: Any) -> Any:
    """``X | None`` -> ``X``; anything else as it is."""
    args = [a for a in typing.get_args(ann) if a is not type(None)]
    if typing.get_origin(ann) is not Literal and len(args) == 1 < len(typing.get_args(ann)):
        return args[0]
    return ann


def _help(description: str | None) -> str:
    return (description or "").replace("%", "%%")  # argparse formats help with %


def _bounds(metadata: list[Any]) -> dict[str, float]:
    """The field's bounds (pydantic's ``Ge(ge=1)``, ...) as ``{"ge": 1}``."""
    return {
        op: getattr(m, op) for m in metadata for op in ("ge", "gt", "le", "lt") if hasattr(m, op)
    }


def _number(kind: type, bounds: dict[str, float]) -> Callable[[str], Any]:
    """``kind(text)``, refused (with the bound) outside ``bounds``."""

    def parse(text: str) -> Any:
        value = kind(text)  # ValueError: argparse says "invalid int value: 'x'"
        if problem := bound_problem(value, bounds):
            raise argparse.ArgumentTypeError(f"{problem}, got {text}")
        return value

    parse.__name__ = kind.__name__
    return parse


def _read_config_first(p: argparse.ArgumentParser) -> None:
    """Make ``p`` read ``--config FILE`` before the rest: the file's settings become the
    parser's defaults, so a flag on the command line wins over the file wherever it stands.
    (argparse gives an action no way to tell a flag left at its default from one given with
    the default's value, so the arguments are parsed twice: once to find the file.)"""
    parse = p.parse_known_args

    def parse_known_args(args=None, namespace=None):
        first, _ = parse(args, None)
        if getattr(first, "config", None):
            try:
                config = load_serve_config(first.config)
            except ConfigError as exc:
                p.error(str(exc))
            p.set_defaults(**config.as_defaults())
        return parse(args, namespace)

    p.parse_known_args = parse_known_args
