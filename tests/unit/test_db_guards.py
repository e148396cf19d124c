"""The per-transaction guard of include/pin_maintenance/db.py hooks into psycopg internals.

``BaseConnection._exec_command`` sends psycopg's own commands (BEGIN, COMMIT, ...) and
``psycopg.generators.execute`` drives a query to its results; the guard overrides the first and
calls the second, and the pool check waits on it with ``psycopg.waiting.wait``. They were read
and checked with the psycopg versions in ``db.CHECKED_PSYCOPG``: this test fails on any other
version as a reminder to re-read them (and
``tests/integration/test_db.py`` checks the behaviour on a real server).
"""

from __future__ import annotations

import inspect

import psycopg

from include.pin_maintenance import db


def test_psycopg_version_is_the_one_the_guard_was_checked_with():
    assert psycopg.__version__.startswith(db.CHECKED_PSYCOPG), (
        f"psycopg {psycopg.__version__}: re-check BaseConnection._exec_command and "
        "generators.execute against include/pin_maintenance/db.py, then extend CHECKED_PSYCOPG"
    )


def test_the_internals_the_guard_uses_exist_with_the_expected_shape():
    base = psycopg.Connection.__mro__[1]
    assert callable(base._exec_command) and callable(psycopg.generators.execute)
    params = list(inspect.signature(base._exec_command).parameters)
    assert params == ["self", "command", "result_format"]
    assert inspect.isgeneratorfunction(base._exec_command)
    # every BEGIN goes through _exec_command: implicit transactions and transaction() blocks
    assert "_exec_command(self._get_tx_start_command())" in inspect.getsource(base._start_query)
    tx_source = inspect.getsource(psycopg.transaction.BaseTransaction)
    assert "self._conn._get_tx_start_command()" in tx_source
    assert "self._conn._exec_command(command)" in tx_source
    assert inspect.getsource(base._get_tx_start_command).count('b"BEGIN"') == 1
    # the pool check waits with psycopg's own bounded wait, which raises this on its timeout
    assert issubclass(psycopg.errors._WaitTimeout, psycopg.OperationalError)
    assert "timeout" in inspect.signature(psycopg.waiting.wait).parameters


def test_set_local_statement_names_each_setting_once():
    settings = db.SessionSettings(1000, 200, "x" * 80, synchronous_commit="off")
    local = settings.local_settings()
    assert local == {
        "statement_timeout": "1000ms",
        "lock_timeout": "200ms",
        "application_name": "x" * 63,
        "synchronous_commit": "off",
    }
    assert "synchronous_commit" not in db.SessionSettings().local_settings()
