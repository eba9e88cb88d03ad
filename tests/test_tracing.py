"""TANDEM_TRACE's stall watch: where a loop is when it has not come round."""

from __future__ import annotations

import logging
import threading

import pytest

from engine import tracing


class _Catch(logging.Handler):
    def __init__(self, needle: str) -> None:
        super().__init__()
        self.needle, self.lines, self.seen = needle, [], threading.Event()

    def emit(self, record: logging.LogRecord) -> None:
        line = record.getMessage()
        self.lines.append(line)
        if self.needle in line:
            self.seen.set()


@pytest.fixture
def caught(monkeypatch):
    monkeypatch.setattr(tracing, "_TRACE", True)
    handler = _Catch("stall:loop")
    tracing.logger.addHandler(handler)
    yield handler
    tracing.logger.removeHandler(handler)


def _stuck_in_a_call(seen: threading.Event) -> bool:
    return seen.wait(10)  # the loop's body, blocked until the watch has reported it


def test_a_loop_that_does_not_come_round_is_reported_with_its_stack(caught):
    watch = tracing.StallWatch("loop", threshold_s=0.05)
    try:
        watch.beat()
        assert _stuck_in_a_call(caught.seen), caught.lines
    finally:
        watch.stop()
    line = next(x for x in caught.lines if "stall:loop" in x)
    _, _, milestone, _ = line.split(" ")  # one token: trace_layout.py's pattern reads it
    name, age_ms, stack = milestone.split(":", 3)[1:]
    assert name == "loop" and float(age_ms) >= 50
    frames = [f.rsplit(":", 1)[1] for f in stack.split("<")]
    assert frames.index("_stuck_in_a_call") < frames.index(  # innermost frames first
        "test_a_loop_that_does_not_come_round_is_reported_with_its_stack"
    )


def test_an_idle_loop_is_not_a_stall(caught):
    watch = tracing.StallWatch("loop", threshold_s=0.05)
    try:
        watch.beat()
        watch.idle()  # blocked waiting for work from here on
        assert not caught.seen.wait(0.3)  # six thresholds pass without a report
        watch.beat()
        assert caught.seen.wait(10)  # and a beat arms it again
    finally:
        watch.stop()


@pytest.mark.parametrize(
    "value, on",
    [(None, False), ("", False), ("0", False), ("false", False), ("No", False), ("off", False),
     ("1", True), ("true", True), ("yes", True)],
)  # fmt: skip
def test_trace_flag_reads_zero_and_false_as_off(value, on):
    """TANDEM_TRACE=0 turns tracing off (it used to turn it on: any non-empty string did)."""
    assert tracing._flag(value) is on
