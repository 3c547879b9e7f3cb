"""Kept for existing imports: the report lives in the ``bench.reports`` package."""
from bench.reports import build, render  # noqa: F401
