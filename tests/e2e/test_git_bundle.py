"""The repository deployed as an Airflow 3 DAG bundle: a ``GitDagBundle`` on a local Git repository.

What a deployment sees (docs/deploying.md): the scheduler, dag-processor, API server and
triggerer run with no ``PYTHONPATH`` entry for this repository, an empty plugins folder and their
working directory outside it. The DAGs and the job code come from a ``GitDagBundle`` tracking
``main`` of a repository made from this checkout (``file://``); the scheduler-side code (the
deadline reference, the deadline callback, alert delivery) from the installed distribution
``pin-maintenance-airflow-plugin`` only.

On the session's git-bundle stack (``tests/e2e/bundle_fixtures.py``: LocalExecutor, no
scheduled runs, every run is triggered), in any order:

- the dag processor parses exactly the 4 DAG ids of the bundle, with no import error (each
  of the 4 DAGs runs from a trigger and succeeds with the job checks: ``test_job_dags``);
- a late run raises its deadline alert (``user_activity_retention`` with its deadline
  Variable at 1 s) through the webhook;
- a commit that changes the slot job's default ``batch_size`` is pushed to ``main``: the next
  run records the new commit as its bundle version and runs the new code (more batches), while
  the earlier run keeps its recorded version.
"""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from devtools.local_airflow import wait_for
from devtools.slot_data import insert_slots
from tests.e2e import job_checks as jc
from tests.e2e.bundle_fixtures import (
    BUNDLE,
    DEFAULT_BATCH,
    LATE_DAG,
    PUSHED_BATCH,
    REPO,
    SLOT_CONFIG,
    git,
)
from tests.e2e.stack_fixtures import E2EAirflow

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.slow,
    pytest.mark.timeout(1200),
]


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


def test_a_late_run_raises_its_deadline_alert(bundle_e2e: E2EAirflow) -> None:
    """A retention run takes longer than its 1 s deadline Variable: the installed plugin's
    reference and callback, with no bundle code on the scheduler's path, page through the
    webhook."""
    jc.quiet_window(bundle_e2e, LATE_DAG)  # parsed and unpaused: no earlier test does it for us
    late = jc.trigger(bundle_e2e, LATE_DAG, {"dry_run": True}, "api")
    log = bundle_e2e.stack.webhook_log

    def alerted() -> list[dict] | None:
        bundle_e2e.stack.check_alive()
        lines = log.read_text().splitlines() if log and log.exists() else []
        sent = [json.loads(line)["body"] for line in lines]  # devtools.webhook_sink's lines
        hits = [a for a in sent if a["alert"] == "deadline_missed" and a["run_id"] == late]
        return hits or None

    hits = wait_for(alerted, timeout=120, interval=1, what="deadline_missed for retention")
    assert len(hits) == 1, hits
    assert hits[0]["dag_id"] == LATE_DAG
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
