"""Checks the cluster tests share (tests/test_disagg_cluster.py, tests/chaos/)."""

from __future__ import annotations

import time


def assert_idle(cluster, timeout: float = 20.0) -> None:
    """Every worker of ``cluster`` idle with free + cached + in use == total and nothing in use
    (waiting up to ``timeout`` for aborts and frees still on their way)."""
    deadline = time.monotonic() + timeout
    while True:
        report = cluster.check_idle()
        if all(v is None for v in report.values()) or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert all(v is None for v in report.values()), report
