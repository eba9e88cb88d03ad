"""deploy/: the `ray up` cluster files, the scripts they run, and the Grafana dashboard.

Ray's checks, run on every deploy/*.yaml without a cloud account: the steps `ray up` takes
before it touches a machine (ray/autoscaler/_private/commands.py ``_bootstrap_config``):

  1. the file as written against the schema shipped in the installed ray package
     (ray/autoscaler/ray-schema.json, with jsonschema);
  2. ``prepare_config``: the provider's defaults merged in (``fillout_defaults``), the common
     setup commands merged into the head's and the workers', the docker section checked, each
     node type's min / max workers filled in; for the local provider ``prepare_local`` first,
     which refuses node types and needs ``head_ip`` / ``worker_ips``;
  3. ``validate_config`` on the result: the schema again, the head type among the node types,
     the sum of the types' min_workers within max_workers;
  4. the local provider (onprem.yaml): the whole of ``_bootstrap_config``, its bootstrap needs
     no credentials.

Not run: the AWS and GCP bootstraps (``fillout_available_node_types_resources``,
``bootstrap_aws`` / ``bootstrap_gcp``: instance types, IAM roles, key pairs, subnets, images,
the project) call the cloud with the user's credentials and need boto3 /
google-api-python-client.

Then what would go wrong in tandem's use of them: the role resources (node types, or the
on-prem hosts' `ray start --resources`, run here in bash for every host), the `tandem serve`
command the head starts (parsed with tandem's own parser and its config file: joins the
cluster, asks for role resources, binds 127.0.0.1, fits the node types), Ray token auth on
every `ray start`, the files the commands name. And the dashboard: every series its queries
use is one the gateway exports (rendered by router/metrics.py from a fake backend), with the
labels the queries select on.
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import json
import os
import re
import shlex
import subprocess
from pathlib import Path

import pytest

yaml = pytest.importorskip("yaml")
jsonschema = pytest.importorskip("jsonschema")
ray = pytest.importorskip("ray")

ROOT = Path(__file__).resolve().parents[1]
DEPLOY = ROOT / "deploy"
CLUSTER_FILES = sorted(DEPLOY.glob("*.yaml"))
CLOUD = ("aws", "gcp")
ROLES = ("prefill", "decode")


def load(name: str) -> dict:
    return yaml.safe_load((DEPLOY / f"{name}.yaml").read_text())


def ids(paths):
    return [p.stem for p in paths]


def test_every_cluster_file_is_here():
    assert {p.stem for p in CLUSTER_FILES} == {"aws", "gcp", "onprem"}


# -- Ray's own checks ---------------------------------------------------------------------------


def ray_schema() -> dict:
    return json.loads((Path(ray.autoscaler.__file__).parent / "ray-schema.json").read_text())


@pytest.mark.parametrize("path", CLUSTER_FILES, ids=ids(CLUSTER_FILES))
def test_file_matches_rays_schema(path):
    jsonschema.validate(yaml.safe_load(path.read_text()), ray_schema())


@pytest.mark.parametrize("path", CLUSTER_FILES, ids=ids(CLUSTER_FILES))
def test_rays_prepare_and_validate(path):
    from ray.autoscaler._private.util import prepare_config, validate_config

    config = prepare_config(yaml.safe_load(path.read_text()))
    validate_config(config)
    assert config["head_node_type"] in config["available_node_types"]


def test_onprem_passes_rays_whole_bootstrap():
    from ray.autoscaler._private.commands import _bootstrap_config

    raw = load("onprem")
    config = _bootstrap_config(copy.deepcopy(raw), no_config_cache=True)
    (node_type,) = config["available_node_types"].values()  # the local provider's one type
    hosts = len(raw["provider"]["worker_ips"])
    assert node_type["min_workers"] == node_type["max_workers"] == hosts


@pytest.mark.parametrize(
    "mutate",
    [
        lambda c: c.update(max_worker=4),  # a typo'd top-level key
        lambda c: c["available_node_types"]["tandem.prefill"]["resources"].update(GPU=0.5),
        lambda c: c["available_node_types"]["tandem.decode"].update(min_worker=1),
    ],
    ids=["unknown-key", "fractional-resource", "typo-in-node-type"],
)
def test_schema_check_catches_mistakes(mutate):
    config = load("aws")
    mutate(config)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(config, ray_schema())


def test_rays_validation_catches_min_over_max():
    from ray.autoscaler._private.util import prepare_config, validate_config

    config = load("aws")
    config["available_node_types"]["tandem.decode"]["min_workers"] = config["max_workers"] + 1
    with pytest.raises(ValueError, match="max_workers"):
        validate_config(prepare_config(config))


def test_ray_up_worker_count_flags_as_the_readme_says():
    """deploy/README.md: `ray up --min-workers` is dropped where node types exist (each type's
    own min_workers counts) and sets the started hosts on-prem; `--max-workers` caps all types,
    and below the sum of their min_workers Ray refuses the file."""
    from ray.autoscaler._private.util import prepare_config, validate_config

    config = load("aws")
    mins = {k: t.get("min_workers", 0) for k, t in config["available_node_types"].items()}
    prepared = prepare_config({**config, "min_workers": 3})  # what `--min-workers 3` sets
    assert {k: t["min_workers"] for k, t in prepared["available_node_types"].items()} == mins
    validate_config(prepare_config({**config, "max_workers": sum(mins.values())}))
    with pytest.raises(ValueError, match="max_workers"):
        validate_config(prepare_config({**config, "max_workers": sum(mins.values()) - 1}))

    prepared = prepare_config({**load("onprem"), "min_workers": 1})
    assert prepared["available_node_types"]["local.cluster.node"]["min_workers"] == 1


# -- roles and resources ------------------------------------------------------------------------


def role_types(config: dict) -> dict[str, list[dict]]:
    out: dict[str, list[dict]] = {r: [] for r in ROLES}
    for node_type in config["available_node_types"].values():
        for role in ROLES:
            if role in node_type["resources"]:
                out[role].append(node_type)
    return out


@pytest.mark.parametrize("name", CLOUD)
def test_cloud_node_types_carry_the_roles(name):
    config = load(name)
    head = config["available_node_types"][config["head_node_type"]]
    assert not set(head["resources"]) & {"GPU", *ROLES}, "the head runs no worker"
    for role, types in role_types(config).items():
        assert types, f"no node type carries the {role!r} resource"
        for t in types:
            res = t["resources"]
            assert not set(res) & (set(ROLES) - {role}), f"a node type with two roles: {res}"
            # one worker per GPU, each taking one unit of its role
            assert res.get("GPU", 0) >= 1 and res[role] == res["GPU"], res
            assert 0 <= t.get("min_workers", 0) <= t["max_workers"] <= config["max_workers"]


@pytest.mark.parametrize("name", CLOUD)
def test_cloud_workers_get_resources_from_the_node_type(name):
    """Ray passes a node type's resources to its `ray start` (RAY_OVERRIDE_RESOURCES); a
    --resources of our own there would give every type every role."""
    for cmd in load(name)["worker_start_ray_commands"]:
        assert "--resources" not in cmd and "--num-gpus" not in cmd, cmd


def run_onprem_worker_start(host: str, gpus: int = 2) -> subprocess.CompletedProcess:
    """onprem.yaml's worker start command in bash, as on ``host``: hostname, nvidia-smi and
    ray are stand-ins (ray prints its arguments one per line)."""
    cmd = load("onprem")["worker_start_ray_commands"][-1]
    fakes = (
        f"hostname() {{ case \"$1\" in -I) echo '{host} 172.17.0.1' ;; *) echo node-x ;; esac; }}\n"
        f'nvidia-smi() {{ for i in $(seq 0 {gpus - 1}); do echo "GPU $i: NVIDIA H100"; done; }}\n'
        'ray() { printf "%s\\n" "$@"; }\n'
        "ulimit() { :; }\n"
    )
    env = {**os.environ, "RAY_HEAD_IP": "10.0.0.10"}
    return subprocess.run(
        ["bash", "-c", fakes + cmd], capture_output=True, text=True, env=env, timeout=30
    )


def test_onprem_gives_every_worker_host_its_role():
    hosts = load("onprem")["provider"]["worker_ips"]
    seen = {}
    for host in hosts:
        out = run_onprem_worker_start(host, gpus=4)
        assert out.returncode == 0, out.stderr
        args = out.stdout.splitlines()
        assert args[0] == "start" and "--address=10.0.0.10:6379" in args
        assert "--num-gpus=4" in args
        (resources,) = [a.removeprefix("--resources=") for a in args if a.startswith("--resou")]
        ((role, units),) = json.loads(resources).items()
        assert role in ROLES and units == 4
        seen[host] = role
    assert set(seen.values()) == set(ROLES), f"each role needs a host: {seen}"


def test_onprem_refuses_a_host_without_a_role_or_gpu():
    out = run_onprem_worker_start("10.9.9.9")
    assert out.returncode != 0 and "no role" in out.stderr
    host = load("onprem")["provider"]["worker_ips"][0]
    out = run_onprem_worker_start(host, gpus=0)
    assert out.returncode != 0 and "no GPU" in out.stderr


def test_onprem_head_is_not_a_worker():
    config = load("onprem")
    assert config["provider"]["head_ip"] not in config["provider"]["worker_ips"]
    assert config.get("max_workers", len(config["provider"]["worker_ips"])) == len(
        config["provider"]["worker_ips"]
    )


# -- what the head starts -----------------------------------------------------------------------


def local_path(config: dict, remote: str) -> Path | None:
    """The checkout file behind a path on the nodes (through file_mounts), or None."""
    for dest, src in config.get("file_mounts", {}).items():
        dest = dest.rstrip("/")
        if remote == dest or remote.startswith(dest + "/"):
            if src.startswith("~") or os.path.isabs(src):
                return None  # the operator's machine, not the checkout
            return (ROOT / src / remote[len(dest) :].lstrip("/")).resolve()
    return None


def serve_command(config: dict) -> tuple[list[str], argparse.Namespace]:
    """The `tandem serve` the head starts, and what tandem's parser makes of it (its config
    file read from the checkout)."""
    from cluster.launch.serve import add_serve_args

    (cmd,) = [c for c in config["head_start_ray_commands"] if "tandem serve" in c]
    argv = shlex.split(cmd)
    serve = argv[argv.index("tandem") + 2 :]
    i = serve.index("--config")
    path = local_path(config, serve[i + 1])
    assert path is not None and path.is_file(), f"{serve[i + 1]} is not in the checkout"
    serve[i + 1] = str(path)
    parser = argparse.ArgumentParser(prog="tandem serve", exit_on_error=False)
    add_serve_args(parser)
    return argv, parser.parse_args(serve)


@pytest.mark.parametrize("path", CLUSTER_FILES, ids=ids(CLUSTER_FILES))
def test_head_starts_tandem_serve_on_the_cluster(path):
    config = yaml.safe_load(path.read_text())
    argv, args = serve_command(config)
    assert argv[:2] == ["bash", "~/tandem/deploy/scripts/start-head.sh"]
    assert args.ray_address == "auto" and args.role_resources == "on" and args.detach
    assert args.device == "cuda", "a GPU cluster: the head may have no GPU to find"
    assert args.host == "127.0.0.1", "the gateway stays on loopback (an ssh tunnel reaches it)"
    assert (args.prefill or 0) >= 1 and (args.decode or 0) >= 1
    assert args.kv_host == "node", "prefill workers on other nodes must reach the decode's KV"
    assert args.operator_host == "127.0.0.1" and not args.no_operator
    # the key and token files the config names are in the folder the cluster file mounts
    secrets = os.path.expanduser("~/tandem-secrets/")
    assert "~/tandem-secrets" in config["file_mounts"]
    assert args.api_key_file and args.api_key_file.startswith(secrets)
    assert args.operator_token_file is None or args.operator_token_file.startswith(secrets)


@pytest.mark.parametrize("name", CLOUD)
def test_cloud_node_types_can_hold_the_workers(name):
    """A worker that finds no unit of its role waits forever: the types' max_workers must
    hold the workers the head starts."""
    config = load(name)
    _, args = serve_command(config)
    for role, count in (("prefill", args.prefill), ("decode", args.decode)):
        most = sum(t["max_workers"] * t["resources"][role] for t in role_types(config)[role])
        assert count <= most, f"{count} {role} workers, room for {most}"


@pytest.mark.parametrize("path", CLUSTER_FILES, ids=ids(CLUSTER_FILES))
def test_head_restart_drains_the_server_on_its_port(path):
    config = yaml.safe_load(path.read_text())
    cmds = config["head_start_ray_commands"]
    _, args = serve_command(config)
    stops = [i for i, c in enumerate(cmds) if c.startswith("tandem stop")]
    ray_stop = cmds.index("ray stop")
    assert stops and stops[0] < ray_stop, "stop tandem before Ray goes"
    assert f"--port {args.port}" in cmds[stops[0]]


@pytest.mark.parametrize("path", CLUSTER_FILES, ids=ids(CLUSTER_FILES))
def test_the_model_is_on_every_node(path):
    """Workers load the folder the head names: the setup commands (run on every node) must
    put that model there, or check it is there."""
    config = yaml.safe_load(path.read_text())
    _, args = serve_command(config)
    setup = " ".join(config["setup_commands"])
    if os.path.isabs(args.model):
        assert f"test -f {args.model}/config.json" in setup
    else:
        assert f"tandem model pull {args.model}" in setup


@pytest.mark.parametrize("path", CLUSTER_FILES, ids=ids(CLUSTER_FILES))
def test_ray_token_auth_on_every_node(path):
    config = yaml.safe_load(path.read_text())
    assert config["file_mounts"].get("~/.ray/auth_token") == "~/.ray/auth_token"
    for key in ("head_start_ray_commands", "worker_start_ray_commands"):
        starts = [c for c in config[key] if "ray start" in c]
        assert starts, key
        for cmd in starts:
            assert "RAY_AUTH_MODE=token ray start" in cmd, cmd
    (head,) = [c for c in config["head_start_ray_commands"] if "ray start --head" in c]
    assert "--dashboard-host=127.0.0.1" in head


@pytest.mark.parametrize("path", CLUSTER_FILES, ids=ids(CLUSTER_FILES))
def test_commands_name_files_that_exist(path):
    config = yaml.safe_load(path.read_text())
    for dest, src in config["file_mounts"].items():
        if not src.startswith("~"):
            assert (ROOT / src).exists(), f"file_mounts {dest}: {src} is not in the checkout"
    commands = [c for key, v in config.items() if key.endswith("_commands") for c in v]
    scripts = {m for c in commands for m in re.findall(r"~/tandem/\S+\.(?:sh|yaml)", c)}
    assert scripts, "the commands run nothing from the checkout"
    for remote in scripts:
        local = local_path(config, remote)
        assert local is not None and local.is_file(), f"{remote} is not in the checkout"


@pytest.mark.parametrize("script", sorted((DEPLOY / "scripts").glob("*.sh")), ids=lambda p: p.name)
def test_scripts_parse(script):
    out = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr


def test_start_head_keeps_secrets_off_command_lines():
    """The Redis password goes into a 0600 config file and the server's environment, never
    into an argv; the Redis it starts is bound to one address and asks for the password."""
    text = (DEPLOY / "scripts" / "start-head.sh").read_text()
    assert "TANDEM_REDIS_URL=$redis_url nohup" in text
    assert "requirepass $password" in text and "umask 077" in text
    assert not re.search(r"redis-server[^\n]*--requirepass", text)
    assert "bind $ip" in text and "0.0.0.0" not in text


# -- the Grafana dashboard ----------------------------------------------------------------------


class FakeBackend:
    """Every key router/metrics.py reads, so every family it exports has samples."""

    async def worker_stats(self):
        return [
            {
                "name": "decode-0",
                "running": 1,
                "waiting": 0,
                "total_blocks": 10,
                "in_use_blocks": 2,
                "prefix_queries_tokens": 5,
                "prefix_hit_tokens": 2,
                "kv_bytes_sent": 1,
                "kv_bytes_received": 1,
                "kv_transfer_seconds": 0.1,
                "projected_blocks": 3,
                "migrations": {
                    "out": {"migrated": 1},
                    "in": {"migrated": 1},
                    "reasons": {"drain": 1},
                    "bytes": 1,
                    "blocks": 1,
                    "stages": 2,
                    "pause_buckets": [(0.01, 1)],
                    "pause_sum": 0.005,
                },
            }
        ]

    def router_stats(self):
        from router.admission import Admission, QueueConfig
        from router.backend import RouterStats

        admission = Admission(QueueConfig(), lambda: 4)
        for i in range(25):  # Kendall's tau needs 20 finished requests
            admission.quality.observe(10 + i, 12 + 2 * i)
            admission.refined_quality.observe(10 + i, 11 + i)
        scheduling = {**admission.stats(), "predictor": "learned"}
        return RouterStats(
            {"cache_hit": 1},
            1,
            resumes={"dead": 1},
            worker_states={"decode-0": "active"},
            missed_polls={"decode-0": 0},
            migrations=1,
            scheduling=scheduling,
            control={
                "counts": [{"role": "decode", "direction": "out", "reason": "slots", "count": 1}],
                "pools": {"decode": 2},
                "latest": {"decode": {"pressures": {"slots": 0.9}}},
            },
        )


def exported_series() -> dict[str, set[str]]:
    """Sample name -> label names, from a real scrape of router/metrics.py."""
    from prometheus_client.parser import text_string_to_metric_families

    from router.metrics import GatewayMetrics

    metrics = GatewayMetrics("smollm2")
    metrics.reject("invalid")
    metrics.finished("stop")
    text = asyncio.run(metrics.render(FakeBackend())).decode()
    series: dict[str, set[str]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            series.setdefault(sample.name, set()).update(sample.labels)
    return series


METRIC = re.compile(r"tandem:[A-Za-z0-9_:]+")
SELECTOR = re.compile(r"(tandem:[A-Za-z0-9_:]+)\{([^}]*)\}")
GROUPING = re.compile(r"\b(?:by|without)\s*\(([^)]*)\)")


def query_problems(expr: str, series: dict[str, set[str]]) -> list[str]:
    """Names in ``expr`` tandem does not export, and labels it uses that its series lack."""
    problems = []
    names = set(METRIC.findall(expr))
    for name in sorted(names):
        if name not in series:
            problems.append(f"{name} is not exported")
    for name, matchers in SELECTOR.findall(expr):
        for label in re.findall(r"([A-Za-z_]\w*)\s*(?:=~|!~|!=|=)", matchers):
            if name in series and label not in series[name]:
                problems.append(f"{name} has no label {label!r}")
    known = set().union(*(series.get(n, set()) for n in names))
    for group in GROUPING.findall(expr):
        for label in (x.strip() for x in group.split(",")):
            if label and label not in known | {"le"}:
                problems.append(f"grouping by {label!r}, which no series here has")
    return problems


def dashboard_queries() -> list[tuple[str, str]]:
    board = json.loads((DEPLOY / "grafana" / "tandem.json").read_text())
    out = []
    for panel in board["panels"]:
        for target in panel.get("targets", []):
            out.append((panel["title"], target["expr"]))
    for var in board["templating"]["list"]:
        if var["type"] == "query":
            out.append((f"variable {var['name']}", var["definition"]))
    return out


def test_dashboard_queries_use_exported_series():
    series = exported_series()
    queries = dashboard_queries()
    assert len(queries) > 30
    problems = [f"{title}: {p}" for title, expr in queries for p in query_problems(expr, series)]
    assert not problems, "\n".join(problems)


def test_dashboard_check_catches_a_wrong_name_or_label():
    series = exported_series()
    assert query_problems("rate(tandem:time_to_first_token_seconds_bucket[1m])", series) == []
    assert query_problems("rate(tandem:ttft_seconds_bucket[1m])", series)  # renamed metric
    assert query_problems('tandem:kv_cache_usage_perc{instance_id="x"}', series)
    assert query_problems("sum by (worker) (tandem:queue_waiting)", series)
    assert (
        query_problems("sum by (role) (increase(tandem:scaling_decisions_total[5m]))", series) == []
    )
    assert query_problems("sum by (gpu) (tandem:pool_replicas)", series)


def test_dashboard_covers_what_operators_watch():
    exprs = " ".join(e for _, e in dashboard_queries())
    for name in (
        "tandem:time_to_first_token_seconds_bucket",
        "tandem:inter_token_latency_seconds_bucket",
        "tandem:generation_tokens_total",
        "tandem:kv_cache_usage_perc",
        "tandem:prefix_cache_hits_total",
        "tandem:kv_transfer_bytes_total",
        "tandem:migrations_total",
        "tandem:queue_waiting",
        "tandem:early_rejections_total",
        "tandem:length_prediction_error_bucket",
        "tandem:scaling_decisions_total",
        "tandem:pool_replicas",
        "tandem:autoscaler_pressure",
    ):
        assert name in exprs, name


def test_dashboard_json_is_what_its_source_makes():
    import importlib.util

    spec = importlib.util.spec_from_file_location(
        "make_dashboard", DEPLOY / "grafana" / "make_dashboard.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert (DEPLOY / "grafana" / "tandem.json").read_text() == module.render(), (
        "deploy/grafana/tandem.json is stale: python deploy/grafana/make_dashboard.py"
    )
    board = json.loads(module.render())
    ids_ = [p["id"] for p in board["panels"]]
    assert len(ids_) == len(set(ids_))
    for p in board["panels"]:
        assert p["gridPos"]["x"] + p["gridPos"]["w"] <= 24
