"""The colocated worker: prefill and decode in one actor, plain continuous batching.

For small deployments, and the baseline of every disaggregation figure. A request's life::

    1. generate(request_id, prompt, params)   validate and queue in the engine (errors raise)
    2. the engine thread steps: chunked prefill, then one token per step, batched with others
    3. stream(request_id)                      outputs as they are produced, last one finished
    4. completion or abort(request_id)         frees its blocks (prompt blocks stay as cache)
"""

from __future__ import annotations

from typing import Any

from cluster.worker import EngineWorker
from engine.sampling_params import SamplingParams


class ColocatedWorker(EngineWorker):
    role = "colocated"

    async def generate(
        self, request_id: str, prompt: str | list[int], params: SamplingParams, **kwargs: Any
    ) -> None:
        """Queue a request; read its outputs with ``stream(request_id)``."""
        self._open_stream(request_id)
        try:
            await self.call(lambda: self.engine.add_request(request_id, prompt, params, **kwargs))
        except BaseException:
            self._streams.pop(request_id, None)
            raise
