"""The multi-process runner of the tensor-parallel tests: ``prefill.tp.launch`` (spawned ranks on
a gloo group, a watchdog that fails a hang with every rank's stack), re-exported."""

from __future__ import annotations

from prefill.tp.launch import DEFAULT_TIMEOUT_S, RanksFailed, RanksHung, free_port, run_ranks

__all__ = ["DEFAULT_TIMEOUT_S", "RanksFailed", "RanksHung", "free_port", "run_ranks"]
