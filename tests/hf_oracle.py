"""The correctness oracle shared by the tests: transformers' greedy generate, and random tiny
Llama-family configs to run it on."""

from __future__ import annotations

TINY_CONFIG = dict(
    vocab_size=320,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    initializer_range=0.2,  # larger than usual: random logits far from ties
    eos_token_id=None,
    bos_token_id=None,
    pad_token_id=None,
)


def tiny_config(**overrides) -> dict:
    """Keyword arguments of a random tiny Llama-family HF config (no eos: runs never stop early)."""
    return {**TINY_CONFIG, **overrides}


# The shape the GPU tests use (bf16 kernels want wider heads than TINY_CONFIG's).
GPU_TINY = dict(
    vocab_size=512,
    hidden_size=256,
    intermediate_size=512,
    num_attention_heads=8,
    num_hidden_layers=4,
    num_key_value_heads=2,
)


# The tensor-parallel GPU tests' shape: 8 query heads and tiny_config's 2 KV heads (one per rank
# at TP 2), a vocabulary of 511 that TP 2 pads.
TP_GPU_TINY = dict(vocab_size=511, hidden_size=128, intermediate_size=256, num_attention_heads=8)


def save_tiny_model(tmp_path_factory, name: str, **overrides):
    """A random tiny Llama (transformers-built, seed 0) saved to a fresh folder: the model (in
    eval mode, on the CPU) and its path."""
    import torch
    import transformers

    torch.manual_seed(0)
    path = tmp_path_factory.mktemp(name)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**tiny_config(**overrides)))
    model.save_pretrained(path)
    return model.eval(), str(path)


def save_tiny(tmp_path_factory, name: str, **overrides) -> str:
    """``save_tiny_model``'s path alone."""
    return save_tiny_model(tmp_path_factory, name, **overrides)[1]


def hf_greedy_ids(model, prompt: list[int], max_new_tokens: int, stop_at_eos: bool = False):
    """The oracle: transformers' greedy ``generate`` on one unpadded prompt."""
    import torch

    x = torch.tensor([prompt], device=model.device)
    kwargs = {} if stop_at_eos else {"eos_token_id": None, "pad_token_id": 0}
    with torch.no_grad():
        out = model.generate(
            x,
            attention_mask=torch.ones_like(x),  # explicit: no token is padding
            max_new_tokens=max_new_tokens,
            do_sample=False,
            **kwargs,
        )
    return out[0, len(prompt) :].tolist()


# Batched and one-at-a-time fp32 logits differ by about 6e-5 on SmolLM2 (measured on the 2-core
# CPU); a prompt whose greedy path comes closer to a tie than this at any step is recomputed alone.
BATCH_TIE_MARGIN = 1e-3
# A prompt joins a batch of longer ones if it needs at most this many pad tokens: padding costs
# prefill compute, a batch of its own costs a decode pass.
BATCH_MAX_PAD = 256


def hf_greedy_ids_batch(
    model, prompts: list[list[int]], max_new_tokens: int, stop_at_eos: bool = False
) -> list[list[int]]:
    """``hf_greedy_ids`` of each prompt, from left-padded batched ``generate`` calls.

    A GEMV-bound CPU decodes a batch of a dozen in about the time of one sequence. Batching changes
    the fp32 logits by rounding only, so a prompt's tokens are ``hf_greedy_ids``' whenever the top
    logit beat the runner-up by ``BATCH_TIE_MARGIN`` at every step; the prompts where it did not
    are recomputed one at a time with ``hf_greedy_ids`` itself, as is a prompt alone in its batch.
    Identical prompts run once."""
    unique = sorted(set(map(tuple, prompts)), key=len, reverse=True)
    groups: list[list[tuple[int, ...]]] = []
    for p in unique:
        if groups and len(groups[-1][0]) - len(p) <= BATCH_MAX_PAD:
            groups[-1].append(p)
        else:
            groups.append([p])
    by_prompt = {}
    for group in groups:
        if len(group) == 1:
            by_prompt[group[0]] = hf_greedy_ids(model, list(group[0]), max_new_tokens, stop_at_eos)
        else:
            by_prompt |= _greedy_batch(model, group, max_new_tokens, stop_at_eos)
    return [by_prompt[tuple(p)] for p in prompts]


def _greedy_batch(model, group, max_new_tokens: int, stop_at_eos: bool) -> dict:
    import torch

    width = len(group[0])
    x = torch.tensor([[0] * (width - len(p)) + list(p) for p in group], device=model.device)
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in group])
    kwargs = {} if stop_at_eos else {"eos_token_id": None, "pad_token_id": 0}
    with torch.no_grad():
        out = model.generate(
            x,
            attention_mask=mask.to(model.device),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            output_logits=True,
            return_dict_in_generate=True,
            **kwargs,
        )
    tokens = out.sequences[:, width:].cpu()
    logits = torch.stack(out.logits, dim=1).float().cpu()  # (prompt, step, vocab)
    lengths = torch.full((len(group),), tokens.shape[1])
    if stop_at_eos:  # each row ends at its first eos (a finished row is padded after it)
        eos = model.generation_config.eos_token_id
        eos = torch.tensor([eos] if isinstance(eos, int) else list(eos or []), dtype=torch.long)
        for i, row in enumerate(tokens):
            hits = torch.isin(row, eos).nonzero()
            if len(hits):
                lengths[i] = int(hits[0]) + 1
    live = torch.arange(tokens.shape[1])[None, :] < lengths[:, None]
    greedy = logits.argmax(dim=-1) == tokens
    assert bool((greedy | ~live).all()), "generate's greedy tokens are not argmaxes"
    top2 = logits.topk(2, dim=-1).values
    gap = (top2[..., 0] - top2[..., 1]).masked_fill(~live, float("inf"))
    close = gap.amin(dim=-1) < BATCH_TIE_MARGIN
    return {
        p: hf_greedy_ids(model, list(p), max_new_tokens, stop_at_eos)
        if near_tie
        else row[:n].tolist()
        for p, row, n, near_tie in zip(group, tokens, lengths.tolist(), close.tolist(), strict=True)
    }
