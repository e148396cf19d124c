"""docs/runbooks: one per seed runbook row, each naming its alerts, SQL to run and the fix."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
RUNBOOKS = REPO / "docs" / "runbooks"

# seed runbook rows (000 detach, 002 slots, 003 retention) + the Airflow-level alerts
EXPECTED = {
    "snapshot-detach-pending.md": ["NewsSnapshotDetachPendingGrowing", "selections_auth_failed"],
    "snapshot-detach-quarantined.md": [
        "snapshot_detach_quarantined",
        "news_snapshot_detach_requeue",
    ],
    "snapshot-detach-misrouted.md": ["selections_misrouted", "misroute_quarantine_limit"],
    "snapshot-detach-worker-stopped.md": [
        "NewsSnapshotDetachNoSuccessfulRun",
        "pg_terminate_backend",
    ],
    "slot-expiration-backlog.md": ["CalendarSlotExpirationBacklogHigh"],
    "slot-expiration-poison-slot.md": ["slot_expiration_poison_row"],
    "activity-retention-backlog.md": ["ActivityRetentionBacklogGrowing", "max_batches_per_run"],
    "activity-retention-failure.md": ["retention_batch_failed", "batch_ids"],
    "activity-retention-lock.md": ["pg_locks", "pg_terminate_backend"],
    "deadline-missed.md": ["deadline_missed", "_deadline_seconds"],
    "task-failed.md": ["task_failed"],
    "database-privileges-missing.md": ["database_privileges_missing", "job_roles.sql"],
    "database-server-unsupported.md": ["database_server_unsupported", "server_version_num"],
}


@pytest.mark.parametrize(("name", "must_mention"), EXPECTED.items())
def test_runbook_content(name, must_mention) -> None:
    text = (RUNBOOKS / name).read_text()
    assert text.startswith("# ")
    assert "**Alert" in text  # names the alert(s) that lead here
    for word in must_mention:
        assert word in text, f"{name} should mention {word}"
    if name != "task-failed.md":
        assert "```sql" in text or "```bash" in text  # something to run


def test_requeue_runbook_uses_the_dag_params() -> None:
    text = (RUNBOOKS / "snapshot-detach-quarantined.md").read_text()
    for param in ("snapshot_ids", "all_quarantined", "dry_run"):
        assert param in text


def test_index_links_every_runbook_and_links_resolve() -> None:
    index = (RUNBOOKS / "README.md").read_text()
    files = {p.name for p in RUNBOOKS.glob("*.md")} - {"README.md"}
    assert files == set(EXPECTED)
    for path in RUNBOOKS.glob("*.md"):
        for link in re.findall(r"\]\(([^)#]+\.md)\)", path.read_text()):
            assert (RUNBOOKS / link).is_file(), f"{path.name} -> {link}"
    assert {link for link in re.findall(r"\]\(([^)]+\.md)\)", index)} == files
