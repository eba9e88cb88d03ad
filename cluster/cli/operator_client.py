"""The tandem CLI's side of the operator API: find the server, call it, print the answers.

Where to connect and with what token, first found wins::

    address   --address, TANDEM_OPERATOR_ADDRESS, the connection file
    token     --token-file, --token, TANDEM_OPERATOR_TOKEN, the connection file (only when it
              is the file of that address)
    TLS CA    --tls-ca, the connection file's (the server's own certificate)

The connection file is the one `tandem serve` wrote (cluster/launch/serve.py ``operator_file``:
``$TANDEM_CACHE_DIR/run/operator-<gateway port>.json``, mode 0600): ``--serve-port`` picks
one, else the only one whose server still runs.

Exit codes, for scripts: 0 done; 1 done only in part (a drain that left requests, a scale with
failed workers, a migration that did not move); 2 a bad argument or one the controller refused
(an unknown worker); 3 no operator at the address; 4 the token was refused; 5 refused as things
are (below one worker or the running load without --force; a scale already running).

This module imports grpc: the CLI imports it inside its handlers only.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
from google.protobuf import json_format

from cluster.control.spec import engine_pairs
from proto import operator_pb2 as pb
from proto import operator_pb2_grpc as pb_grpc

EXIT_PARTIAL, EXIT_USAGE, EXIT_UNREACHABLE, EXIT_AUTH, EXIT_REFUSED = 1, 2, 3, 4, 5
ROLES = {"prefill": pb.ROLE_PREFILL, "decode": pb.ROLE_DECODE, "colocated": pb.ROLE_COLOCATED}
_ENUM_PREFIXES = ("ROLE_", "WORKER_STATE_", "KIND_", "PHASE_")


@dataclass(frozen=True)
class Target:
    address: str
    token: str
    tls_ca: str | None = None


class OperatorError(Exception):
    """A call failed: the message for people and the exit code for scripts."""

    def __init__(self, message: str, code: int) -> None:
        super().__init__(message)
        self.code = code


# -- where ------------------------------------------------------------------------------------


def _connection_files() -> list[Path]:
    from cluster.launch.serve import operator_file

    return sorted(operator_file(0).parent.glob("operator-*.json"))


def _read_connection(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise OperatorError(f"cannot read {path}: {exc}", EXIT_USAGE) from None


def connection(serve_port: int | None) -> dict[str, Any] | None:
    """The connection file of the `tandem serve` on ``serve_port``, or of the only one that
    runs here (None when none does)."""
    from cluster.launch.serve import operator_file, pid_alive

    if serve_port is not None:
        path = operator_file(serve_port)
        if not path.exists():
            raise OperatorError(
                f"no `tandem serve` with --port {serve_port} wrote {path}", EXIT_UNREACHABLE
            )
        return _read_connection(path)
    live = []
    for path in _connection_files():
        conn = _read_connection(path)
        if pid_alive(int(conn.get("pid", 0) or 0)):
            live.append((path, conn))
    if len(live) > 1:
        ports = ", ".join(p.stem.removeprefix("operator-") for p, _ in live)
        raise OperatorError(
            f"several `tandem serve` run here (gateway ports {ports}): pick one with --serve-port",
            EXIT_USAGE,
        )
    return live[0][1] if live else None


def _read_token_file(path: str) -> str:
    from cluster.launch.serve import _read_secret_file

    return _read_secret_file(path).strip()


def find_target(args: argparse.Namespace) -> Target:
    """Where to call and with which token (the module docstring has the order)."""
    address = args.address or os.environ.get("TANDEM_OPERATOR_ADDRESS")
    token = None
    if args.token_file:
        token = _read_token_file(args.token_file)
    elif args.token:
        print(
            "tandem: warning: --token is visible to every local user in process listings: "
            "prefer TANDEM_OPERATOR_TOKEN or --token-file",
            file=sys.stderr,
        )
        token = args.token
    else:
        token = os.environ.get("TANDEM_OPERATOR_TOKEN") or None
    conn = None
    if address is None or token is None or args.serve_port is not None:
        conn = connection(args.serve_port)
    if conn is not None and address not in (None, conn["address"]):
        conn = None  # another server's file: nothing of it applies
    if address is None:
        if conn is None:
            raise OperatorError(
                "no tandem operator found: start `tandem serve` on this machine, or pass "
                "--address HOST:PORT (and --token-file)",
                EXIT_UNREACHABLE,
            )
        address = conn["address"]
    if token is None and conn is not None:
        token = _read_token_file(conn["token_file"]) if "token_file" in conn else conn["token"]
    if not token:
        raise OperatorError(
            f"no token for the operator at {address}: --token-file PATH or TANDEM_OPERATOR_TOKEN",
            EXIT_AUTH,
        )
    tls_ca = args.tls_ca or (conn or {}).get("tls_ca")
    return Target(address, token, tls_ca)


# -- calls ------------------------------------------------------------------------------------


class Operator:
    """A channel to one operator API and its calls (each with the token)."""

    def __init__(self, target: Target, timeout_s: float | None) -> None:
        self.target = target
        self.timeout_s = timeout_s
        if target.tls_ca:
            with open(target.tls_ca, "rb") as f:
                creds = grpc.ssl_channel_credentials(root_certificates=f.read())
            self.channel = grpc.secure_channel(target.address, creds)
        else:
            self.channel = grpc.insecure_channel(target.address)
        self.stub = pb_grpc.ClusterOperatorStub(self.channel)
        self.metadata = (("authorization", f"Bearer {target.token}"),)

    def call(self, method: str, request: Any, timeout_s: float | None = ...) -> Any:
        timeout = self.timeout_s if timeout_s is ... else timeout_s
        try:
            return getattr(self.stub, method)(request, timeout=timeout, metadata=self.metadata)
        except grpc.RpcError as exc:
            raise self._error(exc, timeout) from None

    def watch(self, since: int | None) -> Iterator[pb.Event]:
        request = pb.WatchRequest() if since is None else pb.WatchRequest(since=since)
        try:
            yield from self.stub.Watch(request, metadata=self.metadata)
        except grpc.RpcError as exc:
            raise self._error(exc, None) from None

    def _error(self, exc: grpc.RpcError, timeout_s: float | None) -> OperatorError:
        code, details, where = exc.code(), exc.details() or "", self.target.address
        if code == grpc.StatusCode.UNAVAILABLE:
            return OperatorError(
                f"no tandem operator at {where}: is `tandem serve` running? ({details})",
                EXIT_UNREACHABLE,
            )
        if code == grpc.StatusCode.UNAUTHENTICATED:
            return OperatorError(f"the operator at {where} refused the token: {details}", EXIT_AUTH)
        if code == grpc.StatusCode.DEADLINE_EXCEEDED:
            return OperatorError(
                f"the operator at {where} did not answer within {timeout_s or 0:g} s (--timeout)",
                EXIT_PARTIAL,
            )
        exit_code = {
            grpc.StatusCode.INVALID_ARGUMENT: EXIT_USAGE,
            grpc.StatusCode.FAILED_PRECONDITION: EXIT_REFUSED,
        }.get(code, EXIT_PARTIAL)
        return OperatorError(details or code.name, exit_code)

    def close(self) -> None:
        self.channel.close()


def new_request_id() -> str:
    """The idempotency key of one mutating call (a retry of the same call would reuse it)."""
    return f"cli-{uuid.uuid4()}"


def plain(msg: Any) -> dict[str, Any]:
    """A message as JSON-ready values: field names as in the .proto, integers as numbers,
    enums as their lower-case names without prefix ("decode", "active", "up")."""
    d = json_format.MessageToDict(
        msg,
        preserving_proto_field_name=True,
        always_print_fields_with_no_presence=True,
        unquote_int64_if_possible=True,
    )
    return _enum_names(d)


def _enum_names(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _enum_names(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_enum_names(v) for v in value]
    if isinstance(value, str):
        for prefix in _ENUM_PREFIXES:
            if value.startswith(prefix) and value.isupper():
                return value.removeprefix(prefix).lower()
    return value


# -- commands ---------------------------------------------------------------------------------


def run(args: argparse.Namespace, command) -> int:
    """Connect, run ``command(operator, args) -> exit code``, and turn failures into a line on
    stderr and their exit code."""
    try:
        op = Operator(find_target(args), args.timeout)
        try:
            return command(op, args)
        finally:
            op.close()
    except OperatorError as exc:
        print(f"tandem: {exc}", file=sys.stderr)
        return exc.code


def status(op: Operator, args: argparse.Namespace) -> int:
    resp = plain(op.call("Status", pb.StatusRequest()))
    if args.output == "json":
        print(json.dumps(resp, indent=2))
    else:
        print(status_table(resp))
    return 0


def _duration(latency: dict[str, Any] | None) -> str:
    if not latency or not latency.get("samples"):
        return "-"

    def one(s: float) -> str:
        return f"{s * 1000:.0f}ms" if s < 1 else f"{s:.2f}s"

    return f"{one(latency['p50_s'])}/{one(latency['p99_s'])}"


def _tier(t: dict[str, Any] | None) -> str:
    """A KV tier's use: bytes held (and the share of its bound), or ``-`` without one."""
    if not t:
        return "-"
    used, cap = int(t.get("used_bytes", 0)), int(t.get("capacity_bytes", 0))
    return f"{used / 2**30:.1f}G({used / max(cap, 1):.0%})"


def _devices(ranks: list[dict[str, Any]] | None) -> str:
    """A worker's devices, one per tensor-parallel rank: ``cuda:0,1``, ``cpu x2``, ``-``."""
    names = [r.get("device") or "?" for r in ranks or []]
    if not names:
        return "-"
    if all(n.startswith("cuda:") for n in names):
        return "cuda:" + ",".join(n.removeprefix("cuda:") for n in names)
    if len(set(names)) == 1:
        return names[0] if len(names) == 1 else f"{names[0]} x{len(names)}"
    return ",".join(names)


def status_table(status: dict[str, Any]) -> str:
    """``tandem status``'s table: a header line, then one aligned row per worker."""
    reb = status["policy"]["rebalance"]
    head = (
        f"cluster {status['cluster_id']}  model {Path(status['model']).name}  "
        f"membership v{status['membership_version']}  "
        f"migrations in flight {status['migrations_in_flight']}  rebalance {reb['mode']}  "
        f"autoscaler {'on' if (status.get('autoscale') or {}).get('enabled') else 'off'}"
    )
    for s in status["scaling"]:
        head += f"\nscaling {s['role']} to {s['replicas']} (since {time.ctime(s['started'])})"
    head += "".join(f"\n{line}" for line in autoscale_lines(status))
    columns = [
        "ROLE",
        "WORKER",
        "NODE",
        "STATE",
        "DEVICES",
        "RUN",
        "WAIT",
        "KV",
        "TTFT p50/p99",
        "ITL p50/p99",
        "MIGR out/in",
        "TIERS host/disk",
    ]
    rows = []
    for w in status["workers"]:
        if w["error"]:
            figures = ["-"] * 6 + [w["error"]]  # the reason in the last column
        else:
            kv = f"{w['kv_use']:.0%}"
            if w["role"] == "decode":
                kv += f" ({w['kv_projected_use']:.0%})"
            figures = [
                str(w["running"]),
                str(w["waiting"]),
                kv,
                _duration(w.get("ttft")),
                _duration(w.get("itl")),
                f"{w['migrations_out']}/{w['migrations_in']}" if w["role"] == "decode" else "-",
                f"{_tier(w.get('kv_host'))}/{_tier(w.get('kv_disk'))}",
            ]
        devices = _devices(w.get("ranks"))
        rows.append([w["role"], w["name"], w["node_ip"] or "-", w["state"], devices, *figures])
    widths = [max(len(r[i]) for r in [columns, *rows]) for i in range(len(columns) - 1)]
    lines = [
        "  ".join([*(c.ljust(n) for c, n in zip(r[:-1], widths, strict=True)), r[-1]]).rstrip()
        for r in [columns, *rows]
    ]
    return "\n".join([head, *lines])


def autoscale_lines(status: dict[str, Any]) -> list[str]:
    """The autoscaler's latest look at each pool, when it is on (its pressures, the largest
    first, and its decisions so far)."""
    a = status.get("autoscale") or {}
    if not a.get("enabled"):
        return []
    made: dict[str, int] = {}
    for c in a.get("counts", []):
        made[c["role"]] = made.get(c["role"], 0) + int(c["count"])
    lines = []
    for role, look in sorted(a.get("latest", {}).items()):
        pressures = sorted(look["pressures"].items(), key=lambda kv: -kv[1])
        shown = ", ".join(f"{k} {v:.2f}" for k, v in pressures) or "no signal"
        lines.append(
            f"autoscaler {role}: {look['replicas']} active, {shown}; "
            f"{made.get(role, 0)} decision(s)"
        )
    return lines


def scale(op: Operator, args: argparse.Namespace) -> int:
    try:
        engine = engine_pairs(getattr(args, "engine", None) or [])
    except ValueError as exc:
        raise OperatorError(str(exc), EXIT_USAGE) from None
    request = pb.ScaleRequest(
        request_id=new_request_id(),
        role=ROLES[args.role],
        replicas=args.replicas,
        wait=args.wait,
        force=args.force,
        drain_deadline_s=args.drain_deadline,
        engine=engine,
    )
    resp = op.call("Scale", request, None if args.wait else ...)
    _print(args, resp, resp.message + ("" if resp.done else " (`tandem events` follows it)"))
    for name, why in sorted(resp.failed.items()):
        print(f"  {name}: {why}", file=sys.stderr)
    return EXIT_PARTIAL if resp.failed else 0


def drain(op: Operator, args: argparse.Namespace) -> int:
    request = pb.DrainRequest(
        request_id=new_request_id(), worker=args.worker, deadline_s=args.deadline
    )
    resp = op.call("Drain", request, args.deadline + args.timeout)
    counts = ", ".join(f"{n} {k}" for k, n in sorted(resp.counts.items())) or "no requests"
    state = "idle" if resp.idle else "NOT idle"
    note = f"; {resp.note}" if resp.note else ""
    _print(args, resp, f"{resp.worker}: {state} after {resp.seconds:.1f} s ({counts}{note})")
    return 0 if resp.idle and resp.not_moved == 0 else EXIT_PARTIAL


def undrain(op: Operator, args: argparse.Namespace) -> int:
    request = pb.UndrainRequest(request_id=new_request_id(), worker=args.worker)
    resp = op.call("Undrain", request)
    _print(args, resp, f"{resp.worker}: {plain(resp)['state']}")
    return 0


def switch(op: Operator, args: argparse.Namespace) -> int:
    request = pb.SwitchRoleRequest(
        request_id=new_request_id(),
        worker=args.worker,
        role=ROLES[args.role],
        deadline_s=args.deadline,
    )
    resp = op.call("SwitchRole", request, args.deadline + args.timeout)
    d = plain(resp)
    _print(
        args,
        resp,
        f"{resp.worker}: {d['from_role']} -> {d['role']} in {resp.seconds:.1f} s "
        f"({resp.migrated} migrated)",
    )
    return 0


def migrate(op: Operator, args: argparse.Namespace) -> int:
    request = pb.MigrateRequest(request_id=new_request_id(), to=args.to or "", count=args.count)
    if args.request:
        request.request = args.request
    else:
        request.from_worker = args.from_worker
    resp = op.call("Migrate", request)
    lines = [
        f"{r.request}: {r.outcome} {r.source} -> {r.dest or '?'}"
        + (
            f" ({r.reason})"
            if r.reason
            else f" ({r.seconds:.2f} s, paused {r.pause_s * 1000:.0f} ms)"
        )
        for r in resp.results
    ]
    _print(args, resp, "\n".join(lines) or "nothing to migrate")
    return 0 if resp.results and all(r.outcome == "migrated" for r in resp.results) else 1


def rebalance(op: Operator, args: argparse.Namespace) -> int:
    resp = op.call(
        "Rebalance", pb.RebalanceRequest(request_id=new_request_id(), dry_run=args.dry_run)
    )
    lines = [
        f"{a.request}: {a.from_worker} ({a.from_use:.0%}) -> {a.to_worker} ({a.to_use:.0%}), "
        f"{a.blocks} blocks: {a.outcome}"
        for a in resp.actions
    ]
    p = resp.policy
    summary = f"no move (high {p.high:g}, low {p.low:g})" if not lines else "\n".join(lines)
    _print(args, resp, summary)
    return 0


# the fields `tandem policy --pool ROLE` may change: the request's own
POOL_FIELDS = tuple(f.name for f in pb.PoolPolicyUpdate.DESCRIPTOR.fields)
# the controller-wide settings `tandem policy` sets from a flag of the same name (the request's
# own fields, but its id and the two with flags of another shape: --autoscale, --pool)
POLICY_FIELDS = tuple(
    f.name
    for f in pb.SetPolicyRequest.DESCRIPTOR.fields
    if f.name not in ("request_id", "autoscale_enabled", "autoscale_pools")
)


def policy(op: Operator, args: argparse.Namespace) -> int:
    request = pb.SetPolicyRequest(request_id=new_request_id())
    for name in POLICY_FIELDS:
        if getattr(args, name) is not None:
            setattr(request, name, getattr(args, name))
    if args.autoscale is not None:
        request.autoscale_enabled = args.autoscale == "on"
    pool = {n: getattr(args, n) for n in POOL_FIELDS if getattr(args, n) is not None}
    if pool and args.pool is None:
        print(f"tandem: --{next(iter(pool)).replace('_', '-')} needs --pool", file=sys.stderr)
        return EXIT_USAGE
    if args.pool is not None:
        request.autoscale_pools[args.pool].CopyFrom(pb.PoolPolicyUpdate(**pool))
    if len(request.ListFields()) == 1:  # nothing to change: show them
        resp = op.call("Status", pb.StatusRequest()).policy
    else:
        resp = op.call("SetPolicy", request).policy
    _print(args, resp, policy_text(plain(resp)))
    return 0


def policy_text(d: dict[str, Any]) -> str:
    def fields(values: dict[str, Any]) -> str:
        return "  ".join(f"{k}={v}" for k, v in values.items() if not isinstance(v, dict))

    lines = [f"{group}: {fields(values)}" for group, values in d.items()]
    for role, pool in d.get("autoscale", {}).items():
        if isinstance(pool, dict):
            lines.append(f"  {role}: {fields(pool)}")
    return "\n".join(lines)


def events(op: Operator, args: argparse.Namespace) -> int:
    for shown, event in enumerate(op.watch(args.since), 1):
        if args.output == "json":
            print(json.dumps(plain(event)), flush=True)
        else:
            print(event_line(event), flush=True)
        if args.limit and shown >= args.limit:
            break
    return 0


def event_line(e: pb.Event) -> str:
    """One event as a line for people."""
    when = time.strftime("%H:%M:%S", time.localtime(e.time)) + f".{int(e.time % 1 * 1000):03d}"
    head = f"{when} #{e.seq}"
    if e.missed:
        head += f" ({e.missed} earlier events no longer kept)"
    body = e.WhichOneof("body")
    d = plain(getattr(e, body)) if body else {}
    if body == "worker":
        where = f" [{d['node_ip']}]" if d["node_ip"] else ""
        return f"{head} worker {d['worker']} ({d['role']}) {d['kind']}: {d['reason']}{where}"
    if body == "scale":
        text = f"{head} scale {d['role']} {d['from_replicas']} -> {d['to_replicas']} {d['phase']}"
        text += f" ({d['reason']})"
        text += "".join(f" +{n}" for n in d["added"]) + "".join(f" -{n}" for n in d["removed"])
        text += "".join(f" !{n}: {why}" for n, why in d["failed"].items())
        if d["phase"] == "done" and d["removed"]:
            text += f" ({d['migrated_requests']} migrated, {d['aborted_requests']} aborted)"
        return text
    if body == "migration":
        return (
            f"{head} migration {d['request']} {d['source']} -> {d['dest']} {d['outcome']} "
            f"({d['cause']}, {d['seconds']:.2f} s, paused {d['pause_s'] * 1000:.0f} ms)"
        )
    if body == "policy":
        reb = d["policy"]["rebalance"]
        text = f"{head} policy rebalance " + " ".join(f"{k}={v}" for k, v in reb.items())
        return text + f" autoscale={'on' if d['policy']['autoscale']['enabled'] else 'off'}"
    if body == "autoscale":
        return (
            f"{head} autoscaler {d['role']} {d['direction']} {d['from_replicas']} -> "
            f"{d['to_replicas']}: {d['reason']}"
        )
    return head


def _print(args: argparse.Namespace, resp: Any, text: str) -> None:
    if getattr(args, "output", "text") == "json":
        print(json.dumps(plain(resp), indent=2))
    else:
        print(text)
