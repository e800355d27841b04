"""The serving benchmark's parts: workload, load generator, statistics, report, plots and launchers."""
