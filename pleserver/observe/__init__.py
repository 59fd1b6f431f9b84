"""Observability: statistics, the metrics port, the health socket, logs."""
