"""Shared benchmark code: one stream reader, load drivers, launcher, workloads, stats, report, plots."""
