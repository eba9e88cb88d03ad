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
        (refused,) = await self.generate_many([(request_id, prompt, params, kwargs)], client)
        if refused is not None:
            kind, message = refused
            raise (ValueError if kind == "invalid" else RuntimeError)(message)

    async def generate_many(
        self, items: list[tuple[str, list[int], SamplingParams, dict[str, Any]]], client: str = ""
    ) -> list[tuple[str, str] | None]:
        """``generate`` for several requests, ``(request_id, prompt, params, kwargs)`` each, in
        one actor call and one hop to the engine thread: the router sends the starts of a
        burst together (router/dispatch.py ``_Starts``), where one call each cost its event
        loop ~0.5 ms of Ray's client work a request. Per request, None (queued) or why not:
        ``("invalid", message)`` for bad input, ``("failed", message)`` for anything else, so
        one request's problem is never another's."""
        for request_id, *_ in items:
            trace(request_id, "worker.called")

        def add() -> list[tuple[str, str] | None]:
            out: list[tuple[str, str] | None] = []
            for request_id, prompt, params, kwargs in items:
                try:
                    self.engine.add_request(request_id, prompt, params, **kwargs)
                    self.register(request_id, client)
                except ValueError as exc:
                    out.append(("invalid", str(exc) or "invalid request"))
                except Exception as exc:  # noqa: BLE001 - that request's, reported to its caller
                    out.append(("failed", f"{type(exc).__name__}: {exc}"))
                else:
                    out.append(None)
            return out

        return await self.call(add)
