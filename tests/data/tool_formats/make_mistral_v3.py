"""Writes mistral_v3.json: Mistral tool-call strings rendered by mistral-common (Mistral's own
tokenizer library), a prompt with tools and the assistant's calls as the model writes them.

    pip install mistral-common==1.13.1 && python tests/data/tool_formats/make_mistral_v3.py
"""

from __future__ import annotations

import json
from pathlib import Path

from mistral_common.protocol.instruct.messages import AssistantMessage, ToolMessage, UserMessage
from mistral_common.protocol.instruct.request import ChatCompletionRequest
from mistral_common.protocol.instruct.tool_calls import Function, FunctionCall, Tool, ToolCall
from mistral_common.tokens.tokenizers.base import SpecialTokenPolicy
from mistral_common.tokens.tokenizers.mistral import MistralTokenizer

WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string"}, "unit": {"enum": ["celsius", "fahrenheit"]}},
    "required": ["city"],
}
TIME = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
TOOLS = [
    Tool(
        function=Function(name="get_weather", description="Weather of a city", parameters=WEATHER)
    ),
    Tool(function=Function(name="get_time", description="Time in a city", parameters=TIME)),
]
CALLS = [
    ToolCall(
        id="abcdefghi",
        function=FunctionCall(name="get_weather", arguments='{"city": "Paris", "unit": "celsius"}'),
    ),
    ToolCall(id="jklmnopqr", function=FunctionCall(name="get_time", arguments='{"city": "Tokyo"}')),
]


def cases(tok: MistralTokenizer) -> list[dict]:
    """One and two calls, each as ``tok``'s encoder writes the assistant's turn: the prompt,
    the answer (up to its end-of-turn) and the calls, special tokens kept."""
    text = tok.instruct_tokenizer.tokenizer

    def decode(ids: list[int]) -> str:
        return text.decode(ids, special_token_policy=SpecialTokenPolicy.KEEP)

    question = [UserMessage(content="Weather in Paris and time in Tokyo?")]
    prompt = tok.encode_chat_completion(ChatCompletionRequest(tools=TOOLS, messages=question))
    out = []
    for k in (1, 2):
        # the answer is read out of a conversation that goes on (a prompt may not end in it)
        results = [ToolMessage(content='{"ok": true}', tool_call_id=c.id) for c in CALLS[:k]]
        turn = [AssistantMessage(content=None, tool_calls=CALLS[:k]), *results]
        full = tok.encode_chat_completion(
            ChatCompletionRequest(tools=TOOLS, messages=question + turn)
        )
        assert full.tokens[: len(prompt.tokens)] == prompt.tokens
        rest = full.tokens[len(prompt.tokens) :]
        answer = rest[: rest.index(text.eos_id)]
        calls = [{"name": c.function.name, "arguments": c.function.arguments} for c in CALLS[:k]]
        out.append({"prompt": decode(prompt.tokens), "answer": decode(answer), "calls": calls})
    return out


def main() -> None:
    out = {
        "source": "mistral-common==1.13.1 (PyPI), MistralTokenizer.v3(), special tokens kept; "
        "written by make_mistral_v3.py (SentencePiece spaces show as U+2581)",
        "cases": cases(MistralTokenizer.v3()),
    }
    path = Path(__file__).with_name("mistral_v3.json")
    path.write_text(json.dumps(out, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")


if __name__ == "__main__":
    main()
