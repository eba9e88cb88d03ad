"""Structured outputs: grammars that allow, at each step, only the tokens that keep a request's
answer valid (a JSON schema, any JSON object, a regex, one of a list of strings).

Plain Python and numpy, no torch (the sampler turns the bitmask into a logits mask)::

    StructuredSpec --Grammars.compile--> compiled grammar   (cached per spec, bounded LRU;
                                                             ValueError naming the problem)
                   --Grammars.matcher(spec, tokens)--> GrammarMatcher, fed the tokens a request
                                                       already has (its state is rebuilt from
                                                       them: resume, migration, a decode
                                                       worker continuing a prefill worker's)
    each step      fill_bitmasks(matchers, rows)  ->  the sampler masks the rows' logits
                   matcher.accept(token)          <-  the request appends the sampled token
    the end        a complete answer's mask allows only end-of-sequence tokens: the request
                   samples one and stops (one step after the last token of the answer)

A failure is the request's own, never its batch's: a matcher that refuses a token, errs or
allows nothing keeps the reason in ``matcher.error`` (its row allows every token that step;
the draw is thrown away) and the scheduler ends that request with it (``FINISHED_ERROR``).

Compiles run off the engine thread: ``Grammars.matcher_async`` hands the compile (and the
matcher's catch-up over the tokens a request already has) to a small thread pool and returns
a future; the request waits (``WAITING_FOR_GRAMMAR``) until it lands. A spec that does not
compile lands as a matcher already in error (``FailedMatcher``).

A bitmask row holds one bit per token id (bit ``t % 32`` of int32 word ``t // 32``), 1 where
the token is allowed; end-of-sequence tokens are allowed only where the grammar may end.

The engine behind it is a ``GrammarBackend`` chosen by name from ``BACKENDS`` (imported
lazily); ``llguidance`` is the default (benchmarks/NOTES.md, "Grammar engines").
"""

from __future__ import annotations

import json
import os
import threading
import time
from abc import ABC, abstractmethod
from collections import OrderedDict
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import numpy as np

from engine.histogram import Buckets
from engine.sampling_params import StructuredSpec

DEFAULT_BACKEND = "llguidance"

# JSON whitespace allowed wherever JSON allows it: at most this pattern, once per place. An
# unbounded run lets a sampled model write newlines until max_tokens cuts the object off.
JSON_WHITESPACE = r"[\x20\x0A]{0,2}"


def bitmask_words(vocab_size: int) -> int:
    """int32 words per bitmask row."""
    return (vocab_size + 31) // 32


def allocate_bitmask(rows: int, vocab_size: int) -> np.ndarray:
    """A [rows, words] int32 bitmask, every token allowed."""
    return np.full((rows, bitmask_words(vocab_size)), -1, dtype=np.int32)


def allowed_tokens(bitmask_row: np.ndarray, vocab_size: int) -> np.ndarray:
    """The token ids one bitmask row allows (tests, debugging)."""
    bits = np.unpackbits(bitmask_row.view(np.uint8), bitorder="little")[:vocab_size]
    return np.flatnonzero(bits)


class GrammarMatcher(ABC):
    """One sequence's place in its grammar. Not thread-safe; one per sequence."""

    # Why this matcher can go no further (a refused token, the engine's error, a mask that
    # allows nothing, a spec that did not compile); None while it is well. Set once, kept.
    error: str | None = None

    def fail(self, why: str) -> None:
        """Put the matcher in error (the first reason is kept)."""
        if self.error is None:
            self.error = why

    @abstractmethod
    def accept(self, token_id: int) -> bool:
        """Advance over ``token_id``. Returns False (the state unchanged or unusable: drop the
        matcher) when the grammar does not allow it here; an implementation also ``fail``s
        then, naming the token."""

    @abstractmethod
    def fill_bitmask(self, bitmask: np.ndarray, row: int) -> None:
        """Write the tokens allowed next into ``bitmask[row]`` (int32, C-contiguous, one bit per
        token of the vocabulary the backend was made with)."""

    @abstractmethod
    def is_terminated(self) -> bool:
        """Whether the answer is complete: no token but end-of-sequence may follow (or one was
        accepted)."""

    @classmethod
    def fill_many(cls, rows: Sequence[tuple[GrammarMatcher, int]], bitmask: np.ndarray) -> None:
        """``fill_bitmask`` of each ``(matcher, row)`` (all of this class); a backend may do
        them at once (llguidance: in parallel, off the GIL)."""
        for matcher, row in rows:
            matcher.fill_bitmask(bitmask, row)


class FailedMatcher(GrammarMatcher):
    """The matcher of a spec that did not compile: in error from the start (its request ends
    with the compile's message before it runs)."""

    def __init__(self, why: str) -> None:
        self.error = why

    def accept(self, token_id: int) -> bool:
        return False

    def fill_bitmask(self, bitmask: np.ndarray, row: int) -> None:
        bitmask[row] = -1

    def is_terminated(self) -> bool:
        return False


def fill_bitmasks(matchers: Sequence[GrammarMatcher], bitmask: np.ndarray) -> list[int]:
    """Row ``j`` of ``bitmask`` (int32, C-contiguous) for ``matchers[j]``. A matcher in error,
    or whose row allows no token, fails: its row allows every token (the draw is thrown away:
    its request ends with ``matcher.error``). Returns those rows."""
    groups: dict[type, list[tuple[GrammarMatcher, int]]] = {}
    failed = []
    for j, matcher in enumerate(matchers):
        if matcher.error is not None:
            failed.append(j)
        else:
            groups.setdefault(type(matcher), []).append((matcher, j))
    for kind, rows in groups.items():
        kind.fill_many(rows, bitmask)
    filled = [j for rows in groups.values() for _, j in rows]
    if filled:
        empty = ~bitmask[filled].any(axis=1)
        for j in np.asarray(filled)[empty].tolist():
            matchers[j].fail("the grammar allows no token here (its matcher is in error)")
        failed += [j for j in filled if matchers[j].error is not None]
    for j in failed:
        bitmask[j] = -1
    return sorted(failed)


class GrammarBackend(ABC):
    """A grammar engine for one tokenizer.

    Args (constructor): ``tokenizer`` (a Hugging Face fast tokenizer), ``vocab_size`` (the
    model's: the bitmask's width, at least the tokenizer's), ``eos_token_ids`` (the tokens
    that end a sequence: allowed only where the grammar may end).
    """

    name: str = ""

    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_ids: Sequence[int]) -> None:
        self.vocab_size = vocab_size
        self.eos_token_ids = tuple(eos_token_ids)

    @abstractmethod
    def compile(self, spec: StructuredSpec) -> Any:
        """The compiled grammar of ``spec`` (opaque, shared by every matcher made from it).

        Raises:
            ValueError: the spec does not compile; the message names the problem.
        """

    @abstractmethod
    def matcher(self, compiled: Any) -> GrammarMatcher:
        """A fresh matcher at the start of ``compiled``."""


BACKENDS: dict[str, Callable[[], type[GrammarBackend]]] = {}
"""Backend name -> a function importing and returning its class (imports stay lazy)."""


def register_backend(name: str) -> Callable:
    def wrap(loader: Callable[[], type[GrammarBackend]]) -> Callable[[], type[GrammarBackend]]:
        BACKENDS[name] = loader
        return loader

    return wrap


@register_backend("llguidance")
def _llguidance() -> type[GrammarBackend]:
    return _LLGuidanceBackend


def make_backend(
    name: str, tokenizer: Any, vocab_size: int, eos_token_ids: Sequence[int]
) -> GrammarBackend:
    if name not in BACKENDS:
        raise ValueError(f"grammar backend must be one of {sorted(BACKENDS)}, got {name!r}")
    return BACKENDS[name]()(tokenizer, vocab_size, eos_token_ids)


COMPILE_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 10.0)
"""Upper edges (seconds) of the compile-time histogram (``Grammars.compile_seconds``)."""


class Grammars:
    """Compiled grammars of one backend, cached per spec (least recently used out first), and
    the matchers made from them. ``compile`` and ``matcher`` run on the caller's thread;
    ``matcher_async`` on a pool of ``threads`` (the cache is shared, under a lock)."""

    def __init__(self, backend: GrammarBackend, capacity: int = 256, threads: int = 2) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        if threads < 1:
            raise ValueError(f"threads must be >= 1, got {threads}")
        self.backend = backend
        self.capacity = capacity
        self.threads = threads
        self._cache: OrderedDict[StructuredSpec, Any] = OrderedDict()
        self._lock = threading.Lock()
        self._pool: ThreadPoolExecutor | None = None
        self.compiles = 0  # cache misses, for tests and stats
        self.compile_seconds = Buckets(COMPILE_BUCKETS)  # each cache miss's compile

    def _cached(self, spec: StructuredSpec) -> Any:
        with self._lock:
            compiled = self._cache.get(spec)
            if compiled is not None:
                self._cache.move_to_end(spec)
            return compiled

    def compile(self, spec: StructuredSpec) -> Any:
        """``spec`` compiled (from the cache when it is there). Raises ValueError."""
        compiled = self._cached(spec)
        if compiled is not None:
            return compiled
        t0 = time.perf_counter()
        compiled = self.backend.compile(spec)  # outside the lock: compiles run side by side
        with self._lock:
            self.compile_seconds.observe(time.perf_counter() - t0)
            self.compiles += 1
            self._cache[spec] = compiled
            if len(self._cache) > self.capacity:
                self._cache.popitem(last=False)
        return compiled

    def matcher(self, spec: StructuredSpec, token_ids: Sequence[int] = ()) -> GrammarMatcher:
        """A matcher for ``spec`` that has accepted ``token_ids`` (a request's output so far).

        Raises:
            ValueError: the spec does not compile, or a token of ``token_ids`` breaks it.
        """
        matcher = self.backend.matcher(self.compile(spec))
        for i, token in enumerate(token_ids):
            if not matcher.accept(token):
                raise ValueError(
                    f"output token {i} (id {token}) does not follow the request's "
                    f"{spec.kind} grammar"
                )
        return matcher

    def matcher_async(self, spec: StructuredSpec, token_ids: Sequence[int] = ()) -> Future:
        """A future of ``matcher(spec, token_ids)``, made on the pool (at once, done, when the
        spec is cached and there are no tokens to catch up on). A spec that does not compile,
        or tokens that break it, give a ``FailedMatcher`` naming why."""
        compiled = self._cached(spec) if not token_ids else None
        if compiled is not None:
            done: Future = Future()
            done.set_result(self.backend.matcher(compiled))
            return done
        if self._pool is None:
            self._pool = ThreadPoolExecutor(self.threads, thread_name_prefix="grammar-compile")
        return self._pool.submit(self._made, spec, list(token_ids))

    def _made(self, spec: StructuredSpec, token_ids: list[int]) -> GrammarMatcher:
        try:
            return self.matcher(spec, token_ids)
        except ValueError as exc:
            return FailedMatcher(str(exc))
        except Exception as exc:  # noqa: BLE001 - the engine's fault, still this request's alone
            return FailedMatcher(f"the grammar engine failed ({type(exc).__name__}: {exc})")

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)

    def __len__(self) -> int:
        return len(self._cache)


# --------------------------------------------------------------------------- llguidance


_REGEX_META = set("\\.+*?()|[]{}^$#&-~")


def _regex_literal(text: str) -> str:
    return "".join(f"\\{c}" if c in _REGEX_META else c for c in text)


class _LLGuidanceBackend(GrammarBackend):
    """llguidance (Rust, lazy lexer): compiles in about a millisecond and builds each state's
    mask on demand, so a new schema never stalls a step for long."""

    name = "llguidance"

    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_ids: Sequence[int]) -> None:
        super().__init__(tokenizer, vocab_size, eos_token_ids)
        import llguidance
        import llguidance.hf

        self._llg = llguidance
        eos = list(self.eos_token_ids) or None
        self._tokenizer = _text_tokenizer(llguidance, tokenizer, vocab_size, eos)
        # Bytes no token holds (a byte-level vocabulary may lack some: SmolLM2 has no token
        # with 0xF1, 0xF2 or a few control bytes). A spec that needs one is refused: llguidance
        # would silently drop such a character, or (4-byte characters) allow a token it then
        # refuses (found by tests/test_fuzz.py: guided_regex "\U00040000" was a 500).
        held: set[int] = set()
        for token in range(self._tokenizer.vocab_size):
            held.update(self._tokenizer.decode_bytes([token]))
        self._missing_bytes = frozenset(range(256)) - held

    def _grammar(self, spec: StructuredSpec) -> str:
        matcher = self._llg.LLMatcher
        if spec.kind == "json_schema" or spec.kind == "json_object":
            schema = json.loads(spec.value) if spec.kind == "json_schema" else {"type": "object"}
            options = {"whitespace_pattern": JSON_WHITESPACE, "lenient": not spec.strict}
            try:
                return matcher.grammar_from_json_schema(schema, defaults=options)
            except ValueError as exc:
                raise ValueError(f"invalid JSON schema: {exc}") from None
        if spec.kind == "regex":
            return matcher.grammar_from_regex(spec.value)
        if spec.kind == "lark":
            return matcher.grammar_from_lark(spec.value)
        return matcher.grammar_from_regex("|".join(_regex_literal(c) for c in spec.choices))

    def _check_writable(self, spec: StructuredSpec) -> None:
        """ValueError naming the first character of the spec's strings that needs a byte no
        token holds."""
        if not self._missing_bytes:
            return
        texts = {
            "regex": lambda: [spec.value],
            "choice": lambda: spec.choices,
            "json_schema": lambda: _strings(spec.schema),
            "json_object": lambda: [],
            "lark": lambda: [],  # (written by the gateway from tool names and schemas)
        }[spec.kind]()
        for text in texts:
            for char in text:
                missing = self._missing_bytes.intersection(char.encode("utf-8", "surrogatepass"))
                if missing:
                    raise ValueError(
                        f"the character U+{ord(char):04X} cannot be written by this model's "
                        f"tokenizer (no token holds byte 0x{min(missing):02X})"
                    )

    def compile(self, spec: StructuredSpec) -> Any:
        self._check_writable(spec)
        grammar = self._grammar(spec)
        template = self._llg.LLMatcher(self._tokenizer, grammar, log_level=0)
        if template.is_error():
            raise ValueError(
                f"invalid {spec.kind.replace('_', ' ')}: {_one_line(template.get_error())}"
            )
        return template

    def matcher(self, compiled: Any) -> GrammarMatcher:
        return _LLGuidanceMatcher(compiled.deep_copy())


def _text_tokenizer(llguidance: Any, tokenizer: Any, vocab_size: int, eos: list[int] | None) -> Any:
    """llguidance's view of ``tokenizer``, whose encoder never matches an added token in text.

    llguidance tokenizes the bytes a grammar forces (``<think>`` in a regex, a JSON key) with the
    tokenizer it is given; an HF tokenizer matches its added tokens in any text, special or not,
    so the forced text ``<think>`` became Qwen3's added token 151667, which llguidance's parser
    (added tokens are special to it) then refused: the mask allowed only a token the matcher would
    not take, and the request failed. The encoder here is the same tokenizer without its added
    tokens, so forced text is written in ordinary tokens; the added tokens stay in the vocabulary
    as special tokens, which a Lark grammar still names (``<think>``, the tool-call markers)."""
    import tokenizers

    base = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size, eos_token=eos)
    added = sorted(getattr(tokenizer, "added_tokens_decoder", {}) or ())
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if not added or backend is None:
        return base
    doc = json.loads(backend.to_str())
    doc["added_tokens"] = []
    plain = tokenizers.Tokenizer.from_str(json.dumps(doc))
    plain.no_padding()
    plain.no_truncation()

    class _Vocabulary:
        """What ``llguidance.TokenizerWrapper`` reads: each token's bytes, the special ids, and
        an encoder (called for forced text only)."""

        eos_token_id = eos[0] if eos else tokenizer.eos_token_id
        bos_token_id = None
        tokens = [base.decode_bytes([i]) for i in range(base.vocab_size)]
        special_token_ids = [i for i in added if i < base.vocab_size]

        def __call__(self, text: str | bytes) -> list[int]:
            if isinstance(text, bytes):
                text = text.decode("utf-8", errors="replace")
            return plain.encode(text, add_special_tokens=False).ids

    wrapper = llguidance.TokenizerWrapper(_Vocabulary())
    return llguidance.LLTokenizer(wrapper, n_vocab=vocab_size, eos_token=eos)


def _strings(value: Any) -> list[str]:
    """Every string in a JSON value, keys included."""
    if isinstance(value, str):
        return [value]
    if isinstance(value, dict):
        return [s for k, v in value.items() for s in (k, *_strings(v))]
    if isinstance(value, list):
        return [s for v in value for s in _strings(v)]
    return []


def _one_line(text: str, limit: int = 400) -> str:
    """An engine's (multi-line, caret-drawing) error as one line for an HTTP 400."""
    line = " ".join(part.strip() for part in text.splitlines() if part.strip())
    return line if len(line) <= limit else line[: limit - 3] + "..."


_EXECUTOR: list = []  # llguidance's thread pool for batched mask fills, made on first use
_EXECUTOR_LOCK = threading.Lock()


def _executor() -> Any:
    with _EXECUTOR_LOCK:
        if not _EXECUTOR:
            import llguidance

            # A few threads: masks of a batch take tens of microseconds each, and the host's
            # other cores launch kernels and run the KV transfers.
            _EXECUTOR.append(llguidance.LLExecutor(max(1, min(4, (os.cpu_count() or 2) // 2))))
        return _EXECUTOR[0]


class _LLGuidanceMatcher(GrammarMatcher):
    # Rows a batched fill does one by one instead (the pool's hand-off costs more)
    SERIAL_ROWS = 4

    def __init__(self, matcher: Any) -> None:
        self._m = matcher

    def accept(self, token_id: int) -> bool:
        if self.error is not None:
            return False
        if self._m.consume_token(token_id):
            return True
        self.fail(f"token {token_id} is not allowed here ({_one_line(self._m.get_error())})")
        return False

    def fill_bitmask(self, bitmask: np.ndarray, row: int) -> None:
        view = bitmask[row]
        self._m.unsafe_compute_mask_ptr(view.ctypes.data, view.nbytes)
        if self._m.is_error():
            self.fail(_one_line(self._m.get_error()))

    @classmethod
    def fill_many(cls, rows: Sequence[tuple[GrammarMatcher, int]], bitmask: np.ndarray) -> None:
        if len(rows) <= cls.SERIAL_ROWS:
            super().fill_many(rows, bitmask)
            return
        batch, words = bitmask.shape
        _executor().unsafe_compute_mask_ptr(
            [(m._m, row) for m, row in rows], bitmask.ctypes.data, words * 4, batch
        )
        for m, _ in rows:
            if m._m.is_error():
                m.fail(_one_line(m._m.get_error()))

    def is_terminated(self) -> bool:
        return self._m.is_stopped()
