"""The selections internal API client built from the ``selections_api`` Airflow connection.

Credentials come from the connection only (docs/design.md, "Connections"), as ``HttpHook``
reads them:

- **basic auth** (the default): connection ``login`` / ``password``;
- **bearer token**: leave ``login`` empty and put ``{"Authorization": "Bearer <token>"}`` in the
  connection's extra; ``HttpHook`` sends every extra key that is not a transport option
  (``timeout``, ``verify``, ``proxies``, ...) as a request header.

The host is the base URL (``http://selections:8080``). TLS options (``verify``, ``cert``) and
proxies in the extra are honoured because the session comes from ``HttpHook.get_conn()``.

The hook builds one configured session (this reads the connection once, in the task's main
thread); each detach worker thread gets its own copy of it with a single kept-alive connection,
so calls reuse TCP connections without sharing a session between threads. Transport retries
are off: the outbox is the retry mechanism.
"""

from __future__ import annotations

import copy

import requests

from include.pin_maintenance.jobs.snapshot_detach_http import (
    HttpDetachClient,
    mount_single_connection_adapter,
)

SELECTIONS_CONN_ID = "selections_api"


def selections_detach_client(conn_id: str = SELECTIONS_CONN_ID) -> HttpDetachClient:
    """An :class:`HttpDetachClient` for the ``selections_api`` connection (via ``HttpHook``)."""
    from airflow.providers.http.hooks.http import HttpHook

    hook = HttpHook(method="POST", http_conn_id=conn_id, tcp_keep_alive=False)
    template = hook.get_conn()  # auth, extra headers, verify/cert/proxies from the connection
    base_url = hook.base_url

    def session_for_thread() -> requests.Session:
        session = requests.Session()
        session.auth = template.auth
        session.headers = copy.copy(template.headers)
        session.verify = template.verify
        session.cert = template.cert
        session.proxies = dict(template.proxies)
        session.trust_env = template.trust_env
        session.max_redirects = template.max_redirects
        return mount_single_connection_adapter(session)

    template.close()
    return HttpDetachClient(base_url, session_for_thread)
