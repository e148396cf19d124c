"""The job CLIs' ``--db-url``: a password on the command line is refused; libpq's sources and
``--db-password-env`` are the ways in (include/pin_maintenance/cli.py)."""

from __future__ import annotations

import argparse

import pytest
from psycopg.conninfo import conninfo_to_dict

from include.pin_maintenance.cli import add_db_arguments, db_conninfo

SECRET = "s3cr3t-value"


def parse(*argv: str) -> str:
    parser = argparse.ArgumentParser(prog="job")
    add_db_arguments(parser, what="test database")
    return db_conninfo(parser, parser.parse_args(list(argv)))


@pytest.mark.parametrize(
    "url",
    [
        f"postgresql://pin:{SECRET}@db.example:5432/pin",
        f"postgres://pin:{SECRET}@db.example/pin",
        f"postgresql://pin@db.example/pin?password={SECRET}",
        f"host=db.example user=pin password={SECRET}",
    ],
)
def test_a_password_in_the_url_exits_2_naming_the_alternatives(url, capsys) -> None:
    with pytest.raises(SystemExit) as exit_:
        parse("--db-url", url)
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert "must not carry a password" in err
    assert "PGPASSWORD" in err and "--db-password-env" in err and "pg_service.conf" in err
    assert SECRET not in err


@pytest.mark.parametrize(
    "url", ["postgresql://pin@db.example/pin", "service=pin", "postgresql:///pin", "dbname=x"]
)
def test_a_url_without_password_is_used_as_given(url) -> None:
    assert parse("--db-url", url) == url


def test_an_unparsable_url_is_refused_without_echoing_it(capsys) -> None:
    with pytest.raises(SystemExit):
        parse("--db-url", f"host=db {SECRET} user")
    assert SECRET not in capsys.readouterr().err


def test_db_password_env_adds_the_variable_in_memory(monkeypatch) -> None:
    monkeypatch.setenv("PIN_DB_PASSWORD", SECRET)
    conninfo = parse(
        "--db-url", "postgresql://pin@db.example/pin", "--db-password-env", "PIN_DB_PASSWORD"
    )
    params = conninfo_to_dict(conninfo)
    assert params["password"] == SECRET
    assert params["host"] == "db.example" and params["user"] == "pin"


def test_db_password_env_naming_an_unset_variable_exits_2(monkeypatch, capsys) -> None:
    monkeypatch.delenv("PIN_DB_PASSWORD", raising=False)
    with pytest.raises(SystemExit) as exit_:
        parse("--db-url", "postgresql://pin@db/pin", "--db-password-env", "PIN_DB_PASSWORD")
    assert exit_.value.code == 2
    assert "PIN_DB_PASSWORD" in capsys.readouterr().err
