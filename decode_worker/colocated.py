"""The colocated worker: prefill and decode in one actor, plain continuous batching.

For small deployments, and the baseline of every disaggregation figure. A request's life::

    1. generate(request_id, prompt, params, client)   validate and queue (ValueError on bad input)
    2. the engine thread steps: chunked prefill, then one token per step, batched with others
    3. each step's deltas go out on ``outputs(client)`` (engine/runtime.py), one batch per step
    4. completion or abort(request_id)         frees its blocks (prompt blocks stay as cache)

It holds no role (``roles`` is empty): ``generate`` is its one request call, and an abort, the
engine's own (engine/runtime.py ``EngineWorker._abort``).
"""

from __future__ import annotations

from typing import Any

from engine.runtime import EngineWorker
from engine.sampling_params import SamplingParams
from engine.tracing import trace


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
        trace(request_id, "worker.called")

        def add() -> None:
            self.engine.add_request(request_id, prompt, params, **kwargs)
            self.register(request_id, client)

        await self.call(add)
