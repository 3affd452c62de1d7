"""How many bytes the run tables take on disk, for per-run storage figures.

Each database measures its own way, and the figure is a delta of two measurements over many
runs, so page-sized steps average out:

- PostgreSQL: ``pg_total_relation_size`` (heap, TOAST and indexes) of each run table;
- SQLite: the pages in use (``page_count - freelist_count``) of the whole file, as the last
  commit left them (the WAL included), times the page size;
- MariaDB: InnoDB's ``data_length + index_length`` after ``ANALYZE TABLE``: page-count
  estimates from its statistics, coarser than the other two.

Kept here rather than as a backend hook: nothing but the benchmarks asks, and a product code
path should not grow a statement only a measurement uses.
"""

from sqlalchemy import text

from moorline.db.manager import DatabaseManager

RUN_TABLES = ("runs", "events", "steps", "interrupts", "messages")
"""Where a run's record lives: its row, its events, checkpoints, interrupts and messages."""


async def stored_bytes(db: DatabaseManager) -> int:
    """Bytes the run tables (with their indexes) take now."""
    name = db.backend.name
    async with db.engine.connect() as conn:
        if name == "postgresql":
            parts = " + ".join(f"pg_total_relation_size('{table}')" for table in RUN_TABLES)
            return int((await conn.exec_driver_sql(f"SELECT {parts}")).scalar_one())
        if name == "sqlite":
            pages = (await conn.exec_driver_sql("PRAGMA page_count")).scalar_one()
            free = (await conn.exec_driver_sql("PRAGMA freelist_count")).scalar_one()
            size = (await conn.exec_driver_sql("PRAGMA page_size")).scalar_one()
            return int((pages - free) * size)
        await conn.exec_driver_sql(f"ANALYZE TABLE {', '.join(RUN_TABLES)}")
        listed = ", ".join(f"'{table}'" for table in RUN_TABLES)
        found = await conn.execute(
            text(
                "SELECT COALESCE(SUM(data_length + index_length), 0) "
                "FROM information_schema.TABLES WHERE table_schema = DATABASE() "
                f"AND table_name IN ({listed})"
            )
        )
        return int(found.scalar_one())
