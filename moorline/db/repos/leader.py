"""The leader lease: a named row of ``leader_leases`` that at most one process holds at a time.

``moorline.dispatch.leader`` elects the process that runs the periodic chores (the reaper) with
it. Expiry is by database time, so processes whose clocks disagree still agree on the holder.
"""

from sqlalchemy import delete, literal, select, update

from moorline.db.manager import DatabaseManager
from moorline.db.schema import leader_leases


class LeaderRepo:
    """Leader leases over one :class:`DatabaseManager`."""

    def __init__(self, db: DatabaseManager) -> None:
        self._db = db

    async def try_acquire_leader(self, name: str, holder: str, ttl_s: float) -> bool:
        """Hold (or keep holding) the leader lease ``name`` for ``ttl_s`` seconds of DB time.

        First a plain read: while another holder's lease is unexpired the answer is no, with
        no write transaction (a follower asks every tick; on SQLite a write would take the
        database's write lock each time). Otherwise three conditional statements, the first
        that changes a row wins: renew when ``holder`` holds it, take over when it expired,
        insert when absent. Concurrent callers are serialised by the row (or the primary key),
        so at most one holds it at a time.

        Returns:
            Whether ``holder`` holds the lease now.
        """
        lease = leader_leases.c
        backend = self._db.backend
        held_by_another = select(literal(1)).where(
            lease.name == name, lease.holder != holder, lease.expires_at > backend.now()
        )

        async def acquire() -> bool:
            async with self._db.connect() as conn:
                if (await conn.execute(held_by_another)).first() is not None:
                    return False
            expires = backend.now(plus_s=ttl_s)
            async with self._db.write_transaction() as conn:
                renewed = await conn.execute(
                    update(leader_leases)
                    .where(lease.name == name, lease.holder == holder)
                    .values(expires_at=expires)
                )
                if renewed.rowcount == 1:
                    return True
                taken = await conn.execute(
                    update(leader_leases)
                    .where(lease.name == name, lease.expires_at < backend.now())
                    .values(holder=holder, term=lease.term + 1, expires_at=expires)
                )
                if taken.rowcount == 1:
                    return True
                inserted = await conn.execute(
                    backend.insert_ignoring_duplicates(leader_leases).values(
                        name=name, holder=holder, term=1, expires_at=expires
                    )
                )
                return inserted.rowcount == 1

        return await self._db.with_retry(acquire)

    async def is_leader(self, name: str, holder: str) -> bool:
        """Whether ``holder`` holds the unexpired leader lease ``name`` by database time."""
        lease = leader_leases.c
        stmt = select(literal(1)).where(
            lease.name == name, lease.holder == holder, lease.expires_at > self._db.backend.now()
        )

        async def read() -> bool:
            async with self._db.connect() as conn:
                return (await conn.execute(stmt)).first() is not None

        return await self._db.with_retry(read)

    async def resign_leader(self, name: str, holder: str) -> bool:
        """Give up the leader lease so another process takes over without waiting the TTL."""
        lease = leader_leases.c

        async def resign() -> bool:
            async with self._db.write_transaction() as conn:
                result = await conn.execute(
                    delete(leader_leases).where(lease.name == name, lease.holder == holder)
                )
            return result.rowcount == 1

        return await self._db.with_retry(resign)
