"""devtools/airflow_forkserver.py's reach into Airflow and cadwyn fails loudly, naming the
internal, when an upgrade moves it: each case below takes one internal away (or changes its
signature) where the server looks it up, and the server's check raises the message a
developer sees, with the versions and the way out (``PIN_AIRFLOW_FORKSERVER=0``). The last
two follow that message across the server's protocol to the test that ran the command."""

from __future__ import annotations

import io
import json
from importlib.metadata import version

import pytest

from devtools import airflow_forkserver as fs

# third-party noise: the Execution API's module imports FastAPI's test client
pytestmark = pytest.mark.filterwarnings("ignore:Using `httpx` with `starlette.testclient`")

API_MODULE = "airflow.api_fastapi.execution_api.app"


def message(internal: str, problem: str) -> str:
    versions = f"Airflow {version('apache-airflow-core')}, cadwyn {version('cadwyn')}"
    return (
        f"airflow_forkserver: {internal} {problem} ({versions}); run with PIN_AIRFLOW_FORKSERVER=0"
    )


def raised(check) -> str:
    with pytest.raises(fs.InternalsChanged) as info:
        check()
    return str(info.value)


def test_todays_airflow_has_every_internal_the_server_uses() -> None:
    from airflow.api_fastapi.execution_api.app import InProcessExecutionAPI

    fs._check_console_script()
    assert fs._execution_api_class() is InProcessExecutionAPI


def test_a_missing_execution_api_class_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    import airflow.api_fastapi.execution_api.app as api_module

    monkeypatch.delattr(api_module, "InProcessExecutionAPI")
    assert raised(fs._execution_api_class) == message(
        f"{API_MODULE}.InProcessExecutionAPI", "not found"
    )


def test_a_changed_execution_api_init_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    from airflow.api_fastapi.execution_api.app import InProcessExecutionAPI

    def __init__(self, client) -> None:  # a required argument the server does not pass
        pass

    monkeypatch.setattr(InProcessExecutionAPI, "__init__", __init__)
    assert raised(fs._execution_api_class) == message(
        f"{API_MODULE}.InProcessExecutionAPI.__init__", "changed signature to (self, client)"
    )


def test_a_missing_cadwyn_initialize_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    import cadwyn

    monkeypatch.delattr(cadwyn.Cadwyn, "_cadwyn_initialize")
    assert raised(fs._execution_api_class) == message(
        "cadwyn.Cadwyn._cadwyn_initialize", "not found"
    )


def test_a_moved_console_script_target_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    import airflow.__main__

    monkeypatch.delattr(airflow.__main__, "main")
    assert raised(fs._check_console_script) == message("airflow.__main__.main", "not found")


def test_the_server_answers_each_dags_test_with_the_message(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The server checks once, then fails every in-process API command with the message
    (no child forked); the client raises it in the caller."""
    text = message("cadwyn.Cadwyn._cadwyn_initialize", "not found")
    calls = []

    def prebuild() -> type:
        calls.append(1)
        raise fs.InternalsChanged(text)

    monkeypatch.setattr(fs, "_prebuild_execution_api", prebuild)
    request = {"env": {}, "cwd": "/", "stdin": "/dev/null", "stdout": "-", "stderr": "-"}
    lines = "".join(
        json.dumps({**request, "argv": ["dags", "test", dag]}) + "\n" for dag in ("a", "b")
    )
    writer = io.StringIO()
    assert fs._serve(io.StringIO(lines), writer) is None
    answers = [json.loads(line) for line in writer.getvalue().splitlines()]
    assert answers[1:] == [{"error": text}, {"error": text}]
    assert len(calls) == 1


class _Answers:
    """A server (no process) that answers a request with ``{"error"}``."""

    def __init__(self, text: str) -> None:
        self.answers = [{"error": text}]
        self.sent: list[dict] = []

    def send(self, request: dict) -> None:
        self.sent.append(request)

    def read(self, timeout: float | None) -> dict | None:
        return self.answers.pop(0)


def test_the_client_raises_the_servers_message(monkeypatch: pytest.MonkeyPatch) -> None:
    text = message(f"{API_MODULE}.InProcessExecutionAPI", "not found")
    server = _Answers(text)
    monkeypatch.setattr(fs, "_server", lambda env: server)
    with pytest.raises(fs.InternalsChanged) as info:
        fs.run(["airflow", "dags", "test", "x"], ["dags", "test", "x"], {})
    assert str(info.value) == text
    assert [r["argv"] for r in server.sent] == [["dags", "test", "x"]]
