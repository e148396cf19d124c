"""``make screenshots``: the main views of the ``make up`` UI as PNGs under docs/screenshots/.

Starts the same stack and drives the same page actions as the browser tests
(:mod:`devtools.ui_browser`), on an embedded Postgres of its own in a temp dir (or
``PIN_PG_URL``, in fresh databases), so the pictures in the README show what the tests check:

- ``dag-list.png``: the DAG list after login;
- ``trigger-form.png``: the trigger dialog of ``calendar_slot_expiration`` with ``dry_run`` on;
- ``run-report.png``: a finished real run of it, its task log with the ``job_completed`` report.

Needs Chromium (Debian's ``chromium``; installed through devtools/ensure_system_packages.sh
when run as root). Takes about three minutes on the shared machine.
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
import time
import uuid
from pathlib import Path

from devtools import pg
from devtools.local_airflow import REPO
from devtools.ui_browser import (
    AirflowUI,
    Api,
    browser_unavailable,
    chromium,
    ensure_chromium,
    new_page,
    ui_stack,
)

OUT = REPO / "docs" / "screenshots"
DAG = "calendar_slot_expiration"


def shoot(stack_url: str, api: Api, out: Path) -> list[Path]:
    saved = []
    with chromium() as browser:
        ui = AirflowUI(new_page(browser), stack_url)
        ui.login()
        ui.dag_list(expected=4)
        saved.append(ui.screenshot(out / "dag-list.png"))

        ui.page.set_viewport_size({"width": 1400, "height": 1200})  # the whole dialog
        dialog = ui.open_trigger(DAG)
        AirflowUI.set_flag(dialog, "dry_run")
        saved.append(ui.screenshot(out / "trigger-form.png"))
        AirflowUI.set_flag(dialog, "dry_run", on=False)  # the picture of the report: a real run
        triggered = ui.submit(dialog)
        if triggered.status != 200:
            raise RuntimeError(f"trigger refused: {triggered.status} {triggered.body}")
        run = api.wait_run(DAG, triggered.run_id)
        if run["state"] != "success":
            raise RuntimeError(f"{DAG} {triggered.run_id} ended {run['state']}")
        ui.page.set_viewport_size({"width": 1400, "height": 900})
        ui.open_task_log(DAG, triggered.run_id, "expire_slots", expect="event=job_completed")
        ui.wrap_log_lines()
        saved.append(ui.screenshot(out / "run-report.png"))
    return saved


def main() -> int:
    started = time.monotonic()
    ensure_chromium()
    reason = browser_unavailable()
    if reason:
        print(f"cannot take screenshots: {reason}", file=sys.stderr)
        return 1
    base = Path(tempfile.mkdtemp(prefix="pin-screenshots-"))
    base.chmod(0o755)  # the embedded server runs as its own system user under root
    external = os.environ.get(pg.EXTERNAL_URL_ENV)
    admin = external or pg.start_embedded(base / "pg", keep_running=True)
    suffix = uuid.uuid4().hex[:8]
    stack = ui_stack(
        base / "stack", admin, meta_db=f"meta_shots_{suffix}", job_db=f"jobs_shots_{suffix}"
    )
    try:
        print(f"==> starting the make-up stack on {stack.url} (about a minute) ...")
        stack.start()
        saved = shoot(stack.url, Api.login(stack), OUT)
    finally:
        stack.stop()
        if external:
            for name in (stack.meta_db, stack.job_db):
                pg.drop_database(admin, name)
        else:
            pg.stop_embedded(base / "pg")
        shutil.rmtree(base, ignore_errors=True)
    for path in saved:
        print(f"saved {path.relative_to(REPO)}")
    print(f"done in {time.monotonic() - started:.0f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
