"""``PIN_REQUIRE_ALL=1`` (set by .ci/run): a skip that ALLOWED_SKIPS does not list fails the run.

Runs a throwaway test module in a pytest subprocess with this suite's conftest loaded as a
plugin, once with the variable and once without.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests import conftest

REPO = Path(__file__).resolve().parents[2]
SKIPPING = """
import pytest

def test_needs_a_tool():
    pytest.skip("the-tool not found: put it on PATH")

def test_runs():
    assert True
"""


def _run(tmp_path: Path, require_all: str | None) -> subprocess.CompletedProcess[str]:
    (tmp_path / "test_skipping.py").write_text(SKIPPING)
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_XDIST")}
    env.pop("PIN_REQUIRE_ALL", None)
    if require_all is not None:
        env["PIN_REQUIRE_ALL"] = require_all
    env["PYTHONPATH"] = str(REPO)
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "tests.conftest", "-p", "no:cacheprovider",
         "-rA", str(tmp_path / "test_skipping.py")],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip


def test_a_skip_stays_a_skip_on_a_developer_machine(tmp_path: Path) -> None:
    done = _run(tmp_path, None)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "1 passed, 1 skipped" in done.stdout
    assert "the-tool not found" in done.stdout


@pytest.mark.parametrize("value", ["1", "true"])
def test_under_require_all_an_unlisted_skip_fails(tmp_path: Path, value: str) -> None:
    done = _run(tmp_path, value)
    assert done.returncode == 1, done.stdout + done.stderr
    assert "1 failed, 1 passed" in done.stdout
    assert "PIN_REQUIRE_ALL=1: this test may not skip" in done.stdout
    assert "the-tool not found" in done.stdout  # the skip's own reason is kept


def test_a_listed_skip_needs_its_module_and_its_reason(monkeypatch) -> None:
    monkeypatch.setattr(conftest, "ALLOWED_SKIPS", {"tests.x": "no GPU here"})
    assert conftest.allowed_skip("tests.x", "skipped: no GPU here (CI has none)")
    assert not conftest.allowed_skip("tests.x", "some other reason")
    assert not conftest.allowed_skip("tests.y", "no GPU here")
