"""Writes mistral_v11.json: tool calls in the newer Mistral syntax, ``[TOOL_CALLS]name[ARGS]{...}``
(v11 adds ``[CALL_ID]id`` after the name; v13 drops it), rendered by mistral-common's own
instruct tokenizers (InstructTokenizerV11 / V13, as Mistral Small 3.x, Devstral and Magistral
use), the answer text of each case with special tokens kept.

mistral-common ships no v11/v13 tokenizer file, so this takes its bundled v3 Tekken file and
declares the v11 control tokens in it (the deprecated default list plus ``[ARGS]`` and
``[CALL_ID]`` at ranks 32 and 33, as Mistral's released v11 files have them): only the text of
the calls matters here, and that comes from mistral-common's encoder unchanged.

    pip install mistral-common==1.13.1 && python tests/data/tool_formats/make_mistral_v11.py
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

from make_mistral_v3 import cases
from mistral_common.tokens.tokenizers.mistral import MistralTokenizer
from mistral_common.tokens.tokenizers.tekken import Tekkenizer


def tokenizer(version: str, folder: Path) -> MistralTokenizer:
    model = json.loads((MistralTokenizer._data_path() / "tekken_240911.json").read_text())
    special = [
        {"rank": t["rank"], "token_str": str(t["token_str"]), "is_control": True}
        for t in Tekkenizer.DEPRECATED_SPECIAL_TOKENS
    ]
    special += [  # (a token's rank is its place in this list)
        {"rank": i, "token_str": Tekkenizer.SPECIAL_TOKEN_TEMPLATE.format(id=i), "is_control": True}
        for i in range(len(special), 32)
    ]
    special += [
        {"rank": 32, "token_str": "[ARGS]", "is_control": True},
        {"rank": 33, "token_str": "[CALL_ID]", "is_control": True},
    ]
    model["special_tokens"] = special
    model["config"]["version"] = version
    model.pop("image", None)
    path = folder / f"tekken_{version}.json"
    path.write_text(json.dumps(model))
    return MistralTokenizer.from_file(path)


def main() -> None:
    out = {
        "source": "mistral-common==1.13.1 (PyPI), InstructTokenizerV11 and V13 over its bundled "
        "tekken_240911.json with [ARGS] and [CALL_ID] declared; special tokens kept; written by "
        "make_mistral_v11.py",
        "versions": {},
    }
    with tempfile.TemporaryDirectory() as folder:
        for version in ("v11", "v13"):
            tok = tokenizer(version, Path(folder))
            out["versions"][version] = [
                {k: v for k, v in case.items() if k != "prompt"} for case in cases(tok)
            ]
    path = Path(__file__).with_name("mistral_v11.json")
    path.write_text(json.dumps(out, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")


if __name__ == "__main__":
    main()
