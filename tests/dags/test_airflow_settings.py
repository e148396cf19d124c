"""``airflow_settings.yaml`` (``astro dev start`` imports it) holds every connection and Variable
the DAGs read, derived here from the code, with local dummy values only.

- Connections: every ``*CONN_ID`` string constant of the runtime code, and every string literal
  passed as a ``*conn_id`` argument or default.
- Variables: the JSON config Variable of each job (``ConfigSpec.job``) and the deadline
  Variable of each DAG's deadline reference (from the DagBag), valued so that local runs
  behave as the code defaults do.
"""

from __future__ import annotations

import ast
import importlib
import json
import pkgutil
from pathlib import Path
from urllib.parse import urlparse

import pytest
import yaml

from include.pin_maintenance import jobs
from include.pin_maintenance.config import ConfigSpec
from tests.unit.test_runtime_imports import runtime_files

pytestmark = pytest.mark.dags

REPO = Path(__file__).resolve().parents[2]
LOCAL_HOSTS = {"host.docker.internal", "localhost", "127.0.0.1"}


@pytest.fixture(scope="module")
def settings() -> dict:
    return yaml.safe_load((REPO / "airflow_settings.yaml").read_text())["airflow"]


def connection_ids_in_code() -> dict[str, str]:
    """conn_id -> where the code names it."""
    found: dict[str, str] = {}

    def note(value: ast.AST, path: Path) -> None:
        if isinstance(value, ast.Constant) and isinstance(value.value, str):
            found.setdefault(value.value, f"{path.relative_to(REPO)}:{value.lineno}")

    for path in runtime_files():
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Assign):
                names = [t.id for t in node.targets if isinstance(t, ast.Name)]
                if any(n == "CONN_ID" or n.endswith("_CONN_ID") for n in names):
                    note(node.value, path)
            elif isinstance(node, ast.Call):
                for kw in node.keywords:
                    if kw.arg and kw.arg.endswith("conn_id"):
                        note(kw.value, path)
            elif isinstance(node, ast.FunctionDef):
                args = node.args.args[-len(node.args.defaults) :] if node.args.defaults else []
                for arg, default in zip(args, node.args.defaults, strict=True):
                    if arg.arg.endswith("conn_id"):
                        note(default, path)
    return found


def config_specs() -> list[ConfigSpec]:
    specs = []
    for info in pkgutil.iter_modules(jobs.__path__):
        module = importlib.import_module(f"{jobs.__name__}.{info.name}")
        specs += [v for v in vars(module).values() if isinstance(v, ConfigSpec)]
    return list({s.job: s for s in specs}.values())


def deadline_variables(dagbag) -> dict[str, int]:
    """Variable -> default seconds, from every DAG's deadline references."""
    assert dagbag.import_errors == {}  # else a DAG, and its Variable, would be missing here
    found = {}
    for dag in dagbag.dags.values():
        alerts = dag.deadline if isinstance(dag.deadline, list) else [dag.deadline]
        for alert in filter(None, alerts):
            variable = getattr(alert.reference, "variable", None)
            if variable:
                found[variable] = alert.reference.default_seconds
    return found


def test_the_derivations_find_what_they_look_for(dagbag) -> None:
    # Guards against a scan that silently finds nothing (the lists themselves are not here).
    assert len(connection_ids_in_code()) >= 4
    assert len(config_specs()) >= 3
    assert len(deadline_variables(dagbag)) >= 3


def test_every_connection_the_code_names_is_in_the_settings(settings) -> None:
    in_code = connection_ids_in_code()
    in_settings = {c["conn_id"] for c in settings["connections"]}
    missing = {c: where for c, where in in_code.items() if c not in in_settings}
    assert missing == {}, "add to airflow_settings.yaml: " + json.dumps(missing)
    assert in_settings <= set(in_code), f"not read by any code: {in_settings - set(in_code)}"


def test_connections_point_at_local_dummies_only(settings) -> None:
    for conn in settings["connections"]:
        host = conn["conn_host"]
        host = urlparse(host).hostname if "://" in host else host
        assert host in LOCAL_HOSTS, (conn["conn_id"], host)


def test_every_variable_the_dags_read_is_in_the_settings_and_behaves_as_the_default(
    settings, dagbag
) -> None:
    values = {v["variable_name"]: v["variable_value"] for v in settings["variables"] or []}
    expected = {spec.job for spec in config_specs()} | set(deadline_variables(dagbag))
    assert set(values) == expected
    for spec in config_specs():
        assert spec.resolve(values[spec.job], {}) == spec.defaults, spec.job
    for variable, default_seconds in deadline_variables(dagbag).items():
        assert int(values[variable]) == default_seconds, variable
