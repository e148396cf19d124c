"""``airflow`` CLI runs forked from an interpreter that has already imported Airflow.

Each ``airflow dags test`` the suite runs spends most of its CPU before and around the DAG:
importing Airflow, its providers and FastAPI, and the in-process Execution API, whose versioned
routes cadwyn generates on the app's first request. The suite runs about a hundred of them on
two cores. A fork server pays both once: this file, run as
``python devtools/airflow_forkserver.py``, imports those modules (and, on its first
``dags test``, builds that app with its routes: :func:`_prebuild_execution_api`), then for
each request forks a child that takes the
request's environment, working directory, stdin, stdout and stderr, and becomes the
``airflow`` console script (``airflow.__main__.main`` with the request's argv) through the
interpreter's normal exit: threads joined, exit handlers run (logging's flush,
OpenTelemetry's shutdown), then devtools/airflow_cli.py's ``gc.freeze``. A small failing
``dags test`` (three task tries), measured on one slow core: 11.5-11.9 CPU-s forked with the
imports only, 2.0-3.0 CPU-s with the app built too (a plain process: about 23).
Forking a warm interpreter is how Airflow runs its own task processes (LocalExecutor and the
Celery worker fork a parent that imported Airflow); nothing of the DAG, the job package or a
connection exists before the fork, so every run parses its DAG file and reads its
``AIRFLOW_CONN_*`` / ``AIRFLOW_VAR_*`` fresh.

What a warm interpreter has fixed is the configuration Airflow read at import. So a server
serves only environments equal to its own except for the variables read when they are used
(:data:`LIVE_PREFIXES`): :func:`run` keeps one server per such environment.

Protocol (one request at a time, JSON lines on the server's stdin and stdout): the server
says ``{"ready"}`` once warm; the client sends
``{"argv", "env", "cwd", "stdin", "stdout", "stderr"}`` (the last three are file paths), the
server answers ``{"pid"}`` once the child exists and ``{"pid", "returncode"}`` when it ends
(negative: killed by that signal, as :mod:`subprocess` reports it). Where an Airflow or cadwyn
internal the server relies on has moved (:class:`InternalsChanged`), it says ``{"error"}``
instead of ``{"ready"}`` or of a ``dags test``'s ``{"pid"}``, and :func:`run` raises it. The
server ends when its stdin closes (its client, a pytest worker or a tool, is gone).
"""

from __future__ import annotations

import atexit
import contextlib
import gc
import importlib
import inspect
import json
import locale
import os
import select
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

# Variables read only when they are used, and the one pytest rewrites per test: a child may
# differ from its server in these. Airflow's environment secrets backend looks up connections
# and Variables per call; the project's own ``PIN_*`` settings are read when a DAG file is
# parsed or the scheduler-side plugin loads, both after the fork (a server imports nothing of
# dags/, include/ or pin_maintenance_plugin: tests/dags/test_airflow_cli.py checks it;
# tests/dags/test_deadline_dags_test_fix.py runs PIN_AIRFLOW_73428_FIX on and off through one
# server). Any other difference needs its own server.
LIVE_PREFIXES = ("AIRFLOW_CONN_", "AIRFLOW_VAR_", "PIN_", "PYTEST_CURRENT_TEST")


def server_key(env: dict[str, str]) -> tuple[tuple[str, str], ...]:
    """The part of ``env`` a server's imports depend on."""
    return tuple(sorted((k, v) for k, v in env.items() if not k.startswith(LIVE_PREFIXES)))


def _warm() -> None:
    """Import what every ``airflow dags test`` imports before it runs its first task."""
    import airflow.__main__  # noqa: F401 (settings, configuration, logging)
    from airflow.cli import cli_parser
    from airflow.cli.commands import dag_command  # noqa: F401
    from airflow.providers.http.hooks import http  # noqa: F401
    from airflow.providers.postgres.hooks import postgres  # noqa: F401

    cli_parser.get_parser()
    _check_console_script()
    # the in-process Execution API: built on the first dags test (_prebuild_execution_api)


# ------------------------------------------------------- the internals the server relies on
# A child becomes the console script by calling its target, and the prebuilt app rests on
# private parts of Airflow and cadwyn. Each is looked up by name and its shape checked before
# use, so that an upgrade that moves one stops the server with a message naming it instead of
# runs that quietly differ from a plain one (tests/unit/test_forkserver_internals.py).

RUN_PLAIN = "PIN_AIRFLOW_FORKSERVER=0"
CONSOLE_SCRIPT = "airflow.__main__:main"
EXECUTION_API = "airflow.api_fastapi.execution_api.app.InProcessExecutionAPI"
CADWYN_APP = "cadwyn.Cadwyn"


class InternalsChanged(RuntimeError):
    """An Airflow or cadwyn internal the fork server relies on is gone or has changed shape."""


def _versions() -> str:
    from importlib.metadata import PackageNotFoundError, version

    found = []
    for name, dist in (("Airflow", "apache-airflow-core"), ("cadwyn", "cadwyn")):
        try:
            found.append(f"{name} {version(dist)}")
        except PackageNotFoundError:
            found.append(f"{name} not installed")
    return ", ".join(found)


def _changed(internal: str, problem: str) -> InternalsChanged:
    return InternalsChanged(
        f"airflow_forkserver: {internal} {problem} ({_versions()}); run with {RUN_PLAIN}"
    )


def _lookup(dotted: str) -> Any:
    """The object named ``dotted`` (its module's longest importable prefix, then attributes)."""
    parts = dotted.split(".")
    for cut in range(len(parts) - 1, 0, -1):
        try:
            found = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for i in range(cut, len(parts)):
            if not hasattr(found, parts[i]):
                raise _changed(".".join(parts[: i + 1]), "not found")
            found = getattr(found, parts[i])
        return found
    raise _changed(dotted, "not found (its module does not import)")


def _check_signature(internal: str, function: Any, *args: Any) -> None:
    """``function`` accepts ``args`` and nothing more is required, as the server calls it."""
    try:
        signature = inspect.signature(function)
    except (TypeError, ValueError) as exc:
        raise _changed(internal, f"has no readable signature ({exc})") from exc
    try:
        signature.bind(*args)
    except TypeError as exc:
        parameters = signature.replace(return_annotation=inspect.Signature.empty)
        raise _changed(internal, f"changed signature to {parameters}") from exc


def _check_console_script() -> None:
    """The ``airflow`` console script still calls what a child calls."""
    from importlib.metadata import entry_points

    targets = sorted({ep.value for ep in entry_points(group="console_scripts", name="airflow")})
    if targets != [CONSOLE_SCRIPT]:
        raise _changed(f"the airflow console script ({CONSOLE_SCRIPT})", f"now runs {targets}")
    _check_signature(CONSOLE_SCRIPT.replace(":", "."), _lookup(CONSOLE_SCRIPT.replace(":", ".")))


def _execution_api_class() -> type:
    """``InProcessExecutionAPI``, checked for what :func:`_prebuild_execution_api` does with it:
    built without arguments, its app lazily built into ``_app`` by the ``app`` property, and a
    cadwyn app that generates its routes in ``_cadwyn_initialize`` unless
    ``_cadwyn_initialized`` says it did."""
    api_class = _lookup(EXECUTION_API)
    _check_signature(f"{EXECUTION_API}.__init__", api_class.__init__, object())
    if getattr(api_class(), "_app", "not found") is not None:  # no app is built here
        raise _changed(f"{EXECUTION_API}._app", "is no longer None on a new instance")
    _lookup(f"{EXECUTION_API}.app")  # what it returns is checked once built
    initialize = _lookup(f"{CADWYN_APP}._cadwyn_initialize")
    _check_signature(f"{CADWYN_APP}._cadwyn_initialize", initialize, object())
    call = _lookup(f"{CADWYN_APP}.__call__")
    reads = getattr(getattr(call, "__code__", None), "co_names", ())
    if not {"_cadwyn_initialized", "_cadwyn_initialize"} <= set(reads):
        raise _changed(
            f"{CADWYN_APP}.__call__", "no longer initializes through _cadwyn_initialized"
        )
    return api_class


# the commands that run tasks against an in-process Execution API
IN_PROCESS_API_COMMANDS = (["dags", "test"], ["tasks", "test"])


def _prebuild_execution_api() -> type:
    """Build the in-process Execution API's app once, routes generated, for each child's first
    ``InProcessExecutionAPI`` (returned). Done by the server on its first such command
    (:data:`IN_PROCESS_API_COMMANDS`), so that a server whose commands are a ``db migrate`` or a
    ``dags trigger`` does not pay for it.

    ``airflow dags test`` runs its tasks against an in-process Execution API: one
    ``InProcessExecutionAPI`` per run, whose app cadwyn completes on its first request by
    generating every API version's routes, about 60 % of a small run's CPU (9 s of 16 s on a
    slow core, measured with py-spy). The app is the same for every run of a server: it is
    built by Airflow's own ``InProcessExecutionAPI.app`` from the configuration the server
    imported (which :func:`server_key` pins), and holds no connection, Variable or DAG (its
    DagBag reads the metadata DB per request). So the server builds it, lets cadwyn generate
    the routes, and each forked child's first instance starts with its own copy of it (fork is
    copy-on-write): the child enters the app's lifespan and starts its event-loop thread as a
    plain run does. Later instances in the same child build their own, as without the server.
    Every internal this uses is checked first (:func:`_execution_api_class`) and its effect
    after: :class:`InternalsChanged` names the one that moved.
    """
    api_class = _execution_api_class()
    cadwyn_class = _lookup(CADWYN_APP)
    app = api_class().app
    if not isinstance(app, cadwyn_class):
        raise _changed(f"{EXECUTION_API}.app", f"is a {type(app).__qualname__}, not a {CADWYN_APP}")
    if getattr(app, "_cadwyn_initialized", None) is not False:
        raise _changed(f"{CADWYN_APP}._cadwyn_initialized", "not found on a new app")
    app._cadwyn_initialize()  # what cadwyn's __call__ does on the first request
    if app._cadwyn_initialized is not True:
        raise _changed(f"{CADWYN_APP}._cadwyn_initialize", "no longer sets _cadwyn_initialized")
    handed = api_class()
    handed._app = app
    if handed.app is not app:
        raise _changed(f"{EXECUTION_API}.app", "no longer returns the app set in _app")
    spare = [app]
    init = api_class.__init__

    def __init__(self, *args, **kwargs) -> None:
        init(self, *args, **kwargs)
        if spare and self._app is None:
            self._app = spare.pop()

    api_class.__init__ = __init__
    return api_class


def _become_child(req: dict, control: list) -> list[str]:
    """In the forked child: take the request's process state; return the argv to run."""
    for stream in control:
        stream.close()
    for fd, path, mode in (
        (0, req["stdin"], os.O_RDONLY),
        (1, req["stdout"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC),
        (2, req["stderr"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC),
    ):
        opened = os.open(path, mode, 0o600)
        os.dup2(opened, fd)
        os.close(opened)
    os.environ.clear()
    os.environ.update(req["env"])
    os.chdir(req["cwd"])
    return req["argv"]


def _control() -> tuple:
    """The request pipe (stdin) and the answer pipe (stdout) as files of their own; fds 0 and 1
    become /dev/null and stderr, so that nothing Airflow prints can garble an answer."""
    ctl_in, ctl_out = os.dup(0), os.dup(1)
    devnull = os.open(os.devnull, os.O_RDWR)
    os.dup2(devnull, 0)
    os.dup2(2, 1)
    os.close(devnull)
    reader = os.fdopen(ctl_in, "r", encoding="utf-8")
    writer = os.fdopen(ctl_out, "w", encoding="utf-8", buffering=1)
    return reader, writer


def _serve(reader, writer) -> list[str] | None:
    """Answer requests until stdin closes (returns None) or, in a child, return its argv."""
    writer.write(json.dumps({"ready": os.getpid()}) + "\n")
    prebuilt, changed = False, None
    for line in reader:
        req = json.loads(line)
        if not prebuilt and req["argv"][:2] in IN_PROCESS_API_COMMANDS:
            if changed is None:
                try:
                    _prebuild_execution_api()
                    prebuilt = True
                except InternalsChanged as exc:
                    changed = str(exc)
            if changed is not None:  # each such command fails with it; the others still run
                writer.write(json.dumps({"error": changed}) + "\n")
                continue
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            return _become_child(req, [reader, writer])
        writer.write(json.dumps({"pid": pid}) + "\n")
        _, status = os.waitpid(pid, 0)
        writer.write(json.dumps({"pid": pid, "returncode": _returncode(status)}) + "\n")
    return None


def _returncode(status: int) -> int:
    return -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)


# ------------------------------------------------------------------------------- the client

# One per environment in use. Past the limit the server that has run the fewest commands ends
# first (the least recently used among those): a module's one-off environments (a statsd port,
# a fixture DAG folder) come and go, while the DAG tier's shared environment keeps its server
# (with "least recently used" alone it was ended and warmed again, 8 CPU-s each time).
MAX_SERVERS = 4
_servers: dict[tuple[tuple[str, str], ...], _Server] = {}
_cold: set[tuple[tuple[str, str], ...]] = set()  # environments Airflow does not import in


class _Server:
    """One server process and the line protocol to it."""

    def __init__(self, env: dict[str, str]) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, str(Path(__file__).resolve())],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,  # a server that fails to warm is replaced (see run)
            env=env,
        )
        self._buf = b""
        self.uses = 0
        try:
            first = self.read(timeout=300)
        except TimeoutError:
            first = None
        self.ready = first is not None and "ready" in first
        # what an Airflow upgrade moved (InternalsChanged), as the server reported it
        self.changed = first.get("error") if first is not None else None

    def read(self, timeout: float | None) -> dict | None:
        """The next answer; None when the server has ended; TimeoutError after ``timeout``."""
        deadline = None if timeout is None else time.monotonic() + timeout
        fd = self.proc.stdout.fileno()
        while b"\n" not in self._buf:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            if not select.select([fd], [], [], left)[0]:
                raise TimeoutError
            chunk = os.read(fd, 65536)
            if not chunk:
                return None
            self._buf += chunk
        line, self._buf = self._buf.split(b"\n", 1)
        return json.loads(line)

    def send(self, request: dict) -> None:
        self.proc.stdin.write(json.dumps(request).encode() + b"\n")
        self.proc.stdin.flush()

    def close(self, *, kill: bool = False) -> None:
        """End the server: stdin closed (it exits), or killed; its pipes closed."""
        try:
            if kill:
                self.proc.kill()
            self.proc.stdin.close()
            self.proc.wait(timeout=10)
        except (OSError, subprocess.TimeoutExpired):
            self.proc.kill()
            self.proc.wait()
        self.proc.stdout.close()


def _server(env: dict[str, str]) -> _Server | None:
    key = server_key(env)
    if key in _cold:
        return None
    server = _servers.pop(key, None)
    if server is not None and server.proc.poll() is not None:
        server.close()  # it ended (killed from outside): its pipes, then a new one
        server = None
    if server is None:
        while len(_servers) >= MAX_SERVERS:
            fewest = min(_servers, key=lambda k: _servers[k].uses)  # first = least recent
            _servers.pop(fewest).close()
        server = _Server(env)
        if server.changed is not None:
            server.close()
            raise InternalsChanged(server.changed)
        if not server.ready:
            server.close()
            _cold.add(key)
            return None
    _servers[key] = server  # most recently used last
    server.uses += 1
    return server


def run(
    cmd: list[str], argv: list[str], env: dict[str, str], timeout: float | None = None
) -> subprocess.CompletedProcess[str]:
    """``subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)`` for
    ``cmd``, the ``airflow`` command with ``argv``, forked from a warm server.

    Where Airflow does not even import in ``env`` (a test's broken configuration), the command
    runs as a plain subprocess, so its output is the console script's.
    """
    server = _server(env)
    if server is None:
        return subprocess.run(
            cmd, env=env, capture_output=True, text=True, timeout=timeout, check=False
        )
    with tempfile.TemporaryDirectory(prefix="airflow-fork-") as tmp:
        out, err = Path(tmp) / "stdout", Path(tmp) / "stderr"
        request = {"argv": argv, "env": env, "cwd": os.getcwd(), "stdin": os.devnull}
        server.send({**request, "stdout": str(out), "stderr": str(err)})
        pid = done = changed = None
        try:
            # the server answers once the child exists; before its first dags test it builds
            # the app first (seconds, more on a loaded machine); a dead server answers at once;
            # where an internal the app needs has moved, it answers with that instead
            first = _answer(server, 300)
            changed, pid = first.get("error"), first.get("pid")
            try:
                done = None if pid is None else _answer(server, timeout)
            except TimeoutError:
                os.kill(pid, signal.SIGKILL)  # as subprocess.run does; the server reaps it
                _answer(server, 60)
        except BaseException:  # interrupted (pytest-timeout, Ctrl-C): the child and server end
            if pid is not None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            _servers.pop(server_key(env), None)
            server.close(kill=True)
            raise
        if changed is not None:
            raise InternalsChanged(changed)
        if done is None:
            raise subprocess.TimeoutExpired(cmd, timeout, _text(out), _text(err))
        return subprocess.CompletedProcess(cmd, done["returncode"], _text(out), _text(err))


def _answer(server: _Server, timeout: float | None) -> dict:
    answer = server.read(timeout)
    if answer is None:
        raise RuntimeError(f"the airflow fork server (pid {server.proc.pid}) ended mid-request")
    return answer


def _text(path: Path) -> str:
    """A captured stream decoded as ``subprocess.run(text=True)`` decodes it."""
    if not path.exists():
        return ""
    with path.open(encoding=locale.getpreferredencoding(False)) as f:
        return f.read()


def close(*, home: Path | None = None) -> None:
    """End the servers (those whose ``AIRFLOW_HOME`` is ``home``, when given)."""
    for key in list(_servers):
        if home is None or dict(key).get("AIRFLOW_HOME") == str(home):
            _servers.pop(key).close()


atexit.register(close)


if __name__ == "__main__":
    # the same exit as devtools/airflow_cli.py (see there); registered before Airflow's
    atexit.register(gc.freeze)
    if sys.path and sys.path[0] == str(Path(__file__).resolve().parent):
        del sys.path[0]  # as devtools/airflow_cli.py: the console script has no such entry
    control = _control()
    try:
        _warm()
    except InternalsChanged as exc:  # the client raises it; an ImportError falls back to plain
        control[1].write(json.dumps({"error": str(exc)}) + "\n")
        sys.exit(1)
    argv = _serve(*control)
    if argv is None:
        sys.exit(0)
    sys.argv = [str(Path(sys.executable).with_name("airflow")), *argv]
    from airflow.__main__ import main

    sys.exit(main())
