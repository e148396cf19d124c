"""``airflow dags test`` and ``deadline=``: exit 0 with the plugin fix, exit 1 without it.

apache/airflow#73428 (Airflow 3.3.2): the run succeeds, then ``DagRun.update_state`` fails on
the in-memory DAG's encoded deadline alerts and the CLI exits 1. The fix is
pin_maintenance_plugin.dags_test_fix, installed by the entry-point plugin's ``on_load``. The
"without" case (the same installed plugin with ``PIN_AIRFLOW_73428_FIX=off``, so the deadline
reference is still registered) proves the fix is still needed on this Airflow; when it starts
exiting 0, upstream fixed the bug: delete the fix and this file.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from devtools.pg import Database

pytestmark = pytest.mark.dags

FIXTURES = Path(__file__).resolve().parent / "fixtures_dags" / "deadline"
NO_JOB_DB = Database(url="postgresql:///unused", name="unused")  # the fixtures touch no DB
BUG = "'dict' object has no attribute 'hex'"


@pytest.fixture(scope="module")
def no_plugins(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An empty plugins folder: the plugin is the entry point. One for the module, so that the
    two runs with the fix share an environment (and a warm fork server)."""
    return tmp_path_factory.mktemp("no-plugins")


def env(plugins: Path, *, fix: bool = True) -> dict[str, str]:
    return {
        "AIRFLOW__CORE__DAGS_FOLDER": str(FIXTURES),
        "AIRFLOW__CORE__PLUGINS_FOLDER": str(plugins),  # empty: the plugin is the entry point
        "PIN_AIRFLOW_73428_FIX": "on" if fix else "off",
    }


@pytest.mark.parametrize(
    "dag_id",
    [
        "pin_fixture_deadline",  # the project's deadline_alert (custom reference)
        "pin_fixture_builtin_deadline",  # a builtin DAGRUN_QUEUED_AT reference: the bug is generic
    ],
)
def test_dags_test_exits_0_with_the_fix(run_dag, dag_id, no_plugins) -> None:
    done = run_dag(dag_id, NO_JOB_DB, extra_env=env(no_plugins))
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-4000:]
    assert BUG not in output
    assert "Marking run" in output and "successful" in output


def test_dags_test_exits_1_without_the_fix(run_dag, no_plugins) -> None:
    """Only the deadline reference registered, not the fix: the upstream bug shows."""
    done = run_dag("pin_fixture_deadline", NO_JOB_DB, extra_env=env(no_plugins, fix=False))
    output = done.stdout + done.stderr
    assert done.returncode == 1, (
        "airflow dags test exited 0 without pin_maintenance_plugin.dags_test_fix: "
        "apache/airflow#73428 looks fixed in this Airflow. Delete the fix and its tests."
    )
    assert BUG in output
    assert "successful" in output  # the run itself succeeded before the CLI failed
