"""A redis-server of one test's own, on a free port: stopped and restarted at will.

Faults against Redis (a restart, a crash) must never touch the shared server on 6379 that
other tests use. This server keeps nothing on disk, so a restart brings it back empty, as a
Redis without persistence does.
"""

import asyncio
import shutil
import socket
import subprocess
import time
from pathlib import Path

from redis.asyncio import Redis
from redis.exceptions import RedisError


class PrivateRedis:
    """``redis-server`` on 127.0.0.1 and a free port, its files in ``folder``."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            self.port: int = probe.getsockname()[1]
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.proc: subprocess.Popen[bytes] | None = None

    def launch(self) -> None:
        """Start the process; :meth:`wait_ready` waits until it answers."""
        with (self.folder / "redis.log").open("ab") as log:
            self.proc = subprocess.Popen(
                [
                    shutil.which("redis-server") or "redis-server",
                    *("--port", str(self.port), "--bind", "127.0.0.1"),
                    *("--save", "", "--appendonly", "no", "--dir", str(self.folder)),
                ],
                stdout=log,
                stderr=subprocess.STDOUT,
            )

    async def wait_ready(self, timeout_s: float = 10.0) -> None:
        """Until PING answers (a poll with a deadline)."""
        deadline = time.monotonic() + timeout_s
        while True:
            client = Redis.from_url(self.url)
            try:
                if await client.ping():
                    return
            except (OSError, RedisError):
                if time.monotonic() > deadline:
                    raise
            finally:
                await client.aclose()
            await asyncio.sleep(0.05)

    async def start(self) -> None:
        self.launch()
        await self.wait_ready()

    def stop(self) -> None:
        """kill -9: nothing is flushed, every key is gone."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)

    async def restart(self) -> None:
        """Gone for a moment, back empty."""
        self.stop()
        await self.start()
