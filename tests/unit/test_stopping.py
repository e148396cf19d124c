"""The stop signal (pure; no DB)."""

from __future__ import annotations

import os
import signal
import threading
import time

from include.pin_maintenance.stopping import StopSignal


def test_sigterm_sets_signal_and_chains_previous_handler():
    seen = []
    previous = signal.signal(signal.SIGTERM, lambda s, f: seen.append(s))
    try:
        stop = StopSignal()
        with stop.on_sigterm():
            os.kill(os.getpid(), signal.SIGTERM)
            assert stop.is_set()
            assert stop.reason == "SIGTERM received"
        assert seen == [signal.SIGTERM]
        # the previous handler is back in place after the block
        os.kill(os.getpid(), signal.SIGTERM)
        assert seen == [signal.SIGTERM, signal.SIGTERM]
    finally:
        signal.signal(signal.SIGTERM, previous)


def test_a_child_signal_follows_its_parent_but_not_the_other_way():
    run = StopSignal()
    loop = StopSignal(parent=run)
    assert not loop.is_set()

    run.set("SIGTERM received")
    assert loop.is_set() and loop.reason == "SIGTERM received"

    other_run = StopSignal()
    sibling = StopSignal(parent=other_run)
    sibling.set("runner 2 failed")
    assert sibling.is_set() and sibling.reason == "runner 2 failed"
    assert not other_run.is_set() and other_run.reason == ""


def test_wait_wakes_on_the_signal_or_on_its_parent():
    run = StopSignal()
    loop = StopSignal(parent=run)
    assert loop.wait(0.01) is False
    threading.Timer(0.05, run.set, args=("SIGTERM received",)).start()
    started = time.monotonic()
    assert loop.wait(10) is True
    assert time.monotonic() - started < 5
    assert loop.reason == "SIGTERM received"
    late = StopSignal(parent=run)  # made after its parent was set
    assert late.wait(0) is True
