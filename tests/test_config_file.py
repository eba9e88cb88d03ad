"""`tandem serve --config FILE` (cluster/launch/config_file.py): loading, errors, precedence against
the command line, the example files, and the generated reference in docs/config.md."""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path

import pytest

pytest.importorskip("pydantic")
pytest.importorskip("yaml")

from cluster.launch.config_file import ConfigError, ServeConfig, load_serve_config  # noqa: E402
from cluster.launch.config_reference import REFERENCE_BEGIN, REFERENCE_END, reference_markdown  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = sorted((ROOT / "deploy" / "examples").glob("*.yaml"))
NOT_IN_FILES = {"detach", "api_key", "config"}  # serve flags a file does not set (the docs say why)


def write(tmp_path: Path, text: str, name: str = "serve.yaml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def serve_parser() -> argparse.ArgumentParser:
    from cluster.launch.serve import add_serve_args

    parser = argparse.ArgumentParser(prog="tandem serve")
    add_serve_args(parser)
    return parser


def problems(tmp_path: Path, text: str, name: str = "serve.yaml") -> str:
    with pytest.raises(ConfigError) as err:
        load_serve_config(write(tmp_path, text, name))
    return str(err.value)


# -- errors -------------------------------------------------------------------------------------


def test_a_typo_is_an_error_that_names_the_key_and_the_fix(tmp_path):
    msg = problems(tmp_path, "model: smollm2\nprefil: 2\ndecode: 2\n")
    assert "serve.yaml: 1 problem" in msg
    assert "prefil: unknown setting (did you mean 'prefill'?)" in msg


def test_a_typo_in_a_section_and_a_dashed_key(tmp_path):
    msg = problems(tmp_path, "migration:\n  max_stage: 3\nmax-queue: 5\n")
    assert "migration.max_stage: unknown setting (did you mean 'max_stages'?)" in msg
    assert "max-queue: unknown setting (did you mean 'max_queue'?)" in msg
    assert "2 problems" in msg


def test_wrong_values_name_the_key_and_the_value(tmp_path):
    msg = problems(tmp_path, "port: 70000\nqueue_policy: lifo\ndevice: tpu\n")
    assert "port: Input should be less than or equal to 65535 (got 70000)" in msg
    assert "queue_policy: Input should be 'fcfs' or 'sjf' (got 'lifo')" in msg
    assert "device:" in msg and "'tpu'" in msg


def test_engine_keys_are_checked_against_engine_config(tmp_path):
    msg = problems(tmp_path, "engine:\n  max_num_seq: 8\n")
    assert "engine: 'max_num_seq' is not an engine setting (did you mean 'max_num_seqs'?)" in msg
    msg = problems(tmp_path, "decode_engine:\n  model_dir: /x\n")  # the launcher sets it
    assert "'model_dir' is not an engine setting" in msg


def test_kv_cache_settings_are_the_same_for_prefill_and_decode(tmp_path):
    """Workers that exchange KV must agree on its dtype and block size (the KV handshake would
    refuse every pair): a file that splits them is refused before anything starts."""
    msg = problems(tmp_path, "prefill_engine: {kv_cache_dtype: fp8}\n")
    assert "prefill workers would run kv_cache_dtype='fp8' and decode workers " in msg
    assert "kv_cache_dtype='auto'" in msg and "set it in `engine`" in msg
    msg = problems(tmp_path, "engine: {block_size: 32}\ndecode_engine: {block_size: 16}\n")
    assert "block_size=32 and decode workers block_size=16" in msg
    msg = problems(tmp_path, "dtype: bfloat16\ndecode_engine: {dtype: float32}\n")
    assert "dtype='bfloat16' and decode workers dtype='float32'" in msg
    # block_size left out is the device's: 128 on CPU, 16 on CUDA
    msg = problems(tmp_path, "device: cpu\ndecode_engine: {block_size: 16}\n")
    assert "block_size=128 and decode workers block_size=16" in msg
    fine = [
        "engine: {kv_cache_dtype: fp8}\nprefill_engine: {kv_cache_dtype: fp8}\n",
        "device: cuda\ndecode_engine: {block_size: 16}\n",  # CUDA's default: as left out
        "device: cpu\nprefill_engine: {block_size: 128}\n",  # and CPU's
        "decode_engine: {block_size: 16}\n",  # device auto: the handshake checks it later
        "prefill_engine: {dtype: bfloat16}\n",  # dtype auto: bfloat16 on CUDA, checked later
    ]
    for text in fine:
        load_serve_config(write(tmp_path, text))


def test_disaggregated_needs_both_roles(tmp_path):
    msg = problems(tmp_path, "prefill: 2\n")
    assert "prefill (2) and decode (None) go together" in msg


def test_autoscale_pools_are_checked(tmp_path):
    path = write(tmp_path, "autoscale: {decode: {min_replicas: 3, max_replicas: 2}}\n")
    with pytest.raises(ConfigError, match="min_replicas"):
        load_serve_config(path)
    path = write(tmp_path, "autoscale: {prefill: {hihg: 0.9}}\n")
    with pytest.raises(ConfigError, match="hihg"):
        load_serve_config(path)


def test_rebalance_marks_are_ordered(tmp_path):
    assert "low (0.9) must be below high (0.5)" in problems(
        tmp_path, "rebalance: {mode: 'on', high: 0.5, low: 0.9}\n"
    )


def test_secrets_are_refused(tmp_path):
    msg = problems(tmp_path, "redis_url: redis://:hunter2@10.0.0.1:6379/0\n")
    assert "TANDEM_REDIS_URL" in msg and "hunter2" not in msg
    assert "api_key: unknown setting" in problems(tmp_path, "api_key: k\n")
    assert load_serve_config(write(tmp_path, "redis_url: redis://10.0.0.1:6379/0\n")).redis_url


def test_unusable_files(tmp_path):
    with pytest.raises(ConfigError, match="cannot read config file"):
        load_serve_config(tmp_path / "missing.yaml")
    assert "must hold a mapping of settings, not a list" in problems(tmp_path, "- port: 1\n")
    assert "is not valid YAML" in problems(tmp_path, "port: [1\n")
    assert "is not valid json" in problems(tmp_path, "{port: 1}", name="serve.json")
    assert load_serve_config(write(tmp_path, "# nothing\n")).model_fields_set == set()


def test_yaml_on_and_off_mean_on_and_off(tmp_path):
    config = load_serve_config(write(tmp_path, "role_resources: on\nrebalance:\n  mode: off\n"))
    assert config.role_resources == "on" and config.rebalance.mode == "off"


def test_json_files_and_paths_relative_to_the_file(tmp_path):
    (tmp_path / "conf").mkdir()
    path = write(tmp_path / "conf", json.dumps({"port": 9000, "api_key_file": "keys"}), "s.json")
    config = load_serve_config(path)
    assert config.port == 9000
    assert config.api_key_file == str(tmp_path / "conf" / "keys")


# -- precedence: file < command line ------------------------------------------------------------


def test_file_values_apply(tmp_path):
    path = write(tmp_path, "port: 9000\nqueue_policy: sjf\nprefill: 2\ndecode: 1\n")
    args = serve_parser().parse_args(["--config", str(path)])
    assert (args.port, args.queue_policy, args.prefill, args.decode) == (9000, "sjf", 2, 1)
    assert args.max_queue == 1024  # not in the file: the flag's default


@pytest.mark.parametrize(
    "argv",
    [
        ["--config", "FILE", "--port", "9001"],
        ["--port", "9001", "--config", "FILE"],
        ["--port=9001", "--config=FILE"],
    ],
)
def test_a_flag_wins_over_the_file_wherever_it_stands(tmp_path, argv):
    path = write(tmp_path, "port: 9000\nhost: 127.0.0.1\n")
    args = serve_parser().parse_args([a.replace("FILE", str(path)) for a in argv])
    assert args.port == 9001


def test_a_flag_given_with_its_default_value_still_wins(tmp_path):
    path = write(tmp_path, "port: 9000\nmax_resumes: 5\nrole_resources: 'on'\n")
    args = serve_parser().parse_args(
        ["--port", "8000", "--max-resumes", "2", "--role-resources", "auto", "--config", str(path)]
    )
    assert (args.port, args.max_resumes, args.role_resources) == (8000, 2, "auto")


def test_kv_cache_dtype_is_an_engine_setting_of_serve(tmp_path):
    """``tandem serve --engine kv_cache_dtype=fp8`` (or the file's ``engine`` mapping), as any
    ``EngineConfig`` field."""
    from cluster.launch.config_file import engine_override_keys
    from cluster.launch.serve import _engine_overrides

    assert "kv_cache_dtype" in engine_override_keys()
    args = serve_parser().parse_args(["--engine", "kv_cache_dtype=fp8"])
    assert _engine_overrides(args.engine) == {"kv_cache_dtype": "fp8"}
    config = load_serve_config(write(tmp_path, "engine: {kv_cache_dtype: fp8}\n"))
    assert config.as_defaults()["engine"] == ['kv_cache_dtype="fp8"']


def test_engine_flags_add_to_the_files_engine(tmp_path):
    from cluster.launch.serve import _engine_overrides

    path = write(tmp_path, "engine:\n  max_num_seqs: 8\n  enforce_eager: true\n")
    args = serve_parser().parse_args(["--config", str(path), "--engine", "max_num_seqs=16"])
    assert _engine_overrides(args.engine) == {"max_num_seqs": 16, "enforce_eager": True}


def test_settings_without_flags_reach_the_cluster(tmp_path):
    from cluster.launch.serve import _cluster_options

    path = write(
        tmp_path,
        "kv_host: node\nrole_resources: 'on'\ngpus: {decode: 0.5}\n"
        "prefill_engine: {max_num_batched_tokens: 8192}\nmigration: {max_stages: 2}\n"
        "rebalance: {mode: dry-run}\n"
        "autoscale: {enabled: true, decode: {max_replicas: 3, slo_s: 0.2}}\n",
    )
    args = serve_parser().parse_args(["--config", str(path)])
    options = _cluster_options(args)
    assert options["host"] == "node" and options["role_resources"] == "on"
    assert options["gpus"] == {"decode": 0.5}
    assert options["prefill_engine"] == {"max_num_batched_tokens": 8192}
    assert options["migration"]["max_stages"] == 2
    assert args.rebalance["mode"] == "dry-run"
    assert _cluster_options(serve_parser().parse_args([]))["migration"] == {}
    # only what the file sets: the pools it leaves out keep their own defaults (slo_s)
    assert options["autoscale"] == {
        "enabled": True,
        "interval_s": 5.0,
        "decode": {"max_replicas": 3, "slo_s": 0.2},
    }
    from cluster.control.autoscaler import AutoscalerConfig

    config = AutoscalerConfig(**options["autoscale"])
    assert config.decode.max_replicas == 3 and config.prefill.slo_s == 2.0
    # a pool section that sets other fields keeps its role's latency target (it fell to None,
    # turning the decode pool's ITL signal off, before 2026-11-26); null turns it off
    kept = AutoscalerConfig(decode={"max_replicas": 8}, prefill={"slo_s": None})
    assert (kept.decode.slo_s, kept.decode.max_replicas) == (0.25, 8)
    assert kept.prefill.slo_s is None and kept.colocated.slo_s == 2.0
    from cluster.launch.local import ClusterConfig

    cluster = ClusterConfig(num_prefill=1, num_decode=1, **options)
    assert (cluster.host, cluster.role_resources, cluster.gpus) == ("node", "on", {"decode": 0.5})


def test_the_files_rebalancer_is_set_on_the_controller(tmp_path, monkeypatch):
    import ray

    from cluster.launch.serve import _start_rebalancer

    calls = []

    class Controller:
        class rebalance:  # noqa: N801 - stands in for an actor method
            @staticmethod
            def remote(**settings):
                calls.append(settings)

    cluster = type("Cluster", (), {"controller": Controller})()
    monkeypatch.setattr(ray, "get", lambda ref: ref)
    _start_rebalancer(cluster, serve_parser().parse_args([]))  # no file: nothing set
    path = write(tmp_path, "rebalance: {mode: 'on', high: 0.9}\n")
    _start_rebalancer(cluster, serve_parser().parse_args(["--config", str(path)]))
    assert calls == [{"mode": "on", "interval_s": 1.0, "high": 0.9, "low": 0.6, "max_moves": 1}]


def test_a_bad_file_stops_the_command_with_its_problems(tmp_path, capsys):
    path = write(tmp_path, "prefil: 2\n")
    with pytest.raises(SystemExit) as exit_:
        serve_parser().parse_args(["--config", str(path)])
    assert exit_.value.code == 2
    assert "prefil: unknown setting (did you mean 'prefill'?)" in capsys.readouterr().err


def test_through_the_tandem_cli(tmp_path):
    from cluster.cli import build_parser

    path = write(tmp_path, "port: 9000\ndevice: cpu\n")
    args = build_parser().parse_args(["serve", "--config", str(path), "--device", "cuda"])
    assert (args.port, args.device) == (9000, "cuda")


def test_detach_hands_the_child_the_file_and_the_flags_that_differ(tmp_path):
    from cluster.launch.serve import _child_argv

    path = write(tmp_path, "port: 9000\nqueue_policy: sjf\n")
    args = serve_parser().parse_args(["--config", str(path), "--max-queue", "7", "--detach"])
    child = _child_argv(args)
    assert child[child.index("--config") + 1] == str(path)
    assert "--max-queue" in child and "--detach" not in child
    assert "--port" not in child and "--queue-policy" not in child  # the child reads them


# -- the model mirrors the flags ----------------------------------------------------------------


def test_every_serve_flag_has_a_key_with_its_default():
    parser = serve_parser()
    fields = ServeConfig.model_fields
    for action in parser._actions:
        if not action.option_strings or action.dest in NOT_IN_FILES | {"help"}:
            continue
        assert action.dest in fields, f"{action.option_strings[-1]} has no config key"
        field = fields[action.dest]
        default = field.default_factory() if field.default_factory else field.default
        if action.dest == "engine":
            assert default == {} and action.default == []
        else:
            assert default == action.default, action.dest
    assert {"detach", "api_key"}.isdisjoint(fields)


def test_every_setting_is_documented():
    def walk(model, prefix=""):
        for name, info in model.model_fields.items():
            assert info.description and len(info.description) > 10, f"{prefix}{name}"
            ann = info.annotation
            if isinstance(ann, type) and hasattr(ann, "model_fields"):
                walk(ann, f"{prefix}{name}.")

    walk(ServeConfig)


def test_sections_mirror_the_workers_dataclasses():
    from cluster.control.migrations import RebalanceSettings as Rebalance
    from cluster.launch.config_file import MigrationSettings, RebalanceSettings
    from decode_worker.migration import MigrationConfig

    for ours, theirs in ((MigrationSettings, MigrationConfig), (RebalanceSettings, Rebalance)):
        defaults = {f.name: f.default for f in dataclasses.fields(theirs)}
        assert defaults == {k: v.default for k, v in ours.model_fields.items()}, theirs.__name__
    from cluster.control.autoscaler import AutoscalerConfig, PoolPolicy
    from cluster.launch.config_file import AutoscaleSettings, PoolSettings

    defaults = {f.name: f.default for f in dataclasses.fields(PoolPolicy)}
    assert defaults == {k: v.default for k, v in PoolSettings.model_fields.items()}
    assert set(AutoscaleSettings.model_fields) == {
        f.name for f in dataclasses.fields(AutoscalerConfig)
    }


def test_role_resources_setting():
    from cluster.launch.local import ClusterConfig, _use_role_resources

    both = {"prefill": 2.0, "decode": 2.0, "GPU": 4.0}
    assert _use_role_resources("auto", both) and not _use_role_resources("auto", {"GPU": 4.0})
    assert _use_role_resources("on", {}) and not _use_role_resources("off", both)
    with pytest.raises(ValueError, match="role_resources must be auto, on or off"):
        ClusterConfig(role_resources="yes")


# -- examples and the reference -----------------------------------------------------------------


def test_examples_exist():
    assert {p.name for p in EXAMPLES} >= {"cluster-gpu.yaml", "onprem-gpu.yaml", "local-cpu.yaml"}


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_example_loads(path):
    config = load_serve_config(path)
    assert config.model_fields_set, "an example that sets nothing"
    args = serve_parser().parse_args(["--config", str(path)])
    assert args.host == "127.0.0.1"


def test_reference_in_docs_is_current():
    doc = (ROOT / "docs" / "config.md").read_text()
    start, end = doc.index(REFERENCE_BEGIN), doc.index(REFERENCE_END)
    assert doc[start + len(REFERENCE_BEGIN) : end].strip() == reference_markdown().strip(), (
        "docs/config.md is stale: python -m cluster.launch.config_reference --write docs/config.md"
    )
    for name in ServeConfig.model_fields:
        assert f"\n| {name} |" in doc


def test_sections_are_generated_from_their_dataclasses():
    """One definition (engine/settings.py): a file section's keys, defaults, bounds and help come
    from its settings dataclass's fields, and both reject the same values."""
    import dataclasses

    from pydantic import ValidationError

    from cluster.control.autoscaler import PoolPolicy
    from cluster.control.migrations import RebalanceSettings as Rebalance
    from cluster.launch.config_file import MigrationSettings, PoolSettings, RebalanceSettings
    from decode_worker.migration_config import MigrationConfig

    pairs = ((MigrationSettings, MigrationConfig), (RebalanceSettings, Rebalance))
    for section, settings in (*pairs, (PoolSettings, PoolPolicy)):
        names = [f.name for f in dataclasses.fields(settings)]
        assert list(section.model_fields) == names, settings.__name__
        for f in dataclasses.fields(settings):
            info = section.model_fields[f.name]
            assert info.default == f.default and info.description == f.metadata["help"], f.name
    # cross-field checks live on the dataclass and hold in a file's section too
    for section, settings, bad in (
        (RebalanceSettings, Rebalance, {"low": 0.9, "high": 0.5}),
        (PoolSettings, PoolPolicy, {"min_replicas": 5, "max_replicas": 2}),
    ):
        with pytest.raises(ValueError, match=next(iter(bad))):
            settings(**bad)
        with pytest.raises(ValidationError, match=next(iter(bad))):
            section(**bad)
    with pytest.raises(ValueError, match="must be one of off, on, dry-run"):
        Rebalance(mode="sometimes")
    assert RebalanceSettings(mode=False).mode == "off"  # YAML's off
    assert PoolPolicy(slo_s=None).slo_s is None and PoolSettings(slo_s=None).slo_s is None
    for bad in (
        {"max_stages": 0},
        {"headroom_blocks": -1},
        {"timeout_s": 0.0},
        {"chunks_ahead": 0},
    ):
        with pytest.raises(ValueError, match=next(iter(bad))):
            MigrationConfig(**bad)
        with pytest.raises(ValidationError):
            MigrationSettings(**bad)
    with pytest.raises(ValueError, match="must be an integer"):
        MigrationConfig(max_in=True)
    with pytest.raises(ValueError, match="must be a number"):
        MigrationConfig(timeout_s="30")
    assert MigrationConfig(timeout_s=5).timeout_s == 5  # an int is a number
    assert MigrationConfig(**MigrationSettings(max_out=2).model_dump()).max_out == 2
    with pytest.raises(ValidationError, match="unknown_key|extra"):
        MigrationSettings(unknown_key=1)
