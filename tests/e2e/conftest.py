"""End-to-end tier: a real Airflow (api-server, scheduler, dag-processor, triggerer) per session.

Fixtures live in ``stack_fixtures`` (and ``celery_fixtures`` for the distributed executor);
every test here is marked ``e2e``.
"""

from __future__ import annotations

import pytest

from tests.e2e.stack_fixtures import airflow_e2e, e2e_job_server, e2e_selections

__all__ = ["airflow_e2e", "e2e_job_server", "e2e_selections"]


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if "tests/e2e/" in str(item.fspath).replace("\\", "/"):
            item.add_marker(pytest.mark.e2e)
