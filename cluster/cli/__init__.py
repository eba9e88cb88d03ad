"""The CLI room: the ``tandem`` commands (``main.py``) and the operator API's client
(``operator_client.py``). Runs in the user's shell; starts ``tandem serve`` through the launch
room and talks to a running cluster over gRPC only. Imports launch (never the other way); never
control, whose process it reaches through the operator API."""

from cluster.cli.main import build_parser, main

__all__ = ["build_parser", "main"]
