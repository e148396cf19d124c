"""What Airflow loads from this repository at run time loads with what is installed here.

Each DAG file is parsed by a DagBag of its own in a fresh interpreter (nothing imported by
the tests before), and ``airflow plugins`` lists every plugin the repository defines: the
plugin files of ``[core] plugins_folder`` and the ``airflow.plugins`` entry points of the
repository's own distributions. In the Astro image's environment (tests/image, or
``astro dev pytest`` in the image) this is the check that the image's requirements suffice.
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from devtools import airflow_env as ae

pytestmark = pytest.mark.dags

REPO = Path(__file__).resolve().parents[2]
DAG_FILES = sorted((REPO / "dags").glob("*.py"))
# Directories of the repository's own installable distributions (see devtools.image_env).
DISTRIBUTION_DIRS = [REPO / "scheduler_plugin"]

PARSE_EACH_DAG_FILE = """
import json, sys
from airflow.dag_processing.dagbag import DagBag
found = {}
for path in sys.argv[1:]:
    bag = DagBag(dag_folder=path)
    errors = {k: str(v) for k, v in bag.import_errors.items()}
    found[path] = {"dag_ids": sorted(bag.dag_ids), "errors": errors}
print(json.dumps(found))
"""


def defined_plugin_names() -> set[str]:
    """``name`` of every AirflowPlugin subclass in the repository's plugin code (from source)."""
    roots = [REPO / "plugins", *DISTRIBUTION_DIRS]
    names = set()
    for path in (p for r in roots if r.is_dir() for p in r.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if not isinstance(node, ast.ClassDef):
                continue
            if not any(ast.unparse(b).endswith("AirflowPlugin") for b in node.bases):
                continue
            for stmt in node.body:
                if (
                    isinstance(stmt, ast.Assign)
                    and [ast.unparse(t) for t in stmt.targets] == ["name"]
                    and isinstance(stmt.value, ast.Constant)
                ):
                    names.add(stmt.value.value)
    return names


def own_distribution_names() -> set[str]:
    return {
        tomllib.loads((d / "pyproject.toml").read_text())["project"]["name"]
        for d in DISTRIBUTION_DIRS
        if (d / "pyproject.toml").is_file()
    }


def test_each_dag_file_parses_alone_into_the_dag_it_is_named_after(tmp_path: Path) -> None:
    assert len(DAG_FILES) >= 4
    env = ae.airflow_env(tmp_path, job_db_url="postgresql:///unused")
    done = subprocess.run(
        [sys.executable, "-c", PARSE_EACH_DAG_FILE, *map(str, DAG_FILES)],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    found = json.loads(done.stdout.strip().splitlines()[-1])
    assert found == {str(p): {"dag_ids": [p.stem], "errors": {}} for p in DAG_FILES}


def test_airflow_loads_every_plugin_the_repository_defines(tmp_path: Path) -> None:
    expected = defined_plugin_names()
    assert "pin_maintenance" in expected  # the scan finds the deadline-reference plugin
    env = ae.airflow_env(tmp_path, job_db_url="postgresql:///unused")
    done = ae.airflow(["plugins", "--output", "json"], env, timeout=300)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert "Failed to import plugin" not in done.stdout + done.stderr, done.stderr[-3000:]
    listed = {p["name"] for p in json.loads(done.stdout.strip().splitlines()[-1])}
    assert expected <= listed, f"defined but not loaded: {sorted(expected - listed)}"


def test_the_repository_distributions_entry_points_load() -> None:
    from importlib.metadata import distribution

    from airflow.plugins_manager import AirflowPlugin

    for name in own_distribution_names():
        points = [e for e in distribution(name).entry_points if e.group == "airflow.plugins"]
        assert points, f"{name} declares no airflow.plugins entry point"
        for point in points:
            loaded = point.load()
            assert isinstance(loaded, type) and issubclass(loaded, AirflowPlugin), point
