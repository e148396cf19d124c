"""Every job's command line, written once: ``python -m include.pin_maintenance.jobs.<job>
--db-url ... [--config JSON] [--dry-run]`` runs a job without Airflow (docs/jobs.md, "Running a
job without Airflow"; exit codes: docs/design.md, "Layout of the job package")."""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import psycopg
from psycopg.conninfo import conninfo_to_dict, make_conninfo

from include.pin_maintenance.config import ConfigError, JobConfig
from include.pin_maintenance.db import Connect, SessionSettings, configured
from include.pin_maintenance.lifecycle import CONFIG_INVALID, JobSpec, describe_error
from include.pin_maintenance.privileges import MissingPrivileges
from include.pin_maintenance.server_version import UnsupportedServer
from include.pin_maintenance.stopping import JobCancelled, StopSignal
from include.pin_maintenance.telemetry import JobLog, Telemetry

EXIT_OK, EXIT_FAILED, EXIT_USAGE, EXIT_CANCELLED = 0, 1, 2, 3

PASSWORD_SOURCES = (
    "PGPASSWORD, a password file (~/.pgpass or PGPASSFILE), a service in .pg_service.conf "
    '(--db-url "service=NAME" or PGSERVICE), or --db-password-env VAR'
)
REFUSED = (
    "--db-url must not carry a password: any local user can read a command line (ps). "
    f"Drop it from the URL and give it through {PASSWORD_SOURCES}."
)


@dataclass(frozen=True)
class CliRun:
    """What a job's CLI body gets: parsed arguments, validated config and the run's parts."""

    args: argparse.Namespace
    config: JobConfig
    connect: Connect
    telemetry: Telemetry
    stop: StopSignal
    dry_run: bool


@dataclass(frozen=True)
class JobCli:
    """One job's CLI: its spec, database, arguments and run; the optional hooks add arguments,
    derive the session settings from them, and give the one stdout line of exit 3."""

    spec: JobSpec
    module: str  # ``python -m`` path, for the usage line
    database: str  # e.g. "calendar database", for --db-url's help
    description: str
    session: SessionSettings
    run: Callable[[CliRun], Mapping[str, Any]]  # returns the result dict to print
    add_arguments: Callable[[argparse.ArgumentParser], None] | None = None
    session_for: Callable[[argparse.Namespace], SessionSettings] | None = None
    cancelled_output: Mapping[str, Any] | None = None


def main(cli: JobCli, argv: Sequence[str] | None = None) -> int:
    """Parse, validate, run once; print the result and return the exit code."""
    parser = argparse.ArgumentParser(
        prog=f"python -m {cli.module}",
        description=cli.description,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_db_arguments(parser, what=cli.database)
    parser.add_argument("--config", help='JSON object of config keys, e.g. {"batch_size": 100}')
    parser.add_argument(
        "--dry-run", action="store_true", help="report what would change; change nothing"
    )
    parser.add_argument("--run-id", help="correlation id of the log lines")
    if cli.add_arguments is not None:
        cli.add_arguments(parser)
    args = parser.parse_args(argv)
    conninfo = db_conninfo(parser, args)
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s", stream=sys.stderr
    )
    log = JobLog(cli.spec.job, args.run_id or f"cli__{uuid.uuid4().hex[:12]}")
    session = cli.session_for(args) if cli.session_for is not None else cli.session
    stop = StopSignal()
    try:
        config = cli.spec.config.resolve(args.config, None, variable_source="--config")
        connect = configured(lambda: psycopg.connect(conninfo), session)
        run = CliRun(args, config, connect, Telemetry.local(log), stop, args.dry_run)
        with stop.on_sigterm():
            result = cli.run(run)
    except JobCancelled:  # the lifecycle logged job_cancelled
        if cli.cancelled_output is not None:
            print(json.dumps(dict(cli.cancelled_output), sort_keys=True), flush=True)
        return EXIT_CANCELLED
    except ConfigError as exc:  # the config, checked before anything connects, or a run's rule
        log.error(CONFIG_INVALID, error=str(exc))
        print(describe_error(exc), file=sys.stderr)  # for a terminal, as a failure's line
        return EXIT_USAGE
    except (MissingPrivileges, UnsupportedServer) as exc:  # set-up, not data: nothing written
        print(f"{type(exc).__name__}: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except Exception as exc:  # the lifecycle logged job_failed; this line is for a terminal
        print(describe_error(exc), file=sys.stderr)
        return EXIT_FAILED
    print(json.dumps(dict(result), sort_keys=True, default=str), flush=True)
    return EXIT_OK


def add_db_arguments(parser: argparse.ArgumentParser, *, what: str) -> None:
    """``--db-url`` (required, no password) and ``--db-password-env``."""
    parser.add_argument(
        "--db-url",
        required=True,
        help=(
            f"libpq URL or key=value string of the {what}, without a password; the password "
            f"comes from {PASSWORD_SOURCES}"
        ),
    )
    parser.add_argument(
        "--db-password-env",
        metavar="VAR",
        help="name of an environment variable that holds the database password",
    )


def db_conninfo(parser: argparse.ArgumentParser, args: argparse.Namespace) -> str:
    """The connection string, or exit 2 (``parser.error``) for one that carries a password (never
    echoed); ``--db-password-env``'s password is added here, in memory only."""
    url = args.db_url
    try:
        params = conninfo_to_dict(url)
    except psycopg.ProgrammingError:  # its text quotes the string, which may hold the password
        parser.error("--db-url is not a valid libpq URL or key=value connection string")
    if params.get("password"):
        parser.error(REFUSED)
    if args.db_password_env is None:
        return url
    password = os.environ.get(args.db_password_env)
    if not password:
        parser.error(
            f"--db-password-env {args.db_password_env}: that environment variable is not set"
        )
    return make_conninfo(url, password=password)
