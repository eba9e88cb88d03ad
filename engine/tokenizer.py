"""Tokenizer loading and prompt encoding.

Thin, typed wrappers over Hugging Face tokenizers so the rest of the engine never touches
``transformers`` directly (it is imported lazily: token-id-only deployments never pay for it).

* :func:`load_tokenizer` returns ``None`` for model folders without tokenizer files (random tiny
  test models speak token ids only).
* :func:`encode_prompt` / :func:`apply_chat_template` always return a plain ``list[int]``,
  whatever container the installed ``transformers`` version hands back.
* :func:`eos_token_ids` merges ``generation_config.json`` with the tokenizer's EOS token.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

TOKENIZER_FILES: tuple[str, ...] = ("tokenizer.json", "tokenizer.model", "vocab.json")
"""A folder holding any of these files is considered to ship a tokenizer."""


def has_tokenizer_files(model_dir: str | Path) -> bool:
    """Whether ``model_dir`` contains at least one of :data:`TOKENIZER_FILES`."""
    folder = Path(model_dir)
    return any((folder / name).is_file() for name in TOKENIZER_FILES)


def load_tokenizer(model_dir: str | Path) -> PreTrainedTokenizerBase | None:
    """Load the Hugging Face tokenizer stored in ``model_dir``.

    Returns ``None`` when the folder has no tokenizer files, so models that are driven by token
    ids only still load. Raises ``FileNotFoundError`` if ``model_dir`` is not a folder.
    """
    folder = Path(model_dir)
    if not folder.is_dir():
        raise FileNotFoundError(f"Model folder {str(folder)!r} does not exist.")
    if not has_tokenizer_files(folder):
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(folder))


def encode_prompt(tokenizer: PreTrainedTokenizerBase | Encoder, text: str) -> list[int]:
    """Token ids of ``text``, with special tokens (e.g. BOS) added as HF does by default."""
    if isinstance(tokenizer, Encoder):
        return tokenizer.encode(text)
    return _as_id_list(tokenizer(text)["input_ids"])


# Texts on which a tokenizer's Rust backend must give the ids its Hugging Face wrapper gives
# before the wrapper is bypassed (BatchedEncoder.of); the special tokens' own strings are added.
_PROBES = (
    "Hello world",
    " leading space, then  two",
    "multi\nline\ttabs\r\n end",
    "unicode: héllo naïve 日本語 🙂 ÄÖÜ",
    "numbers 12345 67.89 -0.5e10",
    "code: def f(x):\n    return x ** 2  # done",
)


class Encoder:
    """A Hugging Face fast tokenizer whose texts are encoded by its Rust backend directly
    (``encode``); everything else (``decode``, ``len``, the chat template) is the wrapped
    tokenizer's. ``encode_prompt`` and ``apply_chat_template`` encode through ``encode``
    (a chat is rendered by the wrapper, then encoded without special tokens, as the
    wrapper's own ``tokenize=True`` does). Made by ``BatchedEncoder.of``, which checks that
    the backend's ids are the wrapper's."""

    tokenizer: PreTrainedTokenizerBase

    def __getattr__(self, name: str) -> Any:  # the wrapped tokenizer's everything else
        return getattr(self.tokenizer, name)

    def __len__(self) -> int:
        return len(self.tokenizer)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        raise NotImplementedError


class InlineEncoder(Encoder):
    """A ``BatchedEncoder``'s texts encoded on the calling thread, without waiting for a
    batch: for short prompts on an event loop, where the hop to a thread and back costs the
    request more than the encode (``BatchedEncoder.inline``). The backend's encode borrows it
    shared, as the batch thread's does."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase) -> None:
        self.tokenizer = tokenizer
        self._backend = tokenizer.backend_tokenizer

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self._backend.encode(text, add_special_tokens=add_special_tokens).ids


class BatchedEncoder(Encoder):
    """A Hugging Face fast tokenizer whose encodes, from any number of threads, run together:
    the texts that arrive while one ``encode_batch`` runs go in the next. The Rust tokenizer
    then spreads a burst's prompts over the cores with the GIL released, where one encode per
    request holds the GIL and one core (``tandem serve``'s gateway, issue 23). Everything else
    (``decode``, ``len``, the chat template) is the wrapped tokenizer's.

    ``of`` makes one only where the ids are the wrapper's own: a fast tokenizer whose backend
    gives the same ids on probe texts (and on a chat rendered with its template), with and
    without special tokens. A chat template goes through the wrapper's renderer, then this
    encoder without special tokens, as the wrapper's own ``tokenize=True`` does."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase) -> None:
        import threading

        self.tokenizer = tokenizer
        self._backend = tokenizer.backend_tokenizer
        self._cond = threading.Condition()
        self._pending: list[list[Any]] = []  # [text, add_special_tokens, ids | exception | None]
        self._closed = False
        self.batches = 0  # encode_batch calls, and the texts they took (for tests, metrics)
        self.texts = 0
        self.inline = InlineEncoder(tokenizer)  # the same ids, on the caller's thread
        self._thread = threading.Thread(target=self._run, name="tandem-encode", daemon=True)
        self._thread.start()

    @classmethod
    def of(cls, tokenizer: PreTrainedTokenizerBase | None) -> BatchedEncoder | None:
        backend = getattr(tokenizer, "backend_tokenizer", None)
        if tokenizer is None or backend is None:
            return None
        probes = [*_PROBES, " ".join(getattr(tokenizer, "all_special_tokens", []) or [])]
        for text in probes:
            for special in (True, False):
                want = _as_id_list(tokenizer(text, add_special_tokens=special)["input_ids"])
                if backend.encode(text, add_special_tokens=special).ids != want:
                    return None
        if getattr(tokenizer, "chat_template", None):
            chat = [{"role": "user", "content": _PROBES[3]}]
            try:
                want = apply_chat_template(tokenizer, chat)
                text = tokenizer.apply_chat_template(
                    chat, add_generation_prompt=True, tokenize=False
                )
            except Exception:  # noqa: BLE001 - a template that needs more than a user turn
                return None
            if backend.encode(text, add_special_tokens=False).ids != want:
                return None
        return cls(tokenizer)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """``text``'s ids (blocking; any thread)."""
        item: list[Any] = [text, add_special_tokens, None]
        with self._cond:
            if self._closed:
                raise RuntimeError("the encoder is closed")
            self._pending.append(item)
            self._cond.notify_all()
            while item[2] is None:
                self._cond.wait()
        if isinstance(item[2], BaseException):
            raise item[2]
        return item[2]

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._pending and not self._closed:
                    self._cond.wait()
                if self._closed and not self._pending:
                    return
                batch, self._pending = self._pending, []
            for special in (True, False):
                items = [it for it in batch if it[1] is special]
                if not items:
                    continue
                try:
                    out = self._backend.encode_batch(
                        [it[0] for it in items], add_special_tokens=special
                    )
                    results: list[Any] = [e.ids for e in out]
                except Exception as exc:  # noqa: BLE001 - each caller gets it
                    results = [exc] * len(items)
                self.batches += 1
                self.texts += len(items)
                with self._cond:
                    for it, res in zip(items, results, strict=True):
                        it[2] = res
                    self._cond.notify_all()

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self._thread.join(timeout=5)


def apply_chat_template(
    tokenizer: PreTrainedTokenizerBase,
    messages: Sequence[Mapping[str, Any]],
    add_generation_prompt: bool = True,
    **kwargs: Any,
) -> list[int]:
    """Render ``messages`` with the tokenizer's chat template and tokenize them.

    Extra ``kwargs`` (``chat_template=...``, ``tools=...``, template variables) go straight to
    ``tokenizer.apply_chat_template``. Raises ``ValueError`` when the tokenizer has no chat
    template and none is passed.
    """
    if not getattr(tokenizer, "chat_template", None) and not kwargs.get("chat_template"):
        raise ValueError(
            "This tokenizer has no chat template, so chat messages cannot be formatted. "
            "Pass a Jinja template explicitly (chat_template=...) or send a plain-text prompt."
        )
    kwargs.pop("tokenize", None)
    if isinstance(tokenizer, Encoder):  # the wrapper renders, the backend encodes
        kwargs.pop("return_dict", None)
        text = tokenizer.tokenizer.apply_chat_template(
            list(messages), add_generation_prompt=add_generation_prompt, tokenize=False, **kwargs
        )
        return tokenizer.encode(text, add_special_tokens=False)
    kwargs.setdefault("return_dict", False)
    result = tokenizer.apply_chat_template(
        list(messages), add_generation_prompt=add_generation_prompt, tokenize=True, **kwargs
    )
    return _as_id_list(result)


def eos_token_ids(
    model_dir: str | Path, tokenizer: PreTrainedTokenizerBase | None
) -> tuple[int, ...]:
    """Union (in order, without duplicates) of the generation config's and tokenizer's EOS ids."""
    ids = list(_generation_config_eos(Path(model_dir)))
    tokenizer_eos = getattr(tokenizer, "eos_token_id", None) if tokenizer is not None else None
    if tokenizer_eos is not None:
        ids.append(int(tokenizer_eos))
    return tuple(dict.fromkeys(ids))


def _generation_config_eos(model_dir: Path) -> list[int]:
    """``eos_token_id`` of ``generation_config.json`` (int or list) or ``[]`` when absent."""
    path = model_dir / "generation_config.json"
    if not path.is_file():
        return []
    with path.open(encoding="utf-8") as f:
        value = json.load(f).get("eos_token_id")
    if value is None:
        return []
    if isinstance(value, int):
        return [value]
    return [int(v) for v in value]


def _as_id_list(value: Any) -> list[int]:
    """Normalise what HF returns (list, BatchEncoding/dict, tensor, batch of one) to ``list[int]``."""
    if isinstance(value, Mapping):
        value = value["input_ids"]
    if hasattr(value, "tolist"):
        value = value.tolist()
    if not isinstance(value, Iterable):
        raise TypeError(f"Expected token ids, got {type(value).__name__}.")
    value = list(value)
    if len(value) == 1 and isinstance(value[0], (list, tuple)):
        value = list(value[0])
    return [int(v) for v in value]
