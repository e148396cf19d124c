"""How ``make test`` splits the suite across pytest-xdist workers (tests/conftest.py)."""

from __future__ import annotations

from pathlib import Path

from tests import conftest

REPO = Path(__file__).resolve().parents[2]


def test_the_stack_tiers_share_one_group_and_everything_else_groups_by_module() -> None:
    group = conftest.xdist_group
    assert group("tests/e2e/test_scheduler.py::test_x") == conftest.STACK_GROUP
    assert group("tests/ui/test_operator_day.py::test_x[a]") == conftest.STACK_GROUP
    assert group("tests/e2e/test_alert_chain_scheduler.py::t") == conftest.STACK_GROUP
    assert group("tests/unit/test_config.py::test_x") == "tests/unit/test_config.py"
    assert group("tests/dags/test_demo.py::test_x") == "tests/dags/test_demo.py"


def test_stack_free_modules_exist_and_run_beside_the_stacks() -> None:
    assert conftest.STACK_FREE
    for path in conftest.STACK_FREE:
        assert (REPO / path).is_file(), path
        assert conftest.xdist_group(f"{path}::test_x") == path


def test_each_test_of_the_majors_tier_is_a_group_of_its_own() -> None:
    """Each major's inner run goes to whichever worker is free, beside the others."""
    first = "tests/majors/test_supported_majors.py::test_the_sql_facing_tests_pass_on[15]"
    second = "tests/majors/test_supported_majors.py::test_the_sql_facing_tests_pass_on[16]"
    assert conftest.xdist_group(first) == first != conftest.xdist_group(second)
    assert "majors" in conftest.XDIST_TIER_ORDER and "majors" in conftest.TIER_ORDER
