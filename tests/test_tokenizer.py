"""engine.tokenizer: loading, prompt encoding, chat templates and EOS ids (real SmolLM2 tokenizer)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from engine.tokenizer import (
    BatchedEncoder,
    _as_id_list,
    apply_chat_template,
    encode_prompt,
    eos_token_ids,
    has_tokenizer_files,
    load_tokenizer,
)

CONVERSATIONS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Say hi 👋 in 日本語."},
        {"role": "assistant", "content": "こんにちは"},
        {"role": "user", "content": "And in French?"},
    ],
]


@pytest.fixture(scope="module")
def tok(smollm2_dir):
    tokenizer = load_tokenizer(smollm2_dir)
    assert tokenizer is not None
    return tokenizer


@pytest.fixture()
def templateless_dir(tok, tmp_path: Path) -> Path:
    """A copy of the SmolLM2 tokenizer with its chat template removed."""
    tok.save_pretrained(tmp_path)
    (tmp_path / "chat_template.jinja").unlink(missing_ok=True)
    config_path = tmp_path / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config.pop("chat_template", None)
    config_path.write_text(json.dumps(config))
    return tmp_path


def _hf_chat_ids(tok, messages, **kwargs) -> list[int]:
    result = tok.apply_chat_template(messages, tokenize=True, **kwargs)
    if isinstance(result, dict) or hasattr(result, "keys"):
        result = result["input_ids"]
    return list(result)


# --- load_tokenizer ---------------------------------------------------------------------------


def test_load_returns_none_without_tokenizer_files(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{}")
    assert not has_tokenizer_files(tmp_path)
    assert load_tokenizer(tmp_path) is None
    assert load_tokenizer(str(tmp_path)) is None


def test_load_missing_folder_raises(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError):
        load_tokenizer(tmp_path / "nope")


def test_load_real_tokenizer(smollm2_dir, tok) -> None:
    assert has_tokenizer_files(smollm2_dir)
    assert tok.eos_token is not None
    assert tok.chat_template


# --- encode_prompt ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "text", ["Hello world", "  spaces\tand\nnewlines ", "emoji 😀 日本語 café", "<|im_start|>user"]
)
def test_encode_prompt_matches_hf(tok, text: str) -> None:
    ids = encode_prompt(tok, text)
    assert ids == list(tok(text).input_ids)
    assert all(type(i) is int for i in ids)
    assert tok.decode(ids, skip_special_tokens=False) == text


# --- BatchedEncoder (the gateway's: prompts from many threads, one encode_batch) --------------


@pytest.fixture(scope="module")
def batched(tok):
    encoder = BatchedEncoder.of(tok)
    assert encoder is not None  # SmolLM2's backend gives its wrapper's ids on every probe
    yield encoder
    encoder.close()


@pytest.mark.parametrize(
    "text", ["Hello world", "  spaces\tand\nnewlines ", "emoji 😀 日本語 café", "<|im_start|>user"]
)
def test_batched_encoder_gives_hf_ids(tok, batched, text: str) -> None:
    assert encode_prompt(batched, text) == list(tok(text).input_ids)
    assert batched.encode(text, add_special_tokens=False) == list(
        tok(text, add_special_tokens=False).input_ids
    )
    assert len(batched) == len(tok) and batched.eos_token_id == tok.eos_token_id


@pytest.mark.parametrize("generation_prompt", [True, False])
@pytest.mark.parametrize("messages", CONVERSATIONS)
def test_batched_chat_template_gives_hf_ids(tok, batched, messages, generation_prompt) -> None:
    want = _hf_chat_ids(tok, messages, add_generation_prompt=generation_prompt)
    assert apply_chat_template(batched, messages, generation_prompt) == want
    template = "{% for m in messages %}[{{ m['role'] }}]{{ m['content'] }}{% endfor %}"
    assert apply_chat_template(batched, messages, chat_template=template) == apply_chat_template(
        tok, messages, chat_template=template
    )


def test_encodes_arriving_during_a_batch_go_in_the_next_one(tok) -> None:
    """While one encode_batch runs, encodes from five threads queue; they go in one call
    together, and each caller gets its own text's ids."""
    import threading
    import time

    encoder = BatchedEncoder.of(tok)
    real = encoder._backend
    inside, release, calls = threading.Event(), threading.Event(), []

    class Held:  # the first encode_batch waits until five more encodes are queued
        def encode_batch(self, texts, add_special_tokens=True):
            calls.append(len(texts))
            if len(calls) == 1:
                inside.set()
                assert release.wait(30)
            return real.encode_batch(texts, add_special_tokens=add_special_tokens)

    encoder._backend = Held()
    texts = [f"text number {i} with some words" for i in range(6)]
    got: dict[int, list[int]] = {}

    def one(i: int) -> None:
        got[i] = encoder.encode(texts[i])

    threads = [threading.Thread(target=one, args=(0,))]
    threads[0].start()
    assert inside.wait(30)
    threads += [threading.Thread(target=one, args=(i,)) for i in range(1, 6)]
    for t in threads[1:]:
        t.start()
    deadline = time.monotonic() + 30
    while len(encoder._pending) < 5:  # (each thread queues its text, then waits)
        assert time.monotonic() < deadline
        time.sleep(0.005)
    release.set()
    for t in threads:
        t.join(30)
    encoder.close()
    assert calls == [1, 5]
    assert got == {i: list(tok(texts[i]).input_ids) for i in range(6)}
    assert (encoder.batches, encoder.texts) == (2, 6)


def test_inline_encoder_gives_the_batched_ids_without_a_batch(tok) -> None:
    """``inline`` (the gateway's short prompts, on its event loop) gives the ids the wrapper
    gives, with and without special tokens and for a rendered chat, and makes no batch."""
    encoder = BatchedEncoder.of(tok)
    assert encoder is not None
    try:
        for text in ("Hello world", "unicode: héllo 日本語 🙂", "x" * 300):
            inline = encoder.inline
            assert encode_prompt(inline, text) == list(tok(text).input_ids) == encoder.encode(text)
            plain = list(tok(text, add_special_tokens=False).input_ids)
            assert inline.encode(text, add_special_tokens=False) == plain
            if tok.chat_template:
                chat = [{"role": "user", "content": text}]
                assert apply_chat_template(inline, chat) == apply_chat_template(tok, chat)
        assert encoder.texts == 3  # only the three encode() calls went through a batch
    finally:
        encoder.close()


def test_a_backend_that_disagrees_is_not_bypassed(tok) -> None:
    """A tokenizer whose Rust backend gives other ids than the wrapper (a Python-side
    normalisation, say) gets no BatchedEncoder: the gateway keeps the wrapper."""

    class Backend:
        def encode(self, text, add_special_tokens=True):
            class Out:
                ids = [0, *tok(text, add_special_tokens=add_special_tokens).input_ids]

            return Out()

    class Wrapper:
        backend_tokenizer = Backend()
        all_special_tokens = tok.all_special_tokens
        chat_template = None

        def __call__(self, text, add_special_tokens=True):
            return tok(text, add_special_tokens=add_special_tokens)

    assert BatchedEncoder.of(Wrapper()) is None
    assert BatchedEncoder.of(None) is None


# --- apply_chat_template ----------------------------------------------------------------------


@pytest.mark.parametrize("messages", CONVERSATIONS)
def test_chat_template_matches_hf(tok, messages) -> None:
    ids = apply_chat_template(tok, messages)
    assert ids == _hf_chat_ids(tok, messages, add_generation_prompt=True)
    assert all(type(i) is int for i in ids)
    text = tok.decode(ids)
    assert text.endswith("<|im_start|>assistant\n")
    assert messages[-1]["content"] in text


def test_chat_template_without_generation_prompt(tok) -> None:
    messages = CONVERSATIONS[1]
    ids = apply_chat_template(tok, messages, add_generation_prompt=False)
    assert ids == _hf_chat_ids(tok, messages, add_generation_prompt=False)
    assert ids != apply_chat_template(tok, messages)


def test_chat_template_kwargs_pass_through(tok) -> None:
    template = "{% for m in messages %}[{{ m['role'] }}]{{ m['content'] }}{% endfor %}"
    ids = apply_chat_template(tok, CONVERSATIONS[0], chat_template=template)
    assert tok.decode(ids) == "[user]What is the capital of France?"


def test_chat_template_missing_raises(templateless_dir: Path) -> None:
    bare = load_tokenizer(templateless_dir)
    assert bare is not None and not bare.chat_template
    with pytest.raises(ValueError, match="no chat template") as info:
        apply_chat_template(bare, CONVERSATIONS[0])
    assert "chat_template=" in str(info.value)
    ids = apply_chat_template(bare, CONVERSATIONS[0], chat_template="{{ messages[0]['content'] }}")
    assert bare.decode(ids) == CONVERSATIONS[0][0]["content"]


def test_as_id_list_normalises_containers(tok) -> None:
    ids = [5, 6, 7]
    assert _as_id_list(ids) == ids
    assert _as_id_list({"input_ids": ids}) == ids
    assert _as_id_list(tok("a b c")) == list(tok("a b c").input_ids)
    assert _as_id_list(torch.tensor([ids])) == ids
    assert _as_id_list([ids]) == ids
    assert _as_id_list(torch.tensor(ids)) == ids


# --- eos_token_ids ----------------------------------------------------------------------------


def _write_generation_config(folder: Path, eos) -> None:
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": eos}))


def test_eos_union_list_and_tokenizer(tok, tmp_path: Path) -> None:
    _write_generation_config(tmp_path, [tok.eos_token_id, 7])
    assert eos_token_ids(tmp_path, tok) == (tok.eos_token_id, 7)


def test_eos_int_and_tokenizer(tok, tmp_path: Path) -> None:
    _write_generation_config(tmp_path, 9)
    assert eos_token_ids(tmp_path, tok) == (9, tok.eos_token_id)


def test_eos_without_generation_config(tok, tmp_path: Path) -> None:
    assert eos_token_ids(tmp_path, tok) == (tok.eos_token_id,)
    assert eos_token_ids(tmp_path, None) == ()


def test_eos_without_tokenizer(tmp_path: Path) -> None:
    _write_generation_config(tmp_path, [3, 4, 3])
    assert eos_token_ids(tmp_path, None) == (3, 4)
    _write_generation_config(tmp_path, None)
    assert eos_token_ids(tmp_path, None) == ()


def test_eos_real_model_dir(smollm2_dir, tok) -> None:
    ids = eos_token_ids(smollm2_dir, tok)
    assert tok.eos_token_id in ids
    assert len(set(ids)) == len(ids)
