"""Helpers for the deadline-alert tests: a loopback webhook and a local Airflow (real scheduler).

``LocalAirflow`` runs ``airflow scheduler``, ``airflow dag-processor`` and ``airflow api-server``
(LocalExecutor, Postgres metadata DB) each in its own process group, so ``stop()`` ends the
LocalExecutor workers and callback supervisors too (DESIGN section 8).
"""

from __future__ import annotations

import json
import os
import secrets
import signal
import socket
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, TypeVar

from devtools import airflow_env as ae

T = TypeVar("T")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for(
    probe: Callable[[], T], *, timeout: float, interval: float = 0.5, what: str = "condition"
) -> T:
    """Poll ``probe`` until it returns something truthy; raise AssertionError on timeout."""
    deadline = time.monotonic() + timeout
    while True:
        value = probe()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}")
        time.sleep(interval)


class RecordingWebhook:
    """A loopback HTTP server that records JSON POST bodies (the ``alerts_webhook`` target).

    ``status`` is what it answers; ``delay`` makes it slow (to test the notifier's timeout).
    """

    def __init__(self, status: int = 200, delay: float = 0.0) -> None:
        self.status = status
        self.delay = delay
        self.received: list[dict[str, Any]] = []
        self.headers: list[dict[str, str]] = []
        self.received_at: list[float] = []  # unix time of each POST
        self._lock = threading.Lock()
        webhook = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                raw = self.rfile.read(length)
                with webhook._lock:
                    webhook.received_at.append(time.time())
                    webhook.headers.append(dict(self.headers.items()))
                    try:
                        webhook.received.append(json.loads(raw))
                    except ValueError:
                        webhook.received.append({"_raw": raw.decode(errors="replace")})
                if webhook.delay:
                    time.sleep(webhook.delay)
                self.send_response(webhook.status)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, format: str, *args: Any) -> None:  # quiet
                return

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        host, port = self._server.server_address[:2]
        return f"http://{host}:{port}/alerts"

    def alerts(self, name: str | None = None) -> list[dict[str, Any]]:
        with self._lock:
            return [a for a in self.received if name is None or a.get("alert") == name]

    def __enter__(self) -> RecordingWebhook:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.shutdown()
        self._server.server_close()


class UdpListener:
    """A loopback UDP socket that keeps every StatsD line it receives."""

    def __init__(self) -> None:
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self.sock.bind(("127.0.0.1", 0))
        self.sock.settimeout(0.2)
        self.lines: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    @property
    def port(self) -> int:
        return self.sock.getsockname()[1]

    def airflow_env(self) -> dict[str, str]:
        """``[metrics]`` settings that send Airflow's StatsD to this listener."""
        return {
            "AIRFLOW__METRICS__STATSD_ON": "True",
            "AIRFLOW__METRICS__STATSD_HOST": "127.0.0.1",
            "AIRFLOW__METRICS__STATSD_PORT": str(self.port),
            "AIRFLOW__METRICS__STATSD_PREFIX": "airflow",
        }

    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                data = self.sock.recv(65535)
            except TimeoutError:
                continue
            self.lines += data.decode(errors="replace").splitlines()

    def __enter__(self) -> UdpListener:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.sock.close()


class LocalAirflow:
    """Scheduler + dag-processor + api-server on a scratch AIRFLOW_HOME (real scheduling)."""

    COMPONENTS = ("api-server", "scheduler", "dag-processor")

    def __init__(
        self,
        home: Path,
        dags_folder: Path,
        *,
        metadata_url: str,
        job_db_url: str,
        webhook_url: str | None,
        variables: dict[str, object] | None = None,
        extra_env: dict[str, str] | None = None,
    ) -> None:
        self.home = home
        self.port = free_port()
        self.env = ae.airflow_env(
            home,
            job_db_url=job_db_url,
            webhook_url=webhook_url,
            metadata_url=metadata_url,
            variables=variables,
            extra={
                "AIRFLOW__CORE__DAGS_FOLDER": str(dags_folder),
                "AIRFLOW__CORE__EXECUTOR": "LocalExecutor",
                "AIRFLOW__CORE__DAGS_ARE_PAUSED_AT_CREATION": "False",
                "AIRFLOW__API__HOST": "127.0.0.1",
                "AIRFLOW__API__PORT": str(self.port),
                "AIRFLOW__API__WORKERS": "1",
                "AIRFLOW__CORE__EXECUTION_API_SERVER_URL": (
                    f"http://127.0.0.1:{self.port}/execution/"
                ),
                "AIRFLOW__API_AUTH__JWT_SECRET": secrets.token_urlsafe(32),
                "AIRFLOW__API__SECRET_KEY": secrets.token_urlsafe(32),
                # re-parse quickly so the "edit the DAG file" step takes seconds
                "AIRFLOW__DAG_PROCESSOR__REFRESH_INTERVAL": "2",
                "AIRFLOW__DAG_PROCESSOR__MIN_FILE_PROCESS_INTERVAL": "1",
                "AIRFLOW__DAG_PROCESSOR__BUNDLE_REFRESH_CHECK_INTERVAL": "1",
                "AIRFLOW__CORE__MIN_SERIALIZED_DAG_UPDATE_INTERVAL": "1",  # default 30 s
                "AIRFLOW__SCHEDULER__SCHEDULER_HEARTBEAT_SEC": "1",
                **(extra_env or {}),
            },
        )
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self.logs = home / "component-logs"

    def migrate(self) -> None:
        ae.migrate(self.env)

    def start(self) -> None:
        self.logs.mkdir(parents=True, exist_ok=True)
        for name in self.COMPONENTS:
            out = (self.logs / f"{name}.log").open("wb")
            self.procs[name] = subprocess.Popen(
                [str(ae.VENV_BIN / "airflow"), name],
                env=self.env,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # own process group: stop() ends its children too
            )
            out.close()

    def stop(self) -> None:
        """End every process the components started, including the task supervisors, which
        put themselves in process groups of their own (``setpgid``)."""
        groups = self._groups()
        for group in groups:
            _signal_group(group, signal.SIGTERM)
        end = time.monotonic() + 15
        for proc in self.procs.values():
            with suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=max(0.1, end - time.monotonic()))
        for group in groups | self._groups():
            _signal_group(group, signal.SIGKILL)
        for proc in self.procs.values():
            proc.wait(timeout=10)

    def _groups(self) -> set[int]:
        pids = {proc.pid for proc in self.procs.values() if proc.poll() is None}
        for proc in self.procs.values():
            pids |= _descendants(proc.pid)
        groups = {proc.pid for proc in self.procs.values()}  # start_new_session: pgid == pid
        for pid in pids:
            with suppress(ProcessLookupError):
                groups.add(os.getpgid(pid))
        return groups

    def assert_running(self) -> None:
        dead = {n: p.returncode for n, p in self.procs.items() if p.poll() is not None}
        if dead:
            raise AssertionError(f"Airflow components exited: {dead}\n{self.tail_logs()}")

    def tail_logs(self, lines: int = 40) -> str:
        chunks = []
        for name in self.COMPONENTS:
            path = self.logs / f"{name}.log"
            if path.exists():
                text = path.read_text(errors="replace").splitlines()[-lines:]
                chunks.append(f"--- {name}\n" + "\n".join(text))
        return "\n".join(chunks)

    def cli(self, *args: str) -> subprocess.CompletedProcess[str]:
        done = ae.airflow(list(args), self.env, timeout=120)
        if done.returncode != 0:
            raise AssertionError(f"airflow {' '.join(args)} failed:\n{done.stdout}\n{done.stderr}")
        return done

    def log_text(self, name: str) -> str:
        path = self.logs / f"{name}.log"
        return path.read_text(errors="replace") if path.exists() else ""


def _signal_group(pgid: int, sig: int) -> None:
    with suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)


def _descendants(root: int) -> set[int]:
    """All live descendants of ``root`` (from /proc; Linux)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        children.setdefault(ppid, []).append(int(entry.name))
    found: set[int] = set()
    todo = [root]
    while todo:
        for child in children.get(todo.pop(), []):
            if child not in found:
                found.add(child)
                todo.append(child)
    return found


@contextmanager
def local_airflow(**kwargs: Any) -> Iterator[LocalAirflow]:
    af = LocalAirflow(**kwargs)
    af.migrate()
    af.start()
    try:
        yield af
    finally:
        af.stop()
