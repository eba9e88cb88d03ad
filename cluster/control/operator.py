"""The gRPC operator API (proto/operator.proto), served from inside the controller actor.

``Controller.start_operator`` makes an ``OperatorServer`` on the actor's own event loop (the
controller is an async Ray actor): a call reaches the controller's methods directly, with no
Ray hop. One call::

    1. who      ``authorization: Bearer <token>`` in the metadata, compared with
                hmac.compare_digest; missing or wrong: UNAUTHENTICATED (no other work done)
    2. replay   a mutating call (Scale, Drain, Undrain, Migrate, Rebalance, SetPolicy) must
                carry a ``request_id``; one seen before (a bounded LRU of the last 4096) gets
                the answer it got then, and the action is not run again (a call still running
                is awaited); the same id with another request: INVALID_ARGUMENT
    3. action   the controller's method. It runs to its end even when the caller goes away
                (a retry with the same id then gets its answer). ValueError:
                INVALID_ARGUMENT; controller.Refused: FAILED_PRECONDITION; anything else:
                INTERNAL (logged; not remembered, so a retry runs it again)
    4. audit    one JSON line per mutating call, refused ones included: time, caller peer,
                method, request fields, outcome, seconds (a file of mode 0600)

``Watch`` streams the controller's event log (``Controller.events``: a long poll over a
bounded ring with sequence numbers) as ``Event`` messages.

Nothing here unpickles: requests and answers are protobuf. ``grpc`` is imported by this module
only (and by the CLI's handlers), so a machine without it still runs everything else.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import grpc
from google.protobuf import json_format

from cluster.control.operations import DRAIN_DEADLINE_S, Refused, not_moved
from cluster.control.spec import json_values
from engine.messages import MigrationResult, WorkerState, brief
from proto import operator_pb2 as pb
from proto import operator_pb2_grpc as pb_grpc
from router.auth import bearer_matches

logger = logging.getLogger(__name__)

REPLAYS_KEPT = 4096  # request ids whose answers are remembered
WATCH_POLL_S = 15.0  # Watch's long poll on the event log (a stream stays open across polls)

ROLE = {"prefill": pb.ROLE_PREFILL, "decode": pb.ROLE_DECODE, "colocated": pb.ROLE_COLOCATED}
ROLE_NAME = {v: k for k, v in ROLE.items()}
STATE = {
    WorkerState.STARTING: pb.WORKER_STATE_STARTING,
    WorkerState.ACTIVE: pb.WORKER_STATE_ACTIVE,
    WorkerState.SUSPECT: pb.WORKER_STATE_SUSPECT,
    WorkerState.DRAINING: pb.WORKER_STATE_DRAINING,
    WorkerState.DEAD: pb.WORKER_STATE_DEAD,
}
WORKER_EVENT = {
    "starting": pb.WorkerEvent.KIND_STARTING,
    "up": pb.WorkerEvent.KIND_UP,
    "suspect": pb.WorkerEvent.KIND_SUSPECT,
    "active": pb.WorkerEvent.KIND_ACTIVE,
    "draining": pb.WorkerEvent.KIND_DRAINING,
    "dead": pb.WorkerEvent.KIND_DEAD,
    "removed": pb.WorkerEvent.KIND_REMOVED,
    "switched": pb.WorkerEvent.KIND_SWITCHED,
    "switch_failed": pb.WorkerEvent.KIND_SWITCH_FAILED,
}
SCALE_PHASE = {
    "started": pb.ScaleEvent.PHASE_STARTED,
    "done": pb.ScaleEvent.PHASE_DONE,
    "refused": pb.ScaleEvent.PHASE_REFUSED,
}


@dataclass(frozen=True)
class _Outcome:
    """How a call ended: ``code`` OK with ``response``, or an error code with ``details``."""

    code: grpc.StatusCode
    response: Any = None
    details: str = ""


class OperatorServer:
    """The ClusterOperator service of one controller, on a ``grpc.aio`` server."""

    def __init__(self, controller: Any, token: str, audit_log: str | None = None) -> None:
        if not token:
            raise ValueError("the operator API needs a token (it never runs unauthenticated)")
        self.controller = controller
        self._token = token.encode()
        self._audit_path = audit_log
        self._audit = None
        self._server: grpc.aio.Server | None = None
        self._replays: OrderedDict[str, tuple[bytes, asyncio.Future]] = OrderedDict()
        self.address = ""

    async def start(
        self, host: str, port: int, tls_cert: str | None = None, tls_key: str | None = None
    ) -> str:
        """Listen on ``host``:``port`` (0: a free port); returns ``HOST:PORT`` as bound."""
        if (tls_cert is None) != (tls_key is None):
            raise ValueError("TLS needs both a certificate and its key (or neither)")
        # SO_REUSEPORT off: a second server on a taken port must fail, not share it
        server = grpc.aio.server(options=[("grpc.so_reuseport", 0)])
        pb_grpc.add_ClusterOperatorServicer_to_server(_Servicer(self), server)
        where = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        try:
            if tls_cert is not None:
                with open(tls_key, "rb") as k, open(tls_cert, "rb") as c:
                    creds = grpc.ssl_server_credentials([(k.read(), c.read())])
                bound = server.add_secure_port(where, creds)
            else:
                bound = server.add_insecure_port(where)
        except RuntimeError as exc:
            raise ValueError(f"the operator API cannot listen on {where}: {exc}") from None
        if not bound:
            raise ValueError(f"the operator API cannot listen on {where} (in use?)")
        if self._audit_path:
            fd = os.open(self._audit_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
            self._audit = os.fdopen(fd, "a", buffering=1)
        await server.start()
        self._server = server
        self.address = f"[{host}]:{bound}" if ":" in host else f"{host}:{bound}"
        logger.info("operator API on %s (TLS %s)", self.address, "on" if tls_cert else "off")
        return self.address

    async def stop(self, grace_s: float = 1.0) -> None:
        if self._server is not None:
            await self._server.stop(grace_s)
            self._server = None
        if self._audit is not None:
            self._audit.close()
            self._audit = None

    # -- the four steps of a call -----------------------------------------------------------

    def authorize(self, context: grpc.aio.ServicerContext) -> str | None:
        """None when the call carries the token; else why not (for UNAUTHENTICATED)."""
        header = b""
        for key, value in context.invocation_metadata() or ():
            if key == "authorization":
                header = value.encode("latin-1") if isinstance(value, str) else value
        if not header:
            return (
                "missing operator token: send 'authorization: Bearer <token>' (the tandem CLI "
                "reads it from the file `tandem serve` writes, --token-file or "
                "TANDEM_OPERATOR_TOKEN)"
            )
        if not bearer_matches(header, [self._token]):
            return "invalid operator token"
        return None

    async def mutate(
        self,
        context: grpc.aio.ServicerContext,
        method: str,
        request: Any,
        action: Callable[[], Awaitable[Any]],
    ) -> Any:
        """Steps 1-4 for a mutating call: its response, or the call aborted with its error."""
        t0 = time.monotonic()
        peer = context.peer()
        why = self.authorize(context)
        if why is not None:
            self._write_audit(peer, method, request, "UNAUTHENTICATED", why, t0)
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, why)
        rid = request.request_id
        if not rid:
            why = (
                "request_id is required on calls that change the cluster (any unique string, "
                "a UUID say: a retry with the same id gets the first answer)"
            )
            self._write_audit(peer, method, request, "INVALID_ARGUMENT", why, t0)
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, why)
        fingerprint = method.encode() + b"\0" + request.SerializeToString(deterministic=True)
        seen = self._replays.get(rid)
        if seen is not None:
            self._replays.move_to_end(rid)
            if seen[0] != fingerprint:
                why = f"request_id {rid!r} was used for another request: use a new id"
                self._write_audit(peer, method, request, "INVALID_ARGUMENT", why, t0)
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, why)
            outcome = await asyncio.shield(seen[1])
            self._write_audit(peer, method, request, outcome.code.name, outcome.details, t0, True)
        else:
            task = asyncio.ensure_future(self._run(action))
            self._remember(rid, fingerprint, task)
            outcome = await asyncio.shield(task)  # the caller may go: the action goes on
            if outcome.code == grpc.StatusCode.INTERNAL:
                self._replays.pop(rid, None)  # a fault, not an answer: a retry runs again
            self._write_audit(peer, method, request, outcome.code.name, outcome.details, t0)
        if outcome.code != grpc.StatusCode.OK:
            await context.abort(outcome.code, outcome.details)
        return outcome.response

    async def read(self, context: grpc.aio.ServicerContext, action) -> Any:
        """Step 1 and the action, for a call that changes nothing (no replay, no audit)."""
        why = self.authorize(context)
        if why is not None:
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, why)
        outcome = await self._run(action)
        if outcome.code != grpc.StatusCode.OK:
            await context.abort(outcome.code, outcome.details)
        return outcome.response

    async def _run(self, action: Callable[[], Awaitable[Any]]) -> _Outcome:
        try:
            return _Outcome(grpc.StatusCode.OK, await action())
        except Refused as exc:
            return _Outcome(grpc.StatusCode.FAILED_PRECONDITION, details=str(exc))
        except ValueError as exc:
            return _Outcome(grpc.StatusCode.INVALID_ARGUMENT, details=str(exc))
        except Exception as exc:  # noqa: BLE001 - the caller gets INTERNAL, the log the trace
            logger.exception("operator call failed")
            return _Outcome(grpc.StatusCode.INTERNAL, details=brief(exc))

    def _remember(self, rid: str, fingerprint: bytes, task: asyncio.Future) -> None:
        self._replays[rid] = (fingerprint, task)
        while len(self._replays) > REPLAYS_KEPT:
            self._replays.popitem(last=False)

    def _write_audit(
        self,
        peer: str,
        method: str,
        request: Any,
        outcome: str,
        details: str,
        t0: float,
        replayed: bool = False,
    ) -> None:
        if self._audit is None:
            return
        line = {
            "time": round(time.time(), 3),
            "peer": peer,
            "method": method,
            "request": json_format.MessageToDict(request, preserving_proto_field_name=True),
            "outcome": outcome,
            "details": details,
            "replayed": replayed,
            "seconds": round(time.monotonic() - t0, 3),
        }
        try:
            self._audit.write(json.dumps(line, sort_keys=True) + "\n")
        except OSError:
            logger.exception("the operator audit log %s cannot be written", self._audit_path)


class _Servicer(pb_grpc.ClusterOperatorServicer):
    """Each method: proto in, the controller's plain values, proto out."""

    def __init__(self, server: OperatorServer) -> None:
        self.server = server
        self.controller = server.controller

    async def Status(self, request, context):
        async def status():
            return status_pb(await self.controller.status())

        return await self.server.read(context, status)

    async def Scale(self, request, context):
        async def scale():
            if request.role not in ROLE_NAME:
                raise ValueError("role must be ROLE_PREFILL, ROLE_DECODE or ROLE_COLOCATED")
            result = await self.controller.scale(
                ROLE_NAME[request.role],
                request.replicas,
                wait=request.wait,
                force=request.force,
                drain_deadline_s=request.drain_deadline_s or DRAIN_DEADLINE_S,
                reason=f"operator at {context.peer()}",
                engine=json_values(request.engine) or None,
            )
            return pb.ScaleResponse(
                role=ROLE[result["role"]],
                previous_replicas=result["previous_replicas"],
                replicas=result["replicas"],
                added=result["added"],
                removed=result["removed"],
                failed=result["failed"],
                aborted_requests=result["aborted_requests"],
                migrated_requests=result["migrated_requests"],
                done=result["done"],
                message=result["message"],
                seconds=result["seconds"],
            )

        return await self.server.mutate(context, "Scale", request, scale)

    async def Drain(self, request, context):
        async def drain():
            report = await self.controller.drain(
                request.worker, request.deadline_s or DRAIN_DEADLINE_S
            )
            return pb.DrainResponse(
                worker=report["worker"],
                idle=report["idle"],
                requests=report["requests"],
                counts=report["counts"],
                not_moved=not_moved(report),
                seconds=report["seconds"],
                note=report["note"],
            )

        return await self.server.mutate(context, "Drain", request, drain)

    async def Undrain(self, request, context):
        async def undrain():
            state = await self.controller.undrain(request.worker)
            return pb.UndrainResponse(worker=request.worker, state=STATE[state])

        return await self.server.mutate(context, "Undrain", request, undrain)

    async def SwitchRole(self, request, context):
        async def switch():
            role = ROLE_NAME.get(request.role)
            if role not in ("prefill", "decode"):
                raise ValueError("role must be ROLE_PREFILL or ROLE_DECODE")
            result = await self.controller.switch_role(
                request.worker, role, request.deadline_s or DRAIN_DEADLINE_S
            )
            return pb.SwitchRoleResponse(
                worker=result["worker"],
                from_role=ROLE[result["from"]],
                role=ROLE[result["to"]],
                migrated=result["migrated"],
                aborted=result["aborted"],
                seconds=result["seconds"],
            )

        return await self.server.mutate(context, "SwitchRole", request, switch)

    async def Migrate(self, request, context):
        async def migrate():
            what = request.WhichOneof("what")
            if what is None:
                raise ValueError("set one of request (a running request) and from_worker")
            results = await self.controller.migrate(
                request.request if what == "request" else None,
                to=request.to or None,
                from_=request.from_worker if what == "from_worker" else None,
                count=request.count or 1,
            )
            return pb.MigrateResponse(results=[migration_pb(r) for r in results])

        return await self.server.mutate(context, "Migrate", request, migrate)

    async def Rebalance(self, request, context):
        async def rebalance():
            actions = await self.controller.rebalance_once(dry_run=request.dry_run)
            settings = self.controller.policy()["rebalance"]
            return pb.RebalanceResponse(
                actions=[
                    pb.RebalanceAction(
                        request=a["request_id"],
                        from_worker=a["from"],
                        to_worker=a["to"],
                        from_use=a["from_use"],
                        to_use=a["to_use"],
                        blocks=a["blocks"],
                        avoids_preemption=a["avoids_preemption"],
                        outcome=a.get("outcome", ""),
                    )
                    for a in actions
                ],
                policy=pb.RebalancePolicy(**settings),
            )

        return await self.server.mutate(context, "Rebalance", request, rebalance)

    async def SetPolicy(self, request, context):
        async def set_policy():
            changes: dict[str, dict[str, Any]] = {"rebalance": {}, "health": {}}
            for field, value in request.ListFields():
                group, _, name = field.name.partition("_")
                if group in changes:
                    changes[group][name] = value
            changes["autoscale"] = autoscale_changes(request)
            return pb.SetPolicyResponse(
                policy=policy_pb(await self.controller.set_policy(**changes))
            )

        return await self.server.mutate(context, "SetPolicy", request, set_policy)

    async def Watch(self, request, context) -> AsyncIterator[pb.Event]:
        why = self.server.authorize(context)
        if why is not None:
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, why)
        since = request.since if request.HasField("since") else None
        if since is None:
            since = (await self.controller.events(None))["last_seq"]
        while True:
            batch = await self.controller.events(since, WATCH_POLL_S)
            missed = batch["missed"]
            for event in batch["events"]:
                yield event_pb(event, missed)
                missed, since = 0, event["seq"]


# -- the controller's plain values as messages ------------------------------------------------


def _latency(q: dict[str, float] | None) -> dict[str, Any]:
    return {} if not q else {"p50_s": q["p50"], "p99_s": q["p99"], "samples": q["n"]}


def worker_pb(w: dict[str, Any]) -> pb.WorkerStatus:
    msg = pb.WorkerStatus(
        name=w["name"],
        role=ROLE.get(w["role"], pb.ROLE_UNSPECIFIED),
        state=STATE[WorkerState[w["state"].upper()]],
        node_id=w.get("node_id", ""),
        node_ip=w.get("node_ip", ""),
        pid=w.get("pid", 0),
        running=w.get("running", 0),
        waiting=w.get("waiting", 0),
        kv_blocks_total=w.get("kv_blocks_total", 0),
        kv_blocks_used=w.get("kv_blocks_used", 0),
        kv_use=w.get("kv_use", 0.0),
        kv_projected_use=w.get("kv_projected_use", 0.0),
        migrations_out=w.get("migrations_out", 0),
        migrations_in=w.get("migrations_in", 0),
        max_num_seqs=w.get("max_num_seqs", 0),
        error=w.get("error", ""),
    )
    for name in ("ttft", "itl"):
        if w.get(name):
            getattr(msg, name).CopyFrom(pb.Latency(**_latency(w[name])))
    for name in ("kv_host", "kv_disk"):
        if w.get(name):
            getattr(msg, name).CopyFrom(pb.KVTier(**w[name]))
    msg.ranks.extend(pb.Rank(**r) for r in w.get("ranks") or [])
    return msg


def _pool_policy_pb(pool: dict[str, Any]) -> pb.PoolPolicy:
    return pb.PoolPolicy(**{**pool, "slo_s": pool.get("slo_s") or 0.0})


def policy_pb(policy: dict[str, Any]) -> pb.Policy:
    autoscale = policy["autoscale"]
    return pb.Policy(
        rebalance=pb.RebalancePolicy(**policy["rebalance"]),
        health=pb.HealthPolicy(**policy["health"]),
        autoscale=pb.AutoscalePolicy(
            enabled=autoscale["enabled"],
            interval_s=autoscale["interval_s"],
            **{r: _pool_policy_pb(autoscale[r]) for r in ROLE},
        ),
    )


def autoscale_changes(request: pb.SetPolicyRequest) -> dict[str, Any]:
    """A SetPolicyRequest's autoscaler fields as ``Controller.set_policy(autoscale=...)``
    takes them (a pool's ``slo_s`` 0 means none)."""
    changes: dict[str, Any] = {}
    if request.HasField("autoscale_enabled"):
        changes["enabled"] = request.autoscale_enabled
    if request.HasField("autoscale_interval_s"):
        changes["interval_s"] = request.autoscale_interval_s
    for role, update in request.autoscale_pools.items():
        if role not in ROLE:
            raise ValueError(f"autoscale pool must be one of {sorted(ROLE)}, got {role!r}")
        fields = {f.name: v for f, v in update.ListFields()}
        if "slo_s" in fields:
            fields["slo_s"] = fields["slo_s"] or None
        changes[role] = fields
    return changes


def autoscale_status_pb(a: dict[str, Any]) -> pb.AutoscaleStatus:
    return pb.AutoscaleStatus(
        enabled=a["enabled"],
        latest={
            role: pb.PoolLook(
                replicas=look["replicas"],
                pressures=look["pressures"],
                signal=look["signal"],
                pressure=look["pressure"],
            )
            for role, look in a.get("latest", {}).items()
        },
        pools=a.get("pools", {}),
        counts=[
            pb.DecisionCount(
                role=ROLE[c["role"]], direction=c["direction"], reason=c["reason"], count=c["count"]
            )
            for c in a.get("counts", [])
        ],
    )


def status_pb(status: dict[str, Any]) -> pb.StatusResponse:
    return pb.StatusResponse(
        cluster_id=status["cluster_id"],
        model=status["model"],
        membership_version=status["membership_version"],
        workers=[worker_pb(w) for w in status["workers"]],
        policy=policy_pb(status["policy"]),
        migrations_in_flight=status["migrations_in_flight"],
        migration_outcomes=status["migration_outcomes"],
        scaling=[
            pb.ScaleInProgress(role=ROLE[s["role"]], replicas=s["replicas"], started=s["started"])
            for s in status["scaling"]
        ],
        last_event_seq=status["last_event_seq"],
        autoscale=autoscale_status_pb(status["autoscale"]),
    )


def migration_pb(r: MigrationResult) -> pb.Migration:
    return pb.Migration(
        request=r.request_id,
        outcome=r.outcome,
        source=r.source,
        dest=r.dest,
        reason=r.reason,
        stages=r.stages,
        tokens=r.tokens,
        bytes=r.bytes,
        pause_s=r.pause_s,
        seconds=r.seconds,
    )


def event_pb(e: dict[str, Any], missed: int = 0) -> pb.Event:
    msg = pb.Event(seq=e["seq"], time=e["time"], missed=missed)
    kind = e["type"]
    if kind == "worker":
        msg.worker.CopyFrom(
            pb.WorkerEvent(
                kind=WORKER_EVENT.get(e["kind"], pb.WorkerEvent.KIND_UNSPECIFIED),
                worker=e["worker"],
                role=ROLE.get(e["role"], pb.ROLE_UNSPECIFIED),
                reason=e["reason"],
                node_ip=e.get("node_ip", ""),
            )
        )
    elif kind == "scale":
        msg.scale.CopyFrom(
            pb.ScaleEvent(
                phase=SCALE_PHASE[e["phase"]],
                role=ROLE[e["role"]],
                from_replicas=e["from_replicas"],
                to_replicas=e["to_replicas"],
                reason=e["reason"],
                added=e.get("added", []),
                removed=e.get("removed", []),
                failed=e.get("failed", {}),
                aborted_requests=e.get("aborted_requests", 0),
                migrated_requests=e.get("migrated_requests", 0),
            )
        )
    elif kind == "migration":
        msg.migration.CopyFrom(
            pb.MigrationEvent(
                request=e["request"],
                source=e["source"],
                dest=e["dest"],
                outcome=e["outcome"],
                cause=e["cause"],
                seconds=e["seconds"],
                pause_s=e["pause_s"],
            )
        )
    elif kind == "policy":
        msg.policy.CopyFrom(pb.PolicyEvent(policy=policy_pb(e["policy"])))
    elif kind == "autoscale":
        msg.autoscale.CopyFrom(
            pb.AutoscaleEvent(
                role=ROLE[e["role"]],
                direction=e["direction"],
                from_replicas=e["from_replicas"],
                to_replicas=e["to_replicas"],
                signal=e["signal"],
                reason=e["reason"],
                inputs_json=json.dumps(e["inputs"], sort_keys=True),
            )
        )
    return msg
