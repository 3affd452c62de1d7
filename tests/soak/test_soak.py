"""The CI-sized chaos soak (under three minutes): see :mod:`tests.soak.chaos` for what it does.

Calibration (13 s), then 110 s of load at 70 % of the measured drain rate with two Redis
restarts, worker kills every 5-20 s and terminated database connections every 2-6 s.

``make soak`` runs the same soak for as long as asked (``MINUTES=...``).
"""

from pathlib import Path

import pytest

from tests.helpers import FULL_SIZE
from tests.servers import require_server
from tests.soak.chaos import SoakConfig, SoakResult, run_soak

RSS_GROWTH_LIMIT = 0.05


def failures(result: SoakResult) -> list[str]:
    """Every guarantee the soak broke, one sentence each (none: it held)."""
    found = []
    history = result.history
    assert history is not None
    if result.submitted == 0:
        found.append("nothing was submitted")
    if history.terminal != result.submitted:
        found.append(f"submitted {result.submitted} but {history.terminal} terminal")
    if not history.ok:
        found.append("the history checker found runs lost or doubled (above)")
    if history.statuses.keys() - {"succeeded"}:
        found.append(f"runs ended otherwise than succeeded: {dict(history.statuses)}")
    if result.keys_without_ttl:
        found.append(f"Redis keys without a TTL: {result.keys_without_ttl[:10]}")
    if not result.rss_growth:
        found.append("no RSS measured after warm-up")
    for name, growth in result.rss_growth.items():
        if growth >= RSS_GROWTH_LIMIT:
            found.append(f"{name}: RSS grew {growth:.1%} after warm-up")
    if result.kills == 0 or result.terminated_connections == 0:
        found.append("a kind of fault was never injected")
    if result.redis_restarts < result.planned_redis_restarts:
        found.append(
            f"Redis restarted {result.redis_restarts} times of {result.planned_redis_restarts}"
        )
    return found


@pytest.mark.faults
@pytest.mark.slow
@pytest.mark.timeout(2400 if FULL_SIZE else 900)  # CI: under 3 minutes, more with a backlog
def test_chaos_soak(tmp_path: Path) -> None:
    require_server("postgresql")
    config = SoakConfig(load_s=600.0) if FULL_SIZE else SoakConfig()
    result = run_soak(config, tmp_path)
    print(result.describe())
    assert not failures(result), result.describe()
