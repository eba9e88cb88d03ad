"""Who asks for live migrations: the admin call, drain and the rebalancer (in the controller).

The protocol itself runs between the two decode workers (decode_worker/migration.py); this
module picks what moves where and asks the source (``migrate_out``)::

    migrate(request_id, to)        the decode worker running it moves it to ``to`` (or to the
    migrate(from_, to, count)      decode worker with the most free blocks); ``count`` requests
                                   of ``from_``, longest remaining work first
    drain(worker, deadline_s)      DRAINING: routers place nothing new there; every request it
                                   runs is migrated away (one at a time: a worker sends one
                                   migration at a time), failed moves are retried until the
                                   deadline; the report says per request migrated / finished /
                                   failed, and whether the worker is idle (it can be removed)
    rebalance loop                 every ``interval_s``: each ACTIVE decode worker's projected
                                   KV use (blocks in use plus the blocks its running requests
                                   still need, by their max_tokens) over its total. A worker
                                   above ``high`` sends one request (the one whose move helps
                                   most that fits) to the least loaded worker below ``low``;
                                   between the two marks nothing moves (hysteresis). A source
                                   projected past its whole pool would preempt: that move is
                                   counted as a preemption avoided. Modes: off, on, dry-run
                                   (logs and records what it would move, moves nothing)
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import Counter, deque
from dataclasses import asdict, dataclass, field, replace
from typing import Any, Literal

from cluster.control.events import EventLog
from cluster.control.membership import MembershipTable
from engine.aio import within
from engine.messages import MigrationResult, WorkerState, control
from engine.settings import check, setting

logger = logging.getLogger(__name__)


@dataclass
class RebalanceSettings:
    """The rebalancer's settings; one definition for the code, the serve config file's
    ``rebalance`` section and its rows in docs/config.md (engine/settings.py). Changed live by
    ``POST /admin/rebalance`` (the controller checks a changed copy before it takes it)."""

    mode: Literal["off", "on", "dry-run"] = setting(
        "off", "`on` moves requests; `dry-run` only logs the moves it would make."
    )
    interval_s: float = setting(1.0, "Seconds between rebalance rounds.", gt=0)
    high: float = setting(0.85, "Projected KV use above which a decode worker gives.", gt=0, le=1)
    low: float = setting(0.6, "Projected KV use below which a decode worker takes.", gt=0, le=1)
    max_moves: int = setting(1, "Requests moved per source per round.", ge=1)

    def __post_init__(self) -> None:
        check(self)
        if not self.low < self.high:
            raise ValueError(f"low ({self.low}) must be below high ({self.high})")


@dataclass
class _Load:
    name: str
    handle: Any
    total: int
    projected: int
    free: int

    @property
    def use(self) -> float:
        return self.projected / max(self.total, 1)


@dataclass
class RebalanceState:
    settings: RebalanceSettings = field(default_factory=RebalanceSettings)
    rounds: int = 0
    moves: Counter = field(default_factory=Counter)  # by outcome
    preemptions_avoided: int = 0
    recent: deque = field(default_factory=lambda: deque(maxlen=50))  # planned / done moves

    def as_dict(self) -> dict[str, Any]:
        return {
            **asdict(self.settings),
            "rounds": self.rounds,
            "moves": dict(self.moves),
            "preemptions_avoided": self.preemptions_avoided,
            "recent": list(self.recent),
        }


class Migrator:
    """Migration orchestration over the controller's membership table (its ``workers`` and
    ``set_state``); every migration it asks for is counted in flight and, once it ends, an
    event in ``events``."""

    def __init__(self, membership: MembershipTable, events: EventLog) -> None:
        self.membership = membership
        self.events = events
        self.rebalance_state = RebalanceState()
        self._loop: asyncio.Task | None = None
        self.outcomes: Counter = Counter()  # every migration asked from here, by outcome
        self.in_flight = 0

    # -- the table -------------------------------------------------------------------------

    def _decode(self, *states: WorkerState):
        states = states or (WorkerState.ACTIVE,)
        return [
            w for w in self.membership.workers.values() if w.role == "decode" and w.state in states
        ]

    def _worker(self, name: str):
        info = self.membership.workers.get(name)
        if info is None or info.role != "decode":
            raise ValueError(f"no decode worker named {name!r}")
        if info.state == WorkerState.DEAD:
            raise ValueError(f"decode worker {name!r} is dead")
        return info

    async def _loads(self, workers) -> list[_Load]:
        stats = await asyncio.gather(
            *(within(control(w.handle.stats).remote(), 5.0) for w in workers),
            return_exceptions=True,
        )
        return [
            _Load(w.name, w.handle, s["total_blocks"], s["projected_blocks"], s["free_blocks"])
            for w, s in zip(workers, stats, strict=True)
            if isinstance(s, dict)
        ]

    async def _roomiest(self, exclude: set[str]):
        loads = await self._loads([w for w in self._decode() if w.name not in exclude])
        if not loads:
            return None
        best = min(loads, key=lambda x: x.use)
        return self.membership.workers[best.name]

    # -- one move ----------------------------------------------------------------------------

    async def move(self, source, rid: str, dest, reason: str) -> MigrationResult:
        self.in_flight += 1
        try:
            result = await source.handle.migrate_out.remote(rid, dest.handle, dest.name, reason)
        except Exception as exc:  # noqa: BLE001 - the source died: the router resumes it
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            result = MigrationResult(rid, "source_failed", source.name, dest.name, first)
        finally:
            self.in_flight -= 1
        self.outcomes[result.outcome] += 1
        self.events.add(
            "migration",
            request=result.request_id,
            source=result.source,
            dest=result.dest,
            outcome=result.outcome,
            cause=reason,
            seconds=result.seconds,
            pause_s=result.pause_s,
        )
        return result

    async def migrate(
        self,
        request_id: str | None = None,
        *,
        to: str | None = None,
        from_: str | None = None,
        count: int = 1,
    ) -> list[MigrationResult]:
        """Move one request (by id: the client-facing id matches its resumed attempts too) or
        ``count`` requests of ``from_``; ``to`` None: the least loaded other decode worker."""
        if (request_id is None) == (from_ is None):
            raise ValueError("give request_id or from_ (and not both)")
        dest = self._worker(to) if to is not None else None
        if request_id is not None:
            found = await self._find(request_id)
            if found is None:
                return [MigrationResult(request_id, "not_migratable", "", to or "", "not running")]
            source, rids = found
        else:
            source = self._worker(from_)
            cands = await control(source.handle.migration_candidates).remote()
            cands = [c for c in cands if c["decoding"] and not c["migrating"]]
            cands.sort(key=lambda c: -c["remaining"])
            rids = [c["request_id"] for c in cands[: max(count, 0)]]
        results = []
        for rid in rids:
            target = dest or await self._roomiest({source.name})
            if target is None or target.name == source.name:
                why = (
                    "no other decode worker" if target is None else "source and destination are one"
                )
                results.append(MigrationResult(rid, "dest_full", source.name, "", why))
                continue
            results.append(await self.move(source, rid, target, "admin"))
        return results

    async def _find(self, request_id: str):
        workers = self._decode(WorkerState.ACTIVE, WorkerState.SUSPECT, WorkerState.DRAINING)
        lists = await asyncio.gather(
            *(control(w.handle.migration_candidates).remote() for w in workers),
            return_exceptions=True,
        )
        for w, cands in zip(workers, lists, strict=True):
            if isinstance(cands, BaseException):
                continue
            rids = [
                c["request_id"]
                for c in cands
                if c["request_id"] == request_id or c["request_id"].startswith(request_id + "~")
            ]
            if rids:
                return w, rids[-1:]
        return None

    # -- drain -------------------------------------------------------------------------------

    async def drain(self, name: str, deadline_s: float = 60.0) -> dict[str, Any]:
        source = self._worker(name)
        self.membership.set_state(name, WorkerState.DRAINING, "drained by the operator")
        source = self.membership.workers[name]
        t0 = time.monotonic()
        report: dict[str, str] = {}
        seen: set[str] = set()
        while time.monotonic() - t0 < deadline_s:
            try:
                cands = await control(source.handle.migration_candidates).remote()
            except Exception as exc:  # noqa: BLE001 - it died: its requests resume elsewhere
                return self._drain_report(name, report, seen, set(), t0, f"worker died: {exc}")
            live = {c["request_id"] for c in cands}
            for rid in seen - live:
                report.setdefault(rid, "finished")
            seen |= live
            if not cands:
                return self._drain_report(name, report, seen, live, t0)
            ready = [c for c in cands if c["decoding"] and not c["migrating"]]
            if not ready:  # mid-transfer or waiting: soon decoding (or finished)
                await asyncio.sleep(0.02)
                continue
            ready.sort(key=lambda c: -c["remaining"])
            dest = await self._roomiest({name})
            if dest is None:
                await asyncio.sleep(0.1)
                continue
            rid = ready[0]["request_id"]
            result = await self.move(source, rid, dest, "drain")
            if result.ok:
                report[rid] = "migrated"
            elif result.outcome == "finished":
                report[rid] = "finished"
            else:
                report[rid] = f"failed: {result.outcome}"
                await asyncio.sleep(0.05)  # retried until the deadline
        live = set()
        with contextlib.suppress(Exception):  # died at the end: its requests resume elsewhere
            cands = await control(source.handle.migration_candidates).remote()
            live = {c["request_id"] for c in cands}
        return self._drain_report(name, report, seen, live, t0, "deadline passed")

    def _drain_report(self, name, report, seen, live, t0, note: str = "") -> dict[str, Any]:
        for rid in seen - live:
            if not report.get(rid, "").startswith(("migrated", "finished")):
                report[rid] = "finished"
        for rid in live:
            report[rid] = report.get(rid, "still running")
            if report[rid] in ("migrated", "finished"):
                report[rid] = "still running"
        counts = Counter(v.split(":")[0] for v in report.values())
        return {
            "worker": name,
            "idle": not live,
            "requests": report,
            "counts": dict(counts),
            "seconds": round(time.monotonic() - t0, 3),
            "note": note,
        }

    # -- rebalance ---------------------------------------------------------------------------

    def configure(self, **settings: Any) -> dict[str, Any]:
        s = replace(self.rebalance_state.settings, **settings)  # checked as it is built
        self.rebalance_state.settings = s
        if s.mode != "off" and (self._loop is None or self._loop.done()):
            self._loop = asyncio.ensure_future(self._rebalance_forever())
        return self.rebalance_state.as_dict()

    def stop(self) -> None:
        self.rebalance_state.settings.mode = "off"
        if self._loop is not None:
            self._loop.cancel()

    async def _rebalance_forever(self) -> None:
        state = self.rebalance_state
        while state.settings.mode != "off":
            try:
                await self.rebalance_once()
            except Exception:  # noqa: BLE001 - one bad round must not end the loop
                logger.exception("rebalance round failed")
            await asyncio.sleep(state.settings.interval_s)

    async def rebalance_once(self, dry_run: bool | None = None) -> list[dict[str, Any]]:
        """One round: plan (and unless dry-run, make) the moves the marks call for.
        ``dry_run`` None: as the mode says; True / False: plan only / move, whatever it is."""
        state = self.rebalance_state
        s = state.settings
        dry = s.mode == "dry-run" if dry_run is None else dry_run
        state.rounds += 1
        loads = await self._loads(self._decode())
        sources = sorted((x for x in loads if x.use > s.high), key=lambda x: -x.use)
        dests = sorted((x for x in loads if x.use < s.low), key=lambda x: x.use)
        actions = []
        for src in sources:
            if not dests:
                break
            cands = await control(src.handle.migration_candidates).remote()
            cands = [c for c in cands if c["decoding"] and not c["migrating"]]
            for _ in range(s.max_moves):
                dst = dests[0]
                pick = self._pick(src, dst, cands, s)
                if pick is None:
                    break
                cands.remove(pick)
                need = _blocks(pick)
                action = {
                    "time": round(time.time(), 3),
                    "request_id": pick["request_id"],
                    "from": src.name,
                    "to": dst.name,
                    "from_use": round(src.use, 3),
                    "to_use": round(dst.use, 3),
                    "blocks": need,
                    "avoids_preemption": src.projected > src.total,
                }
                if dry:
                    action["outcome"] = "planned"
                    logger.warning("rebalance (dry run) would move %s", action)
                else:
                    source = self.membership.workers[src.name]
                    dest = self.membership.workers[dst.name]
                    why = "preemption" if action["avoids_preemption"] else "rebalance"
                    result = await self.move(source, pick["request_id"], dest, why)
                    action["outcome"] = result.outcome
                    state.moves[result.outcome] += 1
                    if result.ok and action["avoids_preemption"]:
                        state.preemptions_avoided += 1
                src.projected -= need
                dst.projected += need
                state.recent.append(action)
                actions.append(action)
                dests.sort(key=lambda x: x.use)
                if src.use <= s.high or dests[0].use >= s.low:
                    break
        return actions

    @staticmethod
    def _pick(src: _Load, dst: _Load, cands: list[dict], s: RebalanceSettings):
        """The request whose move brings ``src`` closest to the high mark without pushing
        ``dst`` past the low one (the largest that fits when none reaches it)."""
        room = int(s.low * dst.total) - dst.projected
        excess = src.projected - int(s.high * src.total)
        fits = [c for c in cands if _blocks(c) <= room]
        if not fits:
            return None
        enough = [c for c in fits if _blocks(c) >= excess]
        if enough:
            return min(enough, key=lambda c: _blocks(c))
        return max(fits, key=lambda c: _blocks(c))


def _blocks(cand: dict[str, Any]) -> int:
    """Blocks a request holds and will still need (its share of a worker's projected use)."""
    return -(-(cand["num_tokens"] + cand["remaining"]) // cand["block_size"])
