"""Run the detach retry job once without Airflow (the demo, the benchmark, the crash test).

``python -m include.pin_maintenance.jobs.snapshot_detach_cli --db-url postgresql://user@host/news \
--selections-url http://127.0.0.1:8080 --login pin-maintenance --password-env SELECTIONS_PASSWORD \
[--config '{"batch_size": 50}'] [--dry-run]``

The passwords are read from the environment, never from the command line (which any local
user can see in ``ps``): the selections one from ``--password-env``, the database one from
libpq's own sources (``PGPASSWORD``, ``~/.pgpass``, ``.pg_service.conf``) or
``--db-password-env``; a password in ``--db-url`` is refused. Prints the result as one JSON
line; SIGTERM stops the run between rows (exit code 3); a database role without a privilege the
job needs stops it before any write (exit code 2, naming the privilege).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import uuid

import psycopg

from include.pin_maintenance.cli_db import add_db_arguments, db_conninfo
from include.pin_maintenance.db import SessionSettings, configured
from include.pin_maintenance.jobs import snapshot_detach
from include.pin_maintenance.jobs.snapshot_detach_client import (
    HttpDetachClient,
    basic_auth_session,
)
from include.pin_maintenance.privileges import MissingPrivileges
from include.pin_maintenance.runloop import JobCancelled, StopSignal
from include.pin_maintenance.telemetry import JobLog, RecordingMetrics, Telemetry


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m include.pin_maintenance.jobs.snapshot_detach_cli",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_db_arguments(parser, what="news database")
    parser.add_argument("--selections-url", required=True)
    parser.add_argument("--login", default=None)
    parser.add_argument("--password-env", default="SELECTIONS_PASSWORD")
    parser.add_argument("--config", default=None, help="JSON object of config keys")
    parser.add_argument("--dry-run", action="store_true")
    parser.add_argument("--run-id", default=None)
    args = parser.parse_args(argv)
    conninfo = db_conninfo(parser, args)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")

    config = snapshot_detach.CONFIG.resolve(args.config, None)  # fails before any write
    run_id = args.run_id or f"cli__{uuid.uuid4().hex[:12]}"
    log = JobLog(snapshot_detach.JOB, run_id)
    metrics = RecordingMetrics()
    telemetry = Telemetry.local(log, metrics)
    connect = configured(
        lambda: psycopg.connect(conninfo), SessionSettings(application_name="detach-cli")
    )
    password = os.environ.get(args.password_env)
    client = HttpDetachClient(args.selections_url, lambda: basic_auth_session(args.login, password))
    stop = StopSignal()
    try:
        with client, stop.on_sigterm():
            result = snapshot_detach.run(
                connect, config, telemetry, stop, client, dry_run=args.dry_run
            )
    except JobCancelled:
        print(json.dumps({"cancelled": True}), flush=True)
        return 3
    except MissingPrivileges as exc:
        print(f"MissingPrivileges: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(result.as_dict()), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
