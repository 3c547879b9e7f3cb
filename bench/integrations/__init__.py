"""kvbench inside other benchmark systems: the entry points their harness scripts call (one module each)."""
