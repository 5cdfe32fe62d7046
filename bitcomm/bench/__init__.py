"""Benchmarks: functions that measure and return rows; the CLI prints and saves them."""
