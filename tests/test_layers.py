"""The import-layer contract (pyproject's [tool.importlinter]) holds, and catches a violation.

The tree's Python files are copied to a scratch folder; ``lint-imports`` must pass there as it
is, and fail once a lower layer imports a higher one (a module-level import and one hidden in
a function body, as the old worker runtime's lazy router import was).
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ["cluster", "router", "prefill_worker", "decode_worker", "engine", "kernels", "proto"]
LINT = shutil.which("lint-imports")

pytestmark = pytest.mark.skipif(LINT is None, reason="import-linter is not installed")


def _copy_tree(dest: Path) -> None:
    for pkg in PACKAGES:
        for src in (ROOT / pkg).rglob("*.py"):
            target = dest / src.relative_to(ROOT)
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(src, target)
    shutil.copyfile(ROOT / "pyproject.toml", dest / "pyproject.toml")


def _lint(tree: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(tree)}
    return subprocess.run(
        [LINT, "--no-cache", "--config", str(tree / "pyproject.toml")],
        cwd=tree,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_layer_contract_holds_on_the_tree(tmp_path):
    _copy_tree(tmp_path)
    res = _lint(tmp_path)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "KEPT" in res.stdout


@pytest.mark.parametrize(
    ("where", "source"),
    [
        ("engine/_planted.py", "from router.dispatch import Dispatcher\n"),
        (
            "decode_worker/_planted.py",
            "def f():\n    from cluster.control.controller import Controller\n",
        ),
        ("prefill_worker/_planted.py", "import decode_worker.worker\n"),
        ("kernels/_planted.py", "import engine.config\n"),
        # cluster/'s rooms: the controller's process must not import the launcher's
        ("cluster/control/_planted.py", "def f():\n    from cluster.launch import serve\n"),
        ("cluster/launch/_planted.py", "import cluster.cli.operator_client\n"),
    ],
)
def test_layer_contract_fails_on_a_planted_violation(tmp_path, where, source):
    _copy_tree(tmp_path)
    (tmp_path / where).write_text(source)
    res = _lint(tmp_path)
    assert res.returncode != 0, res.stdout
    module = where.removesuffix(".py").replace("/", ".")
    assert "BROKEN" in res.stdout and module in res.stdout, res.stdout


@pytest.mark.parametrize(
    "planted",
    [
        # the circle cut when the backend registry left transport.py (engine/kv_transfer/backends.py)
        {"engine/kv_transfer/transport.py": "\ndef _nccl():\n    import engine.kv_transfer.nccl\n"},
        # two modules of one folder, each importing the other (one inside a function)
        {
            "router/_planted_a.py": "import router._planted_b\n",
            "router/_planted_b.py": "def f():\n    import router._planted_a\n",
        },
    ],
)
def test_a_circle_inside_a_folder_fails(tmp_path, planted):
    """The acyclic-siblings contract: an import circle between modules (or subfolders) of one
    folder fails ``lint-imports``, as the three circles cut from the tree would have."""
    _copy_tree(tmp_path)
    for where, source in planted.items():
        path = tmp_path / where
        path.write_text((path.read_text() if path.exists() else "") + source)
    res = _lint(tmp_path)
    assert res.returncode != 0, res.stdout
    assert "no import circles inside a folder" in res.stdout and "BROKEN" in res.stdout, res.stdout
