"""Checks through the official openai client that the server tests share (tests/test_serve.py
on a disaggregated cluster, tests/test_serve_gateways.py on a colocated one)."""

from __future__ import annotations

from collections import defaultdict

PROMPT = "The capital of France is"
QUESTION = [{"role": "user", "content": "Name three colors."}]


def _streamed(chunks, chat: bool) -> tuple[dict[int, str], dict[int, str]]:
    """Per choice index: the text the frames add up to, and its finish reason."""
    texts: dict[int, str] = defaultdict(str)
    finish: dict[int, str] = {}
    for chunk in chunks:
        for c in chunk.choices:
            texts[c.index] += (c.delta.content or "") if chat else c.text
            if c.finish_reason is not None:
                assert c.index not in finish, f"choice {c.index} finished twice"
                finish[c.index] = c.finish_reason
    return dict(texts), finish


def check_n_samples(client, model: str) -> None:
    """``n`` = 2 and 3, streamed and not, with logprobs, on /v1/completions and
    /v1/chat/completions: every choice is there once, greedy choices are the n = 1 answer,
    seeded samples are the same streamed or not, usage counts every choice's tokens."""
    one = client.completions.create(model=model, prompt=PROMPT, max_tokens=6, temperature=0)
    greedy = one.choices[0].text
    assert greedy
    for n in (2, 3):
        args = dict(model=model, prompt=PROMPT, max_tokens=6, temperature=0, n=n, logprobs=2)
        out = client.completions.create(**args)
        assert sorted(c.index for c in out.choices) == list(range(n))
        assert [c.text for c in out.choices] == [greedy] * n
        assert all(len(c.logprobs.tokens) == len(c.logprobs.top_logprobs) for c in out.choices)
        assert out.usage.completion_tokens == sum(len(c.logprobs.tokens) for c in out.choices)
        texts, finish = _streamed(client.completions.create(**args, stream=True), chat=False)
        assert texts == dict.fromkeys(range(n), greedy) and sorted(finish) == list(range(n))

        chat = dict(
            model=model,
            messages=QUESTION,
            max_tokens=8,
            temperature=1.0,
            seed=11,
            n=n,
            logprobs=True,
            top_logprobs=2,
        )
        out = client.chat.completions.create(**chat)
        assert sorted(c.index for c in out.choices) == list(range(n))
        contents = {c.index: c.message.content for c in out.choices}
        assert all(contents.values())
        assert out.usage.completion_tokens == sum(len(c.logprobs.content) for c in out.choices)
        texts, finish = _streamed(client.chat.completions.create(**chat, stream=True), chat=True)
        assert texts == contents and sorted(finish) == list(range(n))
