"""Every command the runbooks show is accepted, run as an operator would paste it.

``airflow ...`` commands run through the venv's Airflow CLI against a migrated metadata DB of
their own (SQLite) holding the serialized DAGs, with the runbook's placeholders filled in
(`<dag_id>` = every DAG, `<snapshot uuid>` = a uuid, `<json>` = a dry run / an empty config).
A trigger must create a run (its conf validated against the DAG's params by Airflow itself), a
Variable must hold a value the job's config accepts, and the ``python -c`` one-liner must print
the lock key the runbook quotes. A conf the DAG's params reject is refused, so "accepted" means
something.
"""

from __future__ import annotations

import json
import re
import shlex
import sqlite3
import subprocess
import sys
import uuid
from contextlib import closing
from pathlib import Path

import pytest

from devtools import airflow_env as ae
from include.pin_maintenance.jobs import activity_retention_config as retention_cfg
from include.pin_maintenance.jobs import slot_expiration_config as slot_cfg
from include.pin_maintenance.jobs import snapshot_detach_config as detach_cfg

REPO = Path(__file__).resolve().parents[2]
RUNBOOKS = REPO / "docs" / "runbooks"
DAG_IDS = sorted(p.stem for p in (REPO / "dags").glob("*.py"))
JOB_CONFIGS = {
    detach_cfg.JOB: detach_cfg.CONFIG,
    slot_cfg.JOB: slot_cfg.CONFIG,
    retention_cfg.JOB: retention_cfg.CONFIG,
}


def runbook_commands() -> list[tuple[str, str]]:
    """(runbook, command) for every `airflow ...` line of a bash block or inline code span."""
    found: list[tuple[str, str]] = []
    for path in sorted(RUNBOOKS.glob("*.md")):
        text = path.read_text()
        for block in re.findall(r"```bash\n(.*?)```", text, flags=re.S):
            joined = re.sub(r"\\\n\s*", "", block)
            found += [(path.name, line.strip()) for line in joined.splitlines() if line.strip()]
        prose = re.sub(r"```.*?```", "", text, flags=re.S)
        triggered = re.findall(r"airflow dags trigger (\w+)", text)
        for raw in re.findall(r"`([^`]+)`", prose):
            span = re.sub(r"\s+", " ", raw).strip()
            if span.startswith("airflow "):
                found.append((path.name, span))
            elif span.startswith("--conf ") and triggered:  # "the same with `--conf '...'`"
                found.append((path.name, f"airflow dags trigger {triggered[-1]} {span}"))
    return [(name, cmd) for name, cmd in found if not cmd.startswith("#")]


def expand(command: str) -> list[str]:
    """The command with its placeholders filled in; one per DAG when it says `<dag_id>`."""
    for i in range(command.count("<snapshot uuid>")):  # fixed values: the same on every call
        command = command.replace("<snapshot uuid>", str(uuid.UUID(int=0x4000_8000 + i)), 1)
    # a Variable `<dag_id>` is a job's config: the requeue DAG has none
    dag_ids = sorted(JOB_CONFIGS) if command.startswith("airflow variables") else DAG_IDS
    dags = dag_ids if "<dag_id>" in command else [None]
    out = []
    for dag in dags:
        filled = command if dag is None else command.replace("<dag_id>", dag)
        if "'<json>'" in filled:
            is_trigger = filled.startswith("airflow dags trigger")
            filled = filled.replace("'<json>'", "'{\"dry_run\": true}'" if is_trigger else "'{}'")
        out.append(filled)
    return out


COMMANDS = runbook_commands()


def test_the_runbooks_show_the_commands_they_are_known_to_show() -> None:
    kinds = {" ".join(shlex.split(cmd)[:3]) for _, cmd in COMMANDS}
    assert {
        "airflow dags trigger",
        "airflow variables set",
        "airflow dags list-import-errors",
    } <= kinds
    assert all("<" not in c for _, cmd in COMMANDS for c in expand(cmd)), "unfilled placeholder"


REJECTED = ["dags", "trigger", "news_snapshot_detach_requeue", "--conf", '{"dry_run": "maybe"}']


def _cli_args(command: str) -> list[str]:
    args = shlex.split(command)
    assert args[0] == "airflow", command
    if args[1:] == ["tasks", "test"]:  # named as a thing people do, not a full command
        args.append("--help")
    if args[1:3] == ["dags", "test"]:  # runs the DAG on its job DB (none here): the dags tier
        return ["dags", "test", "--help"]  # runs `dags test <dag> --conf '{"dry_run": true}'`
    return args[1:]


@pytest.fixture(scope="module")
def batch(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """Every runbook command, run once against a fresh metadata DB with the DAGs serialized.

    One interpreter for all of them (tests/dags/airflow_cli_batch.py): ~20 s instead of ~4 min
    of CLI start-ups on a loaded machine. Returns results by command and the DB path.
    """
    home = tmp_path_factory.mktemp("airflow-runbook-commands")
    env = ae.airflow_env(home, job_db_url="postgresql:///unused")
    commands = [["db", "migrate"], ["dags", "reserialize"]]
    for _, command in COMMANDS:
        for filled in expand(command):
            commands.append(_cli_args(filled))
            if commands[-1][:2] == ["variables", "set"]:
                commands.append(["variables", "get", commands[-1][2]])
    commands.append(REJECTED)
    done = subprocess.run(
        [sys.executable, "-m", "tests.dags.airflow_cli_batch"],
        input=json.dumps(commands),
        env=env,
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    results = json.loads(done.stdout.strip().splitlines()[-1])
    assert results[0]["rc"] == 0 and results[1]["rc"] == 0, results[:2]
    return {"results": results, "db": home / "airflow.db"}


def _result(batch: dict, args: list[str], after: int = 0) -> dict:
    matches = [i for i, r in enumerate(batch["results"]) if r["args"] == args]
    assert matches, args
    return batch["results"][matches[0] + after]


def _runs(batch: dict) -> list[tuple[str, dict]]:
    # closing(): sqlite3's own context manager commits and leaves the connection open
    with closing(sqlite3.connect(batch["db"])) as conn:
        rows = conn.execute("select dag_id, conf from dag_run").fetchall()
    return [(dag, json.loads(conf) if isinstance(conf, str) else conf) for dag, conf in rows]


@pytest.mark.parametrize(("runbook", "command"), COMMANDS, ids=[c for _, c in COMMANDS])
def test_runbook_command_is_accepted(batch, runbook: str, command: str) -> None:
    for filled in expand(command):
        args = _cli_args(filled)
        done = _result(batch, args)
        assert done["rc"] == 0, f"{runbook}: `{filled}` failed:\n{done['stderr'][-3000:]}"
        if args[:2] == ["dags", "trigger"]:
            conf = json.loads(args[args.index("--conf") + 1]) if "--conf" in args else {}
            assert (args[2], conf) in _runs(batch), f"{filled}: no run with that conf"
        if args[:2] == ["variables", "set"]:
            key, value = args[2], args[3]
            got = _result(batch, args, after=1)
            assert got["rc"] == 0 and value.strip() in got["stdout"], got
            if key in JOB_CONFIGS:
                JOB_CONFIGS[key].resolve(value, None)  # the job accepts it (raises otherwise)
            else:
                assert key.endswith("_deadline_seconds") and float(value) > 0, key
        if args == ["plugins"]:  # the deadline runbook's check: the project's plugin is loaded
            assert "pin_maintenance" in done["stdout"], done["stdout"]
        if args[:2] == ["dags", "list-import-errors"]:
            for dag in DAG_IDS:
                assert f"{dag}.py" not in done["stdout"] + done["stderr"], done


def test_a_conf_the_params_reject_is_refused(batch) -> None:
    done = _result(batch, REJECTED)
    assert done["rc"] != 0
    assert "dry_run" in done["stderr"]
    assert ("news_snapshot_detach_requeue", {"dry_run": "maybe"}) not in _runs(batch)


def test_variable_examples_are_configs_the_jobs_accept() -> None:
    """`{"batch_size": 2000, ...}` quoted next to "the Variable `<dag_id>`"."""
    checked = 0
    for path in sorted(RUNBOOKS.glob("*.md")):
        prose = re.sub(r"```.*?```", "", path.read_text(), flags=re.S)
        for para in re.split(r"\n\s*\n|\n(?=\s*- )", prose):
            dags = [d for d in JOB_CONFIGS if f"Variable `{d}`" in para]
            for span in re.findall(r"`(\{[^`]+\})`", para):
                if ":" not in span:
                    continue  # a set of key names (`{"alert", "severity", ...}`), not JSON
                assert len(dags) == 1, f"{path.name}: which DAG is {span} for?"
                JOB_CONFIGS[dags[0]].resolve(span, None)
                checked += 1
    assert checked >= 2


def test_lock_key_one_liner_prints_the_key_the_runbook_quotes() -> None:
    text = (RUNBOOKS / "snapshot-detach-worker-stopped.md").read_text()
    m = re.search(r"lock_key\('([^']+)'\) = (-?\d+)", text)
    one_liner = re.search(r'python -c "([^"]+)"', text).group(1)
    name, key = m.group(1), int(m.group(2))
    code = one_liner.replace("'...'", repr(name))
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=False
    )
    assert done.returncode == 0, done.stderr
    assert int(done.stdout.strip()) == key
