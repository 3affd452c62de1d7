"""What ``bench/scale.py`` reads while a drain runs: CPU from ``/proc``, the servers' counters.

Linux only (``/proc``); the bench runs as a user who may read the database server's
``/proc/<pid>`` entries (root on the CI machine). Each backend's differences are its
:class:`Probe`: what the server says about the bench's database, and which of its processes or
threads serve it.
"""

import os
from dataclasses import dataclass
from pathlib import Path

from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncConnection


def cpu_s(stat: Path) -> float:
    """User + system CPU seconds of a process or thread (its ``/proc/.../stat``); 0 if gone."""
    try:
        fields = stat.read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    # After the command: state is field 3, utime and stime are fields 14 and 15.
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def host_jiffies() -> tuple[int, int]:
    """(busy, total) clock ticks of every CPU since boot, from ``/proc/stat``."""
    values = [int(value) for value in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    total = sum(values[:8])  # user nice system idle iowait irq softirq steal (guest is in user)
    return total - values[3] - values[4], total


def pid_of(command: str) -> int | None:
    """The first process whose ``comm`` is ``command``."""
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if (entry / "comm").read_text().strip() == command:
                    return int(entry.name)
            except OSError:
                continue
    return None


class Probe:
    """What a backend's server tells about the bench's database: SQLite tells nothing."""

    async def commits(self, conn: AsyncConnection) -> int | None:
        return None

    async def server_threads(self, conn: AsyncConnection) -> list[Path]:
        """The ``stat`` files of the server processes or threads serving the database."""
        return []


class PostgresProbe(Probe):
    async def commits(self, conn: AsyncConnection) -> int | None:
        query = "SELECT xact_commit FROM pg_stat_database WHERE datname = current_database()"
        return int((await conn.execute(text(query))).scalar_one())

    async def server_threads(self, conn: AsyncConnection) -> list[Path]:
        # A backend process per connection: the bench's own polling one left out.
        query = (
            "SELECT pid FROM pg_stat_activity"
            " WHERE datname = current_database() AND pid <> pg_backend_pid()"
        )
        return [Path(f"/proc/{pid}/stat") for pid in (await conn.execute(text(query))).scalars()]


class MariaDBProbe(Probe):
    def __init__(self) -> None:
        self.server = pid_of("mariadbd") or pid_of("mysqld")

    async def commits(self, conn: AsyncConnection) -> int | None:
        # COMMIT statements, server-wide: MariaDB keeps no count per database without the
        # performance schema. Handler_commit is no better: a read-only SELECT counts there too.
        row = (await conn.execute(text("SHOW GLOBAL STATUS LIKE 'Com_commit'"))).one()
        return int(row[1])

    async def server_threads(self, conn: AsyncConnection) -> list[Path]:
        # A thread per connection; MariaDB names its system thread id (TID).
        if self.server is None:
            return []
        query = (
            "SELECT TID FROM information_schema.PROCESSLIST"
            " WHERE DB = DATABASE() AND ID <> CONNECTION_ID()"
        )
        tids = (await conn.execute(text(query))).scalars()
        return [Path(f"/proc/{self.server}/task/{tid}/stat") for tid in tids]


PROBES: dict[str, type[Probe]] = {
    "postgresql": PostgresProbe,
    "mysql": MariaDBProbe,
    "sqlite": Probe,
}


@dataclass(frozen=True)
class Sample:
    """The counters at one moment of a drain."""

    at: float
    done: int
    commits: int | None
    workers_cpu: float
    server_cpu: dict[Path, float]
    redis_cpu: float
    host: tuple[int, int]
