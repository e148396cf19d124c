"""What the test-only DAGs in ``tests/e2e/dags`` record, and how the tests read it back.

The DAGs run in Airflow's task processes (LocalExecutor or Celery workers on this host); they
append JSON lines to files in ``$PIN_E2E_STATE_DIR``, which the e2e stack sets for every
component. No Airflow imports here.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

STATE_DIR_ENV = "PIN_E2E_STATE_DIR"


def state_dir() -> Path:
    return Path(os.environ[STATE_DIR_ENV])


def record_event(dag_id: str, event: str, run_id: str, **data: object) -> None:
    line = json.dumps({"event": event, "run_id": run_id, "t": time.time(), **data}, default=str)
    with (state_dir() / f"{dag_id}.jsonl").open("a", encoding="utf-8") as f:
        f.write(line + "\n")


def celery_worker_name() -> str | None:
    """The Celery node name of the worker this task process runs under, if any.

    Read from the process's ancestors (task process <- supervisor <- the worker's pool child
    <- the worker): Celery titles its processes ``[celeryd: <node name>:<process>]``, and the
    worker's own command line carries ``--celery-hostname <node name>``. The proof of *where* a
    task ran, which the task instance's ``hostname`` (the machine's name under every executor)
    cannot give.
    """
    import re

    import psutil

    patterns = (r"\[celeryd: ([^:\]\s]+)", r"--celery-hostname[ =](\S+)")
    proc: psutil.Process | None = psutil.Process()
    while proc is not None:
        try:
            title = " ".join(proc.cmdline())
            for pattern in patterns:
                if found := re.search(pattern, title):
                    return found.group(1)
            proc = proc.parent()
        except psutil.Error:
            return None
    return None


def hold_until_released(dag_id: str, run_id: str, *, timeout: float) -> None:
    record_event(dag_id, "start", run_id, pid=os.getpid())
    gate = state_dir() / f"{dag_id}.release"
    deadline = time.monotonic() + timeout
    while not gate.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{gate} did not appear within {timeout}s")
        time.sleep(0.5)
    record_event(dag_id, "end", run_id)


def read_events(directory: Path, dag_id: str) -> list[dict]:
    path = directory / f"{dag_id}.jsonl"
    if not path.exists():
        return []
    return [json.loads(x) for x in path.read_text(encoding="utf-8").splitlines() if x.strip()]
