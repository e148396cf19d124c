"""The repository as a ``GitDagBundle``, the way a deployment runs it (README, "Deploying").

``bundle_e2e`` (session): a bare git repository made from this checkout (tracked and new files,
nothing ignored) is the only DAG bundle of a LocalExecutor stack with manual runs only, no
``PYTHONPATH`` entry for the checkout, an empty plugins folder and a working directory outside
it: the DAGs and the job code import from the bundle, the scheduler side from the installed
distribution. Besides the bundle's own tests (``test_git_bundle``), the LocalExecutor job
scenarios (``test_job_dags``) and the Postgres-restart faults (``test_faults``) run on it: no
scheduled tick can land inside them.
"""

from __future__ import annotations

import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from devtools.local_airflow import git_bundle
from tests.e2e import job_checks as jc
from tests.e2e.stack_fixtures import (
    QUICK_REPARSE,
    E2EAirflow,
    JobServer,
    e2e_stack,
    running_e2e,
)

REPO = Path(__file__).resolve().parents[2]
BUNDLE = "pin-maintenance"
SLOT_CONFIG = "include/pin_maintenance/jobs/slot_expiration_config.py"
DEFAULT_BATCH = "batch_size: int = setting(\n        500,"
PUSHED_BATCH = "batch_size: int = setting(\n        7,"
LATE_DAG = jc.RETENTION
GIT_ID = ["-c", "user.name=pin-e2e", "-c", "user.email=pin-e2e@localhost"]


def git(cwd: Path, *args: str) -> str:
    done = subprocess.run(
        ["git", *GIT_ID, *args], cwd=cwd, capture_output=True, text=True, check=False
    )
    assert done.returncode == 0, f"git {' '.join(args)}: {done.stdout}{done.stderr}"
    return done.stdout.strip()


def checkout_files() -> list[str]:
    """The checkout as a commit would hold it: tracked and new files, without ignored ones."""
    out = git(REPO, "ls-files", "-z", "--cached", "--others", "--exclude-standard")
    return [f for f in out.split("\0") if f and (REPO / f).is_file()]


@pytest.fixture(scope="session")
def origin(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Path, Path]]:
    """(bare origin repository, a working clone that pushes to it), both from this checkout."""
    if shutil.which("git") is None:
        pytest.skip("needs the git client (GitDagBundle)")
    base = tmp_path_factory.mktemp("git-bundle-repo")
    work = base / "work"
    for rel in checkout_files():
        (work / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(REPO / rel, work / rel)
    git(work, "init", "-q", "-b", "main")
    git(work, "add", "-A")
    git(work, "commit", "-q", "-m", "the checkout under test")
    bare = base / "origin.git"
    git(base, "clone", "-q", "--bare", str(work), str(bare))
    git(work, "remote", "add", "origin", str(bare))
    yield bare, work


@pytest.fixture(scope="session")
def bundle_e2e(  # noqa: PLR0917 (pytest fixtures)
    tmp_path_factory: pytest.TempPathFactory,
    pg_admin_url: str,
    airflow_meta_template: str,
    e2e_job_server: JobServer,
    e2e_selections,
    origin: tuple[Path, Path],
) -> Iterator[E2EAirflow]:
    bare, _ = origin
    e2e = e2e_stack(
        tmp_path_factory.mktemp("e2e-git-bundle"),
        meta_admin_url=pg_admin_url,
        job_server=e2e_job_server,
        selections=e2e_selections,
        scheduled_runs=False,
        name="gitbundle",
        bundle_config=[git_bundle(f"file://{bare}", refresh_interval=2, name=BUNDLE)],
        repo_on_path=False,
        extra_env={
            **QUICK_REPARSE,
            f"AIRFLOW_VAR_{LATE_DAG.upper()}_DEADLINE_SECONDS": "1",
        },
    )
    with running_e2e(e2e, meta_template=airflow_meta_template, what="the git-bundle stack"):
        yield e2e
