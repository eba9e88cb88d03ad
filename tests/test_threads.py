"""engine/threads.py: a helper thread's torch ops stay on it (no second OpenMP team)."""

from __future__ import annotations

import os
import threading

import pytest
import torch

from engine.threads import _omp_set_num_threads, torch_single_threaded


def _os_threads() -> int:
    return len(os.listdir("/proc/self/task"))


def _big_op() -> None:
    x = torch.randn(1 << 22)
    for _ in range(3):
        x = torch.sin(x)  # parallel on >1 thread for this size


def _in_thread(single: bool) -> tuple[int, int]:
    """(torch threads the helper sees, OS threads of the process after its op)."""
    out: list[int] = []

    def run() -> None:
        if single:
            torch_single_threaded()
        _big_op()
        out.extend([torch.get_num_threads(), _os_threads()])

    th = threading.Thread(target=run)
    th.start()
    th.join()
    return out[0], out[1]


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="needs /proc")
def test_a_single_threaded_helper_adds_no_openmp_team():
    if torch.get_num_threads() < 2 or _omp_set_num_threads() is None:
        pytest.skip("torch runs one thread here, or not on libgomp")
    _big_op()  # this thread's team exists
    before = _os_threads()
    threads, after = _in_thread(single=True)
    assert threads == 1 and torch.get_num_threads() >= 2  # the caller keeps its own
    assert after == before + 1  # the helper itself, no team of its own
    # a helper left alone makes a team: its OpenMP workers outlive it
    _, after_plain = _in_thread(single=False)
    assert after_plain > before + 1


def test_a_worker_builds_its_engine_on_its_engine_thread(tmp_path_factory, monkeypatch):
    """Every torch call of a worker's engine, its construction included, runs on the engine
    thread (one OpenMP team on CPU); a build that fails ends that thread."""
    from hf_oracle import save_tiny

    import engine.runtime as runtime
    from decode_worker.worker import DecodeWorker

    built_on = []
    real = runtime.LLMEngine

    def recording(*args, **kwargs):
        built_on.append(threading.current_thread())
        return real(*args, **kwargs)

    monkeypatch.setattr(runtime, "LLMEngine", recording)
    cfg = {"model_dir": save_tiny(tmp_path_factory, "tiny-threads"), "num_kv_blocks": 16}
    w = DecodeWorker(cfg, "d", transport="inproc")
    try:
        assert built_on == [w._thread] and w._thread is not threading.main_thread()
        w.start()
        assert w._thread.is_alive()
    finally:
        w.shutdown()
    assert not w._thread.is_alive()

    with pytest.raises(ValueError, match="max_model_len"):
        DecodeWorker({**cfg, "max_model_len": 1 << 30}, "bad", transport="inproc")
    for t in [t for t in threading.enumerate() if t.name == "bad-engine"]:
        t.join(10)  # told to end: it does, without a loop ever starting
        assert not t.is_alive()
