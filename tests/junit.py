"""What an inner pytest run's JUnit XML says of each test case (tests/image, tests/majors)."""

from __future__ import annotations

import xml.etree.ElementTree as ET
from pathlib import Path


def outcomes(junit: Path) -> list[tuple[str, str, str]]:
    """``(module, test name, outcome)`` per test case; the outcome is ``passed``, ``failed``
    or ``skipped: <why>``, the module dotted (``tests.dags.test_x``, a test class left out)."""
    result = []
    for case in ET.parse(junit).getroot().iter("testcase"):
        skipped = case.find("skipped")
        if skipped is not None:
            outcome = "skipped: " + (skipped.get("message") or "")
        elif case.find("failure") is not None or case.find("error") is not None:
            outcome = "failed"
        else:
            outcome = "passed"
        parts = case.get("classname", "").split(".")
        while parts and parts[-1][:1].isupper():  # Class of a method: keep the module
            parts.pop()
        result.append((".".join(parts), case.get("name", ""), outcome))
    return result
