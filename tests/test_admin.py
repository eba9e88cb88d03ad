"""The gateway's /admin routes (router/admin.py) and the live-migration series of /metrics.

A fake backend's ``admin`` records every call (operation, its arguments) and answers as the
controller would (or raises what it is told to). Clients are Starlette's TestClient: its default client address
is ``testclient`` (not loopback); ``client=("127.0.0.1", ...)`` makes one on this machine.
"""

from __future__ import annotations

import asyncio
import os
from types import SimpleNamespace
from typing import Any

import pytest
from fastapi.testclient import TestClient
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from engine.messages import MigrationResult
from router.backend import RouterStats
from router.gateway import create_app
from router.metrics import BackendCollector
from router.service import ClusterBackend

ADMIN, API = "adm-secret", "api-secret"
LOCAL = ("127.0.0.1", 40000)
RESULT = MigrationResult("r1", "migrated", "decode-0", "decode-1", stages=3, bytes=4096)
STATE = {"mode": "off", "high": 0.85, "low": 0.6, "interval_s": 5.0, "max_moves": 2, "rounds": 0}


class FakeBackend:
    model_name = "m"
    max_model_len = 64
    tokenizer = None

    def __init__(self) -> None:
        self.calls: list[tuple[str, dict[str, Any]]] = []
        self.fail: Exception | None = None
        self.admin: FakeAdmin | None = FakeAdmin(self)

    async def healthy(self) -> bool:
        return True

    async def worker_stats(self) -> list[dict[str, Any]]:
        return []

    def router_stats(self) -> RouterStats:
        return RouterStats()


class FakeAdmin:
    """``router.backend.Admin`` as the controller answers it, recording into its backend."""

    def __init__(self, backend: FakeBackend) -> None:
        self.backend = backend

    def _called(self, op: str, **kwargs: Any) -> None:
        self.backend.calls.append((op, kwargs))
        if self.backend.fail is not None:
            raise self.backend.fail

    async def migrate(self, request_id=None, *, to=None, from_=None, count=1) -> list[Any]:
        self._called("migrate", request_id=request_id, to=to, from_=from_, count=count)
        return [RESULT]

    async def drain(self, worker: str, deadline_s: float) -> dict[str, Any]:
        self._called("drain", worker=worker, deadline_s=deadline_s)
        return {"worker": worker, "idle": True, "requests": {"r1": "migrated"}}

    async def undrain(self, worker: str) -> None:
        self._called("undrain", worker=worker)

    async def rebalance(
        self, *, mode=None, high=None, low=None, interval_s=None, max_moves=None
    ) -> dict[str, Any]:
        given = {"mode": mode, "high": high, "low": low, "interval_s": interval_s}
        settings = {k: v for k, v in {**given, "max_moves": max_moves}.items() if v is not None}
        self._called("rebalance", **settings)
        return {**STATE, **settings}

    async def rebalance_once(self) -> list[dict[str, Any]]:
        self._called("rebalance_once")
        return [{"from": "decode-0", "to": "decode-1", "request_id": "r1"}]


class NoAdminBackend(FakeBackend):
    """A backend without admin operations (no controller behind it)."""

    def __init__(self) -> None:
        super().__init__()
        self.admin = None


@pytest.fixture()
def backend() -> FakeBackend:
    return FakeBackend()


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def error_of(r) -> dict[str, Any]:
    body = r.json()
    assert body["object"] == "error", body
    return body["error"]


# -- who may call them -------------------------------------------------------------------------


def test_admin_keys_are_required_and_api_keys_do_not_open_admin(backend) -> None:
    app = create_app(backend, api_keys=[API], admin_keys=["other", ADMIN])
    c = TestClient(app)  # not loopback: the keys decide
    for headers in ({}, bearer(API), bearer("wrong"), {"Authorization": f"Basic {ADMIN}"}):
        r = c.post("/admin/undrain", json={"worker": "decode-0"}, headers=headers)
        assert r.status_code == 401, headers
        assert error_of(r)["type"] == "authentication_error"
        assert r.headers["www-authenticate"] == "Bearer"
    assert backend.calls == []  # nobody unauthorized reached the controller
    r = c.post("/admin/undrain", json={"worker": "decode-0"}, headers=bearer(ADMIN))
    assert r.status_code == 200 and r.json() == {"worker": "decode-0"}
    assert c.get("/admin/rebalance", headers=bearer("other")).status_code == 200
    # the admin key is not an API key, and the API routes still want theirs
    assert c.get("/v1/models", headers=bearer(ADMIN)).status_code == 401
    assert c.get("/v1/models", headers=bearer(API)).status_code == 200
    text = c.get("/metrics", headers=bearer(API)).text
    assert 'tandem:request_rejected_total{model_name="m",reason="auth"} 5.0' in text


def test_admin_keys_alone_guard_admin_only(backend) -> None:
    c = TestClient(create_app(backend, admin_keys=[ADMIN]))
    assert c.post("/admin/rebalance/once").status_code == 401
    assert c.post("/admin/rebalance/once", headers=bearer(ADMIN)).status_code == 200
    assert c.get("/v1/models").status_code == 200  # no API keys: the API is open


def test_api_keys_guard_admin_without_admin_keys(backend) -> None:
    c = TestClient(create_app(backend, api_keys=[API]))
    r = c.post("/admin/undrain", json={"worker": "decode-0"})
    assert r.status_code == 401 and error_of(r)["code"] == "invalid_api_key"
    r = c.post("/admin/undrain", json={"worker": "decode-0"}, headers=bearer(API))
    assert r.status_code == 200
    assert backend.calls == [("undrain", {"worker": "decode-0"})]


def test_without_keys_admin_answers_loopback_only(backend) -> None:
    app = create_app(backend)
    for route in ("/admin/migrate", "/admin/drain", "/admin/undrain", "/admin/rebalance/once"):
        r = TestClient(app).post(route, json={"nonsense": 1})  # refused before the body is read
        assert r.status_code == 403, route
        err = error_of(r)
        assert err["type"] == "permission_error" and "--admin-key-file" in err["message"]
    assert TestClient(app).get("/admin/rebalance").status_code == 403
    assert TestClient(app, client=("10.1.2.3", 5000)).get("/admin/rebalance").status_code == 403
    assert backend.calls == []
    for host in ("127.0.0.1", "127.0.0.53", "::1", "::ffff:127.0.0.1"):
        assert TestClient(app, client=(host, 5000)).get("/admin/rebalance").status_code == 200
    assert TestClient(app).get("/v1/models").status_code == 200  # the API itself is open


# -- bodies and errors -------------------------------------------------------------------------


@pytest.mark.parametrize(
    "route, body, param",
    [
        ("/admin/migrate", {"request_id": "r1", "from_": "decode-0"}, "from_"),  # unknown field
        ("/admin/migrate", {"from": "decode-0", "count": "2"}, "count"),  # strict types
        ("/admin/migrate", {"from": "decode-0", "count": 0}, "count"),
        ("/admin/migrate", {"request_id": "r1", "from": "decode-0"}, "request_id"),
        ("/admin/migrate", {}, "request_id"),
        ("/admin/drain", {}, "worker"),
        ("/admin/drain", {"worker": "decode-0", "deadline_s": -1}, "deadline_s"),
        ("/admin/undrain", {"worker": 3}, "worker"),
        ("/admin/rebalance", {"mode": "on", "hi": 0.9}, "hi"),
        ("/admin/rebalance", {"max_moves": 1.5}, "max_moves"),
    ],
)
def test_bad_bodies_are_400(backend, route, body, param) -> None:
    r = TestClient(create_app(backend), client=LOCAL).post(route, json=body)
    assert r.status_code == 400, r.text
    err = error_of(r)
    assert err["type"] == "invalid_request_error" and err["param"] == param, err
    assert backend.calls == []


def test_malformed_json_is_400(backend) -> None:
    c = TestClient(create_app(backend), client=LOCAL)
    r = c.post("/admin/drain", content=b"{worker", headers={"Content-Type": "application/json"})
    assert r.status_code == 400 and error_of(r)["code"] == "invalid_json"
    r = c.post("/admin/drain", json=["decode-0"])
    assert r.status_code == 400
    assert backend.calls == []


class _Wrapped(Exception):
    """A remote error that only unwraps through ``as_instanceof_cause()``."""

    def __init__(self, cause: Exception) -> None:
        super().__init__("ray::Controller.drain()\nTraceback ...")
        self._cause = cause

    def as_instanceof_cause(self) -> Exception:
        return self._cause


def _ray_task_error(cause: Exception) -> Exception:
    exceptions = pytest.importorskip("ray.exceptions")
    return exceptions.RayTaskError("migrate", f"Traceback ...\nValueError: {cause}", cause)


@pytest.mark.parametrize(
    "wrap",
    [
        lambda e: e,
        lambda e: _ray_task_error(e),  # RayTaskError(...).cause
        lambda e: _ray_task_error(e).as_instanceof_cause(),  # what awaiting a ref raises
        _Wrapped,
    ],
    ids=["plain", "ray-cause", "ray-instanceof", "as_instanceof_cause"],
)
def test_controller_value_error_is_400(backend, wrap) -> None:
    backend.fail = wrap(ValueError("no decode worker named 'decode-9'"))
    c = TestClient(create_app(backend), client=LOCAL)
    r = c.post("/admin/drain", json={"worker": "decode-9"})
    assert r.status_code == 400
    assert error_of(r)["message"] == "no decode worker named 'decode-9'"


def test_other_controller_errors_are_500(backend) -> None:
    backend.fail = RuntimeError("the controller died\nmore detail")
    r = TestClient(create_app(backend), client=LOCAL).post("/admin/rebalance/once")
    assert r.status_code == 500
    err = error_of(r)
    assert err["type"] == "server_error" and "RuntimeError: the controller died" in err["message"]


def test_backend_without_admin_is_501() -> None:
    c = TestClient(create_app(NoAdminBackend()), client=LOCAL)
    r = c.post("/admin/migrate", json={"request_id": "r1"})
    assert r.status_code == 501 and error_of(r)["code"] == "not_implemented"
    assert c.get("/admin/rebalance").status_code == 501


# -- the happy paths pass arguments through ------------------------------------------------------


def test_migrate_passes_arguments_and_returns_results(backend) -> None:
    c = TestClient(create_app(backend), client=LOCAL)
    r = c.post("/admin/migrate", json={"request_id": "r1", "to": "decode-1"})
    assert r.status_code == 200
    assert r.json() == {
        "results": [
            {
                "request_id": "r1",
                "outcome": "migrated",
                "source": "decode-0",
                "dest": "decode-1",
                "reason": "",
                "stages": 3,
                "tokens": 0,
                "bytes": 4096,
                "pause_s": 0.0,
                "seconds": 0.0,
                "copy_s": 0.0,
            }
        ]
    }
    assert c.post("/admin/migrate", json={"from": "decode-0", "count": 2}).status_code == 200
    assert backend.calls == [
        ("migrate", {"request_id": "r1", "to": "decode-1", "from_": None, "count": 1}),
        ("migrate", {"request_id": None, "to": None, "from_": "decode-0", "count": 2}),
    ]


def test_drain_undrain_and_rebalance(backend) -> None:
    c = TestClient(create_app(backend), client=LOCAL)
    r = c.post("/admin/drain", json={"worker": "decode-0", "deadline_s": 5})
    assert r.json() == {"worker": "decode-0", "idle": True, "requests": {"r1": "migrated"}}
    assert c.post("/admin/drain", json={"worker": "decode-1"}).status_code == 200
    assert c.post("/admin/undrain", json={"worker": "decode-0"}).json() == {"worker": "decode-0"}
    assert c.get("/admin/rebalance").json() == STATE
    r = c.post("/admin/rebalance", json={"mode": "dry-run", "high": 0.9, "max_moves": 4})
    assert r.json() == {**STATE, "mode": "dry-run", "high": 0.9, "max_moves": 4}
    assert c.post("/admin/rebalance", json={"low": None}).json() == STATE  # null: unchanged
    assert c.post("/admin/rebalance").status_code == 200  # no body: nothing changes
    r = c.post("/admin/rebalance/once")
    assert r.json() == {"actions": [{"from": "decode-0", "to": "decode-1", "request_id": "r1"}]}
    assert backend.calls == [
        ("drain", {"worker": "decode-0", "deadline_s": 5.0}),
        ("drain", {"worker": "decode-1", "deadline_s": 60.0}),
        ("undrain", {"worker": "decode-0"}),
        ("rebalance", {}),
        ("rebalance", {"mode": "dry-run", "high": 0.9, "max_moves": 4}),
        ("rebalance", {}),
        ("rebalance", {}),
        ("rebalance_once", {}),
    ]


def test_cluster_backend_admin_calls_the_controller() -> None:
    seen = []

    class Method:
        def __init__(self, name: str) -> None:
            self.name = name

        def remote(self, **kwargs: Any):
            seen.append((self.name, kwargs))
            future = asyncio.get_running_loop().create_future()
            future.set_result(f"{self.name} done")
            return future

    controller = SimpleNamespace(
        drain=Method("drain"), rebalance=Method("rebalance"), shutdown=Method("shutdown")
    )
    fake = SimpleNamespace(members=SimpleNamespace(controller=controller))

    async def main() -> None:
        admin = ClusterBackend.admin.fget(fake)
        assert await admin.drain("decode-0", deadline_s=5.0) == "drain done"
        assert await admin.rebalance(mode="on", low=None) == "rebalance done"  # None: unchanged
        with pytest.raises(AttributeError):  # only the operator's calls, by name in code
            admin.shutdown  # noqa: B018
        fake.members.controller = None
        assert ClusterBackend.admin.fget(fake) is None

    asyncio.run(main())
    assert seen == [
        ("drain", {"worker": "decode-0", "deadline_s": 5.0}),
        ("rebalance", {"mode": "on"}),
    ]


# -- metrics -------------------------------------------------------------------------------------


def scrape(workers: list[dict[str, Any]], router: Any = None) -> dict[tuple, float]:
    """Every sample of one scrape: (name, sorted labels) -> value."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(BackendCollector(workers, router, "m"))
    text = generate_latest(registry).decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def sample(name: str, **labels: str) -> tuple:
    return name, tuple(sorted({"model_name": "m", **labels}.items()))


def test_migration_metrics() -> None:
    stats = {
        "name": "decode-0",
        "running": 2,
        "projected_blocks": 40,
        "migrations": {
            "out": {"migrated": 3, "aborted": 1},
            "in": {"admitted": 2, "failed": 1},
            "reasons": {"drain": 2, "preemption": 1},
            "bytes": 8192,
            "blocks": 12,
            "stages": 7,
            "pause_buckets": [(0.01, 2), (0.05, 1), (0.1, 0), (float("inf"), 1)],
            "pause_sum": 0.5,
        },
    }
    got = scrape([stats], RouterStats(migrations=3))
    w = {"worker": "decode-0"}
    downtime = "tandem:migration_downtime_seconds"
    expected = {
        sample("tandem:request_migrations_total"): 3,
        sample("tandem:migrations_total", **w, direction="out", outcome="migrated"): 3,
        sample("tandem:migrations_total", **w, direction="out", outcome="aborted"): 1,
        sample("tandem:migrations_total", **w, direction="in", outcome="admitted"): 2,
        sample("tandem:migrations_total", **w, direction="in", outcome="failed"): 1,
        sample("tandem:migrations_by_reason_total", **w, reason="drain"): 2,
        sample("tandem:migrations_by_reason_total", **w, reason="preemption"): 1,
        sample("tandem:migration_preemptions_avoided_total", **w): 1,
        sample("tandem:migration_kv_bytes_total", **w): 8192,
        sample("tandem:migration_kv_blocks_total", **w): 12,
        sample("tandem:migration_stages_total", **w): 7,
        sample("tandem:kv_projected_blocks", **w): 40,
        # cumulative: each bucket counts everything at or below its bound; +Inf is the total
        sample(f"{downtime}_bucket", **w, le="0.01"): 2,
        sample(f"{downtime}_bucket", **w, le="0.05"): 3,
        sample(f"{downtime}_bucket", **w, le="0.1"): 3,
        sample(f"{downtime}_bucket", **w, le="+Inf"): 4,
        sample(f"{downtime}_count", **w): 4,
        sample(f"{downtime}_sum", **w): 0.5,
    }
    assert {k: got.get(k) for k in expected} == expected
    buckets = [k for k in got if k[0] == f"{downtime}_bucket"]
    assert len(buckets) == 4  # no bucket twice (the inf bound is +Inf, once)


def test_old_stats_add_no_migration_series() -> None:
    old = {"name": "decode-0", "running": 1, "total_blocks": 10, "in_use_blocks": 5}
    partial = {"name": "decode-1", "migrations": {"out": {"migrated": 1}}}  # no bytes, no pauses
    router = SimpleNamespace(**{**RouterStats().__dict__})
    del router.migrations  # a router from before live migration
    got = scrape([old, partial], router)
    migration = {k: v for k, v in got.items() if "migration" in k[0] or "projected" in k[0]}
    key = sample("tandem:migrations_total", worker="decode-1", direction="out", outcome="migrated")
    assert migration == {key: 1.0}
    assert got[sample("tandem:num_requests_running", worker="decode-0")] == 1.0


# -- tandem serve: --admin-key-file / TANDEM_ADMIN_KEY ----------------------------------------------


def test_admin_keys_come_from_the_environment_and_a_0600_file(tmp_path, monkeypatch) -> None:
    from cluster.cli import build_parser
    from cluster.launch.serve import _admin_keys, _child_argv, _secret_env

    def serve_args(*argv: str):
        return build_parser().parse_args(["serve", *argv])

    monkeypatch.delenv("TANDEM_API_KEY", raising=False)
    monkeypatch.delenv("TANDEM_REDIS_URL", raising=False)
    monkeypatch.delenv("TANDEM_ADMIN_KEY", raising=False)
    assert _admin_keys(serve_args()) == []
    path = tmp_path / "admin-keys"
    path.write_text("a1\n\na2\n")
    path.chmod(0o644)
    with pytest.raises(ValueError, match=f"chmod 600 {path}"):
        _admin_keys(serve_args("--admin-key-file", str(path)))
    path.chmod(0o600)
    monkeypatch.setenv("TANDEM_ADMIN_KEY", "a3")
    args = serve_args("--detach", "--admin-key-file", str(path), "--port", "9002")
    assert _admin_keys(args) == ["a3", "a1", "a2"]
    assert "TANDEM_ADMIN_KEY" not in os.environ  # read once; no child inherits it
    argv = _child_argv(args)  # the detached server gets them in its environment, not argv
    assert "--admin-key-file" not in argv and str(path) not in argv, argv
    assert _secret_env(args) == {"TANDEM_ADMIN_KEY": "a3\na1\na2"}


def test_grammar_metrics() -> None:
    """Structured outputs' per-worker series from stats()["grammar"]; a worker without it
    adds none."""
    grammar = {
        "compile_buckets": [(0.001, 3), (0.01, 1), (float("inf"), 0)],
        "compile_sum": 0.012,
        "mask_buckets": [(0.0001, 5), (0.001, 2), (float("inf"), 1)],
        "mask_sum": 0.02,
        "errors": 2,
    }
    got = scrape([{"name": "decode-0", "grammar": grammar}, {"name": "prefill-0"}])
    w = {"worker": "decode-0"}
    assert got[sample("tandem:grammar_compile_seconds_count", **w)] == 4
    assert got[sample("tandem:grammar_compile_seconds_bucket", **w, le="0.001")] == 3
    assert got[sample("tandem:grammar_compile_seconds_sum", **w)] == 0.012
    assert got[sample("tandem:grammar_mask_seconds_bucket", **w, le="0.001")] == 7
    assert got[sample("tandem:grammar_mask_seconds_count", **w)] == 8
    assert got[sample("tandem:grammar_errors_total", **w)] == 2
    assert not [k for k in got if k[0].startswith("tandem:grammar") and "prefill-0" in str(k)]
