"""engine/threads.py: a helper thread's torch ops stay on it (no second OpenMP team)."""

from __future__ import annotations

import threading

import pytest
import torch

from engine.threads import _omp_set_num_threads, torch_single_threaded


def _big_op() -> torch.Tensor:
    x = torch.arange(1 << 20, dtype=torch.float32)
    return torch.sin(x)  # parallel on >1 thread for this size (elementwise: the same bits)


def _in_thread(single: bool) -> tuple[int, torch.Tensor]:
    """(torch threads the helper's ops run on, their result)."""
    out: list = []

    def run() -> None:
        if single:
            torch_single_threaded()
        out.extend([torch.get_num_threads(), _big_op()])

    th = threading.Thread(target=run)
    th.start()
    th.join()
    return out[0], out[1]


def test_a_single_threaded_helper_runs_torch_on_itself_alone():
    """The helper's ops run on one thread (so it makes no OpenMP team of its own); the caller
    and a helper that did not ask keep the process's count; the results are the same."""
    if _omp_set_num_threads() is None:
        pytest.skip("torch does not run on libgomp here")
    old = torch.get_num_threads()
    torch.set_num_threads(2)  # (another test may have left 1)
    try:
        expected = _big_op()
        threads, got = _in_thread(single=True)
        assert threads == 1 and torch.get_num_threads() == 2
        assert torch.equal(got, expected)
        threads, got = _in_thread(single=False)
        assert threads == 2 and torch.equal(got, expected)
    finally:
        torch.set_num_threads(old)


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
    cfg = {
        "model_dir": save_tiny(tmp_path_factory, "tiny-threads"),
        "num_kv_blocks": 16,
        "block_size": 16,
    }
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
