"""The two apps of a rolling deploy: the old one runs ``alpha`` only, the new one ``beta`` only.

``--app tests.faults.served_apps:alpha_app`` or ``…:beta_app`` (``test_served_workflows``).
"""

from moorline.engine.context import Context
from moorline.engine.registry import Moorline

alpha_app = Moorline()
beta_app = Moorline()


@alpha_app.workflow("alpha")
async def alpha(ctx: Context) -> str:
    """A workflow only the old app has."""
    return "alpha"


@beta_app.workflow("beta")
async def beta(ctx: Context) -> str:
    """A workflow only the new app has."""
    return "beta"
