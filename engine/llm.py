"""Offline batch API: ``LLM(model=...).generate(prompts, SamplingParams(...))``."""

from __future__ import annotations

import sys
import time
from collections.abc import Mapping, Sequence
from typing import Any

from engine.config import EngineConfig
from engine.llm_engine import LLMEngine, PromptType
from engine.model_hub import resolve_model
from engine.outputs import RequestOutput
from engine.sampling_params import SamplingParams
from engine.tokenizer import apply_chat_template

Message = Mapping[str, Any]


PROGRESS_EVERY_S = 5.0  # use_tqdm's progress into a log: a line this often


class LLM:
    def __init__(
        self,
        model: str = "smollm2",
        *,
        dtype: str = "float32",
        device: str = "cpu",
        block_size: int | None = None,  # None: the device's default (EngineConfig)
        num_kv_blocks: int | None = None,
        max_num_batched_tokens: int | None = None,  # None: the device's default (EngineConfig)
        max_num_seqs: int | None = None,
        max_model_len: int | None = None,
        enable_prefix_caching: bool = True,
        load_format: str = "auto",
        seed: int = 0,
        tensor_parallel_size: int = 1,
        **kwargs: Any,
    ):
        """``tensor_parallel_size`` > 1 splits the model over that many ranks, started here as
        child processes (``close()`` stops them; so does leaving a ``with`` block)."""
        cfg = EngineConfig(
            model_dir=str(resolve_model(model)),
            dtype=dtype,
            device=device,
            block_size=block_size,
            num_kv_blocks=num_kv_blocks,
            max_num_batched_tokens=max_num_batched_tokens,
            max_num_seqs=max_num_seqs,
            max_model_len=max_model_len,
            enable_prefix_caching=enable_prefix_caching,
            load_format=load_format,
            seed=seed,
            tensor_parallel_size=tensor_parallel_size,
            **kwargs,
        )
        self.engine = LLMEngine(cfg)

    def close(self) -> None:
        """Stop the tensor-parallel ranks (nothing to do on one device)."""
        self.engine.close()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def reset_prefix_cache(self) -> bool:
        """Forget the cached prompt prefixes (``LLMEngine.reset_prefix_cache``): a workload
        run again then prefills again. False while requests are unfinished."""
        return self.engine.reset_prefix_cache()

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        priority: Sequence[int] | None = None,
        use_tqdm: bool = False,
    ) -> list[RequestOutput]:
        """Run every prompt to completion; outputs come back in input order."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]  # one prompt: text or a flat list of token ids
        params = _per_prompt(sampling_params, len(prompts))
        for p in params:  # offline nothing runs yet: a spec that does not compile raises here
            if p.structured is not None:
                self.engine.structured_outputs().compile(p.structured)
        ids = []
        try:
            for i, (prompt, p) in enumerate(zip(prompts, params, strict=True)):
                prio = priority[i] if priority is not None else 0
                ids.append(self.engine.add_request(None, prompt, p, priority=prio))
        except ValueError:
            self.engine.abort_request(ids)
            raise
        return self._run(ids, use_tqdm)

    def chat(
        self,
        messages: Sequence[Message] | Sequence[Sequence[Message]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
        use_tqdm: bool = False,
    ) -> list[RequestOutput]:
        if self.tokenizer is None:
            raise ValueError("this model folder has no tokenizer, so chat is unavailable")
        conversations = [messages] if messages and isinstance(messages[0], Mapping) else messages
        kwargs = {"chat_template": chat_template} if chat_template else {}
        prompts = [
            apply_chat_template(self.tokenizer, conv, add_generation_prompt, **kwargs)
            for conv in conversations
        ]
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)

    def _run(self, ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        final: dict[str, RequestOutput] = {}
        t0, done = time.perf_counter(), 0
        # progress: one line rewritten on a terminal; into a file or a pipe (a log), a line
        # every PROGRESS_EVERY_S, not one per request
        tty, shown = sys.stderr.isatty(), t0
        # Only finished requests' outputs are kept, so only those are made (output kind
        # "final", as vLLM's LLM.generate asks for FINAL_ONLY).
        kind, self.engine.output_kind = self.engine.output_kind, "final"
        try:
            while self.engine.has_unfinished_requests():
                for out in self.engine.step():
                    final[out.request_id] = out
                    done += 1
                    now = time.perf_counter()
                    if use_tqdm and (tty or now - shown >= PROGRESS_EVERY_S or done == len(ids)):
                        shown = now
                        line = f"{done}/{len(ids)} requests, {done / (now - t0):.1f} req/s"
                        print(
                            f"\r{line}" if tty else line, end="" if tty else "\n", file=sys.stderr
                        )
        finally:
            self.engine.output_kind = kind
        if use_tqdm and tty:
            print(file=sys.stderr)
        return [final[i] for i in ids]


def _per_prompt(params, n: int) -> list[SamplingParams]:
    if params is None:
        return [SamplingParams()] * n
    if isinstance(params, SamplingParams):
        return [params] * n
    if len(params) != n:
        raise ValueError(f"got {len(params)} SamplingParams for {n} prompts")
    return list(params)
