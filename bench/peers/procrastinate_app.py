"""The Procrastinate side of the peer workload: a no-op task (PostgreSQL-durable, as Moorline).

Procrastinate marks a job ``succeeded`` in PostgreSQL when it has run; its own table is the
record of completion.
"""

import os

from procrastinate import App, PsycopgConnector

app = App(connector=PsycopgConnector(conninfo=os.environ.get("PEERS_PG", "")))


@app.task(name="noop")
async def noop() -> None:
    """Does nothing."""
