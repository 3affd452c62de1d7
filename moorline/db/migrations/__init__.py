"""Alembic migrations for PostgreSQL and MySQL/MariaDB (SQLite uses ``create_all``).

A package so that ``env.py`` and ``versions/*.py`` ship in the wheel.
"""
