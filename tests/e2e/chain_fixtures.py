"""The operators' alert chain, run for real on loopback: statsd_exporter -> Prometheus ->
Alertmanager -> a recording webhook.

- statsd_exporter: upstream's binary, found through the setting ``STATSD_EXPORTER`` (a path) or
  on ``PATH`` (``.ci/run`` puts ``../shared/bin`` there when that folder exists); loaded with
  ``ops/statsd/mapping.yml`` as shipped. No Debian package exists for it.
- Prometheus and Alertmanager: Debian's ``prometheus`` / ``prometheus-alertmanager``, installed by
  ``devtools/ensure_system_packages.sh`` where the machine allows it (root, apt-get).

A missing tool skips the suite with a message naming it (under ``PIN_REQUIRE_ALL=1``, as in CI,
that skip fails the run: ``tests/conftest.py``). Each daemon is our own process on loopback ports
with its own data directory under the test's temp dir, stopped by its pid. The Prometheus
config is generated here (1 s scrape and evaluation); the rules are ``ops/prometheus/alerts.yml``
as shipped, and Alertmanager runs ``ops/alertmanager/alertmanager.yml`` as shipped (its
timings scaled down: :data:`TEST_TIMINGS`), its receiver's URL pointed at the recording
webhook.

Every test gets a fresh chain (:func:`alert_chain`: new daemons, empty data directories, a new
receiver), so no test sees another's metrics or alerts. The ports are chosen once per session
(:func:`chain_ports`): the session's manual-runs Airflow (:func:`chain_airflow`) sends StatsD
and task alerts to them whichever chain is up.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from devtools.local_airflow import free_port, wait_for
from devtools.otlp_receiver import OtlpReceiver
from tests.e2e.loopback import RecordingWebhook
from tests.e2e.stack_fixtures import E2EAirflow, e2e_stack, running_e2e
from tests.unit.test_ops_promql import promql_series

REPO = Path(__file__).resolve().parents[2]
MAPPING = REPO / "ops" / "statsd" / "mapping.yml"
RULES = REPO / "ops" / "prometheus" / "alerts.yml"
ALERTMANAGER = REPO / "ops" / "alertmanager" / "alertmanager.yml"
ENSURE = REPO / "devtools" / "ensure_system_packages.sh"
STATSD_EXPORTER_ENV = "STATSD_EXPORTER"
# where a user gets the binary (README, "Layout"): the version the tests run with
STATSD_EXPORTER_VERSION = "v0.23.0"
STATSD_EXPORTER_HINT = (
    f"Debian has no package; upstream's release {STATSD_EXPORTER_VERSION} from "
    "github.com/prometheus/statsd_exporter/releases"
)
SCRAPE_SECONDS = 1


def find_statsd_exporter() -> str | None:
    configured = os.environ.get(STATSD_EXPORTER_ENV)
    if configured:
        return configured if os.access(configured, os.X_OK) else None
    return shutil.which("statsd_exporter")


def require_tools() -> dict[str, str]:
    """The three binaries, or skip naming what is missing."""
    exporter = find_statsd_exporter()
    if exporter is None and os.environ.get(STATSD_EXPORTER_ENV):
        pytest.skip(
            f"{STATSD_EXPORTER_ENV}={os.environ[STATSD_EXPORTER_ENV]} is not an executable file"
        )
    if exporter is None:
        pytest.skip(
            "statsd_exporter not found: put upstream's binary on PATH or set "
            f"{STATSD_EXPORTER_ENV}=/path/to/statsd_exporter ({STATSD_EXPORTER_HINT})"
        )
    done = subprocess.run(
        [
            "bash",
            str(ENSURE),
            "prometheus:prometheus",
            "prometheus-alertmanager:prometheus-alertmanager",
        ],
        capture_output=True,
        text=True,
        check=False,
        timeout=900,
    )
    if done.returncode != 0:
        pytest.skip(f"Prometheus/Alertmanager unavailable: {done.stderr.strip()}")
    return {
        "statsd_exporter": exporter,
        "prometheus": shutil.which("prometheus") or "prometheus",
        "alertmanager": shutil.which("prometheus-alertmanager") or "prometheus-alertmanager",
    }


def free_udp_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass(frozen=True)
class ChainPorts:
    """Where the chain listens (chosen once per session; each test's fresh chain reuses them)."""

    statsd: int  # UDP
    exporter_web: str
    prometheus_web: str
    alertmanager_web: str

    @classmethod
    def pick(cls) -> ChainPorts:
        return cls(
            free_udp_port(),
            f"127.0.0.1:{free_port()}",
            f"127.0.0.1:{free_port()}",
            f"127.0.0.1:{free_port()}",
        )

    def airflow_env(self) -> dict[str, str]:
        """StatsD to the exporter; task alerts also to Alertmanager (connection alertmanager)."""
        return {
            "AIRFLOW__METRICS__STATSD_ON": "True",
            "AIRFLOW__METRICS__STATSD_HOST": "127.0.0.1",
            "AIRFLOW__METRICS__STATSD_PORT": str(self.statsd),
            "AIRFLOW__METRICS__STATSD_PREFIX": "airflow",
            "AIRFLOW_CONN_ALERTMANAGER": json.dumps(
                {"conn_type": "http", "host": f"http://{self.alertmanager_web}"}
            ),
        }


@dataclass
class Daemon:
    """One of our own processes; ``start`` waits for its HTTP ``ready`` URL."""

    name: str
    args: list[str]
    ready_url: str
    log: Path
    proc: subprocess.Popen | None = None

    def start(self) -> None:
        out = self.log.open("ab")
        self.proc = subprocess.Popen(
            self.args, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )
        out.close()

        def ready() -> bool:
            if self.proc.poll() is not None:
                raise AssertionError(f"{self.name} exited: {self.log.read_text()[-2000:]}")
            return httpx.get(self.ready_url, timeout=2).status_code == 200

        wait_for(ready, timeout=60, what=f"{self.name} ready", retry_errors=True)

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.terminate()
        try:
            self.proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=10)

    def restart(self) -> None:
        self.stop()
        self.start()


@dataclass
class Chain:
    exporter: Daemon
    prometheus: Daemon
    alertmanager: Daemon
    receiver: RecordingWebhook
    ports: ChainPorts
    started_at: float = field(default_factory=time.time)

    @property
    def prometheus_url(self) -> str:
        return f"http://{self.ports.prometheus_web}"

    @property
    def alertmanager_url(self) -> str:
        return f"http://{self.ports.alertmanager_web}"

    # -- what Airflow needs ----------------------------------------------------------------

    def airflow_env(self) -> dict[str, str]:
        return self.ports.airflow_env()

    # -- Prometheus' query API -----------------------------------------------------------

    def query(self, expr: str, at: float | None = None) -> list[dict[str, Any]]:
        params: dict[str, Any] = {"query": expr}
        if at is not None:
            params["time"] = f"{at:.3f}"
        answer = httpx.get(f"{self.prometheus_url}/api/v1/query", params=params, timeout=10)
        body = answer.json()
        assert answer.status_code == 200 and body["status"] == "success", (expr, body)
        return body["data"]["result"]

    def value(self, expr: str, at: float | None = None) -> float | None:
        result = self.query(expr, at)
        return float(result[0]["value"][1]) if result else None

    def wait_series(self, expr: str, timeout: float = 30) -> list[dict[str, Any]]:
        return wait_for(lambda: self.query(expr), timeout=timeout, what=f"series {expr}")

    def rule_expr(self, alert: str) -> str:
        for group in yaml.safe_load(RULES.read_text())["groups"]:
            for rule in group["rules"]:
                if rule.get("alert") == alert:
                    return rule["expr"]
        raise KeyError(alert)

    def alert_states(self, since: float) -> dict[str, set[str]]:
        """Every rule that was pending or firing at any evaluation since ``since``."""
        window = max(int(time.time() - since) + 1, 2)
        found: dict[str, set[str]] = {}
        for series in self.query(f"max_over_time(ALERTS[{window}s])"):
            labels = series["metric"]
            found.setdefault(labels["alertname"], set()).add(labels["alertstate"])
        return found

    def scraped_since(self, since: float, scrapes: int = 3) -> None:
        """Wait until Prometheus has evaluated on a few scrapes newer than ``since``."""

        def enough() -> bool:
            newest = self.value('max(timestamp(up{job="statsd"}))')
            return newest is not None and newest > since + scrapes * SCRAPE_SECONDS

        wait_for(enough, timeout=60, what="fresh scrapes")
        time.sleep(2 * SCRAPE_SECONDS)  # and the rule evaluations over them

    # -- what the receiver got -----------------------------------------------------------

    def received(self) -> dict[str, list[dict[str, Any]]]:
        """Firing alerts the receiver got from Alertmanager, by alertname."""
        by_name: dict[str, list[dict[str, Any]]] = {}
        for notification in self.receiver.alerts():
            for alert in notification.get("alerts", []):
                if alert.get("status") == "firing":
                    by_name.setdefault(alert["labels"]["alertname"], []).append(alert)
        return by_name

    def wait_received(self, *names: str, timeout: float = 60) -> dict[str, list[dict]]:
        def arrived() -> dict | None:
            got = self.received()
            return got if all(n in got for n in names) else None

        try:
            return wait_for(arrived, timeout=timeout, what=f"alerts {names}")
        except TimeoutError:
            missing = set(names) - set(self.received())
            raise AssertionError(
                f"never reached the receiver: {sorted(missing)}; got {sorted(self.received())}"
            ) from None


def prometheus_config(exporter_web: str, alertmanager: str) -> dict[str, Any]:
    return {
        "global": {
            "scrape_interval": f"{SCRAPE_SECONDS}s",
            "evaluation_interval": f"{SCRAPE_SECONDS}s",
        },
        "rule_files": [str(RULES)],
        "alerting": {"alertmanagers": [{"static_configs": [{"targets": [alertmanager]}]}]},
        "scrape_configs": [{"job_name": "statsd", "static_configs": [{"targets": [exporter_web]}]}],
    }


# The shipped route's timings, scaled down for the tests (shipped: group_wait 30s,
# group_interval 2m, which tests/unit/test_ops_alertmanager.py checks): the order of events is
# the same (an alert waits group_wait before its group's first page; a later alert of the group
# pages at the next group_interval), only seconds instead of minutes. group_wait stays a few
# scrapes long, so a rule's alert still meets the task alert that inhibits it.
TEST_TIMINGS = {"group_wait": "5s", "group_interval": "15s"}


def alertmanager_config(receiver_url: str) -> dict[str, Any]:
    """``ops/alertmanager/alertmanager.yml`` as shipped (route, group_by, inhibit_rules), with
    :data:`TEST_TIMINGS`; its one receiver's URL points at the loopback receiver."""
    config = yaml.safe_load(ALERTMANAGER.read_text())
    for key, value in TEST_TIMINGS.items():
        assert key in config["route"], f"the shipped route has no {key}"
        config["route"][key] = value
    [pager] = config["receivers"]
    [webhook] = pager["webhook_configs"]
    webhook["url"] = receiver_url
    return config


def start_chain(
    tmp: Path, tools: dict[str, str], receiver: RecordingWebhook, ports: ChainPorts | None = None
) -> Chain:
    tmp.mkdir(parents=True, exist_ok=True)
    ports = ports or ChainPorts.pick()
    statsd_port = ports.statsd
    exporter_web = ports.exporter_web
    prom_web = ports.prometheus_web
    am_web = ports.alertmanager_web
    exporter = Daemon(
        "statsd_exporter",
        [
            tools["statsd_exporter"],
            f"--statsd.mapping-config={MAPPING}",
            f"--statsd.listen-udp=127.0.0.1:{statsd_port}",
            "--statsd.listen-tcp=",
            f"--web.listen-address={exporter_web}",
        ],
        f"http://{exporter_web}/metrics",
        tmp / "statsd_exporter.log",
    )
    (tmp / "alertmanager.yml").write_text(yaml.safe_dump(alertmanager_config(receiver.url)))
    alertmanager = Daemon(
        "alertmanager",
        [
            tools["alertmanager"],
            f"--config.file={tmp / 'alertmanager.yml'}",
            f"--storage.path={tmp / 'alertmanager-data'}",
            f"--web.listen-address={am_web}",
            "--cluster.listen-address=",  # no gossip port: a single local instance
        ],
        f"http://{am_web}/-/ready",
        tmp / "alertmanager.log",
    )
    (tmp / "prometheus.yml").write_text(yaml.safe_dump(prometheus_config(exporter_web, am_web)))
    prometheus = Daemon(
        "prometheus",
        [
            tools["prometheus"],
            f"--config.file={tmp / 'prometheus.yml'}",
            f"--storage.tsdb.path={tmp / 'prometheus-data'}",
            f"--web.listen-address={prom_web}",
        ],
        f"http://{prom_web}/-/ready",
        tmp / "prometheus.log",
    )
    started: list[Daemon] = []
    try:
        for daemon in (exporter, alertmanager, prometheus):
            daemon.start()
            started.append(daemon)
    except BaseException:
        for daemon in reversed(started):
            daemon.stop()
        raise
    return Chain(exporter, prometheus, alertmanager, receiver, ports)


def stop_chain(chain: Chain) -> None:
    for daemon in (chain.prometheus, chain.alertmanager, chain.exporter):
        daemon.stop()


@pytest.fixture(scope="session")
def chain_tools() -> dict[str, str]:
    return require_tools()


@pytest.fixture(scope="session")
def chain_ports() -> ChainPorts:
    return ChainPorts.pick()


@pytest.fixture
def alert_chain(tmp_path: Path, chain_tools, chain_ports: ChainPorts) -> Iterator[Chain]:
    """A fresh chain for one test (new daemons, empty storage, a new receiver)."""
    with RecordingWebhook() as receiver:
        chain = start_chain(tmp_path / "alert-chain", chain_tools, receiver, chain_ports)
        try:
            yield chain
        finally:
            stop_chain(chain)


# -- the manual-runs Airflow of the alert chain and the traces test --------------------------

OTEL_SERVICE = "pin-maintenance-e2e"


@pytest.fixture(scope="session")
def otlp() -> Iterator[OtlpReceiver]:
    """The loopback OTLP/HTTP receiver the manual-runs stack exports its traces to."""
    with OtlpReceiver() as receiver:
        yield receiver


@pytest.fixture(scope="session")
def chain_airflow(  # noqa: PLR0917 (pytest fixtures)
    tmp_path_factory: pytest.TempPathFactory,
    pg_admin_url: str,
    airflow_meta_template: str,
    e2e_job_server,
    e2e_selections,
    chain_ports: ChainPorts,
    otlp: OtlpReceiver,
) -> Iterator[E2EAirflow]:
    """A LocalExecutor Airflow with manual runs only, its StatsD and task alerts going to the
    chain's ports and its traces to :func:`otlp` (``[traces] otel_on``, OTLP/HTTP).

    Used by the alert chain's scheduler test and the traces test; each checks only runs it
    triggered itself (by run id) and, for metrics, a fresh chain of its own. When no chain is
    up (between tests, or without the tools), StatsD goes to a closed UDP port and an alert to
    a closed TCP port: neither fails a job.
    """
    e2e = e2e_stack(
        tmp_path_factory.mktemp("e2e-chain"),
        meta_admin_url=pg_admin_url,
        job_server=e2e_job_server,
        selections=e2e_selections,
        scheduled_runs=False,
        name="chain",
        extra_env={
            **chain_ports.airflow_env(),
            "AIRFLOW__TRACES__OTEL_ON": "True",
            "OTEL_TRACES_EXPORTER": "otlp_proto_http",
            "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": otlp.endpoint,
            "OTEL_SERVICE_NAME": OTEL_SERVICE,
            "OTEL_BSP_SCHEDULE_DELAY": "500",  # ms; the default 5 s only slows the test
        },
    )
    with running_e2e(e2e, meta_template=airflow_meta_template, what="the chain/traces stack"):
        yield e2e


# -- the dashboard's panels on a chain's metrics ---------------------------------------------

# The series the job code emits (ops/metrics.yml), and Airflow's own dagrun metrics.
JOB_METRICS = ("news_snapshot_detach_", "calendar_slot_expiration_", "activity_retention_")
SCHEDULER_METRICS = ("airflow_dagrun_",)


def panel_queries() -> list[tuple[str, str]]:
    dashboard = json.loads((REPO / "ops" / "grafana" / "pin-maintenance.json").read_text())
    return [
        (panel["title"], target["expr"])
        for panel in dashboard["panels"]
        for target in panel.get("targets", [])
    ]


def assert_panels_have_data(
    chain: Chain, prefixes: tuple[str, ...], *, not_fed: dict[str, str] | None = None
) -> None:
    """Every panel target whose series all start with ``prefixes`` (the metrics of the runs
    just made, on this chain) evaluates without error and has data, unless ``not_fed`` lists
    it (by expression) with its reason; its series must have been scraped, too."""
    not_fed = not_fed or {}
    # a rate() panel needs two samples of its series: the runs' last ones may have had one scrape
    chain.scraped_since(time.time(), scrapes=2)
    produced = {s["metric"]["__name__"] for s in chain.query('{__name__=~".+", job="statsd"}')}
    checked, empty = 0, []
    for title, expr in panel_queries():
        series = promql_series(expr)
        if not series or not all(name.startswith(prefixes) for name in series):
            continue
        result = chain.query(expr.replace("$__rate_interval", "1m"))  # raises on an error
        if expr in not_fed:
            continue
        checked += 1
        if not result or not series <= produced:
            empty.append((title, expr, sorted(series - produced)))
    assert checked, f"no panel target is fed by {prefixes}"
    assert empty == [], f"panels with no data (title, expr, series never scraped): {empty}"
