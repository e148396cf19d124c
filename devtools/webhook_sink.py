"""A local stand-in for the alerts webhook: logs every JSON POST it receives to a JSONL file.

The ``alerts_webhook`` connection of ``make up`` and of the end-to-end tests points here, so
alerts sent by the DAGs (``pin_maintenance_plugin.notify.Notifier``) can be read back:

    python -m devtools.webhook_sink --port 8787 --out .local/webhook.jsonl

Each line is ``{"received_at": <unix time>, "path": "/...", "body": <the posted JSON>}``
(``body`` is the raw text when it is not JSON). Answers 204 to every POST.
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path


class _Handler(BaseHTTPRequestHandler):
    server: WebhookSink

    def do_POST(self) -> None:
        length = int(self.headers.get("Content-Length") or 0)
        raw = self.rfile.read(length).decode("utf-8", errors="replace")
        try:
            body: object = json.loads(raw)
        except ValueError:
            body = raw
        self.server.record({"received_at": time.time(), "path": self.path, "body": body})
        self.send_response(204)
        self.end_headers()

    def do_GET(self) -> None:  # liveness probe
        self.send_response(200)
        self.send_header("Content-Type", "text/plain")
        self.end_headers()
        self.wfile.write(b"ok\n")

    def log_message(self, format: str, *args: object) -> None:
        pass


class WebhookSink(ThreadingHTTPServer):
    """``WebhookSink(out, port=0)``; ``.url``; ``.received()``."""

    daemon_threads = True

    def __init__(self, out: Path, host: str = "127.0.0.1", port: int = 0) -> None:
        super().__init__((host, port), _Handler)
        self.out = out
        self.out.parent.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()

    @property
    def url(self) -> str:
        host, port = self.server_address[:2]
        return f"http://{host}:{port}"

    def record(self, entry: dict) -> None:
        line = json.dumps(entry, sort_keys=True, default=str)
        with self._lock, self.out.open("a", encoding="utf-8") as f:
            f.write(line + "\n")

    def received(self) -> list[dict]:
        return read_jsonl(self.out)


def read_jsonl(path: Path) -> list[dict]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--out", type=Path, default=Path(".local/webhook.jsonl"))
    args = parser.parse_args(argv)
    sink = WebhookSink(args.out, args.host, args.port)
    print(f"webhook sink on {sink.url} -> {args.out}", flush=True)
    try:
        sink.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        sink.server_close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
