"""The PostgreSQL majors the jobs run on, and the refusal of an older one before a run's first
statement (docs/deploying.md, "Supported PostgreSQL")."""

from __future__ import annotations

from include.pin_maintenance.telemetry import Alert

SUPPORTED_MAJORS = (15, 16, 17, 18)
ALERT = "database_server_unsupported"


def major_of(server_version: int) -> int:
    """``server_version_num`` (150018) as its major (15)."""
    return server_version // 10000


def describe(server_version: int) -> str:
    """``server_version_num`` as people write it: 150018 -> "15.18"."""
    return f"{server_version // 10000}.{server_version % 10000}"


def supported_range() -> str:
    return f"{SUPPORTED_MAJORS[0]} to {SUPPORTED_MAJORS[-1]}"


def is_supported(server_version: int) -> bool:
    """A lower major is refused; a higher one runs (with a warning: deploying.md says why)."""
    return major_of(server_version) >= SUPPORTED_MAJORS[0]


class UnsupportedServer(RuntimeError):
    """The job's database runs a major older than :data:`SUPPORTED_MAJORS`; nothing was read."""

    alert_event = ALERT  # the task_failed alert that follows names it (one page per event)

    def __init__(self, job: str, server_version: int) -> None:
        self.job, self.server_version = job, server_version
        super().__init__(
            f"{job}: the database runs PostgreSQL {describe(server_version)}; the jobs support "
            f"PostgreSQL {supported_range()}. Nothing was changed: run the job against a "
            'supported server (docs/deploying.md, "Supported PostgreSQL")'
        )

    def alert(self) -> Alert:
        return Alert(
            ALERT,
            "critical",
            f"{self.job}: the database runs PostgreSQL {describe(self.server_version)}, outside "
            f"the supported {supported_range()}; a configuration problem, nothing was changed",
            {
                "problem": "configuration",
                "server_version": describe(self.server_version),
                "supported": supported_range(),
            },
        )
