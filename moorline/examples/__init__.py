"""Example workflows bundled with Moorline (the default ``--app``)."""
