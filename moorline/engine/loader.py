"""Find the user's :class:`~moorline.engine.registry.Moorline` app from ``MODULE:ATTR``."""

import importlib
import sys

from moorline.engine.registry import Moorline
from moorline.errors import ConfigError

DEFAULT_APP = "moorline.examples.app:app"
"""The bundled example app, used when neither ``--app`` nor ``MOORLINE_APP`` names one."""


def load_app(spec: str | None, *, app_dir: str | None = None) -> Moorline:
    """Import ``MODULE:ATTR`` and return the Moorline app it names.

    Args:
        spec: ``MODULE:ATTR``; None means the bundled example app.
        app_dir: a directory to import ``MODULE`` from before the rest of ``sys.path``. The
            CLI passes the working directory, as uvicorn and celery do: the ``moorline``
            script's ``sys.path`` holds its own directory, not the one it is run in, so
            ``moorline serve --app mywf:app`` beside ``mywf.py`` would not find it.

    Raises:
        ConfigError: one line saying what is wrong with ``spec``.
    """
    if app_dir is not None and app_dir not in sys.path:
        sys.path.insert(0, app_dir)
    spec = spec or DEFAULT_APP
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise ConfigError(f"--app {spec!r}: expected MODULE:ATTR, e.g. myproject.workflows:app")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ConfigError(f"--app {spec!r}: cannot import {module_name!r}: {exc}") from None
    try:
        app = getattr(module, attr)
    except AttributeError:
        raise ConfigError(f"--app {spec!r}: module {module_name!r} has no {attr!r}") from None
    if not isinstance(app, Moorline):
        raise ConfigError(f"--app {spec!r}: {attr!r} is a {type(app).__name__}, not a Moorline app")
    return app
