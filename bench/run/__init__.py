"""Running a benchmark: cells, the runner, the row builder, samplers, telemetry, the estimate, validation."""
