"""Wake-ups between the processes that share one SQLite file: Unix datagrams in a directory.

SQLite has no LISTEN/NOTIFY and, without ``MOORLINE_REDIS_URL``, there is no Pub/Sub: a
separate ``moorline worker`` learnt of a new run only from its slow poll (1 s; trigger → start
p50 about 600 ms). Every process on the file's host can reach the directory next to the file,
so that is where they meet:

- a process that waits for work binds one ``SOCK_DGRAM`` Unix socket,
  ``<file>.wakeups/<id>.sock``, and removes it when it stops;
- a producer, after the commit that made runs claimable, sends one datagram (a line
  ``<origin>:<lane>`` per lane, the other transports' payload) to every socket in the directory
  but its own. Sends do not block: to a socket whose queue is full the datagram is dropped,
  and that listener, on reading a full queue, wakes all its lanes; a socket nobody is bound to
  any more (its process was killed) refuses the datagram and its file is removed.

Why datagrams and not a file-change notification: inotify is Linux-only and a watcher learns
that *something* changed, then must read what; a datagram is the message itself, delivered by
the kernel in microseconds, with no connection to keep and no state when a peer dies. Why not a
third-party message bus: it would be a server, which the embedded deployment exists to avoid.

The guarantees are the other transports': a hint, never the truth. A lost datagram costs a
worker its slow poll (``MOORLINE_POLL_INTERVAL``), never a run. A directory that cannot be used
(not creatable, or a path too long for a Unix socket address) is reported once at start and the
process falls back to the poll (:func:`datagram_wakeups_or_none`); a socket file removed from
under a listener is noticed at its next ping and bound again.
"""

import asyncio
import logging
import math
import os
import socket
import time
from pathlib import Path

from moorline.dispatch.wakeups import (
    NOTIFY_TIMEOUT_S,
    PING_INTERVAL_S,
    ListeningWakeups,
    LocalWakeups,
)

logger = logging.getLogger(__name__)

DIRECTORY_SUFFIX = ".wakeups"
"""The directory of sockets is the database file's path with this suffix."""

SOCKET_SUFFIX = ".sock"

MAX_SOCKET_PATH_BYTES = 107
"""Longest path a Unix socket address holds (``sun_path`` is 108 bytes on Linux, with its NUL;
104 on the BSDs and macOS, where a longer directory fails at bind and falls back the same way)."""

RECEIVE_BYTES = 4096
"""Largest datagram read: a line of an origin id and a lane name per lane."""

RELIST_S = 1.0
"""Longest a producer uses one listing of the directory, even if its mtime has not changed."""

QUEUE_LENGTH_FILE = "/proc/sys/net/unix/max_dgram_qlen"
DEFAULT_QUEUE_LENGTH = 10
"""Datagrams a Unix socket queues before senders get ``EAGAIN`` (Linux's
``net.unix.max_dgram_qlen``, often 10 or 512); where it cannot be read, the smallest usual."""


def queue_length() -> int:
    """How many datagrams a socket of this host queues (see :data:`DEFAULT_QUEUE_LENGTH`)."""
    try:
        return max(1, int(Path(QUEUE_LENGTH_FILE).read_text()))
    except (OSError, ValueError):
        return DEFAULT_QUEUE_LENGTH


def directory_for(database_file: str) -> Path:
    """The socket directory of the processes sharing ``database_file``."""
    return Path(f"{os.path.abspath(database_file)}{DIRECTORY_SUFFIX}")


class DatagramWakeups(ListeningWakeups):
    """Wake-ups across the processes of one host through Unix datagram sockets in a directory.

    ``notify`` wakes this process's waiters, then sends to every other process's socket;
    ``start`` binds this process's socket (``moorline worker`` and ``moorline serve`` start it,
    the latter even with ``--workers 0``, where a datagram wakes nothing; a process that only
    submits does not). The directory listing is re-read only when the
    directory's modification time changed (or a second has passed), so a notify costs one
    ``stat`` and one ``sendto`` per peer.
    """

    transport = "datagram"

    def __init__(
        self,
        directory: Path,
        *,
        hub: LocalWakeups | None = None,
        notify_timeout_s: float = NOTIFY_TIMEOUT_S,
        ping_interval_s: float = PING_INTERVAL_S,
    ) -> None:
        """Create datagram wake-ups; nothing is bound before ``start``.

        Args:
            directory: Where the sockets live (:func:`directory_for` the database file).
            hub: The in-process wake-ups to fan out to; a new one when None.
            notify_timeout_s: Longest a ``notify`` may take before it is given up.
            ping_interval_s: Seconds between checks that this process's socket file is there.

        Raises:
            ValueError: a socket path in ``directory`` would not fit a Unix socket address.
        """
        super().__init__(
            hub=hub, notify_timeout_s=notify_timeout_s, ping_interval_s=ping_interval_s
        )
        self.directory = directory
        self.path = str(directory / f"{self.hub.origin[:16]}{SOCKET_SUFFIX}")
        if len(os.fsencode(self.path)) > MAX_SOCKET_PATH_BYTES:
            raise ValueError(
                f"{self.path} is longer than a Unix socket address ({MAX_SOCKET_PATH_BYTES} bytes)"
            )
        self._sender: socket.socket | None = None  # made by the first notify
        self._queue_length = queue_length()
        self._listing_mtime_ns: int | None = None
        self._listed_at = -math.inf
        self._peers: list[str] = []

    # --- the producer side ----------------------------------------------------------------------

    def publish_now(self, lanes: set[str]) -> bool:
        """Send now: a datagram never waits (a peer whose queue is full does not get it)."""
        if lanes:
            try:
                self._send(sorted(lanes))
            except Exception as exc:
                if not self._is_transport_error(exc):
                    raise
                self._not_sent(lanes, exc)
        return True

    async def _publish(self, lanes: list[str]) -> None:
        self._send(lanes)

    def _send(self, lanes: list[str]) -> None:
        # One datagram for all the lanes, a payload per line: queues hold few datagrams.
        datagram = "\n".join(self._payload(lane) for lane in lanes).encode()
        sender = self._sender
        if sender is None:
            sender = self._sender = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
            sender.setblocking(False)
        for peer in self._list_peers():
            try:
                sender.sendto(datagram, peer)
            except BlockingIOError:
                pass  # its queue is full: dropped (the listener wakes every lane, see _read_all)
            except ConnectionRefusedError:
                self._remove_dead(peer)
            except FileNotFoundError:
                pass  # removed since the listing: that process stopped

    def _list_peers(self) -> list[str]:
        """The other processes' sockets, re-listed when the directory changed."""
        try:
            mtime_ns = os.stat(self.directory).st_mtime_ns
        except FileNotFoundError:
            return []
        now = time.monotonic()
        # Re-read at least every second too: on a file system with coarse timestamps two
        # changes within one tick leave the same mtime.
        if mtime_ns != self._listing_mtime_ns or now - self._listed_at > RELIST_S:
            self._listed_at = now
            with os.scandir(self.directory) as entries:
                self._peers = [
                    entry.path
                    for entry in entries
                    if entry.name.endswith(SOCKET_SUFFIX) and entry.path != self.path
                ]
            self._listing_mtime_ns = mtime_ns
        return self._peers

    def _remove_dead(self, peer: str) -> None:
        """Remove the file of a socket nobody is bound to (its process died without cleanup).

        Socket names are random, so no live process can have bound this name since.
        """
        logger.info("removing the wake-up socket %s of a process that is gone", peer)
        try:
            os.unlink(peer)
        except FileNotFoundError:
            pass

    # --- the listener side ----------------------------------------------------------------------

    async def _listen(self) -> None:
        self.directory.mkdir(parents=True, exist_ok=True)
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        sock.setblocking(False)
        loop = asyncio.get_running_loop()
        reading = False
        try:
            self._unlink_own()  # left from before a reconnect
            sock.bind(self.path)
            inode = os.stat(self.path).st_ino
            loop.add_reader(sock.fileno(), self._read_all, sock)
            reading = True
            self._on_listening()
            while True:
                await asyncio.sleep(self._ping_interval_s)
                if not self._is_bound_file(inode):
                    raise ConnectionResetError(f"the wake-up socket {self.path} was removed")
        finally:
            if reading:
                loop.remove_reader(sock.fileno())
            sock.close()
            self._unlink_own()

    def _read_all(self, sock: socket.socket) -> None:
        read = 0
        while True:
            try:
                data = sock.recv(RECEIVE_BYTES)
            except (BlockingIOError, InterruptedError):
                break
            except OSError:
                break  # closed under us: the listener loop notices at its next check
            read += 1
            for payload in data.decode("utf-8", "replace").splitlines():
                self._receive(payload)
        if read >= self._queue_length:
            # The queue may have been full, and a sender drops what does not fit: a lane whose
            # datagram was dropped must not wait for its poll, so every lane claims once.
            self.hub.wake_all()

    def _is_bound_file(self, inode: int) -> bool:
        try:
            return os.stat(self.path).st_ino == inode
        except FileNotFoundError:
            return False

    def _unlink_own(self) -> None:
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass

    def _is_transport_error(self, exc: Exception) -> bool:
        return isinstance(exc, OSError)

    async def _close_transport(self) -> None:
        sender, self._sender = self._sender, None
        if sender is not None:
            sender.close()


def datagram_wakeups_or_none(database_file: str) -> DatagramWakeups | None:
    """Datagram wake-ups next to ``database_file``, or None when its directory is unusable.

    Checked once here (created, writable, short enough for a socket address), so that an
    unusable directory is one warning at start, and the workers poll, rather than a listener
    that keeps failing to bind.
    """
    directory = directory_for(database_file)
    try:
        wakeups = DatagramWakeups(directory)
        directory.mkdir(parents=True, exist_ok=True)
        if not os.access(directory, os.W_OK | os.X_OK):
            raise PermissionError(f"{directory} is not writable")
    except (OSError, ValueError) as exc:
        logger.warning(
            "wake-ups between processes on this SQLite file are off, workers in other "
            "processes find new runs on their poll (MOORLINE_POLL_INTERVAL): %s",
            exc,
        )
        return None
    return wakeups
