"""One class per database: what each backend can do and the strategies that differ.

:class:`~moorline.db.backends.base.Backend` names every point where SQLite, PostgreSQL and
MySQL/MariaDB differ; :mod:`.sqlite`, :mod:`.postgresql` and :mod:`.mysql` implement them. The
rest of ``moorline.db`` asks the manager's ``backend`` (a :class:`Backend`) and its frozen
:class:`~moorline.db.backends.base.Capabilities`, and never tests a dialect name itself.

Imports: SQLAlchemy, the drivers, ``moorline.db.types``, ``moorline.db.dsn``,
``moorline.settings`` and ``moorline.errors``; never a repository.
"""

from moorline.db.backends.base import Backend, Capabilities, DialectName, backend_for

__all__ = ["Backend", "Capabilities", "DialectName", "backend_for"]
