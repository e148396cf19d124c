"""The ``airflow`` command for the tests' and tools' CLI runs, minus the interpreter's last
garbage collection.

``python devtools/airflow_cli.py dags test <dag_id>`` is the venv's ``airflow`` console script
(``airflow.__main__.main`` with the same argv) with one addition: ``gc.freeze()`` as the last
exit handler. Everything the command does, its output, its exit code and every other exit
handler (logging's flush, the OpenTelemetry exporters' shutdown) run as before. What is skipped
is the cycle collection that CPython runs while it tears the interpreter down, which frees
memory the operating system takes back a moment later anyway.

Why: ``airflow dags test`` builds the in-process Execution API (cadwyn's versioned routes, tens
of thousands of objects), and collecting them at exit takes 2 to 3 s of CPU, about a fifth of
the process (sampled with py-spy; README, "Layout", on make test). The suite runs about
50 of them on two cores. Airflow's own task processes skip that step the same way (they end
with ``os._exit``).

Run as a file, not with ``-m``: the git-bundle stack has no checkout on its ``PYTHONPATH``.
"""

from __future__ import annotations

import atexit
import gc
import sys
from pathlib import Path

# registered before Airflow is imported, so it runs after every exit handler Airflow registers
atexit.register(gc.freeze)

HERE = str(Path(__file__).resolve().parent)
# python puts this file's directory first on sys.path; the console script has no such entry
if sys.path and sys.path[0] == HERE:
    del sys.path[0]
sys.argv[0] = str(Path(sys.executable).with_name("airflow"))

from airflow.__main__ import main  # noqa: E402 (after the exit handler and the path fix)

if __name__ == "__main__":
    sys.exit(main())
