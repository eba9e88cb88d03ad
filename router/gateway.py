"""The OpenAI-compatible HTTP gateway: FastAPI in front of a ``router.backend.Backend``.

One completion request through it::

    1. auth middleware        Bearer key (hmac.compare_digest) on every route but /health: 401;
                              request headers over ``max_header_bytes``: 431
    2. body                   read before any slot is taken, within ``body_timeout_s`` (408);
                              Content-Length and the bytes actually read <= max_body_bytes: 413
    3. admission              ``n`` free slots of ``max_concurrent`` (a request of n samples
                              is n requests' work) or 429 + Retry-After at once; while the
                              gateway drains (shutting down): 503 + Retry-After
    4. protocol               template + tokenize (one worker thread, off the event loop),
                              SamplingParams, context check: 400s (router/protocol.py)
    5. backend.open           placement known: CapacityError -> 429/503 + Retry-After,
                              RequestError -> 400, ClusterError -> 500 (``api_error``: the
                              one translation of router/errors.py into HTTP)
    6a. stream                SSE frames; an error after the first byte goes in-band, then
                              [DONE]; the client going away, or not reading for
                              ``write_timeout_s`` (a send that does not complete), ends it
    6b. no stream             outputs collected while a watcher waits for http.disconnect
    7. close                  Generation.aclose() and the slot's release, always, shielded from
                              cancellation, once the response ends or the client is gone

Shutdown (``drain``): new requests get 503 + Retry-After; those in flight have until the
deadline to finish, then each ends with an error (in-band for a stream, a 503 otherwise).

Routes: POST /v1/completions, /v1/chat/completions, /tokenize, /detokenize (these two take a
slot each: the tokenizer thread is bounded as the rest); GET /v1/models, /v1/models/{model},
/health, /metrics; the operator's /admin routes (router/admin.py: migrate, drain, rebalance;
their own admin keys, else the API keys, else loopback clients only). Every error is OpenAI JSON
(``protocol.APIError``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from functools import partial
from typing import Any

import anyio
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from engine.aio import within
from engine.grammar import DEFAULT_BACKEND, Grammars, make_backend
from engine.sampling_params import SamplingParams, StructuredSpec
from engine.tokenizer import BatchedEncoder
from engine.tracing import trace
from router import admin, protocol
from router.auth import bearer_matches
from router.backend import Backend, Generation
from router.chat_output import ChatFormat
from router.errors import CapacityError, ClusterError, RequestError
from router.metrics import GatewayMetrics, RequestTimer
from router.outputs import Answer, Step
from router.predictor import ORACLE_HEADER, PredictInput
from router.protocol import APIError

logger = logging.getLogger("tandem.gateway")

HEALTH_TIMEOUT_S = 5.0
# threads that parse and render prompts (their encodes batch in one BatchedEncoder)
PROMPT_THREADS = 8
# A completion's text prompt, or a chat's text without tools, up to this long is encoded (and
# rendered) on the event loop (~0.05-0.3 ms), not on a tokenizer thread: the thread's answer
# would wait behind a burst's other new requests.
INLINE_PROMPT_CHARS = 2048
_BACKGROUND: set[asyncio.Task] = set()  # cleanups that outlive a cancelled request task


def create_app(
    backend: Backend,
    *,
    api_keys: Sequence[str] = (),
    admin_keys: Sequence[str] = (),
    max_body_bytes: int = 8 << 20,
    max_concurrent: int = 256,
    body_timeout_s: float = 30.0,
    write_timeout_s: float = 30.0,
    max_header_bytes: int = 16 << 10,
    tool_call_parser: str = "auto",
    reasoning_parser: str = "auto",
) -> FastAPI:
    """The gateway app over ``backend``. ``api_keys`` empty: no auth. ``admin_keys``: the keys
    of the /admin routes (none: the API keys guard them, or with no keys at all only loopback
    clients may call them). ``max_body_bytes``: larger bodies get 413. ``max_concurrent``:
    sequences in flight at once (a request of ``n`` samples counts n, from admission to the end
    of the response); more get 429 with Retry-After: 1, never a queue. ``body_timeout_s``: the
    whole body must arrive within it (408). ``write_timeout_s``: a streamed frame the client
    does not take within it ends the stream. ``max_header_bytes``: larger request headers get
    431. ``tool_call_parser`` / ``reasoning_parser``: how chat answers are read (``auto``: by
    the model's chat template; router/chat_output.py). ``app.state.gateway.drain`` shuts it
    down gracefully."""
    if min(max_concurrent, max_body_bytes, max_header_bytes) < 1:
        raise ValueError(
            f"max_concurrent, max_body_bytes and max_header_bytes must be >= 1, got "
            f"{max_concurrent}, {max_body_bytes} and {max_header_bytes}"
        )
    if body_timeout_s <= 0 or write_timeout_s <= 0:
        raise ValueError("body_timeout_s and write_timeout_s must be > 0")
    gateway = _Gateway(backend, max_body_bytes, max_concurrent, body_timeout_s, write_timeout_s)
    if backend.tokenizer is not None:  # a bad setting fails here, before anything serves
        gateway.chat_format = ChatFormat.of(backend.tokenizer, tool_call_parser, reasoning_parser)
    app = FastAPI(title="tandem", version="0.1.0")
    app.state.gateway = gateway
    if api_keys:
        app.add_middleware(
            _AuthMiddleware,
            keys=list(api_keys),
            metrics=gateway.metrics,
            admin_keyed=bool(admin_keys),
        )
    app.add_middleware(_HeaderLimit, limit=max_header_bytes)
    _install_error_handlers(app, gateway.metrics)
    app.post("/v1/completions")(gateway.completions)
    app.post("/v1/chat/completions")(gateway.chat_completions)
    app.get("/v1/models")(gateway.models)
    app.get("/v1/models/{model:path}")(gateway.model)
    app.post("/tokenize")(gateway.tokenize)
    app.post("/detokenize")(gateway.detokenize)
    app.get("/health")(gateway.health)
    app.get("/metrics")(gateway.scrape)
    admin.install(
        app,
        backend,
        admin_keys=admin_keys,
        api_keys=bool(api_keys),
        read_body=gateway._read_body,
    )
    return app


# ----------------------------------------------------------------------------------- plumbing


class _AuthMiddleware:
    """401 unless ``Authorization: Bearer <one of keys>``; /health is always open, and so is
    /admin when ``admin_keyed`` (its routes then ask for an admin key themselves)."""

    def __init__(
        self, app: ASGIApp, keys: list[str], metrics: GatewayMetrics, admin_keyed: bool = False
    ) -> None:
        self.app = app
        self.keys = [k.encode() for k in keys]
        self.metrics = metrics
        self.admin_keyed = admin_keyed

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or self._open(scope["path"]) or self._authorized(scope):
            await self.app(scope, receive, send)
            return
        self.metrics.reject("auth")
        err = APIError(
            401,
            "missing or invalid API key: send 'Authorization: Bearer <key>'",
            type="authentication_error",
            code="invalid_api_key",
            headers={"WWW-Authenticate": "Bearer"},
            reason="auth",
        )
        await _error_response(err)(scope, receive, send)

    def _open(self, path: str) -> bool:
        return path == "/health" or (self.admin_keyed and admin.is_admin_path(path))

    def _authorized(self, scope: Scope) -> bool:
        header = dict(scope.get("headers") or ()).get(b"authorization", b"")
        return bearer_matches(header, self.keys)


class _HeaderLimit:
    """431 for requests whose headers total more than ``limit`` bytes (h11 also refuses them
    while parsing; httptools' parser has no limit of its own, so this is where it holds)."""

    def __init__(self, app: ASGIApp, limit: int) -> None:
        self.app = app
        self.limit = limit

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            size = sum(len(k) + len(v) + 4 for k, v in scope["headers"])
            if size > self.limit:
                err = APIError(
                    431,
                    f"the request headers total {size} bytes, more than {self.limit}",
                    code="request_header_fields_too_large",
                    reason="too_large",
                )
                await _error_response(err)(scope, receive, send)
                return
        await self.app(scope, receive, send)


def _error_response(err: APIError) -> JSONResponse:
    return JSONResponse(err.body(), status_code=err.status, headers=err.headers)


def _install_error_handlers(app: FastAPI, metrics: GatewayMetrics) -> None:
    async def api_error(request: Request, exc: APIError) -> Response:
        if exc.reason is not None:
            metrics.reject(exc.reason)
        return _error_response(exc)

    async def validation(request: Request, exc: RequestValidationError) -> Response:
        return await api_error(request, protocol.validation_error(list(exc.errors())))

    async def http_error(request: Request, exc: StarletteHTTPException) -> Response:
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return _error_response(APIError(exc.status_code, str(exc.detail), type=kind, reason=None))

    async def unexpected(request: Request, exc: Exception) -> Response:
        # Starlette re-raises after this response and the server then drops the connection:
        # say so, or a client's next request on it is lost
        logger.exception("unhandled error in %s", request.url.path)
        err = _server_error("internal error")
        err.headers["Connection"] = "close"
        return _error_response(err)

    app.add_exception_handler(APIError, api_error)
    app.add_exception_handler(RequestValidationError, validation)
    app.add_exception_handler(StarletteHTTPException, http_error)
    app.add_exception_handler(Exception, unexpected)


def _server_error(message: str) -> APIError:
    return APIError(500, message, type="server_error", code="internal_error", reason=None)


def api_error(exc: BaseException) -> APIError:
    """The HTTP error of a request's failure behind the gateway (router/errors.py): the one
    place the router's errors become status codes and OpenAI error JSON."""
    if isinstance(exc, CapacityError):
        return APIError(
            exc.status,
            f"the cluster is overloaded: {exc}",
            type="rate_limit_error" if exc.status == 429 else "service_unavailable_error",
            code="overloaded",
            headers={"Retry-After": protocol.retry_after(exc.retry_after_s)},
            reason="overloaded",
        )
    if isinstance(exc, RequestError):
        return protocol.bad_request(str(exc), param=protocol.param_named(str(exc)))
    if isinstance(exc, ClusterError):
        return _server_error(f"the request failed in the cluster: {exc}")
    logger.error("unexpected backend error", exc_info=exc)
    return _server_error("internal error")


async def _shielded(coro: Awaitable[None]) -> None:
    """Run ``coro`` to the end even if the caller is cancelled (it goes on as a task)."""
    task = asyncio.ensure_future(coro)
    _BACKGROUND.add(task)
    task.add_done_callback(_BACKGROUND.discard)
    with anyio.CancelScope(shield=True):
        await asyncio.shield(task)


class _Slots:
    """The gateway's concurrency bound: take slots or be refused, never wait."""

    def __init__(self, limit: int, metrics: GatewayMetrics) -> None:
        self.limit = limit
        self.in_use = 0
        self._gauge = metrics.in_flight

    def try_take(self, count: int = 1) -> bool:
        if self.in_use + count > self.limit:
            return False
        self.in_use += count
        self._gauge.inc(count)
        return True

    def give_back(self, count: int = 1) -> None:
        self.in_use -= count
        self._gauge.dec(count)


class _Call:
    """One admitted request: owns its slots and, once opened, a Generation. ``stop`` ends it
    early with an error (the gateway shutting down): a stream gets it in-band."""

    def __init__(self, slots: _Slots, count: int, calls: set[_Call]) -> None:
        self._slots = slots
        self._count = count
        self._calls = calls
        calls.add(self)
        self.generation: Generation | None = None
        self.stopped: APIError | None = None
        self.stop_event = asyncio.Event()
        self.stream_scope: anyio.CancelScope | None = None  # set while a stream is written
        self._closed = False

    def stop(self, err: APIError) -> None:
        if self.stopped is None:
            self.stopped = err
            self.stop_event.set()
            if self.stream_scope is not None:
                self.stream_scope.cancel()

    async def close(self) -> None:
        """Abort the generation (a no-op if it finished) and free the slots; idempotent. Runs
        to the end even when the caller is being cancelled (the usual case: a client went
        away)."""
        if not self._closed:
            self._closed = True
            self._calls.discard(self)
            await _shielded(self._release())

    async def _release(self) -> None:
        try:
            if self.generation is not None:
                await self.generation.aclose()
        except Exception:
            logger.warning("Generation.aclose failed", exc_info=True)
        finally:
            self._slots.give_back(self._count)


class _SSEResponse(StreamingResponse):
    """Server-sent events that always end with the call's ``close``: the stream finishing,
    failing, the client disconnecting (seen on receive, or as OSError on send), a frame not
    taken within ``write_timeout_s``, the task being cancelled, or the call being stopped (its
    error then goes out in-band before the end)."""

    media_type = "text/event-stream"

    def __init__(
        self,
        content: AsyncIterator[bytes],
        call: _Call,
        headers: dict[str, str],
        write_timeout_s: float,
    ) -> None:
        super().__init__(content, headers={**headers, "Cache-Control": "no-cache"})
        self._call = call
        self._write_timeout_s = write_timeout_s

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        sent = {"start": False, "end": False}
        # A frame's send is timed by one watcher per stream (``watch``), not by a timeout
        # scope per frame: at a token a frame, ``anyio.fail_after`` cost the gateway ~9 us
        # each, a tenth of a core at 14k frames/s.
        loop = asyncio.get_running_loop()
        sending_since: list[float | None] = [None]

        async def timed_send(message: Message) -> None:
            sending_since[0] = loop.time()
            try:
                await send(message)
            finally:
                sending_since[0] = None
            sent["start"] = True
            if message["type"] == "http.response.body" and not message.get("more_body"):
                sent["end"] = True

        async def watch(everything: anyio.CancelScope) -> None:
            """End the response when a frame has not been taken within ``write_timeout_s``
            (the client stopped reading: the server's send blocks on a full socket)."""
            while True:
                await anyio.sleep(self._write_timeout_s / 4)
                since = sending_since[0]
                if since is not None and loop.time() - since > self._write_timeout_s:
                    everything.cancel()
                    return

        async def stream() -> None:
            # ASGI 2.4 servers: OSError when the client is gone (a frame not taken in time
            # ends the whole response: watch)
            with contextlib.suppress(OSError):
                with anyio.CancelScope() as cancel:
                    self._call.stream_scope = cancel
                    if self._call.stopped is None:
                        await self.stream_response(timed_send)
                err = self._call.stopped
                if err is not None and not sent["start"]:
                    await _error_response(err)(scope, receive, timed_send)
                elif err is not None and not sent["end"]:
                    end = protocol.sse(err.body()) + protocol.SSE_DONE
                    await timed_send({"type": "http.response.body", "body": end})

        try:
            async with anyio.create_task_group() as tg:

                async def stream_then_stop() -> None:
                    await stream()
                    tg.cancel_scope.cancel()

                tg.start_soon(stream_then_stop)
                tg.start_soon(watch, tg.cancel_scope)
                await self.listen_for_disconnect(receive)
                tg.cancel_scope.cancel()
        finally:
            await _shielded(self._close())

    async def _close(self) -> None:
        try:
            await self.body_iterator.aclose()  # type: ignore[union-attr]
        finally:
            await self._call.close()


async def _client_gone(request: Request) -> None:
    """Returns when the client disconnects (the body has been read already)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


@dataclass(frozen=True)
class _Kind:
    """What differs between /v1/completions and /v1/chat/completions."""

    id_prefix: str
    obj: str  # the streamed chunks' "object"
    prompt_param: str


_COMPLETION = _Kind("cmpl", "text_completion", "prompt")
_CHAT = _Kind("chatcmpl", "chat.completion.chunk", "messages")


# ------------------------------------------------------------------------------------ routes


class _Gateway:
    def __init__(
        self,
        backend: Backend,
        max_body_bytes: int,
        max_concurrent: int,
        body_timeout_s: float = 30.0,
        write_timeout_s: float = 30.0,
    ) -> None:
        self.backend = backend
        self.max_body_bytes = max_body_bytes
        self.body_timeout_s = body_timeout_s
        self.write_timeout_s = write_timeout_s
        self.metrics = GatewayMetrics(backend.model_name)
        self.slots = _Slots(max_concurrent, self.metrics)
        self.calls: set[_Call] = set()
        self.draining = False
        self.texts = protocol.TokenTexts(backend.tokenizer)
        self.created = int(time.time())
        # Prompts are parsed and rendered on PROMPT_THREADS threads and encoded together by a
        # BatchedEncoder (engine/tokenizer.py: one encode_batch for the texts that arrive
        # while one runs, the GIL released) where its ids are the tokenizer's own; else on
        # one thread, as HF fast tokenizers are not safe to call from several at once.
        # Grammars compile on a thread of their own.
        self.encoder = BatchedEncoder.of(backend.tokenizer)
        self._prompt_tokenizer = self.encoder or backend.tokenizer
        threads = PROMPT_THREADS if self.encoder is not None else 1
        self._tokenizer_pool = ThreadPoolExecutor(threads, thread_name_prefix="tandem-tokenizer")
        self._grammar_pool = ThreadPoolExecutor(1, thread_name_prefix="tandem-grammar")
        self._grammars: Grammars | None = None  # structured outputs compiled here, made on use
        self.chat_format: ChatFormat | None = None  # (set by create_app from the tokenizer)

    async def completions(self, request: Request) -> Response:
        return await self._generate(request, _COMPLETION)

    async def chat_completions(self, request: Request) -> Response:
        return await self._generate(request, _CHAT)

    async def _generate(self, request: Request, kind: _Kind) -> Response:
        arrival = time.monotonic()
        request_id = f"{kind.id_prefix}-{uuid.uuid4().hex}"
        trace(request_id, "gw.received")
        try:
            body = await self._read_body(request)
            if kind is _CHAT:
                req = protocol.parse_body(protocol.ChatCompletionRequest, body)
            else:
                req = protocol.parse_body(protocol.CompletionRequest, body)
            self._check_model(req.model)
            call = self._admit(req.n)
        except APIError as exc:
            exc.headers.setdefault("x-request-id", request_id)
            raise
        handed_off = False
        try:
            response = await self._start(request, kind, req, request_id, arrival, call)
            handed_off = isinstance(response, _SSEResponse)  # it closes the call when it ends
            return response
        except APIError as exc:
            exc.headers.setdefault("x-request-id", request_id)
            raise
        except Exception:  # a bug: logged under the request id, a plain 500 to the client
            logger.exception("request %s failed", request_id)
            err = _server_error(f"internal error (request id {request_id})")
            err.headers["x-request-id"] = request_id
            raise err from None
        finally:
            if not handed_off:
                await call.close()

    def _admit(self, count: int = 1) -> _Call:
        """``count`` slots, or 503 while draining / 429 when the gateway is full (400 when it
        could never hold them)."""
        if self.draining:
            raise _shutting_down()
        if count > self.slots.limit:
            raise protocol.bad_request(
                f"n must be at most {self.slots.limit} here (the gateway's --max-concurrent), "
                f"got {count}",
                param="n",
            )
        if not self.slots.try_take(count):
            raise APIError(
                429,
                f"the gateway is at its limit of {self.slots.limit} sequences in flight"
                + (f" (this request needs {count})" if count > 1 else ""),
                type="rate_limit_error",
                code="too_many_requests",
                headers={"Retry-After": "1"},
                reason="concurrency_limit",
            )
        return _Call(self.slots, count, self.calls)

    async def _check_structured(self, req: Any, params: SamplingParams) -> None:
        """A structured-output spec that does not compile is a 400 naming the field and the
        problem, before anything runs (compiled on the tokenizer thread; cached here, and the
        worker compiles it again from its own cache). A tool grammar's problem is in a
        function's parameters: ``tools``."""
        if params.structured is None:
            return
        asked = protocol.structured_spec(req)
        param = asked[1] if asked is not None else "tools"
        loop = asyncio.get_running_loop()
        try:
            await loop.run_in_executor(self._grammar_pool, self._compile, params.structured)
        except ValueError as exc:
            raise protocol.bad_request(f"{param}: {exc}", param=param) from None
        self.metrics.structured(params.structured.kind)

    def _compile(self, spec: StructuredSpec) -> None:
        tokenizer = self.backend.tokenizer
        if tokenizer is None:
            raise ValueError("structured outputs need the model's tokenizer; this model has none")
        if self._grammars is None:
            eos = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
            self._grammars = Grammars(make_backend(DEFAULT_BACKEND, tokenizer, len(tokenizer), eos))
        self._grammars.compile(spec)

    async def drain(self, timeout_s: float) -> int:
        """Shut down gracefully: refuse new requests (503 + Retry-After), give those in flight
        ``timeout_s`` to finish, then end the rest with an error. Returns how many were
        ended that way."""
        self.draining = True
        deadline = time.monotonic() + timeout_s
        while self.calls and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        left = list(self.calls)
        for call in left:
            call.stop(_shutting_down("the server shut down before the request finished"))
        for _ in range(100):  # let them write their error and close
            if not self.calls:
                break
            await asyncio.sleep(0.02)
        return len(left)

    async def _start(
        self, request: Request, kind: _Kind, req: Any, request_id: str, arrival: float, call: _Call
    ) -> Response:
        read = None
        if kind is _CHAT:
            tools = protocol.chat_tools(req)
            fmt = self.chat_format
            params = protocol.chat_sampling_params(req, fmt, tools)
            await self._check_structured(req, params)
            render = protocol.ChatRender(fmt, tools, req.chat_template_kwargs)
            render.check()
            chat = (req.messages, req.add_generation_prompt, render)
            # A short conversation without tools is rendered and encoded here, as a short
            # completion text is (below); a long one, or one with tools, on the threads.
            if (
                self.encoder is not None
                and tools is None
                and (protocol.chat_chars(req.messages) <= INLINE_PROMPT_CHARS)
            ):
                ids, hints, thinking = _chat_prompt(*chat, self.encoder.inline)
            else:
                ids, hints, thinking = await self._tokenize(_chat_prompt, *chat)
            if fmt is not None and fmt.reads_anything(tools):
                read = partial(fmt.reader, tools, thinking)
            text = None
        else:
            params = protocol.completion_sampling_params(req)
            await self._check_structured(req, params)
            # Token ids are only checked, and a short text is encoded, here: the answer of a
            # hop through a tokenizer thread would wait on the event loop behind a whole
            # burst's new requests. A long text goes to the threads (batched, off the GIL).
            prompt = protocol.one_prompt(req)
            if not isinstance(prompt, str):
                text, ids = protocol.completion_prompt(req, self._prompt_tokenizer)
            elif self.encoder is not None and len(prompt) <= INLINE_PROMPT_CHARS:
                text, ids = protocol.completion_prompt(req, self.encoder.inline)
            else:
                text, ids = await self._tokenize(protocol.completion_prompt, req)
            hints = PredictInput(text=text)
        trace(request_id, "gw.tokenized")
        protocol.check_context(
            len(ids), params.max_tokens, self.backend.max_model_len, kind.prompt_param
        )
        oracle = request.headers.get(ORACLE_HEADER)
        hints = replace(
            hints,
            prompt_len=len(ids),
            max_tokens=params.max_tokens,
            headers={ORACLE_HEADER: oracle} if oracle is not None else {},
        )
        opening = self.backend.open(
            request_id,
            ids,
            params,
            prompt=text,
            priority=req.priority,
            cache_salt=req.cache_salt,
            hints=hints,
        )
        # until the first token: a client that goes away (or the gateway stopping) ends it (a
        # cancelled open closes its generation: the request is aborted everywhere)
        try:
            opened, call.generation = await _unless_gone(request, call, opening)
        except ClusterError as exc:
            raise api_error(exc) from None
        if not opened:
            return Response(status_code=499, headers={"x-request-id": request_id})
        trace(request_id, "gw.first_output")
        placement = call.generation.placement
        headers = {
            "x-request-id": request_id,
            "x-tandem-prefill": placement.prefill or "none",
            "x-tandem-decode": placement.decode,
        }
        if placement.predicted_tokens is not None:
            headers["x-tandem-predicted-tokens"] = str(placement.predicted_tokens)
        shape = protocol.Shape(
            request_id,
            int(time.time()),
            self.backend.model_name,
            params.logprobs,
            self.texts,
            stream_usage=req.include_usage,
            prompt_token_ids=list(ids) if req.return_token_ids else None,
            read=read,
            reasoning=read is not None and self.chat_format.reasoning is not None,  # type: ignore[union-attr]
        )
        timer = self.metrics.timer(arrival)
        if req.stream:
            frames = self._stream(call, kind, shape, params.n, req.include_usage, timer)
            return _SSEResponse(frames, call, headers, self.write_timeout_s)
        answer = Answer(request_id, ids, params.n, params.logprobs is not None, prompt=text)
        finished = await self._collect(request, call, answer, timer)
        if not finished:  # the client went away; nobody reads this
            return Response(status_code=499, headers=headers)
        build = protocol.chat_response if kind is _CHAT else protocol.completion_response
        return JSONResponse(build(shape, answer), headers=headers)

    async def _read_body(self, request: Request) -> bytes:
        too_large = APIError(
            413,
            f"the request body is larger than {self.max_body_bytes} bytes",
            code="request_too_large",
            reason="too_large",
        )
        length = request.headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > self.max_body_bytes:
            raise too_large
        chunks, size = [], 0
        try:
            with anyio.fail_after(self.body_timeout_s):
                async for chunk in request.stream():
                    size += len(chunk)
                    if size > self.max_body_bytes:
                        raise too_large
                    chunks.append(chunk)
        except ClientDisconnect:
            raise APIError(400, "the client disconnected while sending", reason=None) from None
        except TimeoutError:
            raise APIError(
                408,
                f"the request body did not arrive within {self.body_timeout_s:g} s",
                code="request_timeout",
                reason="body_timeout",
            ) from None
        return b"".join(chunks)

    def _check_model(self, model: str | None) -> None:
        if model is not None and model != self.backend.model_name:
            raise APIError(
                404,
                f"The model `{model}` does not exist; this server serves "
                f"`{self.backend.model_name}`.",
                type="not_found_error",
                param="model",
                code="model_not_found",
                reason="model_not_found",
            )

    async def _tokenize(self, fn: Callable[..., Any], *args: Any) -> Any:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._tokenizer_pool, fn, *args, self._prompt_tokenizer)

    async def _collect(
        self, request: Request, call: _Call, answer: Answer, timer: RequestTimer
    ) -> bool:
        """Fold the request's steps into ``answer``; False when the client disconnected
        first; the call's error when it is stopped first."""
        work = _final_output(call.generation, answer, timer)  # type: ignore[arg-type]
        finished, _ = await _unless_gone(request, call, work)
        return finished

    async def _stream(
        self,
        call: _Call,
        kind: _Kind,
        shape: protocol.Shape,
        n: int,
        include_usage: bool,
        timer: RequestTimer,
    ) -> AsyncIterator[bytes]:
        chunk = protocol.chat_chunk if kind is _CHAT else protocol.completion_chunk
        try:
            if kind is _CHAT:
                for index in range(n):
                    yield protocol.sse(protocol.chat_role_chunk(shape, index))
            last = None
            started: set[int] = set()  # choices whose first frame went out
            readers: dict[int, Any] = {}  # chat: each choice's reader (shape.read)
            try:
                async for step in call.generation.outputs():  # type: ignore[union-attr]
                    timer.observe(step)
                    _check_not_aborted(step)
                    for delta in step.choices:
                        if kind is _CHAT and shape.read is not None:
                            if delta.index not in readers:
                                readers[delta.index] = shape.read()
                            frame = chunk(shape, delta, readers[delta.index])
                            if frame is not None:
                                yield protocol.sse(frame)
                        elif kind is _CHAT:
                            yield protocol.sse(chunk(shape, delta))
                        else:
                            first = delta.index not in started
                            started.add(delta.index)
                            yield protocol.sse(chunk(shape, delta, first))
                    last = step
                _check_finished(last)
            except Exception as exc:  # the status line is sent: the error goes in-band
                err = exc if isinstance(exc, APIError) else api_error(exc)
                yield protocol.sse(err.body())
                yield protocol.SSE_DONE
                return
            timer.finish()
            if include_usage:
                yield protocol.sse(protocol.usage_chunk(shape, kind.obj, last.usage))
            yield protocol.SSE_DONE
        finally:
            await call.close()

    # -- small routes ------------------------------------------------------------------------

    async def models(self) -> dict[str, Any]:
        return {"object": "list", "data": [self._model_card()]}

    async def model(self, model: str) -> dict[str, Any]:
        self._check_model(model)
        return self._model_card()

    def _model_card(self) -> dict[str, Any]:
        name = self.backend.model_name
        return {
            "id": name,
            "object": "model",
            "created": self.created,
            "owned_by": "tandem",
            "root": name,
            "parent": None,
            "max_model_len": self.backend.max_model_len,
        }

    async def tokenize(self, request: Request) -> dict[str, Any]:
        req = protocol.parse_body(protocol.TokenizeRequest, await self._read_body(request))
        self._check_model(req.model)
        call = self._admit()
        try:
            return await self._tokenize_request(req)
        finally:
            await call.close()

    async def _tokenize_request(self, req: Any) -> dict[str, Any]:
        if (req.prompt is None) == (req.messages is None):
            raise protocol.bad_request("send exactly one of 'prompt' and 'messages'", "prompt")
        if req.messages is not None:
            ids = await self._tokenize(
                protocol.chat_prompt, req.messages, req.add_generation_prompt
            )
        else:
            treq = protocol.CompletionRequest(prompt=req.prompt)
            ids = (await self._tokenize(protocol.completion_prompt, treq))[1]
        return {"count": len(ids), "max_model_len": self.backend.max_model_len, "tokens": ids}

    async def detokenize(self, request: Request) -> dict[str, Any]:
        req = protocol.parse_body(protocol.DetokenizeRequest, await self._read_body(request))
        self._check_model(req.model)
        tokenizer = self.backend.tokenizer
        if tokenizer is None:
            raise protocol.bad_request("this model has no tokenizer", param="tokens")
        if req.tokens:
            protocol.check_token_ids(req.tokens, tokenizer, "tokens")
        call = self._admit()
        try:  # decoding a body's worth of ids is real work: off the event loop, bounded
            return {"prompt": await self._tokenize(_decode, req.tokens)}
        finally:
            await call.close()

    async def health(self) -> Response:
        """200 while a request can be placed, else 503 (also while draining); answered from
        the router's state (no worker is called), with each worker's state."""
        try:
            ok = not self.draining and await within(self.backend.healthy(), HEALTH_TIMEOUT_S)
            workers = self.backend.router_stats().worker_states
        except Exception:
            logger.warning("health check failed", exc_info=True)
            ok, workers = False, {}
        if ok:
            return JSONResponse({"status": "ok", "workers": workers})
        err = APIError(
            503,
            "no worker can take requests now",
            type="service_unavailable_error",
            reason=None,
            headers={"Retry-After": "1"},
        )
        body = err.body()
        body["workers"] = workers
        return JSONResponse(body, status_code=503, headers=err.headers)

    async def scrape(self) -> Response:
        return Response(await self.metrics.render(self.backend), media_type=CONTENT_TYPE_LATEST)


async def _unless_gone(request: Request, call: _Call, work: Awaitable[Any]) -> tuple[bool, Any]:
    """Await ``work`` unless the client disconnects or the call is stopped first (``work`` is
    then cancelled). Returns (True, its result) or (False, None) when the client went away;
    raises the call's error when it was stopped, else ``work``'s own exception.

    ``work`` runs in this task, not in one of its own: a new task starts only after every
    callback the event loop has ready, and in a burst those are every other new request's
    handler (~1 ms each), so each request would reach its worker only once the whole burst
    was in. Two watchers cancel this task instead when the client goes or the call stops."""
    me = asyncio.current_task()
    assert me is not None
    gone = asyncio.ensure_future(_client_gone(request))
    stopped = asyncio.ensure_future(call.stop_event.wait())
    watchers = (gone, stopped)
    state = {"running": True, "interrupted": False}

    def interrupt(_: asyncio.Future) -> None:
        if state["running"] and not state["interrupted"]:
            state["interrupted"] = True
            me.cancel()

    for w in watchers:
        w.add_done_callback(interrupt)
    try:
        result = await work
    except asyncio.CancelledError:
        if not state["interrupted"]:
            raise  # cancelled from outside (the server stopping): not ours to answer
        _uncancel(me)
        if call.stopped is not None:
            raise call.stopped from None
        return False, None
    except BaseException:
        if state["interrupted"]:
            _uncancel(me)
            if call.stopped is not None:
                raise call.stopped from None
        raise
    finally:
        state["running"] = False
        for w in watchers:
            w.remove_done_callback(interrupt)
            w.cancel()
            w.add_done_callback(_retrieved)
    if state["interrupted"]:  # ``work`` ended anyway: the cancellation it took is undone
        _uncancel(me)
    return True, result


def _uncancel(task: asyncio.Task) -> None:
    if hasattr(task, "uncancel"):  # Python 3.11+: the request to cancel is counted
        task.uncancel()


def _retrieved(task: asyncio.Future) -> None:
    if not task.cancelled():
        task.exception()  # a watcher's failure is of no interest once the work is over


def _chat_prompt(
    messages: Any, add_generation_prompt: bool, render: protocol.ChatRender, tokenizer: Any
) -> tuple[list[int], PredictInput, bool]:
    """The chat prompt's ids and hints, and whether it leaves the answer inside the model's
    thinking (on a tokenizer thread, or on the loop with the ``InlineEncoder``)."""
    ids, hints = protocol.chat_prompt_and_hints(messages, add_generation_prompt, tokenizer, render)
    thinking = render.fmt is not None and render.fmt.thinking(tokenizer, ids)
    return ids, hints, thinking


def _decode(token_ids: list[int], tokenizer: Any) -> str:
    return tokenizer.decode(token_ids)


def _shutting_down(message: str = "the server is shutting down") -> APIError:
    return APIError(
        503,
        message,
        type="service_unavailable_error",
        code="shutting_down",
        headers={"Retry-After": "1"},
        reason="shutting_down",
    )


async def _final_output(generation: Generation, answer: Answer, timer: RequestTimer) -> None:
    """The cumulative view of a request that is not streamed, in ``answer``."""
    last = None
    try:
        async for step in generation.outputs():
            timer.observe(step)
            _check_not_aborted(step)
            answer.add(step)
            last = step
        _check_finished(last)
    except ClusterError as exc:
        raise api_error(exc) from None
    timer.finish()


def _check_not_aborted(step: Step) -> None:
    if any(c.finish_reason == "abort" for c in step.choices):
        raise _server_error("the request was aborted in the cluster")


def _check_finished(last: Step | None) -> None:
    if last is None or not last.finished:
        raise _server_error("the cluster ended the request before it finished")
