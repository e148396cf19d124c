"""A secrets backend whose service is down (tests only): every lookup raises, as a Vault or
cloud secrets manager outage does. Configured through ``AIRFLOW__SECRETS__BACKEND`` in a
subprocess by tests/unit/test_alerts_deadlines.py."""

from __future__ import annotations

from airflow.secrets import BaseSecretsBackend


class UnreachableSecretsBackend(BaseSecretsBackend):
    def get_variable(self, key: str) -> str | None:
        raise ConnectionError("secrets service unreachable")

    def get_conn_value(self, conn_id: str) -> str | None:
        raise ConnectionError("secrets service unreachable")
