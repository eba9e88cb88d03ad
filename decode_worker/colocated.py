"""The colocated worker: prefill and decode in one actor, plain continuous batching.

For small deployments, and the baseline of every disaggregation figure. A request's life::

    1. generate(request_id, prompt, params, client)   validate and queue (ValueError on bad input)
    2. the engine thread steps: chunked prefill, then one token per step, batched with others
    3. each step's deltas go out on ``outputs(client)`` (engine/runtime.py), one batch per step
    4. completion or abort(request_id)         frees its blocks (prompt blocks stay as cache)

It holds no role (``roles`` is empty): ``generate`` is its one request call (``generate_many``
for several at once: the router's way), and an abort, the engine's own (engine/runtime.py
``EngineWorker._abort``).
"""

from __future__ import annotations

from typing import Any

from engine.runtime import EngineWorker
from engine.sampling_params import SamplingParams


class ColocatedWorker(EngineWorker):
    role = "colocated"
    length_probe = "auto"

    async def generate(
        self,
        request_id: str,
        prompt: list[int],
        params: SamplingParams,
        client: str = "",
        **kwargs: Any,
    ) -> None:
        """Queue a request (raises ValueError on bad input); its deltas go to
        ``outputs(client)``."""
        (refused,) = await self.generate_many([(request_id, prompt, params, kwargs)], client)
        if refused is not None:
            kind, message = refused
            raise (ValueError if kind == "invalid" else RuntimeError)(message)

    async def generate_many(
        self, items: list[tuple[str, list[int], SamplingParams, dict[str, Any]]], client: str = ""
    ) -> list[tuple[str, str] | None]:
        """``generate`` for several requests, ``(request_id, prompt, params, kwargs)`` each, in
        one actor call and one hop to the engine thread: the router sends the starts of a
        burst together (router/dispatch.py ``_Batch``), where one call each cost its event
        loop ~0.5 ms of Ray's client work a request. Per request, None (queued) or why not
        (``EngineWorker.add_requests``)."""
        return await self.add_requests(items, client)
