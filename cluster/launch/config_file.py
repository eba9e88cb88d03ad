"""``tandem serve --config FILE``: a whole serve configuration in one YAML or JSON file.

``ServeConfig`` defines every setting of ``tandem serve`` once: its flags are generated from its
fields (cluster/launch/serve_flags.py: one flag per key, the key's name with ``-`` for ``_``, its type,
choices, bounds, default and help), but for a few that a file alone sets (per-role engine
overrides, GPUs per worker, live migration, rebalancing, the autoscaler). How a file combines
with the command line::

    parser defaults  <  the file's keys  <  flags given on the command line

The file's keys become the parser's defaults (``as_defaults``), so a flag on the command line
wins over the file, and a key the file leaves out keeps the flag's own default. Repeatable flags
add to the file's list (``--engine k=v`` after the file's ``engine`` mapping: the flag wins for
its key).

Not in a file: ``--detach`` (how to run, not what), ``--api-key`` (a key belongs in a 0600 file:
``api_key_file``) and a Redis URL with a password (``TANDEM_REDIS_URL``); a config file is not a
secret store. Relative paths (the key and token files, the TLS certificate and key) are relative
to the file's folder, and ``~`` is expanded.

Every field carries its documentation (``Field(description=...)``): it is its flag's help, and
``python -m cluster.launch.config_reference`` prints them as the Markdown table that docs/config.md
holds. A key that is not a field, a value of the wrong type or out of range fails with the key,
the value and what is accepted (``ConfigError``), before anything starts.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import os
import sys
import typing
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    create_model,
    field_validator,
    model_validator,
)

from cluster.control.autoscaler import AutoscalerConfig, PoolPolicy
from cluster.control.migrations import RebalanceSettings as Rebalance
from decode_worker.migration_config import MigrationConfig
from engine.settings import bounds_of, help_of
from router.chat_output import REASONING_PARSERS, TOOL_CALL_PARSERS

__all__ = ["ConfigError", "ServeConfig", "load_serve_config"]


class ConfigError(ValueError):
    """A config file that cannot be used: unreadable, not a mapping, or invalid settings."""


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_default=True)


def section_from(
    settings: type,
    doc: str,
    before: dict[str, Callable[[Any], Any]] | None = None,
    name: str | None = None,
    base: type[BaseModel] | None = None,
    sections: dict[type, type[BaseModel]] | None = None,
) -> type[BaseModel]:
    """The config file's section for a settings dataclass made with ``engine.settings.setting``:
    one key per field, with its type, default, bounds and help, nothing written twice. A value
    set is then checked by building the dataclass itself, so its own cross-field checks (its
    ``__post_init__``) hold in a file too. ``before``: per field, a conversion of the raw value
    (YAML's ``off`` is False)."""
    hints = typing.get_type_hints(settings)
    fields: dict[str, Any] = {}
    for f in dataclasses.fields(settings):
        kind = hints[f.name]
        if kind in (sections or {}):  # another group (``nested``): its own section, defaults
            section = sections[kind]
            fields[f.name] = (section, Field(default_factory=section, description=help_of(f)))
            continue
        fields[f.name] = (kind, Field(f.default, description=help_of(f), **bounds_of(f)))

    def _as_dataclass(self: BaseModel) -> BaseModel:
        settings(**self.model_dump())  # ValueError: the dataclass's own checks
        return self

    validators: dict[str, Any] = {"_as_dataclass": model_validator(mode="after")(_as_dataclass)}
    for name, convert in (before or {}).items():
        validators[f"_before_{name}"] = field_validator(name, mode="before")(
            classmethod(_converter(convert))
        )
    name = name or settings.__name__.replace("Config", "Settings")
    model = create_model(name, __base__=base or _Section, __validators__=validators, **fields)
    model.__doc__ = doc
    return model


def _on_off(value: Any) -> Any:
    """YAML 1.1 reads a bare ``on`` / ``off`` as true / false: take them back."""
    if value is True:
        return "on"
    if value is False:
        return "off"
    return value


def _converter(convert: Callable[[Any], Any]) -> Callable[[Any, Any], Any]:
    def before(cls: Any, value: Any) -> Any:
        return convert(value)

    return before


MigrationSettings = section_from(
    MigrationConfig,
    "Live migration on the decode workers (decode_worker/migration.py ``MigrationConfig``).",
)


RebalanceSettings = section_from(
    Rebalance,
    "The controller's rebalancer, set at start (cluster/control/migrations.py ``RebalanceSettings``; "
    "``POST /admin/rebalance`` changes it later).",
    before={"mode": _on_off},
)


PoolSettings = section_from(
    PoolPolicy,
    "How the autoscaler sizes one pool (cluster/control/autoscaler.py ``PoolPolicy``).",
    name="PoolSettings",
)


class _AutoscaleSection(_Section):
    def controller_config(self) -> dict[str, Any]:
        """As ``AutoscalerConfig(**...)`` takes it: pools left out keep their defaults (their
        own ``slo_s`` included); a pool's fields left out too."""
        out: dict[str, Any] = {"enabled": self.enabled, "interval_s": self.interval_s}
        for role in ("prefill", "decode", "colocated"):
            pool = getattr(self, role)
            if pool.model_fields_set:
                out[role] = pool.model_dump(exclude_unset=True)
        return out


AutoscaleSettings = section_from(
    AutoscalerConfig,
    "The controller's autoscaler, set at start (cluster/control/autoscaler.py ``AutoscalerConfig``; "
    "``tandem policy --autoscale ... --pool ...`` changes it later).",
    name="AutoscaleSettings",
    base=_AutoscaleSection,
    sections={PoolPolicy: PoolSettings},
)


class GpuShare(_Section):
    """GPUs per worker actor by role (CUDA); a fraction lets workers share a GPU."""

    prefill: float | None = Field(None, gt=0, description="GPUs per prefill worker (default 1).")
    decode: float | None = Field(None, gt=0, description="GPUs per decode worker (default 1).")
    colocated: float | None = Field(
        None, gt=0, description="GPUs per colocated worker (default 1)."
    )


class ServeConfig(BaseModel):
    """Everything ``tandem serve`` takes, but ``--detach`` and the secrets themselves."""

    model_config = ConfigDict(extra="forbid", validate_default=True)

    # -- the model and the workers --------------------------------------------------------------
    model: str = Field(
        "smollm2",
        description="Model alias (`smollm2`) or a local Hugging Face folder; on a multi-node "
        "cluster the folder must exist at the same path on every node.",
    )
    served_model_name: str | None = Field(
        None, description="The `model` id clients send (default: `model`); others get 404."
    )
    device: Literal["auto", "cpu", "cuda"] = Field(
        "auto",
        description="`auto`: CUDA when this machine has a GPU. On a head node without GPUs "
        "set `cuda`: the workers run on the GPU nodes.",
    )
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "auto", description="`auto`: float32 on CPU, bfloat16 on CUDA."
    )
    tensor_parallel_size: int = Field(
        1,
        ge=1,
        description="Each worker's model split over this many ranks (processes, one GPU "
        "each on CUDA), placed together on one node: `EngineConfig.tensor_parallel_size`.",
    )
    prefill_tensor_parallel_size: int | None = Field(
        None,
        ge=1,
        description="Prefill workers' tensor-parallel size (over `tensor_parallel_size`); "
        "prefill and decode may differ: KV moves between any two layouts.",
    )
    decode_tensor_parallel_size: int | None = Field(
        None,
        ge=1,
        description="Decode workers' tensor-parallel size (over `tensor_parallel_size`).",
    )
    quantization: Literal["fp8"] | None = Field(
        None,
        description="`fp8`: each worker quantizes the decoder layers' weights to e4m3 at load "
        "(per-channel scales, activations per token; half of bf16's weight bytes): "
        "`EngineConfig.quantization`. Needs FP8 matmuls (CUDA compute capability 8.9+).",
    )
    prefill: int | None = Field(
        None, ge=0, description="Prefill workers (with `decode`; default: by the GPUs here)."
    )
    decode: int | None = Field(None, ge=0, description="Decode workers (with `prefill`).")
    colocated: int | None = Field(
        None, ge=0, description="Colocated workers (prefill and decode in one actor)."
    )
    engine: dict[str, Any] = Field(
        default_factory=dict,
        description="`EngineConfig` fields for every worker: in a file a mapping "
        "(`{max_num_seqs: 128}`), on the command line `--engine max_num_seqs=128`, repeatable.",
    )
    prefill_engine: dict[str, Any] = Field(
        default_factory=dict,
        description="`EngineConfig` fields for prefill workers only (over `engine`). No flag.",
    )
    decode_engine: dict[str, Any] = Field(
        default_factory=dict,
        description="`EngineConfig` fields for decode workers only (over `engine`). No flag.",
    )
    gpus: GpuShare = Field(
        default_factory=GpuShare, description="GPUs per worker by role. No flag."
    )

    # -- the cluster ----------------------------------------------------------------------------
    ray_address: str | None = Field(
        None,
        description="Join this Ray cluster (`auto`: the one this node belongs to) instead of "
        "starting a local one.",
    )
    role_resources: Literal["auto", "on", "off"] = Field(
        "auto",
        description="Ask Ray for the custom resource `prefill` / `decode` per worker: `on` "
        "(a `ray up` cluster: the autoscaler starts a node of the role's type), `off`, or "
        "`auto` (when the cluster already has both).",
    )
    role_switching: bool = Field(
        False,
        description="Prefill and decode workers that can switch roles without reloading "
        "weights (named `flex-N`; they take the decode engine settings over the prefill ones). "
        "The autoscaler switches one from a pool with one to spare before it starts a new worker.",
    )
    kv_host: str = Field(
        "127.0.0.1",
        description="Where decode workers listen for KV: `127.0.0.1` (one machine), `node` "
        "(the Ray node's IP: prefill workers on other nodes reach it), or an address. "
        "Peers need the cluster's token either way.",
    )
    redis_url: str | None = Field(
        None,
        description="Redis of the global prefix index, without a password (one with a "
        "password goes in `TANDEM_REDIS_URL`). Default: start a local one.",
    )
    migration: MigrationSettings = Field(
        default_factory=MigrationSettings,
        description="Live migration on decode workers. No flag.",
    )
    rebalance: RebalanceSettings = Field(
        default_factory=RebalanceSettings,
        description="The rebalancer's settings at start. No flag.",
    )
    autoscale: AutoscaleSettings = Field(
        default_factory=AutoscaleSettings,
        description="The autoscaler's settings at start (off unless `enabled`). No flag: "
        "`tandem policy --autoscale on` turns it on later.",
    )

    # -- the operator API (tandem status / scale / drain ...) ------------------------------------
    operator_host: str = Field(
        "127.0.0.1",
        description="Address the gRPC operator API binds, on the node that runs `tandem serve`.",
    )
    operator_port: int = Field(
        0,
        ge=0,
        le=65535,
        description="Its port (0: a free one; the connection file under the tandem cache names "
        "it). Fix it to reach the API through an ssh tunnel.",
    )
    operator_token_file: str | None = Field(
        None,
        description="Its bearer token, in a file of mode 0600 (default: TANDEM_OPERATOR_TOKEN, "
        "else a random one written to the connection file).",
    )
    operator_tls_cert: str | None = Field(
        None, description="Serve the operator API over TLS with this certificate (PEM)."
    )
    operator_tls_key: str | None = Field(
        None, description="The key of `operator_tls_cert` (PEM); the two go together."
    )
    no_operator: bool = Field(False, description="Do not serve the operator API at all.")

    # -- the gateway ----------------------------------------------------------------------------
    host: str = Field(
        "127.0.0.1",
        description="Address the gateway binds; anything but loopback is reachable from the "
        "network (set API keys).",
    )
    port: int = Field(8000, ge=1, le=65535, description="Port of the gateway.")
    gateways: int = Field(
        1,
        ge=1,
        description="Gateway processes over the cluster: serve's own and `gateways - 1` "
        "children (`tandem gateway`, restarted when they exit), on `port`, `port + 1`, ... "
        "each with its own `/metrics`, or all on `port` with `reuse_port`. Each router takes "
        "1/N of every decode worker's slots unless `slots_per_worker` is set (then each takes "
        "that many); `max_concurrent` and `max_queue` hold per gateway.",
    )
    reuse_port: bool = Field(
        False,
        description="Every gateway listens on `port` with SO_REUSEPORT and Linux spreads new "
        "connections across them; a `/metrics` scrape then reaches one process at a time.",
    )
    api_key_file: str | None = Field(
        None, description="Accepted bearer keys, one per line, in a file of mode 0600."
    )
    admin_key_file: str | None = Field(
        None,
        description="Keys of the `/admin` routes (migrate, drain, rebalance), one per line, "
        "mode 0600, or `TANDEM_ADMIN_KEY` (default: the API keys; with none, loopback clients "
        "only).",
    )
    log_level: Literal["critical", "error", "warning", "info", "debug", "trace"] = Field(
        "warning", description="uvicorn's log level."
    )
    loop: Literal["auto", "asyncio", "uvloop"] = Field(
        "auto", description="The gateway's event loop (`auto`: uvloop when installed)."
    )
    http: Literal["auto", "h11", "httptools"] = Field(
        "auto", description="uvicorn's HTTP parser (`auto`: httptools when installed)."
    )
    max_concurrent: int = Field(
        256, ge=1, description="Sequences in flight in the gateway; more get 429."
    )
    max_body_bytes: int = Field(8 << 20, ge=1, description="Larger request bodies get 413.")
    max_header_bytes: int = Field(16 << 10, ge=1, description="Larger request headers get 431.")
    body_timeout: float = Field(
        30.0, gt=0, description="Seconds a client has to send its body (408 after)."
    )
    write_timeout: float = Field(
        30.0, gt=0, description="Seconds a streamed frame may wait for the client to read it."
    )
    shutdown_timeout: float = Field(
        30.0,
        ge=0,
        description="On SIGTERM, seconds in-flight requests get to finish (new ones get 503 at "
        "once; a second signal stops at once).",
    )
    tool_call_parser: Literal[TOOL_CALL_PARSERS] = Field(  # type: ignore[valid-type]
        "auto",
        description="How chat answers' tool calls are written and read: `hermes` "
        "(`<tool_call>` JSON: Qwen2.5, Qwen3, Hermes), `llama3_json` (Llama 3.1+), `mistral` "
        "(`[TOOL_CALLS] [...]`, v3 tokenizers), `mistral_v11` (`[TOOL_CALLS]name[ARGS]{...}`: "
        "Mistral Small 3.x, Devstral, Magistral), or `auto`: the format the model's chat "
        "template writes (a template without tools, as SmolLM2's: `hermes`, with the tools in "
        "the system prompt).",
    )
    reasoning_parser: Literal[REASONING_PARSERS] = Field(  # type: ignore[valid-type]
        "auto",
        description="Split the model's thinking into `reasoning_content`: `qwen3` "
        "(`<think>...</think>`), `none`, or `auto`: `qwen3` when the chat template knows "
        "`</think>`.",
    )

    # -- routing and scheduling -----------------------------------------------------------------
    policy: Literal["cache_aware", "least_loaded", "round_robin"] = Field(
        "cache_aware", description="How the router places requests on workers."
    )
    local_prefill_tokens: int = Field(
        0,
        ge=0,
        description="Disaggregated clusters: a prompt a decode worker holds all of but at most "
        "this many tokens (a conversation's next turn) is prefilled on that decode worker, not "
        "on a prefill worker (0: never).",
    )
    queue_policy: Literal["fcfs", "sjf"] = Field(
        "fcfs",
        description="Order of requests waiting for a slot: `fcfs`, or `sjf` (shortest "
        "predicted output first, with aging).",
    )
    predictor: str = Field(
        "learned",
        description="Output-length predictor: `learned`, `none`, `oracle` (benchmarks), or "
        "an artifact path.",
    )
    max_queue: int = Field(1024, ge=0, description="Requests waiting for a slot at most (429).")
    slots_per_worker: int = Field(
        0, ge=0, description="Requests run at once per decode worker (0: its `max_num_seqs`)."
    )
    queue_aging: float = Field(
        2.0, ge=1, description="`sjf`: a request waits about this multiple of its FCFS wait."
    )
    max_queue_wait: float = Field(
        120.0, gt=0, description="`sjf`: seconds after which a waiting request goes first."
    )
    reject_wait: float = Field(
        0.0, ge=0, description="Refuse (429) a request projected to wait longer (0: off)."
    )

    # -- faults ---------------------------------------------------------------------------------
    max_resumes: int = Field(
        2, ge=0, description="Times a request continues elsewhere after its worker failed."
    )
    stall_timeout: float = Field(
        10.0, gt=0, description="Seconds without output or heartbeat before a worker is hung."
    )
    hang_timeout: float = Field(
        60.0,
        gt=0,
        description="Seconds one engine step may run before its worker is hung; keep it above "
        "the slowest step (a full prefill chunk on CPU takes seconds).",
    )

    @field_validator("role_resources", mode="before")
    @classmethod
    def _yaml_on_off(cls, value: Any) -> Any:
        return _on_off(value)

    @field_validator("redis_url")
    @classmethod
    def _no_password(cls, value: str | None) -> str | None:
        from urllib.parse import urlsplit

        if value and urlsplit(value).password:
            raise ValueError(
                "a Redis URL with a password does not belong in a config file: set "
                "TANDEM_REDIS_URL in the environment instead"
            )
        return value

    @field_validator("engine", "prefill_engine", "decode_engine")
    @classmethod
    def _engine_fields(cls, value: dict[str, Any]) -> dict[str, Any]:
        known = engine_override_keys()
        for key in value:
            if key not in known:
                raise ValueError(f"{key!r} is not an engine setting{_did_you_mean(key, known)}")
        return value

    @model_validator(mode="after")
    def _kv_settings_agree(self) -> ServeConfig:
        """Prefill and decode workers exchange KV: the pair handshake refuses workers whose KV
        differs (engine/kv_transfer/transport.py ``KVSpec``), so say so before anything starts.
        A setting left out is its default; ``dtype: auto``, and ``block_size`` left out with
        ``device: auto``, resolve by device later: skipped (the handshake still checks)."""
        base = {**_kv_defaults(), "dtype": self.dtype, **self.engine}
        prefill, decode = {**base, **self.prefill_engine}, {**base, **self.decode_engine}
        if self.device != "auto":  # block_size None: the device's default
            from engine.config import device_defaults

            for side in (prefill, decode):
                if side["block_size"] is None:
                    side["block_size"] = device_defaults(self.device)["block_size"]
        for key in KV_SHARED_SETTINGS:
            unresolved = (key == "dtype" and "auto" in (prefill[key], decode[key])) or (
                key == "block_size" and None in (prefill[key], decode[key])
            )
            if prefill[key] != decode[key] and not unresolved:
                raise ValueError(
                    f"prefill workers would run {key}={prefill[key]!r} and decode workers "
                    f"{key}={decode[key]!r}: workers that exchange KV must share {key} (set it "
                    "in `engine`)"
                )
        return self

    @model_validator(mode="after")
    def _topology(self) -> ServeConfig:
        if bool(self.prefill) != bool(self.decode):
            raise ValueError(
                f"prefill ({self.prefill}) and decode ({self.decode}) go together: "
                "disaggregated serving needs at least one of each"
            )
        return self

    def as_defaults(self) -> dict[str, Any]:
        """The settings this file gives, as argparse defaults of ``tandem serve`` (dest ->
        value). Keys the file leaves out are left out, so they keep the flags' defaults."""
        out: dict[str, Any] = {}
        for name in self.model_fields_set:
            value = getattr(self, name)
            if name == "engine":  # the --engine flag's KEY=VALUE strings (values as JSON)
                value = [f"{k}={json.dumps(v)}" for k, v in value.items()]
            elif name == "gpus":
                value = value.model_dump(exclude_none=True)
            elif name == "autoscale":
                value = value.controller_config()
            elif isinstance(value, BaseModel):
                value = value.model_dump()
            out[name] = value
        return out


# Engine settings that shape the KV a worker sends and receives: prefill and decode workers
# must agree on them.
KV_SHARED_SETTINGS = ("dtype", "kv_cache_dtype", "block_size")

PATH_SETTINGS = (
    "api_key_file",
    "admin_key_file",
    "operator_token_file",
    "operator_tls_cert",
    "operator_tls_key",
)


def engine_override_keys() -> set[str]:
    """``EngineConfig`` fields a serve configuration may set (the launcher sets the model
    folder and the device), plus ``cpu_threads`` (a worker's torch threads)."""
    import dataclasses

    from engine.config import EngineConfig

    return {f.name for f in dataclasses.fields(EngineConfig)} - {"model_dir", "device"} | {
        "cpu_threads"
    }


def _kv_defaults() -> dict[str, Any]:
    """``EngineConfig``'s defaults of ``KV_SHARED_SETTINGS``."""
    from engine.config import EngineConfig

    fields = dataclasses.fields(EngineConfig)
    return {f.name: f.default for f in fields if f.name in KV_SHARED_SETTINGS}


def _did_you_mean(key: str, choices: typing.Iterable[str]) -> str:
    close = difflib.get_close_matches(key.replace("-", "_"), sorted(choices), n=1, cutoff=0.6)
    return f" (did you mean {close[0]!r}?)" if close else ""


# -- loading ------------------------------------------------------------------------------------


def load_serve_config(path: str | os.PathLike[str]) -> ServeConfig:
    """Read and check a YAML (``.yaml`` / ``.yml``) or JSON file. Raises ConfigError with every
    problem, each naming its key."""
    path = Path(path).expanduser()
    try:
        text = path.read_text()
    except OSError as exc:
        raise ConfigError(f"cannot read config file {path}: {exc.strerror}") from None
    try:
        if path.suffix == ".json":
            data = json.loads(text) if text.strip() else {}
        else:
            import yaml

            data = yaml.safe_load(text)
    except (ValueError, ImportError) as exc:  # json / yaml errors are ValueError subclasses
        raise ConfigError(f"{path} is not valid {path.suffix[1:] or 'YAML'}: {exc}") from None
    except Exception as exc:  # noqa: BLE001 - yaml.YAMLError: report it, not a traceback
        raise ConfigError(f"{path} is not valid YAML: {exc}") from None
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path} must hold a mapping of settings, not a {type(data).__name__}")
    try:
        config = ServeConfig.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(_explain(path, exc)) from None
    for name in PATH_SETTINGS:  # relative to the file, ~ expanded
        value = getattr(config, name)
        if value:
            setattr(config, name, str(path.parent / Path(value).expanduser()))
    return config


def _explain(path: Path, exc: ValidationError) -> str:
    """One line per problem: where (dotted key), what was given, what is accepted."""
    lines = []
    for err in exc.errors():
        loc = ".".join(str(p) for p in err["loc"]) or "(top level)"
        if err["type"] == "extra_forbidden":
            fields = _fields_at(err["loc"][:-1])
            key = str(err["loc"][-1])
            lines.append(f"{loc}: unknown setting{_did_you_mean(key, fields)}")
            continue
        msg = err["msg"].removeprefix("Value error, ")
        shown = "" if err["type"] == "value_error" else f" (got {err.get('input')!r})"
        lines.append(f"{loc}: {msg}{shown}")
    head = f"{path}: {len(lines)} problem{'s' if len(lines) > 1 else ''}"
    return "\n  ".join([head, *lines])


def _fields_at(loc: tuple) -> list[str]:
    model: type[BaseModel] = ServeConfig
    for part in loc:
        ann = model.model_fields[str(part)].annotation
        if not (isinstance(ann, type) and issubclass(ann, BaseModel)):
            return []
        model = ann
    return list(model.model_fields)


def main(argv: list[str] | None = None) -> int:
    """``python -m cluster.launch.config_file --check FILE...``: load serve config files and report
    (the reference table: ``python -m cluster.launch.config_reference``)."""
    import argparse

    ap = argparse.ArgumentParser(
        prog="python -m cluster.launch.config_file", description=main.__doc__
    )
    ap.add_argument("--check", nargs="+", metavar="FILE", required=True, help="serve config files")
    args = ap.parse_args(argv)
    failed = 0
    for path in args.check:
        try:
            load_serve_config(path)
            print(f"{path}: ok")
        except ConfigError as exc:
            failed += 1
            print(exc, file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
