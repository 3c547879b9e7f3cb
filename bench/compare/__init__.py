"""Comparing two runs: the statistics of a regression gate and its calibration."""
