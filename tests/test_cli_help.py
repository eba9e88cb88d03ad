"""The ``tandem`` command line as a user meets it: ``--version``, and every flag of every
command with help text and its default shown."""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
from importlib.metadata import version
from pathlib import Path

import pytest

from cluster.cli import build_parser

ROOT = Path(__file__).resolve().parents[1]


def commands(parser: argparse.ArgumentParser, path: str = "tandem"):
    """(command path, its parser) for ``tandem`` and every subcommand under it."""
    yield path, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from commands(sub, f"{path} {name}")


ALL = list(commands(build_parser()))


def test_version_is_the_installed_distributions() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "cluster.cli", "--version"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == f"tandem {version('tandem')}"


@pytest.mark.parametrize("path, parser", ALL, ids=[p for p, _ in ALL])
def test_every_flag_has_help_and_shows_its_default(path, parser) -> None:
    text = parser.format_help()
    flat = re.sub(r"\s+", " ", text)
    for action in parser._actions:
        if not action.option_strings or isinstance(
            action, (argparse._HelpAction, argparse._VersionAction)
        ):
            continue
        flag = action.option_strings[-1]
        assert action.help and action.help.strip(), f"{path} {flag} has no help text"
        default = action.default
        if default in (None, False, []):
            continue
        assert f"default: {default}" in flat or "default:" in (action.help or ""), (
            f"{path} {flag}: its default {default!r} is not shown"
        )


def test_commands_have_help_in_the_overview() -> None:
    overview = build_parser().format_help()
    for path, _ in ALL[1:]:
        name = path.split()[1]
        assert re.search(rf"^\s+{name}\s+\S", overview, re.M), f"{name} has no help line"


def test_policy_has_a_flag_for_every_setting_the_api_takes() -> None:
    """`tandem policy`'s flags and SetPolicy's fields stay one set (a field added to the proto
    without a flag, or a flag the client would drop, fails here)."""
    from proto import operator_pb2 as pb

    (policy,) = [p for path, p in ALL if path == "tandem policy"]
    dests = {a.dest for a in policy._actions if a.option_strings}
    top = {f.name for f in pb.SetPolicyRequest.DESCRIPTOR.fields}
    top -= {"request_id", "autoscale_pools", "autoscale_enabled"}  # --pool ROLE, --autoscale
    pool = {f.name for f in pb.PoolPolicyUpdate.DESCRIPTOR.fields}
    assert top | pool | {"pool", "autoscale"} <= dests
