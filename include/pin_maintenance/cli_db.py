"""``--db-url`` for the job CLIs, without a password on the command line.

Any local user can read another process's command line (``ps``, ``/proc/<pid>/cmdline``), so
a password in ``--db-url`` is refused before anything connects. The password comes instead from
libpq's own sources, which psycopg honours as they are:

- ``PGPASSWORD`` in the environment;
- a password file (``~/.pgpass``, or the file named by ``PGPASSFILE``);
- a connection service (``--db-url "service=pin"`` or ``PGSERVICE``, defined in
  ``~/.pg_service.conf`` or the file named by ``PGSERVICEFILE``);

or from an environment variable named by ``--db-password-env`` (as the detach CLI's
``--password-env`` does for the selections password).

Used by every job CLI's argument parsing: :func:`add_db_arguments`, then :func:`db_conninfo`.
"""

from __future__ import annotations

import argparse
import os

from psycopg import ProgrammingError
from psycopg.conninfo import conninfo_to_dict, make_conninfo

PASSWORD_SOURCES = (
    "PGPASSWORD, a password file (~/.pgpass or PGPASSFILE), a service in .pg_service.conf "
    '(--db-url "service=NAME" or PGSERVICE), or --db-password-env VAR'
)
REFUSED = (
    "--db-url must not carry a password: any local user can read a command line (ps). "
    f"Drop it from the URL and give it through {PASSWORD_SOURCES}."
)


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
        default=None,
        help="name of an environment variable that holds the database password",
    )


def db_conninfo(parser: argparse.ArgumentParser, args: argparse.Namespace) -> str:
    """The connection string to connect with, or exit 2 through ``parser.error``.

    Refuses a URL (or key=value string) that carries a password, naming what to use instead;
    the refused value is never echoed. With ``--db-password-env`` the password is added here,
    in memory only.
    """
    url = args.db_url
    try:
        params = conninfo_to_dict(url)
    except ProgrammingError:  # its text quotes the string, which may hold the password
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
