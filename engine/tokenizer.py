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


def encode_prompt(tokenizer: PreTrainedTokenizerBase, text: str) -> list[int]:
    """Token ids of ``text``, with special tokens (e.g. BOS) added as HF does by default."""
    return _as_id_list(tokenizer(text)["input_ids"])


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
