"""Database connections give up on data left unacknowledged (``TCP_USER_TIMEOUT``).

Behind a partition that drops packets a statement would otherwise wait until TCP gives up,
about 15 minutes (the API hung instead of answering 503). The partition itself is injected in
``tests/faults/test_partitions.py``; this checks every pooled connection carries the bound.
"""

import socket

import pytest

from moorline.db.dsn import UNACKNOWLEDGED_TIMEOUT_S
from moorline.db.manager import DatabaseManager


@pytest.mark.requires("server")
async def test_every_pooled_connection_bounds_unacknowledged_data(db: DatabaseManager) -> None:
    for engine in db.engines:
        async with engine.connect() as conn:
            raw = (await conn.get_raw_connection()).driver_connection
            assert raw is not None
            transport = raw._transport if db.backend.name == "postgresql" else raw._writer.transport
            sock = transport.get_extra_info("socket")
            assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT) == int(
                UNACKNOWLEDGED_TIMEOUT_S * 1000
            )
