"""``devtools/airflow_cli.py``, the ``airflow`` command the tests and tools run, answers as the
venv's console script does: the same output and the same exit code, for a success and a usage
error (the DAG tests' failing runs check the exit code of a failing command).

What it adds, ``gc.freeze()`` as the last exit handler, skips only the interpreter's final cycle
collection. The exit handlers that matter, logging's flush and the span exporters' shutdown,
are exercised by every DAG test that reads a run's output and by
tests/dags/test_traces_dags_test.py."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

from devtools import airflow_env as ae

pytestmark = pytest.mark.slow

# the log lines' timestamps differ from run to run
TIMESTAMP = re.compile(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d+Z")


def _normal(text: str) -> list[str]:
    return [TIMESTAMP.sub("<ts>", line) for line in text.splitlines() if line.strip()]


@pytest.mark.parametrize(
    "args",
    [["version"], ["tasks", "frobnicate"]],
    ids=["success", "usage-error"],
)
def test_the_cli_answers_as_the_console_script(airflow_home: Path, args: list[str]) -> None:
    env = ae.airflow_env(airflow_home, job_db_url="postgresql:///unused")
    script = subprocess.run(
        [str(ae.VENV_BIN / "airflow"), *args], env=env, capture_output=True, text=True, check=False
    )
    ours = ae.airflow(args, env, timeout=120)
    assert ours.returncode == script.returncode
    assert _normal(ours.stdout) == _normal(script.stdout)
    assert _normal(ours.stderr)[-1:] == _normal(script.stderr)[-1:]
    assert script.stdout + script.stderr  # there was something to compare
