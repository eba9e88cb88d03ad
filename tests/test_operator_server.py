"""The operator API's server over TLS, without workers: a real Controller (no worker started)
serving ClusterOperator on 127.0.0.1 from its own event loop, called by the tandem CLI.
(The calls on a cluster with workers: tests/test_operator.py.)"""

from __future__ import annotations

import asyncio
import datetime
import ipaddress
import json
import threading

import pytest

pytest.importorskip("grpc")
x509 = pytest.importorskip("cryptography.x509")

TOKEN = "tls-test-token"


def self_signed(tmp_path) -> tuple[str, str]:
    """A certificate for 127.0.0.1 signed by its own key (PEM files: cert, key)."""
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "tandem operator test")])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(days=1))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(
            x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
            critical=False,
        )
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(key, hashes.SHA256())
    )
    cert_path, key_path = tmp_path / "cert.pem", tmp_path / "key.pem"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    key_path.chmod(0o600)
    return str(cert_path), str(key_path)


@pytest.fixture
def server(tmp_path, monkeypatch):
    """A worker-less controller's operator API over TLS, on an event loop of its own."""
    from cluster.control.controller import Controller, WorkerSpec

    monkeypatch.setenv("TANDEM_OPERATOR_TOKEN", TOKEN)
    monkeypatch.setenv("TANDEM_CACHE_DIR", str(tmp_path))  # no connection file of a real serve
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()

    def run(coro):
        return asyncio.run_coroutine_threadsafe(coro, loop).result(30)

    async def make():
        return Controller(WorkerSpec(model_dir=str(tmp_path), cluster_id="tls0"))

    controller = run(make())
    cert, key = self_signed(tmp_path)
    audit = tmp_path / "audit.jsonl"
    address = run(
        controller.start_operator(token=TOKEN, tls_cert=cert, tls_key=key, audit_log=str(audit))
    )
    yield {"address": address, "cert": cert, "audit": audit, "run": run, "controller": controller}
    run(controller.stop_operator())
    loop.call_soon_threadsafe(loop.stop)
    thread.join(10)


def test_tls_calls_need_the_servers_certificate(server, capsys):
    from cluster.cli import main

    where = ["--address", server["address"], "--timeout", "10"]
    assert main(["status", "-o", "json", "--tls-ca", server["cert"], *where]) == 0
    status = json.loads(capsys.readouterr().out)
    assert status["cluster_id"] == "tls0" and status["workers"] == []
    assert main(["policy", "--rebalance-mode", "dry-run", "--tls-ca", server["cert"], *where]) == 0
    assert "mode=dry-run" in capsys.readouterr().out
    assert main(["status", *where]) == 3  # plain text against TLS: no operator there
    assert "no tandem operator at" in capsys.readouterr().err
    (line,) = [json.loads(x) for x in server["audit"].read_text().splitlines()]
    assert line["method"] == "SetPolicy" and line["outcome"] == "OK"
    assert line["request"]["rebalance_mode"] == "dry-run"


def test_a_second_operator_server_is_refused(server):
    with pytest.raises(ValueError, match="already listens"):
        server["run"](server["controller"].start_operator(token=TOKEN))


def test_autoscaler_policy_through_the_cli(server, capsys):
    from cluster.cli import main

    where = ["--address", server["address"], "--timeout", "10", "--tls-ca", server["cert"]]
    assert main(["policy", "--max-replicas", "3", *where]) == 2  # a pool field needs --pool
    assert "needs --pool" in capsys.readouterr().err
    argv = ["policy", "--autoscale", "on", "--pool", "decode", "--max-replicas", "3"]
    assert main([*argv, "--slo-s", "0", "-o", "json", *where]) == 0
    autoscale = json.loads(capsys.readouterr().out)["autoscale"]
    assert autoscale["enabled"] is True
    assert autoscale["decode"]["max_replicas"] == 3 and autoscale["decode"]["slo_s"] == 0
    assert autoscale["prefill"]["max_replicas"] == 4  # other pools keep theirs
    # min above max: refused as a bad argument, and nothing changes
    assert main(["policy", "--pool", "decode", "--min-replicas", "5", *where]) == 2
    assert "min" in capsys.readouterr().err
    assert main(["policy", *where]) == 0
    text = capsys.readouterr().out
    assert "autoscale: enabled=True" in text and "decode: min_replicas=1  max_replicas=3" in text
    assert main(["status", *where]) == 0
    assert "autoscaler on" in capsys.readouterr().out.splitlines()[0]


def test_an_autoscale_event_as_a_line():
    from cluster.cli.operator_client import event_line
    from cluster.control.operator import event_pb

    event = {
        "seq": 7,
        "time": 0.0,
        "type": "autoscale",
        "role": "decode",
        "direction": "out",
        "from_replicas": 1,
        "to_replicas": 2,
        "signal": "slots",
        "reason": "slots 1.75 > 0.85 for 10 s",
        "inputs": {"pressures": {"slots": 1.75}},
    }
    msg = event_pb(event)
    assert json.loads(msg.autoscale.inputs_json) == {"pressures": {"slots": 1.75}}
    assert event_line(msg).endswith("autoscaler decode out 1 -> 2: slots 1.75 > 0.85 for 10 s")
