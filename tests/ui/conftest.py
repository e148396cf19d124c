"""Browser tier: the ``make up`` stack (``devtools.ui_browser.ui_stack``) driven in Chromium.

One stack per session (own Airflow home, metadata and job databases on the session's Postgres,
free ports; demo rows seeded as ``make up`` does; scheduled ticks off, so every run is one a
test triggered), one Chromium with one logged-in page. A failing test saves a
screenshot under ``.local/ui-failures/`` and names it in its report ("browser screenshot").
"""

from __future__ import annotations

import os
import re
import uuid
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest

from devtools import pg
from devtools.local_airflow import REPO, AirflowStack
from devtools.pg import JobRole
from devtools.ui_browser import (
    AirflowUI,
    Api,
    browser_unavailable,
    chromium,
    ensure_chromium,
    new_page,
    ui_stack,
)
from tests.e2e.stack_fixtures import running_stack

FAILURE_SHOTS = REPO / ".local" / "ui-failures"


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if "tests/ui/" in str(item.fspath).replace("\\", "/"):
            item.add_marker(pytest.mark.ui)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo):
    outcome = yield
    report = outcome.get_result()
    if report.when != "call" or not report.failed:
        return
    ui = item.funcargs.get("ui") if hasattr(item, "funcargs") else None
    if not isinstance(ui, AirflowUI):
        return
    name = re.sub(r"[^A-Za-z0-9_.-]+", "_", item.nodeid.split("::", 1)[-1])
    try:
        path = ui.screenshot(FAILURE_SHOTS / f"{name}.png", full_page=True)
    except Exception as exc:  # the page may be gone with the failure; say so
        report.sections.append(("browser screenshot", f"could not save one: {exc!r}"))
    else:
        report.sections.append(("browser screenshot", str(path)))


@pytest.fixture(scope="session")
def browser() -> Iterator[object]:
    ensure_chromium()
    reason = browser_unavailable()
    if reason:
        pytest.skip(f"browser suite skipped: {reason}")
    with chromium() as b:
        yield b


@pytest.fixture(scope="session")
def ui_airflow(
    browser: object,
    tmp_path_factory: pytest.TempPathFactory,
    pg_admin_url: str,
    airflow_meta_template: str,
    job_roles: dict[str, JobRole],
) -> Iterator[AirflowStack]:
    """The make-up stack for the session (its metadata DB a copy of the migrated template; its
    job connections log in as the session's job roles)."""
    base = tmp_path_factory.mktemp("ui-stack")
    suffix = f"{os.getpid()}_{uuid.uuid4().hex[:6]}"
    stack = ui_stack(
        base,
        pg_admin_url,
        meta_db=f"meta_ui_{suffix}",
        job_db=f"jobs_ui_{suffix}",
        job_roles=job_roles,
    )
    try:
        with running_stack(stack, meta_template=airflow_meta_template, what="the UI stack"):
            yield stack
    finally:  # its grants go with it, so the session can drop its job roles
        pg.drop_database(pg_admin_url, stack.job_db)


@pytest.fixture(scope="session")
def api(ui_airflow: AirflowStack) -> Api:
    return Api.login(ui_airflow)


@pytest.fixture(scope="session")
def ui(browser: object, ui_airflow: AirflowStack) -> Iterator[AirflowUI]:
    """One logged-in page for the session (each test starts with a page load of its own)."""
    page = new_page(browser)
    view = AirflowUI(page, ui_airflow.url)
    view.login()
    try:
        yield view
    finally:
        page.context.close()


@pytest.fixture
def job_db(ui_airflow: AirflowStack) -> Iterator[psycopg.Connection]:
    with psycopg.connect(ui_airflow.job_url, autocommit=True) as conn:
        yield conn


def webhook_alerts(stack: AirflowStack) -> list[dict]:
    import json

    path = stack.webhook_log
    if path is None or not Path(path).exists():
        return []
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
