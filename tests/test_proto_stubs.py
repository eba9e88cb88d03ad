"""The checked-in operator stubs are what ``proto/generate.py`` makes from ``operator.proto``.

An edit of the .proto without ``python proto/generate.py`` (or stubs edited by hand) fails
here, in CI. The generator is grpcio-tools, pinned in the ``test`` extra: another version
writes other bytes.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

pytest.importorskip("grpc_tools")

PROTO = Path(__file__).resolve().parent.parent / "proto"


def _load_generator():
    spec = importlib.util.spec_from_file_location("proto_generate", PROTO / "generate.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_checked_in_stubs_match_the_proto(tmp_path):
    gen = _load_generator()
    paths = gen.generate(tmp_path)
    assert [p.name for p in paths] == list(gen.OUTPUTS)
    for path in paths:
        checked_in = PROTO / path.name
        assert checked_in.exists(), f"{checked_in} is missing: run `python proto/generate.py`"
        assert path.read_bytes() == checked_in.read_bytes(), (
            f"{checked_in.name} differs from what proto/generate.py makes of operator.proto: "
            "run `python proto/generate.py` and commit the result"
        )


def test_the_service_stub_imports_as_part_of_the_package():
    from proto import operator_pb2, operator_pb2_grpc

    assert operator_pb2_grpc.operator__pb2 is operator_pb2
    names = {m.name for m in operator_pb2.DESCRIPTOR.services_by_name["ClusterOperator"].methods}
    assert names == {
        "Status",
        "Scale",
        "Drain",
        "Undrain",
        "SwitchRole",
        "Migrate",
        "Rebalance",
        "SetPolicy",
        "Watch",
    }
