"""The SQLite WAL checkpointer: copies the log back into the database off the write path.

SQLite's automatic checkpoint runs inside the commit that crosses its threshold, which then
takes as long as copying the log and syncing the database file, while it holds this process's
write queue and, with statements run inline, the event loop. The
:class:`~moorline.db.backends.sqlite.SQLiteBackend` turns it off (``wal_autocheckpoint=0``)
and asks :meth:`WalCheckpointer.after_write` instead, which runs the same checkpoint on a
thread of its own, over a connection of its own: nobody waits for it.
"""

import asyncio
import logging
import os
import sqlite3

logger = logging.getLogger(__name__)

CHECKPOINT_WAL_BYTES = 4 * 1024 * 1024
"""Growth of the WAL past which the checkpointer copies the log back into the database file.

About SQLite's own default (1,000 pages of 4 KiB)."""
TRUNCATE_WAL_BYTES = 64 * 1024 * 1024
"""WAL size past which the checkpointer also waits (up to a second) for readers to move on.

A PASSIVE checkpoint never waits, so overlapping readers that never all finish at once (SSE
streams, dashboards) can keep the log from ever starting over, and it would grow without
bound. Past this size the checkpoint is TRUNCATE: it waits for the readers of older
snapshots, then empties the file."""
WAL_KEPT_BYTES = 1024 * 1024
"""``journal_size_limit``: what the WAL file is cut back to when the log starts over after a
checkpoint (the first commit of the new log cuts it to the larger of this and what it wrote).

SQLite otherwise reuses the file from its start and never shrinks it, and its size, which the
checkpointer goes by, would no longer say how much log there is. Below
:data:`CHECKPOINT_WAL_BYTES`, so that a file cut back is never taken for a log due for a
checkpoint; not zero, so that the next megabyte of log overwrites rather than grows the file."""


class WalCheckpointer:
    """Watches one database file's WAL and checkpoints it when it has grown enough."""

    def __init__(self, database: str) -> None:
        """Watch ``database``'s ``-wal`` file; nothing runs before :meth:`after_write`."""
        self.database = database
        self.wal_path = f"{database}-wal"
        self._task: asyncio.Task[bool] | None = None
        self._checkpointed_bytes = 0
        """The WAL's size when the last checkpoint that copied all the log it found began."""

    def wal_bytes(self) -> int:
        """Size of the WAL file (0 when there is none)."""
        try:
            return os.path.getsize(self.wal_path)
        except FileNotFoundError:
            return 0  # checkpointed away, or not written yet

    def after_write(self) -> None:
        """After a write: start a checkpoint when the WAL has grown by its size since the last.

        PASSIVE copies what no reader still needs and stops, so it never blocks a reader or a
        writer; the stat is a couple of microseconds against the write it follows.

        Due when the file has grown by :data:`CHECKPOINT_WAL_BYTES` since the last checkpoint
        that copied all the log it found began, not whenever it is that large: under a steady
        stream of writes the log never starts over (a checkpoint never ends with nothing
        written since it began), so the file stays past the size, and checkpoints would run
        back to back for the few commits since the one before, costing CPU on the core the
        event loop shares. A checkpoint that fell short (a reader of an older snapshot) is
        tried again after the next write; the file reaching :data:`TRUNCATE_WAL_BYTES` still
        empties it.
        """
        task = self._task
        if task is not None:
            if not task.done():
                return
            self._task = None
            if task.cancelled() or task.exception() or not task.result():
                # Fell short (a reader on an older snapshot): try again after the next write.
                self._checkpointed_bytes = 0
        try:
            size = os.path.getsize(self.wal_path)
        except FileNotFoundError:
            return
        if size < self._checkpointed_bytes:
            # The log started over and its file was cut back (WAL_KEPT_BYTES).
            self._checkpointed_bytes = 0
        if size - self._checkpointed_bytes >= CHECKPOINT_WAL_BYTES:
            truncate = size >= TRUNCATE_WAL_BYTES
            self._checkpointed_bytes = size
            self._task = asyncio.create_task(
                asyncio.to_thread(checkpoint, self.database, truncate=truncate),
                name="moorline-sqlite-checkpoint",
            )

    async def close(self) -> None:
        """Wait for a checkpoint in progress to end."""
        if self._task is not None:
            await asyncio.gather(self._task, return_exceptions=True)


def checkpoint(database: str, *, truncate: bool) -> bool:
    """Copy the WAL back into ``database``: PASSIVE, or TRUNCATE (see the constants).

    Returns:
        Whether it copied all the log there was when it began (False: a reader of an older
        snapshot held some back, or the checkpoint could not run).
    """
    mode, timeout_s = ("TRUNCATE", 1.0) if truncate else ("PASSIVE", 0.0)
    try:
        connection = sqlite3.connect(database, timeout=timeout_s, isolation_level=None)
        try:
            busy, logged, copied = connection.execute(f"PRAGMA wal_checkpoint({mode})").fetchone()
        finally:
            connection.close()
    except sqlite3.Error as exc:
        # Another process checkpointing at this moment, say; the next write tries again.
        logger.debug("SQLite checkpoint skipped: %s", exc)
        return False
    return bool(busy == 0 and logged == copied)
