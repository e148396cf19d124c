"""``devtools.local_airflow.stop_groups`` also ends the process groups that descendants of a
component moved to (LocalExecutor's task supervisors call ``setpgid``), as ``make down`` needs."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

from devtools.local_airflow import Proc, descendants, group_members, stop_groups, wait_for

# a "component" whose child leaves for a process group of its own and ignores SIGTERM
COMPONENT = textwrap.dedent(
    """
    import os, signal, subprocess, sys, time
    child = subprocess.Popen([sys.executable, "-c", '''
    import os, signal, time
    os.setpgid(0, 0)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    open(os.environ["READY"], "w").write(str(os.getpid()))
    time.sleep(600)
    '''])
    time.sleep(600)
    """
)


def test_stop_groups_reaches_child_process_groups(tmp_path: Path) -> None:
    ready = tmp_path / "ready"
    popen = subprocess.Popen(
        [sys.executable, "-c", COMPONENT],
        env={**os.environ, "READY": str(ready)},
        start_new_session=True,
    )
    proc = Proc("component", popen.pid, popen.pid, str(tmp_path / "log"), popen)
    try:
        # retry_errors: the file is missing until the child writes it
        child = int(wait_for(ready.read_text, timeout=30, what="child started"))
        assert child in descendants([popen.pid])
        assert os.getpgid(child) == child != popen.pid

        killed = stop_groups([proc], grace=2)

        assert killed == [f"component: process group {child}"]  # SIGTERM ignored: SIGKILLed
        assert popen.poll() is not None
        assert wait_for(lambda: not group_members(child), timeout=10, what="child gone")
    finally:  # whatever the outcome, nothing of this test keeps running
        groups = [popen.pid]
        if ready.exists() and ready.read_text().isdigit():
            groups.append(int(ready.read_text()))
        for pgid in groups:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pgid, signal.SIGKILL)
        popen.wait(timeout=10)
