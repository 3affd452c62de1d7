"""Migration scripts, one per revision; Alembic skips this file."""
