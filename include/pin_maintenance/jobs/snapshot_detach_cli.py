"""Run the detach retry job once without Airflow (the demo, the benchmark, the crash test).

``python -m include.pin_maintenance.jobs.snapshot_detach_cli --db-url postgresql://user@host/news \
--selections-url http://127.0.0.1:8080 --login pin-maintenance --password-env SELECTIONS_PASSWORD \
[--config '{"batch_size": 50}'] [--dry-run]``

The passwords are read from the environment, never from the command line (which any local
user can see in ``ps``): the selections one from ``--password-env``, the database one from
libpq's own sources (``PGPASSWORD``, ``~/.pgpass``, ``.pg_service.conf``) or
``--db-password-env``; a password in ``--db-url`` is refused. Exit codes as for every job
(``include.pin_maintenance.cli``); SIGTERM stops the run between rows (exit code 3).
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Mapping, Sequence
from typing import Any

from include.pin_maintenance import cli
from include.pin_maintenance.db import SessionSettings
from include.pin_maintenance.jobs import snapshot_detach
from include.pin_maintenance.jobs.snapshot_detach_client import (
    HttpDetachClient,
    basic_auth_session,
)


def _add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--selections-url", required=True, help="base URL of selections")
    parser.add_argument("--login", default=None, help="basic auth login (none: no auth)")
    parser.add_argument(
        "--password-env",
        default="SELECTIONS_PASSWORD",
        help="environment variable holding the basic auth password",
    )


def _run(run: cli.CliRun) -> Mapping[str, Any]:
    args = run.args
    password = os.environ.get(args.password_env)
    client = HttpDetachClient(args.selections_url, lambda: basic_auth_session(args.login, password))
    with client:
        result = snapshot_detach.run(
            run.connect, run.config, run.telemetry, run.stop, client, dry_run=run.dry_run
        )
    return result.as_dict()


CLI = cli.JobCli(
    spec=snapshot_detach.SPEC,
    module="include.pin_maintenance.jobs.snapshot_detach_cli",
    database="news database",
    description=__doc__ or "",
    session=SessionSettings(application_name="detach-cli"),
    run=_run,
    add_arguments=_add_arguments,
    cancelled_output={"cancelled": True},  # what the crash test and scripts read on exit 3
)


def main(argv: Sequence[str] | None = None) -> int:
    return cli.main(CLI, argv)


if __name__ == "__main__":
    sys.exit(main())
