"""The operator CLI without a cluster: where it connects, with which token, and its exit code
when nothing answers there (the calls themselves: tests/test_operator.py)."""

from __future__ import annotations

import json
import os
import socket

import pytest

pytest.importorskip("grpc")


@pytest.fixture
def run_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("TANDEM_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("TANDEM_OPERATOR_TOKEN", raising=False)
    monkeypatch.delenv("TANDEM_OPERATOR_ADDRESS", raising=False)
    path = tmp_path / "run"
    path.mkdir()
    return path


def write(run_dir, port: int, pid: int, **fields) -> None:
    path = run_dir / f"operator-{port}.json"
    path.write_text(json.dumps({"address": f"127.0.0.1:{port + 1}", "pid": pid, **fields}))
    path.chmod(0o600)


def args(*argv: str):
    from cluster.cli import build_parser

    return build_parser().parse_args(["status", *argv])


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_the_one_running_serve_is_found(run_dir):
    from cluster.cli.operator_client import find_target

    write(run_dir, 8000, os.getpid(), token="t-8000")
    write(run_dir, 8100, 2**22 + 7, token="t-8100")  # its server is gone: ignored
    target = find_target(args())
    assert (target.address, target.token, target.tls_ca) == ("127.0.0.1:8001", "t-8000", None)


def test_several_running_serves_need_serve_port(run_dir, tmp_path):
    from cluster.cli.operator_client import OperatorError, find_target

    token_file = tmp_path / "token"
    token_file.write_text("from-the-file\n")
    token_file.chmod(0o600)
    write(run_dir, 8000, os.getpid(), token="t-8000")
    write(run_dir, 8200, os.getpid(), token_file=str(token_file))
    with pytest.raises(OperatorError, match="--serve-port") as err:
        find_target(args())
    assert err.value.code == 2
    assert find_target(args("--serve-port", "8200")).token == "from-the-file"


def test_flags_and_environment_win_over_the_file(run_dir, tmp_path, monkeypatch):
    from cluster.cli.operator_client import find_target

    write(run_dir, 8000, os.getpid(), token="t-8000", tls_ca="/x/cert.pem")
    monkeypatch.setenv("TANDEM_OPERATOR_TOKEN", "from-env")
    assert find_target(args()).token == "from-env"
    monkeypatch.delenv("TANDEM_OPERATOR_TOKEN")
    other = find_target(args("--address", "10.0.0.9:50051", "--token-file", _secret(tmp_path)))
    assert (other.address, other.token, other.tls_ca) == ("10.0.0.9:50051", "s3cret", None)
    same = find_target(args("--address", "127.0.0.1:8001"))  # the file's server: its token
    assert (same.token, same.tls_ca) == ("t-8000", "/x/cert.pem")


def _secret(tmp_path) -> str:
    path = tmp_path / "secret"
    path.write_text("s3cret\n")
    path.chmod(0o600)
    return str(path)


def test_a_token_file_others_can_read_is_refused(run_dir, tmp_path, capsys):
    from cluster.cli import main

    path = tmp_path / "loose"
    path.write_text("tok\n")
    path.chmod(0o644)
    assert main(["status", "--address", "127.0.0.1:1", "--token-file", str(path)]) == 2
    assert f"chmod 600 {path}" in capsys.readouterr().err


def test_exit_codes_when_nothing_answers(run_dir, capsys, monkeypatch):
    from cluster.cli import main

    assert main(["status"]) == 3  # no address, no connection file
    assert "no tandem operator found" in capsys.readouterr().err
    monkeypatch.setenv("TANDEM_OPERATOR_TOKEN", "tok")
    port = closed_port()
    code = main(["drain", "decode-0", "--address", f"127.0.0.1:{port}", "--timeout", "5"])
    assert code == 3
    assert f"no tandem operator at 127.0.0.1:{port}: is `tandem serve` running?" in (
        capsys.readouterr().err
    )
