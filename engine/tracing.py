"""Wall-clock milestones of a request across processes (``TANDEM_TRACE=1``)."""

from __future__ import annotations

import logging
import os
import sys
import threading
import time

logger = logging.getLogger("tandem.trace")


def _flag(value: str | None) -> bool:
    """An on/off environment setting: unset, empty, 0, false, no and off are off."""
    return (value or "").strip().lower() not in ("", "0", "false", "no", "off")


_TRACE = _flag(os.environ.get("TANDEM_TRACE"))


def trace(request_id: str, event: str) -> None:
    """With TANDEM_TRACE=1: log a wall-clock timestamp for a request's milestone (every process
    on one host shares the clock, so a request's path can be laid out across workers)."""
    if _TRACE:
        logger.warning("TRACE %s %s %.6f", request_id, event, time.time())


class StallWatch:
    """With TANDEM_TRACE=1: a thread that logs where a loop is when it has not come round for
    ``threshold_s`` (a milestone ``stall:NAME:AGE_MS:frame<frame<...``, innermost first, once per
    threshold while it lasts). The loop calls ``beat()`` each time round and ``idle()`` before
    it blocks waiting for work, which is not a stall. Without TANDEM_TRACE both are no-ops."""

    def __init__(self, name: str, threshold_s: float | None = None) -> None:
        self.name = name
        if threshold_s is None:
            threshold_s = float(os.environ.get("TANDEM_TRACE_STALL_MS", "150")) / 1e3
        self.threshold_s = threshold_s
        self._ident: int | None = None
        self._last: float | None = None  # monotonic time of the last beat; None: idle
        self._stop = threading.Event()
        if _TRACE:
            threading.Thread(target=self._watch, name=f"stall-watch-{name}", daemon=True).start()

    def beat(self) -> None:
        if _TRACE:
            self._ident = threading.get_ident()
            self._last = time.monotonic()

    def idle(self) -> None:
        self._last = None

    def stop(self) -> None:
        self._stop.set()

    def _watch(self) -> None:
        logged = 0.0  # the age last logged, of the stall now in progress
        while not self._stop.wait(self.threshold_s / 3):
            last, ident = self._last, self._ident
            age = time.monotonic() - last if last is not None else 0.0
            if age < self.threshold_s:
                logged = 0.0
                continue
            if age - logged < self.threshold_s:
                continue
            logged = age
            frame = sys._current_frames().get(ident) if ident is not None else None
            stack = []
            while frame is not None and len(stack) < 8:
                code = frame.f_code
                stack.append(
                    f"{os.path.basename(code.co_filename)}:{frame.f_lineno}:{code.co_name}"
                )
                frame = frame.f_back
            trace("-", f"stall:{self.name}:{age * 1e3:.0f}:{'<'.join(stack) or '?'}")


class StepLog:
    """With ``TANDEM_STEP_LOG=PATH``: one CSV line per engine step appended to ``PATH`` (a
    ``{pid}`` in it becomes the process id, so each worker of a cluster writes its own file):
    wall-clock start, the ``step`` call's milliseconds, and the step's shape (sequences,
    tokens, tokens not of single-token decodes, decodes, preemptions). Offline and served runs
    of the same requests then compare step by step (``benchmarks/step_log.py``). Without the
    variable: no cost."""

    HEADER = "start,ms,seqs,tokens,prefill_tokens,decodes,preempted\n"

    def __init__(self, path: str) -> None:
        self.path = path.replace("{pid}", str(os.getpid()))
        new = not os.path.exists(self.path)
        self._file = open(self.path, "a", buffering=1)  # noqa: SIM115 (line-buffered; closed by close)
        if new:
            self._file.write(self.HEADER)
        self._lock = threading.Lock()

    @classmethod
    def from_env(cls) -> StepLog | None:
        path = os.environ.get("TANDEM_STEP_LOG", "").strip()
        return cls(path) if path else None

    def record(self, start: float, seconds: float, chunks: list, preempted: int) -> None:
        """``chunks``: the step's scheduled chunks (``num_tokens`` each; one token that is
        not a prompt token is a decode)."""
        tokens = decodes = 0
        for c in chunks:
            tokens += c.num_tokens
            decodes += c.num_tokens == 1 and c.start >= c.request.num_prompt_tokens
        line = f"{start:.6f},{seconds * 1e3:.3f},{len(chunks)},{tokens},{tokens - decodes},"
        with self._lock:
            self._file.write(f"{line}{decodes},{preempted}\n")

    def close(self) -> None:
        with self._lock:
            self._file.close()
