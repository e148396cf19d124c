"""``make bench`` at tiny sizes, so the benchmark harness cannot rot.

Runs ``python -m devtools.bench --smoke`` against the test server (``PIN_PG_URL``) and checks
that it exits 0 and writes a report with every section measured. The sections that run
``airflow dags test`` (the Airflow overhead, detach at the service's capacity, the neighbours
with their own primary, replica and pgbench: each a minute or more of CPU) run in ``make
bench-smoke`` only (the capacity and neighbour readings have unit tests). Speed is not
asserted here: figures live in docs/benchmarks.md.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from devtools.bench import DAG_IDS, NOTES_MARKER, TITLES, default_sections

pytestmark = [pytest.mark.integration, pytest.mark.slow]

REPO = Path(__file__).resolve().parents[2]


def test_bench_smoke_writes_a_table_for_every_section(pg_admin_url: str, tmp_path: Path) -> None:
    out = tmp_path / "benchmarks.md"
    env = {**os.environ, "PIN_PG_URL": pg_admin_url, "PYTHONPATH": str(REPO)}
    done = subprocess.run(
        [sys.executable, "-m", "devtools.bench", "--smoke", "--out", str(out)],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]

    text = out.read_text(encoding="utf-8")
    assert "Not measured" not in text
    assert NOTES_MARKER in text
    smoke_titles = [TITLES[key] for key in default_sections(smoke=True)]
    for heading in ("## Machine", "## Data generation", *(f"## {t}" for t in smoke_titles)):
        assert heading in text, f"missing section {heading!r}"
    sections = text.split("\n## ")[1:]
    for section in sections:
        title = section.splitlines()[0]
        assert "\n| " in section, f"section {title!r} has no table"
    # every job's function was measured against its limit, and a DAG file was parsed
    for name in ("| 200 | 2,600 |", "| 2,000 | 300 |", "| 32 (default) | 100 |", "`dags/"):
        assert name in text, f"no row {name!r}"
    for dag_id in DAG_IDS.values():
        assert f"`dags/{dag_id}.py`" in text, f"dags/{dag_id}.py was not parsed"
