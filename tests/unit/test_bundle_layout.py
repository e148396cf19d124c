"""The repository root as a DAG bundle (docs/deploying.md): what the dag processor parses, and
the line between the bundle and the installed scheduler-side distribution.

The real processors are exercised in tests/e2e/test_git_bundle.py (GitDagBundle) and by
``make up`` (LocalDagBundle at the root); here, Airflow's own file discovery and imports, fast.
"""

from __future__ import annotations

import ast
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
JOB_DAG_FILES = {
    "dags/calendar_slot_expiration.py",
    "dags/news_snapshot_detach_requeue.py",
    "dags/news_snapshot_detach_retry.py",
    "dags/user_activity_retention.py",
}
PLUGIN_SRC = REPO / "scheduler_plugin" / "src" / "pin_maintenance_plugin"


def test_root_bundle_lists_only_the_dag_files() -> None:
    """Airflow's own discovery (``.airflowignore``, glob syntax) from the repository root."""
    from airflow.utils.file import find_dag_file_paths

    found = {str(Path(p).relative_to(REPO)) for p in find_dag_file_paths(REPO, safe_mode=True)}
    assert found == JOB_DAG_FILES


def test_root_bundle_ignores_everything_outside_dags_even_without_safe_mode() -> None:
    from airflow.utils.file import list_py_file_paths

    found = {str(Path(p).relative_to(REPO)) for p in list_py_file_paths(REPO, safe_mode=False)}
    assert found == JOB_DAG_FILES


def test_root_dagbag_has_the_four_dags_and_no_import_error() -> None:
    from airflow.dag_processing.dagbag import BundleDagBag

    bag = BundleDagBag(dag_folder=REPO, bundle_path=REPO, bundle_name="pin-maintenance")
    assert bag.import_errors == {}
    assert sorted(bag.dag_ids) == sorted(Path(f).stem for f in JOB_DAG_FILES)


def test_scheduler_side_distribution_carries_no_job_code() -> None:
    """The installed part never imports the bundle's packages (they run per bundle version)."""
    for path in PLUGIN_SRC.glob("*.py"):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module]
            bad = [n for n in names if n.split(".")[0] in {"include", "devtools", "tests"}]
            assert not bad, f"{path.name} imports {bad}: the installed part must not"


def test_the_entry_point_is_what_airflow_loads() -> None:
    from importlib.metadata import entry_points

    meta = tomllib.loads((REPO / "scheduler_plugin" / "pyproject.toml").read_text())
    declared = meta["project"]["entry-points"]["airflow.plugins"]
    installed = {ep.name: ep.value for ep in entry_points(group="airflow.plugins")}
    assert installed.get("pin_maintenance") == declared["pin_maintenance"]

    from airflow import plugins_manager

    plugins, _ = plugins_manager._get_plugins()
    names = {p.name for p in plugins}
    assert "pin_maintenance" in names


def test_installed_copy_is_the_source_tree() -> None:
    """``.venv`` holds scheduler_plugin/ as it is now (the Makefile reinstalls on change)."""
    import pin_maintenance_plugin

    installed = Path(pin_maintenance_plugin.__file__).parent
    assert installed != PLUGIN_SRC, "imported from the source tree, not the installed copy"
    for src in PLUGIN_SRC.glob("*.py"):
        assert (installed / src.name).read_text() == src.read_text(), (
            f"installed {src.name} differs from scheduler_plugin/: run `make venv`"
        )


HIDE_PLUGIN = """
import sys
class Hide:
    def find_spec(self, name, path=None, target=None):
        if name == "pin_maintenance_plugin" or name.startswith("pin_maintenance_plugin."):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
sys.meta_path.insert(0, Hide())
sys.path.insert(0, sys.argv[1])
import runpy
runpy.run_path(sys.argv[2])
"""


@pytest.mark.parametrize(
    ("dag_file", "has_deadline"),
    [(f, "requeue" not in f) for f in sorted(JOB_DAG_FILES)],
)
def test_a_dag_without_the_distribution_names_it(dag_file, has_deadline) -> None:
    """Parse a DAG file with ``pin_maintenance_plugin`` hidden, as on an image without it."""
    done = subprocess.run(
        [sys.executable, "-c", HIDE_PLUGIN, str(REPO), str(REPO / dag_file)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        cwd="/",
    )
    if has_deadline:
        assert done.returncode != 0
        assert "pin-maintenance-airflow-plugin is not installed" in done.stderr, done.stderr
    else:  # the requeue runbook DAG has no deadline: it parses, and fails at task time only
        assert done.returncode == 0, done.stderr


def test_an_incompatible_major_version_is_refused() -> None:
    from include.pin_airflow import scheduler_side

    scheduler_side._check_version("1.4.2")
    with pytest.raises(scheduler_side.SchedulerSideMissingError, match=r"needs 1\.x"):
        scheduler_side._check_version("2.0.0")
