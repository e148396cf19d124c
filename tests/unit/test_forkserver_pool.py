"""devtools/airflow_forkserver.py's pool of warm servers: past ``MAX_SERVERS`` the server that
ran the fewest commands ends first, so a module's one-off environments do not end the server
of the environment the DAG tier shares (warming one again costs seconds of CPU)."""

from __future__ import annotations

import pytest

from devtools import airflow_forkserver as fs


class _Proc:
    def poll(self) -> None:
        return None


class _Stub:
    """A server that is always ready (no process: the pool's bookkeeping is what is tested)."""

    def __init__(self, env: dict[str, str]) -> None:
        self.env, self.proc, self.ready, self.uses, self.closed = env, _Proc(), True, 0, False
        self.changed = None

    def close(self, *, kill: bool = False) -> None:
        self.closed = True


@pytest.fixture
def pool(monkeypatch: pytest.MonkeyPatch) -> dict:
    monkeypatch.setattr(fs, "_Server", _Stub)
    monkeypatch.setattr(fs, "_servers", {})
    monkeypatch.setattr(fs, "MAX_SERVERS", 3)
    return fs._servers


def env(name: str) -> dict[str, str]:
    return {"AIRFLOW_HOME": f"/tmp/{name}", "AIRFLOW_CONN_X": name}


def test_one_off_environments_do_not_end_the_busiest_server(pool: dict) -> None:
    shared = [fs._server(env("shared")) for _ in range(3)]
    assert shared[0] is shared[1] is shared[2] and shared[0].uses == 3
    one_offs = [fs._server(env(f"one-off-{i}")) for i in range(5)]
    assert fs._server(env("shared")) is shared[0]  # still warm: the same server
    assert not shared[0].closed
    assert [s.closed for s in one_offs] == [True, True, True, False, False]
    assert len(pool) == 3


def test_among_equally_used_servers_the_least_recently_used_ends(pool: dict) -> None:
    a, b, c = (fs._server(env(n)) for n in "abc")
    assert fs._server(env("a")) is a  # a: 2 uses, b and c: 1 each, b the older
    fs._server(env("d"))
    assert (a.closed, b.closed, c.closed) == (False, True, False)


def test_live_variables_share_a_server_and_the_rest_do_not(pool: dict) -> None:
    base = {"AIRFLOW_HOME": "/tmp/h"}
    first = fs._server({**base, "AIRFLOW_CONN_NEWS_DB": "postgresql://a", "PIN_X": "1"})
    second = fs._server({**base, "AIRFLOW_CONN_NEWS_DB": "postgresql://b", "PIN_X": "2"})
    assert first is second and len(pool) == 1
    other = fs._server({**base, "AIRFLOW__CORE__DAGS_FOLDER": "/tmp/fixtures"})
    assert other is not first and len(pool) == 2
