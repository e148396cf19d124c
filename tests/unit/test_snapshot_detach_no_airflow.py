"""The detach job package runs without Airflow: importing it must not import airflow."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_detach_job_modules_do_not_import_airflow():
    code = (
        "import sys\n"
        "import include.pin_maintenance.backoff\n"
        "import include.pin_maintenance.jobs.snapshot_detach\n"
        "import include.pin_maintenance.jobs.snapshot_detach_http\n"
        "import include.pin_maintenance.jobs.snapshot_requeue\n"
        "import devtools.selections_service\n"
        "bad = sorted(m for m in sys.modules if m == 'airflow' or m.startswith('airflow.'))\n"
        "assert not bad, bad\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=False
    )
    assert done.returncode == 0, done.stderr
