"""Datagram wake-ups (moorline.dispatch.datagrams) on real Unix sockets in a real directory.

Two "processes" are two DatagramWakeups objects on one directory, each with its own in-process
hub, so a wake-up can only cross between them as a datagram. The two-process test with real
``moorline serve`` and ``moorline worker`` processes is tests/e2e/test_wakeup_processes.py.
"""

import asyncio
import logging
import socket
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from moorline.db.manager import DatabaseManager
from moorline.dispatch.datagrams import SOCKET_SUFFIX, DatagramWakeups, directory_for
from moorline.dispatch.wakeups import BackgroundNotifier, LocalWakeups, make_wakeups
from moorline.settings import Settings
from tests.helpers import wait_for
from tests.integration.test_wakeups import LONG_S, REMOTE_WAKE_S, lane, waiting, woken_within

PING_S = 0.05


@pytest.fixture
def directory() -> Iterator[Path]:
    # Under /tmp, not pytest's tmp_path: a socket address holds at most 107 bytes of path.
    with tempfile.TemporaryDirectory(prefix="mlw") as folder:
        yield Path(folder) / "db.wakeups"


# Blocking file-system calls, kept out of the async tests (ruff ASYNC240).


def _entries(directory: Path) -> list[Path]:
    return list(directory.iterdir())


def _exists(path: Path) -> bool:
    return path.exists()


def _remove(path: Path) -> None:
    path.unlink()


def _leave_dead_socket(directory: Path) -> Path:
    """A socket file nobody is bound to: what a process killed with -9 leaves behind."""
    directory.mkdir(parents=True)
    dead = directory / "deadbeef.sock"
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        sock.bind(str(dead))
    return dead


def _listening_peer(directory: Path) -> socket.socket:
    """A socket bound where another process's listener binds, read by the test itself."""
    directory.mkdir(parents=True)
    peer = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    peer.bind(str(directory / f"peer{SOCKET_SUFFIX}"))
    peer.setblocking(False)
    return peer


async def test_the_submitters_hook_sends_its_datagram_before_it_returns(directory: Path) -> None:
    # A datagram never waits, so the Submitter's hook sends it itself: no task, no turn of the
    # event loop between a batch's commit and the other processes' wake-up.
    producer = DatagramWakeups(directory, ping_interval_s=PING_S)
    peer = _listening_peer(directory)
    try:
        name = lane()
        BackgroundNotifier(producer)({name})
        assert peer.recv(4096).decode("utf-8").endswith(f":{name}")
    finally:
        peer.close()
        await producer.close()


async def test_a_datagram_wakes_the_other_process(directory: Path) -> None:
    consumer = DatagramWakeups(directory, ping_interval_s=PING_S)
    producer = DatagramWakeups(directory, ping_interval_s=PING_S)
    await consumer.start()
    try:
        name = lane()
        task = await waiting(consumer, name)
        elapsed = await woken_within(task, lambda: producer.notify({name}))
        assert elapsed < REMOTE_WAKE_S, f"woke after {elapsed * 1000:.1f} ms"
        # The producer's own waiters were woken in-process; its own echo is not sent to it.
        assert await producer.wait(name, 0) is True
        assert await producer.wait(name, 0) is False
    finally:
        await consumer.close()
        await producer.close()
    assert _entries(directory) == []  # each listener removes its socket when it stops


async def test_a_dead_process_socket_is_removed_and_skipped(directory: Path) -> None:
    dead = _leave_dead_socket(directory)
    consumer = DatagramWakeups(directory, ping_interval_s=PING_S)
    producer = DatagramWakeups(directory)
    await consumer.start()
    try:
        name = lane()
        task = await waiting(consumer, name)
        await woken_within(task, lambda: producer.notify({name}))
        assert not _exists(dead)
    finally:
        await consumer.close()
        await producer.close()


async def test_a_removed_socket_is_bound_again(directory: Path) -> None:
    consumer = DatagramWakeups(directory, ping_interval_s=PING_S)
    producer = DatagramWakeups(directory)
    await consumer.start()
    try:
        _remove(Path(consumer.path))  # a clean-up script, say

        async def rebound() -> bool:
            return consumer.connections == 2 and _exists(Path(consumer.path))

        await wait_for(rebound, timeout_s=5.0, message="the listener to bind again")
        name = lane()
        task = await waiting(consumer, name)
        await woken_within(task, lambda: producer.notify({name}))
    finally:
        await consumer.close()
        await producer.close()


async def test_a_full_queue_drops_datagrams_and_the_listener_wakes_every_lane(
    directory: Path,
) -> None:
    consumer = DatagramWakeups(directory)
    producer = DatagramWakeups(directory)
    await consumer.start()
    try:
        name = lane()
        task = await waiting(consumer, name)
        # Thousands of sends while the consumer's loop cannot read (none of them yields): its
        # queue fills, the rest are dropped, each send returning at once; the wake-up for
        # ``name`` comes last and is dropped too, so only the overflow rule can wake it.
        async with asyncio.timeout(LONG_S):
            for _ in range(2000):
                await producer.publish({"a", "b"})
        await woken_within(task, lambda: producer.publish({name}))
    finally:
        await consumer.close()
        await producer.close()


@pytest.mark.parametrize("backend", ["sqlite"], indirect=True)
async def test_make_wakeups_uses_datagrams_on_a_sqlite_file(
    db: DatabaseManager, settings: Settings
) -> None:
    notifier, waiter = make_wakeups(settings, db)
    assert isinstance(notifier, DatagramWakeups) and notifier is waiter
    assert db.backend.shared_file is not None
    assert notifier.directory == directory_for(db.backend.shared_file)
    await waiter.close()
    in_memory = DatabaseManager(Settings(database_url="sqlite+aiosqlite:///:memory:"))
    try:
        assert type(make_wakeups(Settings(), in_memory)[0]) is LocalWakeups
    finally:
        await in_memory.dispose()


@pytest.mark.parametrize("backend", ["sqlite"], indirect=True)
async def test_an_unusable_directory_falls_back_to_the_poll_with_a_warning(
    db: DatabaseManager, settings: Settings, caplog: pytest.LogCaptureFixture
) -> None:
    assert db.backend.shared_file is not None
    directory = directory_for(db.backend.shared_file)
    directory.rmdir()  # made by the test above, whose wake-ups were this module's database's
    directory.write_text("a file, not a directory")
    try:
        with caplog.at_level(logging.WARNING, logger="moorline.dispatch.datagrams"):
            notifier, waiter = make_wakeups(settings, db)
        assert type(notifier) is LocalWakeups
        assert "wake-ups between processes on this SQLite file are off" in caplog.text
        # The poll still works: a wait ends on its timeout.
        assert await waiter.wait(lane(), 0.01) is False
    finally:
        directory.unlink()


async def test_a_path_too_long_for_a_socket_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="longer than a Unix socket address"):
        DatagramWakeups(tmp_path / ("x" * 120))
