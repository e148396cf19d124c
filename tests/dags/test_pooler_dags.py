"""All four DAGs with `airflow dags test`, every job connection through a real PgBouncer in
transaction mode with a pool of 4 server connections (PgBouncer's default is 20): the most any
job holds at once with its defaults (retention: 1 lock + 3 batch loops). Each job connection
logs in as its own role, so each role has a pool of its own, as in production. Afterwards a
canary client visits every server connection of each pool: no setting of a job, no prepared
statement.
"""

from __future__ import annotations

import pytest

from devtools import bench_data as bd
from devtools.retention_data import seed_sessions
from devtools.selections_service import SelectionsService
from tests.integration.snapshot_detach_fixtures import insert_entries, insert_entry, rows
from tests.pooler import assert_pool_is_clean

pytestmark = pytest.mark.dags

POOL_SIZE = 4


def _output(done) -> str:
    return f"{done.stdout}\n{done.stderr}"


def test_all_four_dags_run_through_transaction_pooling_and_leave_the_pool_clean(
    db, run_dag, pgbouncer
):
    bd.load_slots(db.url, 3_000, 1_200)
    with db.connect() as conn:
        seed_sessions(conn, 40, 5, 2, tag="pool")
        conn.commit()
    due = insert_entries(db, 30)
    quarantined = insert_entry(db, status="Quarantined", attempts=12)
    bouncer = pgbouncer(db, pool_mode="transaction", pool_size=POOL_SIZE)
    pooled = bouncer.db()

    slots = run_dag("calendar_slot_expiration", pooled, conf={"max_batches_per_cycle": 10})
    assert slots.returncode == 0, _output(slots)
    assert bd.slots_state(db.url)["due"] == 0

    retention = run_dag("user_activity_retention", pooled, conf={"batch_size": 7})
    assert retention.returncode == 0, _output(retention)
    with db.connect() as conn:
        (left,) = conn.execute(
            "select count(*) from user_activity.sessions where status = 'Inactive'"
            " and ended_at < now() - interval '365 days'"
        ).fetchone()
    assert left == 0

    with SelectionsService() as svc:
        detach = run_dag("news_snapshot_detach_retry", pooled, selections_url=svc.url)
    assert detach.returncode == 0, _output(detach)
    state = rows(db)
    assert all(state[e.snapshot_id].status == "Done" for e in due)

    requeue = run_dag(
        "news_snapshot_detach_requeue", pooled, conf={"snapshot_ids": [quarantined.snapshot_id]}
    )
    assert requeue.returncode == 0, _output(requeue)
    assert rows(db)[quarantined.snapshot_id].status == "Pending"

    for role in {r.name for r in db.roles.values()}:  # news_db's ran two DAGs
        views = assert_pool_is_clean(bouncer, role)
        assert 1 <= len({v.pid for v in views}) <= POOL_SIZE
    for done in (slots, retention, detach, requeue):
        assert "42P05" not in _output(done) and "26000" not in _output(done)
