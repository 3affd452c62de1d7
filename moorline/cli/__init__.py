"""Moorline."""
