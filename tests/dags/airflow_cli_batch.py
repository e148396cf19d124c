"""Run several ``airflow`` CLI commands in one process, each as ``airflow <args>`` would.

``python -m tests.dags.airflow_cli_batch`` reads a JSON list of argument lists on stdin and
prints one JSON line per command: ``{"args", "rc", "stdout", "stderr"}``. Each command goes
through Airflow's own CLI parser and command function (``get_parser().parse_args(args).func``),
as Airflow's CLI tests call them; only the interpreter start-up (~5 s on a loaded machine) is
shared. The environment (AIRFLOW_HOME, dags folder) is the caller's.
"""

from __future__ import annotations

import contextlib
import io
import json
import sys
import traceback


def main() -> int:
    from airflow.cli.cli_parser import get_parser

    commands = json.load(sys.stdin)
    parser = get_parser()
    results = []
    for args in commands:
        out, err = io.StringIO(), io.StringIO()
        rc = 0
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                parsed = parser.parse_args(args)
                parsed.func(parsed)
            except SystemExit as exc:
                rc = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
            except Exception:
                traceback.print_exc()
                rc = 1
        results.append({"args": args, "rc": rc, "stdout": out.getvalue(), "stderr": err.getvalue()})
    sys.__stdout__.write(json.dumps(results) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
