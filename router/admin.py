"""The gateway's operator routes: live migration, drain and rebalance, run by the controller.

    POST /admin/migrate          {"request_id": ID} or {"from": W, "count": N}; "to"?: W
                                 -> {"results": [MigrationResult as JSON, ...]}
    POST /admin/drain            {"worker": W, "deadline_s"?: 60} -> the drain report
    POST /admin/undrain          {"worker": W} -> {"worker": W}
    GET  /admin/rebalance        -> the rebalancer's settings and what it has done
    POST /admin/rebalance        {"mode"?, "high"?, "low"?, "interval_s"?, "max_moves"?} -> same
    POST /admin/rebalance/once   -> {"actions": [...]} (one round now; dry-run: planned only)

One call through them::

    1. who       admin keys given: ``Authorization: Bearer <admin key>`` (hmac, every key),
                 else 401 (an API key does not open them); API keys only: the gateway's auth
                 middleware already asked for one; no keys at all: clients on loopback only,
                 else 403 (configure --admin-key-file)
    2. body      read under the gateway's limits (413, 408), validated, unknown fields
                 refused: 400
    3. backend   ``await backend.admin.drain(...)`` (``router.backend.Admin``: one typed method
                 per operation): the router's handle on the controller. A backend whose
                 ``admin`` is None or absent: 501; the controller's ValueError (a bad worker
                 name, a bad setting; Ray wraps it): 400; anything else: 500

The router never imports ``cluster/``: the controller's methods are reached through the backend.
"""

from __future__ import annotations

import contextlib
import ipaddress
import logging
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from fastapi import FastAPI, Request
from fastapi.encoders import jsonable_encoder
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator
from starlette.responses import JSONResponse

from router import protocol
from router.auth import bearer_matches
from router.backend import Admin
from router.protocol import APIError

logger = logging.getLogger("tandem.gateway")

PREFIX = "/admin"


def is_admin_path(path: str) -> bool:
    return path == PREFIX or path.startswith(PREFIX + "/")


# ------------------------------------------------------------------------------------- bodies


class _AdminBody(BaseModel):
    """Strict JSON types; an unknown field is a 400 (a typo must not be ignored here)."""

    model_config = ConfigDict(strict=True, extra="forbid")

    @model_validator(mode="wrap")
    @classmethod
    def _no_python_names(cls, data: Any, handler: Any) -> Any:
        """``from_`` is unknown too: pydantic would drop a field's own name silently when the
        field has an alias (``from``), not refuse it as an extra."""
        if isinstance(data, dict):
            shadowed = {n for n, f in cls.model_fields.items() if f.alias not in (None, n)}
            errors = [
                {"type": "extra_forbidden", "loc": (k,), "input": v}
                for k, v in data.items()
                if k in shadowed
            ]
            if errors:
                raise ValidationError.from_exception_data(cls.__name__, errors)  # type: ignore
        return handler(data)


class MigrateBody(_AdminBody):
    request_id: str | None = Field(None, description="the running request to move")
    from_: str | None = Field(None, alias="from", description="move `count` of this worker's")
    to: str | None = Field(None, description="the destination (default: least loaded)")
    count: int = Field(1, ge=1, description="with `from`: how many requests to move")


class DrainBody(_AdminBody):
    worker: str
    deadline_s: float = Field(60.0, gt=0, description="seconds to move its requests away")


class UndrainBody(_AdminBody):
    worker: str


class RebalanceBody(_AdminBody):
    """Settings to change; a field left out (or null) keeps its value."""

    mode: str | None = Field(None, description="off | on | dry-run")
    high: float | None = Field(None, description="KV use above which a worker sheds requests")
    low: float | None = Field(None, description="KV use below which a worker takes them")
    interval_s: float | None = Field(None, description="seconds between rounds")
    max_moves: int | None = Field(None, description="migrations per round, at most")


# ------------------------------------------------------------------------------------- routes


def install(
    app: FastAPI,
    backend: Any,
    *,
    admin_keys: Sequence[str],
    api_keys: bool,
    read_body: Callable[[Request], Awaitable[bytes]],
) -> None:
    """Add the /admin routes to ``app``. ``api_keys``: the gateway's auth middleware asks every
    request for an API key (it lets /admin through to these routes when ``admin_keys`` are
    given). ``read_body``: the gateway's body reader (its size and time limits)."""
    routes = _AdminRoutes(backend, admin_keys, api_keys, read_body)
    app.post(f"{PREFIX}/migrate")(routes.migrate)
    app.post(f"{PREFIX}/drain")(routes.drain)
    app.post(f"{PREFIX}/undrain")(routes.undrain)
    app.get(f"{PREFIX}/rebalance")(routes.rebalance_state)
    app.post(f"{PREFIX}/rebalance")(routes.rebalance)
    app.post(f"{PREFIX}/rebalance/once")(routes.rebalance_once)


class _AdminRoutes:
    def __init__(
        self,
        backend: Any,
        admin_keys: Sequence[str],
        api_keys: bool,
        read_body: Callable[[Request], Awaitable[bytes]],
    ) -> None:
        self.backend = backend
        self.keys = [k.encode() for k in admin_keys]
        self.api_keys = api_keys
        self.read_body = read_body

    async def migrate(self, request: Request) -> JSONResponse:
        body = await self._body(request, MigrateBody)
        if (body.request_id is None) == (body.from_ is None):
            raise protocol.bad_request(
                "send exactly one of 'request_id' (one request) and 'from' (a worker's)",
                param="request_id",
            )
        migrate = self._admin().migrate(
            body.request_id, to=body.to, from_=body.from_, count=body.count
        )
        return _json({"results": list(await self._run("migrate", migrate))})

    async def drain(self, request: Request) -> JSONResponse:
        body = await self._body(request, DrainBody)
        drain = self._admin().drain(body.worker, deadline_s=body.deadline_s)
        return _json(await self._run("drain", drain))

    async def undrain(self, request: Request) -> JSONResponse:
        body = await self._body(request, UndrainBody)
        await self._run("undrain", self._admin().undrain(body.worker))
        return _json({"worker": body.worker})

    async def rebalance_state(self, request: Request) -> JSONResponse:
        self._authorize(request)
        return _json(await self._run("rebalance", self._admin().rebalance()))

    async def rebalance(self, request: Request) -> JSONResponse:
        body = await self._body(request, RebalanceBody)
        rebalance = self._admin().rebalance(
            mode=body.mode,
            high=body.high,
            low=body.low,
            interval_s=body.interval_s,
            max_moves=body.max_moves,
        )
        return _json(await self._run("rebalance", rebalance))

    async def rebalance_once(self, request: Request) -> JSONResponse:
        self._authorize(request)
        actions = await self._run("rebalance_once", self._admin().rebalance_once())
        return _json({"actions": list(actions)})

    # -- plumbing ----------------------------------------------------------------------------

    async def _body(self, request: Request, model: type[_AdminBody]) -> Any:
        """The caller authorized first (no body is read for a stranger), then its body."""
        self._authorize(request)
        raw = await self.read_body(request)
        return protocol.parse_body(model, raw if raw.strip() else b"{}")

    def _authorize(self, request: Request) -> None:
        if self.keys:
            header = request.headers.get("authorization", "").encode("latin-1")
            if not bearer_matches(header, self.keys):
                raise APIError(
                    401,
                    "missing or invalid admin key: send 'Authorization: Bearer <admin key>'",
                    type="authentication_error",
                    code="invalid_api_key",
                    headers={"WWW-Authenticate": "Bearer"},
                    reason="auth",
                )
        elif not self.api_keys and not _is_loopback(request.client and request.client.host):
            raise APIError(
                403,
                "the admin routes answer only clients on this machine when the gateway has no "
                "keys: configure --admin-key-file (or TANDEM_ADMIN_KEY) to call them from "
                "elsewhere",
                type="permission_error",
                code="admin_forbidden",
                reason="auth",
            )

    def _admin(self) -> Admin:
        """The backend's operator calls, or 501 when it has none (no controller behind it)."""
        admin = getattr(self.backend, "admin", None)
        if admin is None:
            raise _not_implemented()
        return admin

    async def _run(self, op: str, call: Awaitable[Any]) -> Any:
        """``call``'s result; the controller's ValueError is a 400, anything else a 500."""
        try:
            return await call
        except Exception as exc:
            bad = _value_error(exc)
            if bad is not None:
                raise protocol.bad_request(bad) from None
            logger.exception("admin %s failed", op)
            raise APIError(
                500,
                f"the admin operation {op!r} failed: {_first_line(exc)}",
                type="server_error",
                code="internal_error",
                reason=None,
            ) from None


def _json(content: Any) -> JSONResponse:
    """Dataclasses (MigrationResult), tuples and sets as plain JSON."""
    return JSONResponse(jsonable_encoder(content))


def _not_implemented() -> APIError:
    return APIError(
        501,
        "this gateway's backend has no admin operations (no cluster controller behind it)",
        type="not_implemented_error",
        code="not_implemented",
        reason=None,
    )


def _is_loopback(host: str | None) -> bool:
    """127.0.0.0/8, ::1 and IPv4-mapped loopback; anything else (no address at all, a test
    client's made-up name) is not this machine."""
    if not host:
        return False
    try:
        addr = ipaddress.ip_address(host.split("%", 1)[0])
    except ValueError:
        return False
    mapped = getattr(addr, "ipv4_mapped", None)
    return addr.is_loopback or (mapped is not None and mapped.is_loopback)


def _value_error(exc: BaseException) -> str | None:
    """The message of a ValueError raised in the controller: ``exc`` itself, or the cause Ray
    wraps it in (a RayTaskError's ``cause``, or its ``as_instanceof_cause()``); else None."""
    cause = getattr(exc, "cause", None)
    if isinstance(cause, ValueError):
        return str(cause)
    if isinstance(exc, ValueError):
        return _last_line(exc)
    unwrap = getattr(exc, "as_instanceof_cause", None)
    if callable(unwrap):
        with contextlib.suppress(Exception):
            inner = unwrap()
            if isinstance(inner, ValueError):
                return _last_line(inner)
    return None


def _last_line(exc: BaseException) -> str:
    """A wrapped remote error prints its traceback; its last line is the error itself."""
    lines = [line for line in str(exc).splitlines() if line.strip()]
    return lines[-1].strip() if lines else type(exc).__name__


def _first_line(exc: BaseException) -> str:
    lines = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {lines[0]}" if lines else type(exc).__name__
