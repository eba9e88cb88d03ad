"""`tandem serve` / `tandem gateway` flags generated from ServeConfig (cluster/launch/serve_flags.py):
the flags users know stay, every field has its flag (or is file-only on purpose), and each flag
is its field: default, choices, bounds and help."""

from __future__ import annotations

import argparse
import re
import typing

import pytest

pytest.importorskip("pydantic")

from pydantic import Field, ValidationError, create_model  # noqa: E402

from cluster.launch import serve_flags  # noqa: E402
from cluster.launch.config_file import ServeConfig  # noqa: E402
from cluster.launch.serve_flags import (  # noqa: E402
    FLAGS,
    GATEWAY_SETTINGS,
    NO_FLAG,
    add_gateway_args,
    add_serve_args,
    flag_of,
)

NO_FIELD = {"detach", "api_key", "config"}  # flags with no setting: how to run, a secret, the file

# The flags as they were written by hand before they were generated (2026-11): their spelling
# is what scripts, deploy/ and the docs use.
SERVE_FLAGS = {
    *("--detach", "--model", "--device", "--dtype", "--prefill", "--decode", "--colocated"),
    *("--redis-url", "--engine", "--ray-address", "--role-resources", "--kv-host"),
    *("--role-switching", "--operator-host", "--operator-port", "--operator-token-file"),
    *("--operator-tls-cert", "--operator-tls-key", "--no-operator", "--gateways", "--config"),
    "--tensor-parallel-size",  # added with tensor parallelism (2026-12)
    "--quantization",  # added with FP8 weights (vLLM's spelling)
    # per-role TP sizes, with KV between layouts (SGLang's --prefill-tp / --decode-tp idea)
    *("--prefill-tensor-parallel-size", "--decode-tensor-parallel-size"),
}
GATEWAY_FLAGS = {
    *("--host", "--port", "--api-key", "--api-key-file", "--admin-key-file", "--policy"),
    "--local-prefill-tokens",
    *("--max-concurrent", "--queue-policy", "--predictor", "--max-queue", "--slots-per-worker"),
    *("--queue-aging", "--max-queue-wait", "--reject-wait", "--max-body-bytes", "--max-resumes"),
    *("--stall-timeout", "--hang-timeout", "--shutdown-timeout", "--body-timeout"),
    *("--write-timeout", "--max-header-bytes", "--served-model-name", "--log-level", "--loop"),
    *("--http", "--reuse-port"),
    *("--tool-call-parser", "--reasoning-parser"),  # (vLLM's spelling)
}


def parser(add=add_serve_args) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="tandem serve")
    add(p)
    return p


def actions(p: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    return {a.dest: a for a in p._actions if a.option_strings and a.dest != "help"}


def test_the_flags_users_know_are_all_there():
    serve = {a.option_strings[-1] for a in actions(parser()).values()}
    gateway = {a.option_strings[-1] for a in actions(parser(add_gateway_args)).values()}
    assert (serve, gateway) == (SERVE_FLAGS | GATEWAY_FLAGS, GATEWAY_FLAGS)
    assert all(len(a.option_strings) == 1 for a in actions(parser()).values())  # no aliases


def test_every_field_has_a_flag_or_is_file_only():
    fields = set(ServeConfig.model_fields)
    assert set(actions(parser())) == (fields - NO_FLAG) | NO_FIELD
    assert NO_FLAG.issubset(fields), "a stale entry in NO_FLAG"
    assert set(FLAGS).issubset(fields - NO_FLAG), "a stale entry in FLAGS"
    assert GATEWAY_SETTINGS.issubset(fields - NO_FLAG)
    assert set(actions(parser(add_gateway_args))) == GATEWAY_SETTINGS | {"api_key"}
    assert NO_FIELD.isdisjoint(fields)


def test_each_flag_is_its_field():
    serve, gateway = actions(parser()), actions(parser(add_gateway_args))
    for name, info in ServeConfig.model_fields.items():
        if name in NO_FLAG:
            continue
        action = serve[name]
        assert action.option_strings == [flag_of(name)], name
        assert action.help == info.description, name
        default = info.get_default(call_default_factory=True)
        assert action.default == ([] if FLAGS.get(name, None) and FLAGS[name].repeat else default)
        kind = serve_flags._without_none(info.annotation)
        if typing.get_origin(kind) is typing.Literal:
            assert action.choices == list(typing.get_args(kind)), name
        if kind is bool:
            assert isinstance(action, argparse._StoreTrueAction), name
        if name in gateway:  # one flag, one meaning, in both commands
            theirs = gateway[name]
            assert (theirs.help, theirs.default, theirs.choices) == (
                action.help,
                action.default,
                action.choices,
            ), name


def test_a_new_setting_gets_its_flag_or_stops_the_parser(monkeypatch):
    extended = create_model(
        "Extended",
        __base__=ServeConfig,
        new_knob=(int, Field(3, ge=1, description="A knob added later.")),
    )
    monkeypatch.setattr(serve_flags, "ServeConfig", extended)
    args = parser().parse_args(["--new-knob", "5"])
    assert args.new_knob == 5 and parser().parse_args([]).new_knob == 3
    assert actions(parser())["new_knob"].help == "A knob added later."
    with pytest.raises(SystemExit):
        parser().parse_args(["--new-knob", "0"])
    mapping = create_model(
        "Mapping",
        __base__=ServeConfig,
        new_map=(dict, Field(default_factory=dict, description="A mapping added later.")),
    )
    monkeypatch.setattr(serve_flags, "ServeConfig", mapping)
    with pytest.raises(TypeError, match=r"new_map .*FLAGS.*NO_FLAG"):
        parser()


@pytest.mark.parametrize("name", ["port", "queue_policy", "hang_timeout", "engine", "reuse_port"])
def test_the_help_of_a_flag_is_its_fields_description(name):
    from cluster.cli import build_parser

    description = ServeConfig.model_fields[name].description
    assert actions(parser())[name].help == description
    (serve,) = [
        sub
        for a in build_parser()._actions
        if isinstance(a, argparse._SubParsersAction)
        for n, sub in a.choices.items()
        if n == "serve"
    ]
    shown = re.sub(r"\s+", " ", serve.format_help())
    assert f"{flag_of(name)}" in shown and re.sub(r"\s+", " ", description) in shown


def _past(bound: str, limit: float) -> float:
    return {"ge": limit - 1, "gt": limit, "le": limit + 1, "lt": limit}[bound]


BOUNDED = [
    (name, op, limit)
    for name, info in ServeConfig.model_fields.items()
    if name not in NO_FLAG
    for op, limit in serve_flags._bounds(info.metadata).items()
]


@pytest.mark.parametrize("name, op, limit", BOUNDED, ids=[f"{n}-{o}" for n, o, _ in BOUNDED])
def test_the_flag_refuses_what_the_file_refuses(name, op, limit, capsys):
    value = _past(op, limit)
    text = str(int(value)) if value == int(value) else str(value)
    with pytest.raises(ValidationError):
        ServeConfig(**{name: value})
    with pytest.raises(SystemExit):
        parser().parse_args([flag_of(name), text])
    sign = {"ge": ">=", "gt": ">", "le": "<=", "lt": "<"}[op]
    assert (
        f"argument {flag_of(name)}: must be {sign} {limit:g}, got {text}" in capsys.readouterr().err
    )


def test_values_as_before():
    p = parser()
    assert p.parse_args(["--log-level", "WARNING"]).log_level == "warning"  # uvicorn's case
    for argv in (["--policy", "nearest"], ["--dtype", "fp16"], ["--port", "x"]):
        with pytest.raises(SystemExit):
            p.parse_args(argv)
    args = p.parse_args(
        ["--port=9001", "--queue-aging", "1.5", "--engine", "a=1", "--engine", "b=2", "--prefill"]
        + ["2", "--decode", "1", "--reuse-port", "--no-operator", "--dtype", "bfloat16"]
    )
    assert (args.port, args.queue_aging, args.engine) == (9001, 1.5, ["a=1", "b=2"])
    assert (args.prefill, args.decode, args.reuse_port, args.no_operator) == (2, 1, True, True)
    assert args.api_key == [] and args.config is None and not args.detach


def test_gateway_lifts_its_open_files_limit():
    """A gateway holds a descriptor per client connection: it lifts a low soft limit to the hard
    one (run in a child, whose limits are its own)."""
    import subprocess
    import sys

    code = (
        "import resource\n"
        "from cluster.launch.serve import raise_open_files_limit\n"
        "hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]\n"
        "resource.setrlimit(resource.RLIMIT_NOFILE, (64, hard))\n"
        "got = raise_open_files_limit()\n"
        "assert resource.getrlimit(resource.RLIMIT_NOFILE)[0] == got, got\n"
        "print(got > 64 or hard == 64)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "True", out.stderr
