"""An operator's day in the Airflow UI of ``make up``, in headless Chromium.

Log in; the DAG list shows the four DAGs with their schedules and no import error; each
DAG's trigger form shows its params (no "required" star on a flag), and a dry run triggered
from it succeeds and changes nothing; a malformed requeue id is refused before
a run exists, and a choice the form cannot check fails the run with one line, changing nothing,
alerted as a warning; a real run's report is readable in its task log.
"""

from __future__ import annotations

import re

import psycopg
import pytest

from devtools.local_airflow import AirflowStack
from devtools.ui_browser import AirflowUI, Api
from tests.ui.conftest import webhook_alerts

pytestmark = [pytest.mark.ui, pytest.mark.slow]

SCHEDULES = {
    "calendar_slot_expiration": "*/5 * * * *",
    "news_snapshot_detach_requeue": "",
    "news_snapshot_detach_retry": "*/5 * * * *",
    "user_activity_retention": "0 3 * * *",
}
TABLES = (
    "news.snapshot_detach_outbox",
    "calendar.availability_slots",
    "user_activity.sessions",
    "user_activity.property_object_views",
    "user_activity.action_events",
    "user_activity.property_object_view_stats",
)
# the task whose return value is the run's report, and its count keys on a dry run
REPORTS = {
    "calendar_slot_expiration": ("expire_slots", "ExpiredCount", "WouldExpireCount"),
    "news_snapshot_detach_retry": ("detach_pending_snapshots", None, None),
    "user_activity_retention": ("report", "DeletedSessions", None),
    "news_snapshot_detach_requeue": (
        "requeue_quarantined_snapshots",
        "RequeuedCount",
        "WouldRequeueCount",
    ),
}


def fingerprint(conn: psycopg.Connection) -> dict[str, tuple[int, str]]:
    """(row count, md5 of every row) per job table: any change to any row shows."""
    out = {}
    for table in TABLES:  # fixed names above, never input
        count, digest = conn.execute(
            f"select count(*), coalesce(md5(string_agg(t::text, ',' order by t::text)), '')"
            f" from {table} t"
        ).fetchone()
        out[table] = (count, digest)
    return out


def test_login_shows_the_four_dags_with_their_schedules(ui: AirflowUI, api: Api) -> None:
    assert ui.dag_list(expected=len(SCHEDULES)) == SCHEDULES
    ui.goto("/")  # the dashboard: import errors show there as a "Dag Import Errors" button
    ui.page.get_by_text("Asset Events").first.wait_for()
    home = ui.body_text()
    assert "Import Error" not in home and "import error" not in home.lower(), home[:2000]
    assert api.get("/importErrors")["total_entries"] == 0


@pytest.mark.parametrize("dag_id", sorted(REPORTS))
def test_trigger_form_shows_the_params_and_a_dry_run_changes_nothing(
    ui: AirflowUI, api: Api, job_db: psycopg.Connection, dag_id: str
) -> None:
    before = fingerprint(job_db)
    params = api.get(f"/dags/{dag_id}/details")["params"]
    dialog = ui.open_trigger(dag_id)
    text = dialog.inner_text()
    for name in params:
        assert AirflowUI.param_field(dialog, name).count() == 1, f"no field for {name}"
        assert not re.search(rf"^{re.escape(name)}\s*\*", text, re.M), f"{name} starred"
    assert "airflow dags test" in text  # dry_run's help: how to preview a paused DAG
    AirflowUI.set_flag(dialog, "dry_run")
    if dag_id == "news_snapshot_detach_requeue":
        AirflowUI.set_flag(dialog, "all_quarantined")
    triggered = ui.submit(dialog)
    assert triggered.status == 200, triggered.body
    assert triggered.body["conf"]["dry_run"] is True
    ui.leave()
    run = api.wait_run(dag_id, triggered.run_id)
    assert run["state"] == "success", run
    assert fingerprint(job_db) == before
    task_id, done_key, would_key = REPORTS[dag_id]
    report = api.xcom(dag_id, triggered.run_id, task_id)
    assert report["DryRun"] is True, report
    if done_key:
        assert report[done_key] == 0, report
    if would_key:
        assert report[would_key] > 0, report  # the demo rows: something would change
    for ti in api.get(f"/dags/{dag_id}/dagRuns/{triggered.run_id}/taskInstances")[
        "task_instances"
    ]:  # one XCom per task, not one per key of its dict
        assert api.xcom_keys(dag_id, triggered.run_id, ti["task_id"]) == ["return_value"]


def test_a_malformed_requeue_id_is_refused_before_a_run_exists(ui: AirflowUI, api: Api) -> None:
    dag_id = "news_snapshot_detach_requeue"
    runs_before = len(api.runs(dag_id))
    dialog = ui.open_trigger(dag_id)
    AirflowUI.fill_text(dialog, "snapshot_ids", "not-a-uuid")
    triggered = ui.submit(dialog)
    assert triggered.status == 400, triggered.body
    dialog.get_by_text("'not-a-uuid' does not match", exact=False).wait_for()
    assert "snapshot_ids" in dialog.inner_text()
    assert len(api.runs(dag_id)) == runs_before


def test_ids_and_all_quarantined_together_fail_at_once_as_a_warning(
    ui: AirflowUI, api: Api, job_db: psycopg.Connection, ui_airflow: AirflowStack
) -> None:
    dag_id, task_id = "news_snapshot_detach_requeue", "requeue_quarantined_snapshots"
    [snapshot_id] = job_db.execute(
        "select snapshot_id::text from news.snapshot_detach_outbox"
        " where status = 'Quarantined' limit 1"
    ).fetchone()
    before = fingerprint(job_db)
    dialog = ui.open_trigger(dag_id)
    AirflowUI.fill_text(dialog, "snapshot_ids", snapshot_id)
    AirflowUI.set_flag(dialog, "all_quarantined")
    triggered = ui.submit(dialog)
    assert triggered.status == 200, triggered.body  # a rule across two params: the task's
    ui.leave()
    run = api.wait_run(dag_id, triggered.run_id)
    assert run["state"] == "failed", run
    assert fingerprint(job_db) == before
    [ti] = api.get(f"/dags/{dag_id}/dagRuns/{triggered.run_id}/taskInstances")["task_instances"]
    assert ti["try_number"] == 1  # failed at once, no retry
    log = ui.open_task_log(dag_id, triggered.run_id, task_id, expect="refused bad input")
    [line] = [x for x in log.splitlines() if "refused bad input" in x]
    assert "not both" in line and "all_quarantined" in line, line
    alerts = [
        a["body"] for a in webhook_alerts(ui_airflow) if a["body"].get("run_id") == triggered.run_id
    ]
    assert [(a["alert"], a["severity"]) for a in alerts] == [("task_failed", "warning")], alerts
    assert alerts[0]["details"]["bad_input"] is True


def test_a_real_run_reports_in_its_task_log(
    ui: AirflowUI, api: Api, job_db: psycopg.Connection
) -> None:
    dag_id, task_id = "calendar_slot_expiration", "expire_slots"
    due_sql = (
        "select count(*) from calendar.availability_slots"
        " where status = 'Available' and start_at <= now()"
    )
    [due] = job_db.execute(due_sql).fetchone()
    assert due > 0, "make up's demo data has due slots"
    dialog = ui.open_trigger(dag_id)
    triggered = ui.submit(dialog)
    assert triggered.status == 200, triggered.body
    ui.leave()
    assert api.wait_run(dag_id, triggered.run_id)["state"] == "success"
    log = ui.open_task_log(dag_id, triggered.run_id, task_id, expect="event=job_completed")
    [line] = [x for x in log.splitlines() if "event=job_completed" in x]
    expired = int(re.search(r"expired_count=(\d+)", line).group(1))
    # the seed's bound: one batch (batch_size 500) per cycle by default; the rest waits
    assert 0 < expired <= 500, line
    assert job_db.execute(due_sql).fetchone()[0] <= due - expired
    assert "Skipping masking" not in log  # no short Variable value to warn about
    assert api.xcom(dag_id, triggered.run_id, task_id)["ExpiredCount"] == expired
