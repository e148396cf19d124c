"""``devtools/airflow_cli.py``, the ``airflow`` command the tests and tools run, answers as the
venv's console script does: the same output and the same exit code, for a success and a usage
error (the DAG tests' failing runs check the exit code of a failing command). ``ae.airflow``
runs it forked from a warm interpreter (devtools/airflow_forkserver.py): a failing
``dags test`` ends as the console script's does, each run reads its own connections and
Variables, a run past its timeout is killed, and where Airflow cannot even import the command
runs as a plain process.

What it adds, ``gc.freeze()`` as the last exit handler, skips only the interpreter's final cycle
collection. The exit handlers that matter, logging's flush and the span exporters' shutdown,
are exercised by every DAG test that reads a run's output and by
tests/dags/test_traces_dags_test.py."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from devtools import airflow_env as ae
from devtools import airflow_forkserver as fs

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


# ----------------------------------------------------------------------- the fork server
# ae.airflow forks each command from a warm interpreter (devtools/airflow_forkserver.py)

FAILURE_DAGS = Path(__file__).resolve().parent / "fixtures_dags" / "failure"
REPO = Path(__file__).resolve().parents[2]


MARKING = re.compile(r"Marking run <DagRun (\S+) .*> (\w+)")


def _final_state(done: subprocess.CompletedProcess[str]) -> list[tuple[str, str]]:
    """(dag_id, state) of each "Marking run <DagRun ...> <state>" line."""
    return MARKING.findall(done.stdout + done.stderr)


def _children(pid: int) -> list[int]:
    found = []
    for status in Path("/proc").glob("[0-9]*/status"):
        try:
            fields = dict(line.split(":\t", 1) for line in status.read_text().splitlines())
        except (OSError, ValueError):
            continue
        if int(fields.get("PPid", "0")) == pid:
            found.append(int(status.parent.name))
    return found


def test_a_forked_dags_test_ends_as_the_console_scripts(airflow_home: Path) -> None:
    """A failing run (a task that fails after its retry): the same exit code and final state."""
    env = ae.airflow_env(
        airflow_home,
        job_db_url="postgresql:///unused",
        extra={"AIRFLOW__CORE__DAGS_FOLDER": str(FAILURE_DAGS)},
    )
    args = ["dags", "test", "pin_fixture_task_failed"]
    script = subprocess.run(
        [str(ae.VENV_BIN / "airflow"), *args], env=env, capture_output=True, text=True, check=False
    )
    forked = ae.airflow(args, env, timeout=300)
    assert (forked.returncode, script.returncode) == (1, 1), forked.stdout + forked.stderr
    assert _final_state(forked) == _final_state(script) == [("pin_fixture_task_failed", "failed")]


PREBUILT_PROBE = """
import sys
from devtools import airflow_forkserver
airflow_forkserver._warm()
InProcessExecutionAPI = airflow_forkserver._prebuild_execution_api()
ours = ("dags", "include", "pin_maintenance_plugin")
print("PROJECT_MODULES", sorted(m for m in sys.modules if m.split(".")[0] in ours))
first, second = InProcessExecutionAPI(), InProcessExecutionAPI()
same = set(first.app.dependency_overrides) == set(second.app.dependency_overrides)
print("PROBE", first.app._cadwyn_initialized, second.app._cadwyn_initialized,
      first.app is second.app, same)
"""


def test_a_childs_first_execution_api_has_the_prebuilt_app_and_later_ones_build_their_own(
    airflow_home: Path,
) -> None:
    """The server's prebuilt app (routes generated) goes to one instance only; the next one is
    built as Airflow builds it, with the same overrides (auth bypassed in-process). A warm
    server has imported nothing of the project, so the ``PIN_*`` settings a child reads are
    its own request's (airflow_forkserver.LIVE_PREFIXES)."""
    env = ae.airflow_env(airflow_home, job_db_url="postgresql:///unused")
    done = subprocess.run(
        [sys.executable, "-c", PREBUILT_PROBE],
        env={**env, "PYTHONPATH": str(REPO)},
        capture_output=True,
        text=True,
        check=False,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    [probe] = [line for line in done.stdout.splitlines() if line.startswith("PROBE ")]
    assert probe.split()[1:] == ["True", "False", "False", "True"]
    assert "PROJECT_MODULES []" in done.stdout.splitlines(), done.stdout[-2000:]


def test_each_forked_run_reads_its_own_connections_and_variables(airflow_home: Path) -> None:
    """One server (same environment but for AIRFLOW_VAR_*), two values: each run sees its own."""
    base = ae.airflow_env(airflow_home, job_db_url="postgresql:///unused")
    seen, servers = [], set()
    for value in ("first", "second"):
        done = ae.airflow(
            ["variables", "get", "pin_probe"], {**base, "AIRFLOW_VAR_PIN_PROBE": value}, timeout=120
        )
        assert done.returncode == 0, done.stdout + done.stderr
        seen.append(done.stdout.strip().splitlines()[-1])
        servers.add(fs._servers[fs.server_key(base)].proc.pid)
    assert seen == ["first", "second"]
    assert len(servers) == 1


def test_other_airflow_settings_get_their_own_server() -> None:
    base = {"AIRFLOW_HOME": "/h", "PATH": "/bin"}
    assert fs.server_key({**base, "AIRFLOW_CONN_NEWS_DB": "a", "AIRFLOW_VAR_X": "1"}) == (
        fs.server_key(base)
    )
    assert fs.server_key({**base, "PYTEST_CURRENT_TEST": "t (call)"}) == fs.server_key(base)
    for other in ({"AIRFLOW__CORE__DAGS_FOLDER": "/d"}, {"OTEL_SERVICE_NAME": "s"}, {"PATH": "/x"}):
        assert fs.server_key({**base, **other}) != fs.server_key(base), other


def test_a_run_past_its_timeout_is_killed_and_the_server_serves_on(airflow_home: Path) -> None:
    env = ae.airflow_env(
        airflow_home,
        job_db_url="postgresql:///unused",
        extra={"AIRFLOW__CORE__DAGS_FOLDER": str(FAILURE_DAGS)},
    )
    assert ae.airflow(["version"], env, timeout=120).returncode == 0  # the server is warm
    server = fs._servers[fs.server_key(env)]
    with pytest.raises(subprocess.TimeoutExpired):
        ae.airflow(["dags", "test", "pin_fixture_task_failed"], env, timeout=0.5)
    assert _children(server.proc.pid) == []  # the run was killed and reaped
    assert ae.airflow(["version"], env, timeout=120).returncode == 0
    assert fs._servers[fs.server_key(env)] is server


def test_where_airflow_does_not_import_the_command_runs_as_the_console_script(
    airflow_home: Path,
) -> None:
    env = ae.airflow_env(
        airflow_home,
        job_db_url="postgresql:///unused",
        metadata_url="nonsense://no-such-dialect",
    )
    script = subprocess.run(
        [str(ae.VENV_BIN / "airflow"), "version"],
        env=env,
        capture_output=True,
        text=True,
        check=False,
    )
    ours = ae.airflow(["version"], env, timeout=120)
    assert ours.returncode == script.returncode != 0
    assert _normal(ours.stderr)[-1:] == _normal(script.stderr)[-1:]
    assert "nonsense" in ours.stderr
    assert fs.server_key(env) not in fs._servers
