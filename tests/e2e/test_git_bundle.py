"""The repository deployed as an Airflow 3 DAG bundle: a ``GitDagBundle`` on a local Git repository.

What a deployment sees (docs/deploying.md): the scheduler, dag-processor, API server and
triggerer run with no ``PYTHONPATH`` entry for this repository, an empty plugins folder and their
working directory outside it. The DAGs and the job code come from a ``GitDagBundle`` tracking
``main`` of a repository made from this checkout (``file://``); the scheduler-side code (the
deadline reference, the deadline callback, alert delivery) from the installed distribution
``pin-maintenance-airflow-plugin`` only.

In order, on one LocalExecutor stack (no scheduled runs: every run is triggered):

1. the dag processor parses exactly the 4 DAG ids of the bundle, with no import error;
2. each of the 4 DAGs runs from a trigger and succeeds, with the job checks of test_job_dags;
3. a late run raises its deadline alert (``user_activity_retention`` with its deadline
   Variable at 1 s) through the webhook;
4. a commit that changes the slot job's default ``batch_size`` is pushed to ``main``: the next
   run records the new commit as its bundle version and runs the new code (more batches), while
   the earlier run keeps its recorded version.
"""

from __future__ import annotations

import json
import shutil
import subprocess
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from devtools.local_airflow import git_bundle, wait_for
from devtools.slot_data import insert_slots
from tests.e2e import job_checks as jc
from tests.e2e.stack_fixtures import E2EAirflow, JobServer, start_e2e, stop_e2e

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.slow,
    pytest.mark.timeout(1200),
    pytest.mark.skipif(shutil.which("git") is None, reason="needs the git client (GitDagBundle)"),
]

REPO = Path(__file__).resolve().parents[2]
BUNDLE = "pin-maintenance"
SLOT_CONFIG = "include/pin_maintenance/jobs/slot_expiration_config.py"
DEFAULT_BATCH = '"batch_size",\n            500,'
PUSHED_BATCH = '"batch_size",\n            7,'
QUICK_REPARSE = {
    "AIRFLOW__DAG_PROCESSOR__REFRESH_INTERVAL": "2",
    "AIRFLOW__DAG_PROCESSOR__MIN_FILE_PROCESS_INTERVAL": "1",
    "AIRFLOW__DAG_PROCESSOR__BUNDLE_REFRESH_CHECK_INTERVAL": "1",
    "AIRFLOW__CORE__MIN_SERIALIZED_DAG_UPDATE_INTERVAL": "1",
}
LATE_DAG = jc.RETENTION
GIT_ID = ["-c", "user.name=pin-e2e", "-c", "user.email=pin-e2e@localhost"]


def git(cwd: Path, *args: str) -> str:
    done = subprocess.run(
        ["git", *GIT_ID, *args], cwd=cwd, capture_output=True, text=True, check=False
    )
    assert done.returncode == 0, f"git {' '.join(args)}: {done.stdout}{done.stderr}"
    return done.stdout.strip()


def checkout_files() -> list[str]:
    """The checkout as a commit would hold it: tracked and new files, without ignored ones."""
    out = git(REPO, "ls-files", "-z", "--cached", "--others", "--exclude-standard")
    return [f for f in out.split("\0") if f and (REPO / f).is_file()]


@pytest.fixture(scope="module")
def origin(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Path, Path]]:
    """(bare origin repository, a working clone that pushes to it), both from this checkout."""
    base = tmp_path_factory.mktemp("git-bundle-repo")
    work = base / "work"
    for rel in checkout_files():
        (work / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(REPO / rel, work / rel)
    git(work, "init", "-q", "-b", "main")
    git(work, "add", "-A")
    git(work, "commit", "-q", "-m", "the checkout under test")
    bare = base / "origin.git"
    git(base, "clone", "-q", "--bare", str(work), str(bare))
    git(work, "remote", "add", "origin", str(bare))
    yield bare, work


@pytest.fixture(scope="module")
def bundle_e2e(
    tmp_path_factory: pytest.TempPathFactory,
    pg_admin_url: str,
    e2e_job_server: JobServer,
    e2e_selections,
    origin: tuple[Path, Path],
) -> Iterator[E2EAirflow]:
    bare, _ = origin
    e2e = start_e2e(
        tmp_path_factory.mktemp("e2e-git-bundle"),
        meta_admin_url=pg_admin_url,
        job_server=e2e_job_server,
        job_admin_url=e2e_job_server.admin_url,
        selections=e2e_selections,
        scheduled_runs=False,
        name="gitbundle",
        bundle_config=[git_bundle(f"file://{bare}", refresh_interval=2, name=BUNDLE)],
        repo_on_path=False,
        extra_env={
            **QUICK_REPARSE,
            f"AIRFLOW_VAR_{LATE_DAG.upper()}_DEADLINE_SECONDS": "1",
        },
    )
    try:
        yield e2e
    finally:
        left = stop_e2e(e2e)
        if left:
            pytest.fail(f"processes left after stopping Airflow: {left}")


def test_the_stack_sees_nothing_of_the_checkout(bundle_e2e: E2EAirflow) -> None:
    env = bundle_e2e.stack.env()
    assert str(REPO) not in env.get("PYTHONPATH", "")
    assert not any(Path(env["AIRFLOW__CORE__PLUGINS_FOLDER"]).iterdir())
    assert not Path(env["AIRFLOW__CORE__DAGS_FOLDER"]).is_relative_to(REPO)


def test_the_bundle_parses_to_exactly_the_four_dags(bundle_e2e: E2EAirflow) -> None:
    for dag_id in jc.JOB_DAGS:
        bundle_e2e.wait_dag(dag_id)
    dags = bundle_e2e.api.get("/dags", params={"limit": 100}).json()["dags"]
    assert sorted(d["dag_id"] for d in dags) == sorted(jc.JOB_DAGS)
    assert {d["bundle_name"] for d in dags} == {BUNDLE}
    errors = bundle_e2e.api.get("/importErrors").json()
    assert errors["total_entries"] == 0, errors


def test_each_dag_runs_from_its_trigger(bundle_e2e: E2EAirflow) -> None:
    jc.check_slot_expiration(bundle_e2e, dry_run_via="cli", via="api")
    jc.check_retention(bundle_e2e, dry_run_via="api", via="api")
    jc.check_detach_retry(bundle_e2e, dry_run_via="api", via="api")
    jc.check_requeue(bundle_e2e, via="api")


def test_a_late_run_raises_its_deadline_alert(bundle_e2e: E2EAirflow) -> None:
    """Retention's runs take longer than its 1 s deadline Variable: the installed plugin's
    reference and callback, with no bundle code on the scheduler's path, page through the
    webhook."""
    retention_runs = {r["dag_run_id"] for r in bundle_e2e.runs(LATE_DAG)}
    assert retention_runs, "test_each_dag_runs_from_its_trigger ran no retention run"
    log = bundle_e2e.stack.webhook_log

    def alerted() -> list[dict] | None:
        bundle_e2e.stack.check_alive()
        lines = log.read_text().splitlines() if log and log.exists() else []
        sent = [json.loads(line)["body"] for line in lines]  # devtools.webhook_sink's lines
        hits = [a for a in sent if a["alert"] == "deadline_missed" and a["dag_id"] == LATE_DAG]
        return hits or None

    hits = wait_for(alerted, timeout=120, interval=1, what="deadline_missed for retention")
    assert {a["run_id"] for a in hits} <= retention_runs
    assert hits[0]["details"]["tune_with_variable"] == f"{LATE_DAG}_deadline_seconds"


def _seed_due_slots(e2e: E2EAirflow, count: int) -> None:
    now = datetime.now(UTC)
    with e2e.job_conn() as conn:
        conn.execute("delete from calendar.availability_slots")
        insert_slots(
            conn,
            status="Available",
            count=count,
            first_start=now - timedelta(days=1),
            last_start=now - timedelta(minutes=5),
        )


def _slot_run(e2e: E2EAirflow) -> tuple[str, dict]:
    _seed_due_slots(e2e, 20)
    # drain mode, so that the pushed batch_size shows in the number of batches of one cycle
    run_id = jc.trigger(e2e, jc.SLOTS, {"max_batches_per_cycle": 10}, "api")
    return run_id, e2e.xcom(jc.SLOTS, run_id, "expire_slots")


def test_a_pushed_commit_reaches_the_next_run_and_not_the_earlier_one(
    bundle_e2e: E2EAirflow, origin: tuple[Path, Path]
) -> None:
    _, work = origin
    first_sha = git(work, "rev-parse", "HEAD")
    jc.quiet_window(bundle_e2e, jc.SLOTS)
    before_id, before = _slot_run(bundle_e2e)
    assert before["ExpiredCount"] == 20
    assert before["Batches"] == 1  # default batch_size 500
    assert bundle_e2e.run(jc.SLOTS, before_id)["bundle_version"] == first_sha

    config = work / SLOT_CONFIG
    text = config.read_text()
    assert DEFAULT_BATCH in text, f"{SLOT_CONFIG} changed: update this test's edit"
    config.write_text(text.replace(DEFAULT_BATCH, PUSHED_BATCH))
    git(work, "commit", "-q", "-am", "slots: default batch_size 7 (e2e bundle test)")
    git(work, "push", "-q", "origin", "main")
    new_sha = git(work, "rev-parse", "HEAD")

    def reparsed() -> bool:
        bundle_e2e.stack.check_alive()
        dag = bundle_e2e.api.get(f"/dags/{jc.SLOTS}").json()
        return dag.get("bundle_version") == new_sha

    wait_for(reparsed, timeout=180, interval=1, what="the pushed commit parsed")

    after_id, after = _slot_run(bundle_e2e)
    assert after["ExpiredCount"] == 20
    assert after["Batches"] >= 3  # 20 slots in batches of 7: the pushed default ran
    assert bundle_e2e.run(jc.SLOTS, after_id)["bundle_version"] == new_sha
    assert bundle_e2e.run(jc.SLOTS, before_id)["bundle_version"] == first_sha
