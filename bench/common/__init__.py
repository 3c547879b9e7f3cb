"""Foundations the adapters and the harness stand on: files, environments, hardware, model files, statistics."""
