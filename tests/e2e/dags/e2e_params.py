"""Test-only DAG (end-to-end suite): records the params each manual run receives.

Its params are built like the job DAGs' (``config_params`` + ``dry_run``), so triggering it
through the CLI and the REST API checks the same JSON-schema validation the job DAGs get.
Never deployed: it lives in ``tests/e2e/dags`` and is loaded only by the e2e Airflow.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta

from airflow.sdk import dag, task

from include.pin_airflow.dag_support import START_DATE, config_params, dry_run_param
from include.pin_maintenance.config import ConfigSpec, JobConfig, setting


@dataclass(frozen=True, kw_only=True)
class E2eConfig(JobConfig):
    batch_size: int = setting(100, minimum=1, maximum=10000, help="Rows per batch.")
    max_run_duration_seconds: float = setting(240, minimum=0, exclusive_minimum=True)


SPEC = ConfigSpec(
    job="e2e_params",
    config_class=E2eConfig,
    extra_params=frozenset({"dry_run"}),
)


@dag(
    dag_id="e2e_params",
    doc_md=__doc__,
    schedule=None,
    start_date=START_DATE,
    catchup=False,
    max_active_runs=1,
    params={**config_params(SPEC), "dry_run": dry_run_param()},
    tags=["pin-e2e"],
)
def e2e_params():
    @task(execution_timeout=timedelta(minutes=5))
    def record(**context) -> None:
        """Append this run's params and conf to ``$PIN_E2E_STATE_DIR/e2e_params.jsonl``."""
        from tests.e2e.probe import celery_worker_name, record_event

        record_event(
            "e2e_params",
            "params",
            context["run_id"],
            params=dict(context["params"]),
            conf=dict(context["dag_run"].conf or {}),
            celery_worker=celery_worker_name(),
        )

    record()


e2e_params()
