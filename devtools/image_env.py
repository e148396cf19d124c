"""The Astro image's Python environment without Docker: what ``astro dev pytest`` runs in.

The Astro runtime image (``Dockerfile``) carries Airflow, the providers its build installs from
``requirements.txt``, and pytest; nothing of ``requirements-dev.txt`` (no pytest-timeout, no
embedded Postgres, no ruff, no Celery pins). This builds that set as a virtualenv, so the
suite can check that it starts and passes there:

- ``requirements-airflow.txt`` (the runtime's Airflow, pinned equal to the image tag's line by
  tests/unit/test_project_files.py) + ``requirements.txt`` + :data:`RUNTIME_PYTEST`;
- plus the local distributions the Dockerfile installs (:data:`LOCAL_DISTRIBUTIONS`, those
  that exist), reinstalled whenever their files change.

The venv lives in ``.local/image-env/<key>`` where the key hashes the requirement files, the
pytest pin and the Python version; a later call with the same inputs reuses it (a build takes
about half a minute here, pip's cache warm). Older keys are removed when a new one is built.
It is built from the Python that runs this, or from the interpreter the setting
``PIN_IMAGE_PYTHON`` names: the Astro Runtime 3 images come with Python 3.11 or 3.12.

    python -m devtools.image_env build            # build or reuse it, print its path
    python -m devtools.image_env pytest [ARGS]    # pytest there, as astro dev pytest would

What the image adds that this does not: its OS packages (``packages.txt``, empty here) and
Astronomer's own extras (providers such as celery or openlineage, astronomer-providers-logging).
Those only add modules; the check here is that ours do not need anything the image lacks.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
ROOT = REPO / ".local" / "image-env"
REQUIREMENT_FILES = ("requirements-airflow.txt", "requirements.txt")
# The pytest of the Astro runtime 3.3 image could not be read here (no Docker; Astronomer
# publishes no package list for the image). Airflow's own constraints, which the runtime is
# built from, pinned pytest 8.3.5 for the 3.0 line; 8.3.5 is therefore the oldest pytest the
# Airflow 3 runtimes are known to carry. The .venv runs 9.x (requirements-dev.txt), so the two
# runs bracket the range. Check with: docker run --rm <image> pip show pytest
RUNTIME_PYTEST = "pytest==8.3.5"
# Directories with a pyproject.toml that the Dockerfile pip-installs into the image.
LOCAL_DISTRIBUTIONS = ("scheduler_plugin",)
COMPLETE = ".complete"
PYTHON_ENV = "PIN_IMAGE_PYTHON"
INSTALL_TIMEOUT_SECONDS = 1200


class ImageEnvError(RuntimeError):
    """Building the environment failed; the message carries pip's output."""


def key() -> str:
    """Hash of everything the base venv is built from."""
    digest = hashlib.sha256()
    for name in REQUIREMENT_FILES:
        digest.update(name.encode() + b"\0" + (REPO / name).read_bytes() + b"\0")
    digest.update(RUNTIME_PYTEST.encode())
    digest.update(base_python_version().encode())
    return digest.hexdigest()[:16]


def base_python() -> str:
    """The interpreter the venv is built from: ``PIN_IMAGE_PYTHON``, else this one."""
    return os.environ.get(PYTHON_ENV) or sys.executable


def base_python_version() -> str:
    python = base_python()
    try:
        done = subprocess.run(
            [python, "-c", "import sys; print(sys.version)"],
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
    except OSError as exc:
        raise ImageEnvError(f"{PYTHON_ENV}={python}: cannot run it ({exc})") from None
    if done.returncode != 0:
        raise ImageEnvError(f"{PYTHON_ENV}={python}: not a Python ({done.stderr.strip()})")
    return done.stdout.strip()


def local_distributions() -> list[Path]:
    return [REPO / d for d in LOCAL_DISTRIBUTIONS if (REPO / d / "pyproject.toml").is_file()]


def tree_hash(paths: list[Path]) -> str:
    """Hash of the files under ``paths`` (build output and caches left out)."""
    digest = hashlib.sha256()
    for root in paths:
        for path in sorted(root.rglob("*")):
            parts = set(path.relative_to(root).parts)
            if not path.is_file() or parts & {"__pycache__", "build", "dist"}:
                continue
            if any(p.endswith(".egg-info") for p in parts):
                continue
            digest.update(str(path.relative_to(REPO)).encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()[:16]


def python(venv: Path) -> Path:
    return venv / "bin" / "python"


def build(root: Path = ROOT) -> Path:
    """The venv for the current inputs: reused when complete, else (re)built. Returns its path."""
    root.mkdir(parents=True, exist_ok=True)
    venv = root / key()
    with _locked(root):
        if not (venv / COMPLETE).is_file():
            shutil.rmtree(venv, ignore_errors=True)
            for old in root.iterdir():
                if old.is_dir():
                    shutil.rmtree(old, ignore_errors=True)
            _run([base_python(), "-m", "venv", str(venv)], "create the venv")
            # as make venv does: the venv's bundled pip resolves this set in a third of the CPU
            # once upgraded (about 7 s against 25 s here)
            _pip(venv, ["install", "--quiet", "--upgrade", "pip"], "upgrade pip")
            reqs = [a for name in REQUIREMENT_FILES for a in ("-r", str(REPO / name))]
            _pip(venv, ["install", "--quiet", *reqs, RUNTIME_PYTEST], "install the requirements")
            (venv / COMPLETE).write_text(key() + "\n")
        _install_local_distributions(venv)
    return venv


def _install_local_distributions(venv: Path) -> None:
    dists = local_distributions()
    stamp = venv / ".local-distributions"
    wanted = tree_hash(dists) if dists else ""
    if not dists or (stamp.is_file() and stamp.read_text().strip() == wanted):
        return
    stamp.unlink(missing_ok=True)
    # --force-reinstall: a changed plugin keeps its version number; --no-deps + pip check: its
    # dependencies must already be in the requirements, as in the image.
    paths = [str(d) for d in dists]
    _pip(venv, ["install", "--quiet", "--no-deps", "--force-reinstall", *paths], "install plugins")
    for dist in dists:  # setuptools builds in the source tree (the Makefile cleans up alike)
        shutil.rmtree(dist / "build", ignore_errors=True)
        for info in dist.rglob("*.egg-info"):
            shutil.rmtree(info, ignore_errors=True)
    _pip(venv, ["check"], "check the installed dependencies")
    stamp.write_text(wanted + "\n")


def pytest_env(venv: Path, extra: dict[str, str] | None = None) -> dict[str, str]:
    """The environment ``astro dev pytest`` gives: the image's Python first, the repository
    importable (the image's working directory), nothing of the caller's venv, nor of its test
    run: not its xdist worker's variables, nor ``PIN_REQUIRE_ALL`` (the caller checks the image
    run's skips against an allow list of its own, tests/image's ``MAY_SKIP``)."""
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in {"VIRTUAL_ENV", "PYTHONHOME", "PIN_REQUIRE_ALL"}
        and not k.startswith("PYTEST_XDIST")
    }
    env["PATH"] = f"{venv / 'bin'}{os.pathsep}{env.get('PATH', '')}"
    env["PYTHONPATH"] = str(REPO)
    env.update(extra or {})
    return env


def run_pytest(
    venv: Path, args: list[str], *, env: dict[str, str] | None = None, timeout: float | None = None
) -> subprocess.CompletedProcess[str]:
    """``python -m pytest ARGS`` in ``venv`` from the repository root; output captured."""
    return subprocess.run(
        [str(python(venv)), "-m", "pytest", *args],
        cwd=REPO,
        env=pytest_env(venv, env),
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


@contextmanager
def _locked(root: Path) -> Iterator[None]:
    with (root / ".lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def _pip(venv: Path, args: list[str], what: str) -> None:
    _run([str(python(venv)), "-m", "pip", *args], what)


def _run(cmd: list[str], what: str) -> None:
    done = subprocess.run(
        cmd, capture_output=True, text=True, timeout=INSTALL_TIMEOUT_SECONDS, check=False
    )
    if done.returncode != 0:
        output = (done.stdout + done.stderr).strip()
        raise ImageEnvError(f"image env: could not {what} ({' '.join(cmd[:4])} ...):\n{output}")


def main(argv: list[str]) -> int:
    cmd = argv[1] if len(argv) > 1 else ""
    if cmd == "build":
        print(build())
        return 0
    if cmd == "pytest":
        venv = build()
        cmd_line = [str(python(venv)), "-m", "pytest", *argv[2:]]
        return subprocess.run(cmd_line, cwd=REPO, env=pytest_env(venv), check=False).returncode
    print(__doc__, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv))
