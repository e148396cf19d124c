"""Loopback listeners for the alert and metrics tests: a webhook that records the JSON POSTs it
gets (the ``alerts_webhook`` target) and a UDP socket that keeps StatsD lines.

(The local Airflow the e2e tests run is :class:`devtools.local_airflow.AirflowStack`.)
"""

from __future__ import annotations

import json
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any


class RecordingWebhook:
    """A loopback HTTP server that records JSON POST bodies (the ``alerts_webhook`` target).

    ``status`` is what it answers; ``delay`` makes it slow (to test the notifier's timeout).
    """

    def __init__(self, status: int = 200, delay: float = 0.0) -> None:
        self.status = status
        self.delay = delay
        self.received: list[dict[str, Any]] = []
        self.headers: list[dict[str, str]] = []
        self.paths: list[str] = []
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
                    webhook.paths.append(self.path)
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
