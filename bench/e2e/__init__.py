"""Shared machinery of the end-to-end benchmarks: executor set-up, the request driver, time budget,
workloads, audit and reporting."""
