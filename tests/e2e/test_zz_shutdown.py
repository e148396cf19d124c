"""Last in the e2e session: stopping Airflow the way ``make down`` does leaves no process.

``devtools.local_airflow.cmd_down`` reads the stack's pid file and ends each component's whole
process group (LocalExecutor's task workers included, docs/design.md, "Known Airflow 3.3.2
behaviour"). Afterwards no process may carry this Airflow's AIRFLOW_HOME in its environment,
wherever it was reparented to.
"""

from __future__ import annotations

import pytest

from devtools.local_airflow import cmd_down, group_members
from tests.e2e.stack_fixtures import E2EAirflow, leftover_processes, wait_gone

pytestmark = [pytest.mark.e2e]


def test_make_down_leaves_no_airflow_process(airflow_e2e: E2EAirflow) -> None:
    stack = airflow_e2e.stack
    assert stack.pid_file.exists()
    groups = [p.pgid for p in stack.procs]
    assert leftover_processes(stack.home), "the stack should be running before the stop"

    assert cmd_down(stack.pid_file) == 0

    assert wait_gone(stack.home) == []
    assert [g for g in groups if group_members(g)] == []
    assert not stack.pid_file.exists()
