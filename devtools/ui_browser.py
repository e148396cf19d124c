"""The Airflow 3.3 UI of ``make up`` driven in headless Chromium (Playwright's Python client).

One set of page actions for the browser tests (``tests/ui``) and ``make screenshots``
(:mod:`devtools.screenshots`), so the screenshots in docs/ show what the tests check.

- :func:`ui_stack`: the ``make up`` stack (the repository root as the DAG bundle, the installed
  scheduler plugin, demo rows in the job tables) with its own Airflow home, databases and free
  ports, so it never clashes with a developer's ``make up``. Scheduled ticks are off by default:
  every run in it is one the caller triggered (unpausing a DAG would otherwise start its
  latest missed tick at once, docs/design.md, "Known Airflow 3.3.2 behaviour").
- :func:`chromium`: Debian's ``chromium`` (``devtools/ensure_system_packages.sh chromium``)
  launched through ``executable_path``; Playwright downloads no browser here.
  :func:`browser_unavailable` says why it cannot run, for a skip message.
- :class:`AirflowUI`: the screens an operator uses, with the selectors that work in 3.3.2
  (``data-testid`` of the trigger buttons, params by ``#element_<name>`` /
  ``[id="switch:element_<name>"]`` / spinbutton named by the param's title).
"""

from __future__ import annotations

import json
import os
import subprocess
import urllib.parse
import urllib.request
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from devtools.local_airflow import (
    ADMIN_PASSWORD,
    ADMIN_USER,
    REPO,
    AirflowStack,
    free_port,
    root_bundle,
    wait_for,
)
from devtools.pg import JobRole

CHROMIUM = Path(os.environ.get("PIN_CHROMIUM", "/usr/lib/chromium/chromium"))
VIEWPORT = {"width": 1400, "height": 900}
TERMINAL = frozenset({"success", "failed"})


def ensure_chromium() -> None:
    """Install Debian's chromium when it is missing and the machine allows it (root, apt)."""
    if not CHROMIUM.exists():
        subprocess.run(
            [str(REPO / "devtools" / "ensure_system_packages.sh"), "chromium:chromium"],
            check=False,
            timeout=1200,
        )


def browser_unavailable() -> str | None:
    """Why the browser cannot run here (for a skip message), or None."""
    try:
        import playwright.sync_api  # noqa: F401
    except ImportError:
        return "playwright is not installed (requirements-dev.txt; run `make venv`)"
    if not CHROMIUM.exists():
        return (
            f"no Chromium at {CHROMIUM}: install Debian's chromium (as root "
            "`devtools/ensure_system_packages.sh chromium`, which make test does when it can) "
            "or point PIN_CHROMIUM at a Chromium binary"
        )
    return None


@contextmanager
def chromium() -> Iterator[Any]:
    """A headless Chromium (Playwright ``Browser``); closed on exit."""
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        # --no-sandbox: CI and the shared machine run as root, where Chromium refuses its sandbox
        browser = p.chromium.launch(
            executable_path=str(CHROMIUM), headless=True, args=["--no-sandbox"]
        )
        try:
            yield browser
        finally:
            browser.close()


def ui_stack(
    base: Path,
    admin_url: str,
    *,
    meta_db: str = "airflow_meta",
    job_db: str = "pin_dev",
    scheduled_ticks: bool = False,
    job_roles: Mapping[str, JobRole] | None = None,
) -> AirflowStack:
    """The ``make up`` stack under ``base`` (home, logs, pid file); not started yet. Its job
    connections log in as ``job_roles``, or as the dev roles."""
    return AirflowStack(
        home=base / "airflow",
        run_dir=base,
        admin_url=admin_url,
        meta_db=meta_db,
        job_db=job_db,
        port=free_port(),
        bundle_config=[root_bundle()],
        repo_on_path=False,
        demo_data=True,
        job_roles=job_roles,
        extra_env={"AIRFLOW__SCHEDULER__USE_JOB_SCHEDULE": str(scheduled_ticks)},
    )


# ---------------------------------------------------------------------------------------------
# REST API (to wait for runs; the browser is for what a person sees)


@dataclass
class Api:
    base_url: str
    token: str

    @classmethod
    def login(cls, stack: AirflowStack) -> Api:
        return cls(stack.url, stack.token())

    def get(self, path: str, **params: Any) -> Any:
        query = f"?{urllib.parse.urlencode(params)}" if params else ""
        req = urllib.request.Request(
            f"{self.base_url}/api/v2{path}{query}",
            headers={"Authorization": f"Bearer {self.token}", "Accept": "application/json"},
        )
        with urllib.request.urlopen(req, timeout=60) as r:
            return json.load(r)

    def runs(self, dag_id: str) -> list[dict]:
        return self.get(f"/dags/{dag_id}/dagRuns", limit=100)["dag_runs"]

    def wait_run(self, dag_id: str, run_id: str, timeout: float = 600) -> dict:
        path = f"/dags/{dag_id}/dagRuns/{urllib.parse.quote(run_id, safe='')}"

        def finished() -> dict | None:
            run = self.get(path)
            return run if run["state"] in TERMINAL else None

        return wait_for(finished, timeout=timeout, interval=1, what=f"{dag_id} {run_id}")  # type: ignore[return-value]

    def task_path(self, dag_id: str, run_id: str, task_id: str) -> str:
        return (
            f"/dags/{dag_id}/dagRuns/{urllib.parse.quote(run_id, safe='')}/taskInstances/{task_id}"
        )

    def xcom_keys(self, dag_id: str, run_id: str, task_id: str) -> list[str]:
        entries = self.get(self.task_path(dag_id, run_id, task_id) + "/xcomEntries")
        return sorted(e["key"] for e in entries["xcom_entries"])

    def xcom(self, dag_id: str, run_id: str, task_id: str) -> Any:
        path = self.task_path(dag_id, run_id, task_id) + "/xcomEntries/return_value"
        value = self.get(path, deserialize="true")["value"]
        return json.loads(value) if isinstance(value, str) else value


# ---------------------------------------------------------------------------------------------
# the screens


@dataclass
class Triggered:
    """What the trigger dialog's POST /dagRuns answered."""

    status: int
    body: Mapping[str, Any]

    @property
    def run_id(self) -> str:
        return str(self.body["dag_run_id"])


class AirflowUI:
    """One logged-in browser page on the stack's UI."""

    def __init__(self, page: Any, base_url: str) -> None:
        self.page = page
        self.base_url = base_url.rstrip("/")

    def goto(self, path: str) -> None:
        # callers wait for the element they need: the UI polls its API, "networkidle" is slow
        self.page.goto(self.base_url + path, wait_until="domcontentloaded")

    def leave(self) -> None:
        """An empty tab: a page left open on the UI keeps polling its API and re-rendering
        (half a core of Chromium while a test waits for a run through the REST API)."""
        self.page.goto("about:blank")

    def login(self, username: str = ADMIN_USER, password: str = ADMIN_PASSWORD) -> None:
        self.goto("/")
        self.page.locator("input[name=username]").wait_for()
        self.page.fill("input[name=username]", username)
        self.page.fill("input[name=password]", password)
        self.page.get_by_role("button", name="Sign in").click()
        self.page.wait_for_url(lambda url: "/auth/login" not in url, timeout=60_000)

    # -- DAG list ---------------------------------------------------------------------------

    def dag_list(self, expected: int) -> dict[str, str]:
        """{dag_id: the schedule its card shows, "" for none} once ``expected`` DAGs are listed."""
        self.goto("/dags")
        self.page.get_by_text(f"{expected} Dags", exact=True).wait_for(timeout=120_000)
        cards: dict[str, str] = {}
        for link in self.page.locator("a[href^='/dags/']").all():
            dag_id = (link.get_attribute("href") or "").removeprefix("/dags/")
            if not dag_id or "/" in dag_id or dag_id in cards:
                continue
            # the card: the nearest enclosing element that also holds the "Schedule" column
            card = link.locator("xpath=ancestor::div[.//*[normalize-space(text())='Schedule']][1]")
            cards[dag_id] = _schedule_of(card.inner_text())
        return cards

    def body_text(self) -> str:
        return self.page.locator("body").inner_text()

    # -- trigger dialog ---------------------------------------------------------------------

    def open_trigger(self, dag_id: str) -> Any:
        """The trigger dialog of ``dag_id`` (a Playwright Locator)."""
        self.goto(f"/dags/{dag_id}")
        self.page.get_by_text(dag_id, exact=True).first.wait_for()
        self.page.get_by_test_id("trigger-dag-button").first.click()
        dialog = self.page.get_by_role("dialog")
        dialog.get_by_test_id("trigger-dag-submit").wait_for()
        return dialog

    @staticmethod
    def param_field(dialog: Any, name: str) -> Any:
        """The form field of param ``name`` (string/array, flag or number)."""
        return (
            dialog.locator(f"#element_{name}")
            .or_(dialog.locator(f'[id="switch:element_{name}"]'))
            .or_(dialog.get_by_role("spinbutton", name=name, exact=True))
        )

    @staticmethod
    def set_flag(dialog: Any, name: str, on: bool = True) -> None:
        switch = dialog.locator(f'[id="switch:element_{name}"]')
        if (switch.get_attribute("data-state") == "checked") != on:
            switch.click()
        want = "checked" if on else "unchecked"
        wait_for(
            lambda: switch.get_attribute("data-state") == want, timeout=10, what=f"{name} {want}"
        )

    @staticmethod
    def fill_text(dialog: Any, name: str, text: str) -> None:
        dialog.locator(f"#element_{name}").fill(text)

    def submit(self, dialog: Any) -> Triggered:
        """Click Trigger and wait for the POST it makes (no sleeps)."""
        with self.page.expect_response(
            lambda r: r.request.method == "POST" and r.url.endswith("/dagRuns"), timeout=60_000
        ) as answer:
            dialog.get_by_test_id("trigger-dag-submit").click()
        response = answer.value
        try:
            body = response.json()
        except Exception:
            body = {"text": response.text()}
        return Triggered(response.status, body)

    # -- a run's task log -------------------------------------------------------------------

    def open_task_log(self, dag_id: str, run_id: str, task_id: str, expect: str) -> str:
        """The task instance page (Logs tab); returns its text once ``expect`` shows in it."""
        self.goto(f"/dags/{dag_id}/runs/{urllib.parse.quote(run_id, safe='')}/tasks/{task_id}")
        self.page.get_by_text(expect, exact=False).first.wait_for(timeout=60_000)
        return self.body_text()

    def wrap_log_lines(self) -> None:
        """Wrap the log viewer's long lines (its "w" shortcut), so a report line reads whole."""
        self.page.locator("body").press("w")

    def screenshot(self, path: Path, *, full_page: bool = False) -> Path:
        path.parent.mkdir(parents=True, exist_ok=True)
        self.page.screenshot(path=str(path), full_page=full_page)
        return path


def _schedule_of(card_text: str) -> str:
    lines = [line.strip() for line in card_text.splitlines() if line.strip()]
    if "Schedule" not in lines:
        return ""
    after = lines[lines.index("Schedule") + 1 :]
    for line in after:
        if line in {"Latest Run", "Next Run"}:
            return ""
        return line
    return ""


def new_page(browser: Any) -> Any:
    context = browser.new_context(viewport=VIEWPORT)
    # generous: the shared machine is loaded and the UI renders its dialogs on one busy core
    context.set_default_timeout(90_000)
    return context.new_page()
