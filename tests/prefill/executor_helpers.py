"""Builders and checks shared by the executor tests (``test_executor*``, ``test_review_executor``).

- :func:`executor_args`: the small CPU ``ServerArgs`` every story starts from (page 4, 256
  device tokens, chunks of 16, float32, ``--disaggregation-mode prefill``, 2 optimistic
  attempts), keyword arguments overriding any field; :data:`WRITE_THROUGH` adds L2 under
  ``write_through`` with optimistic prefill allowed there.
- :data:`NEVER` / :data:`NOW`: bootstrap delays of a peer that never gets ready on its own (a
  story drives it) and of one ready at once.
- :func:`prompt`: seeded token ids of the tiny model's vocabulary.
- :func:`step`: executor steps, ``check_integrity`` after each.
- :func:`assert_drained` / :func:`finish`: the clean end state of a story (nothing held, nothing
  leaked, nothing speculative in L2).
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from hicache_prefill.prefill.disagg.simulated import DelayDistribution
from hicache_prefill.prefill.executor import OptimisticPrefillExecutor
from hicache_prefill.server_args import ServerArgs

logger = logging.getLogger(__name__)

BASE_ARGS: dict[str, Any] = dict(
    page_size=4, max_total_tokens=256, chunked_prefill_size=16, device="cpu", dtype="float32",
    disaggregation_mode="prefill", optimistic_prefill_attempts=2,
)  # fmt: skip

NEVER = DelayDistribution("fixed", 1e9)
NOW = DelayDistribution("fixed", 0.0)

WRITE_THROUGH: dict[str, Any] = dict(
    enable_hierarchical_cache=True, hicache_write_policy="write_through",
    optimistic_prefill_write_through=True,
)  # fmt: skip


def executor_args(**overrides: Any) -> ServerArgs:
    """``ServerArgs`` of :data:`BASE_ARGS` with ``overrides`` (any field, base ones included)."""
    return ServerArgs(**{**BASE_ARGS, **overrides})


def prompt(n: int, seed: int = 0) -> list[int]:
    """``n`` token ids in ``[0, 512)``, seeded."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 512, (n,), generator=g).tolist()


def step(ex: OptimisticPrefillExecutor, n: int = 1) -> None:
    """``n`` executor steps, ``check_integrity`` after each."""
    for _ in range(n):
        ex.step()
        ex.check_integrity()


def assert_drained(ex: OptimisticPrefillExecutor) -> None:
    """After the cache's pending events: integrity holds, the executor is idle with no request,
    request-owned slot or tree lock left, every metadata buffer is free, and no speculative page
    is in L2."""
    ex.drain_cache_events()
    ex.check_integrity()
    assert ex.is_idle() and not ex.requests and ex.request_owned_slots() == 0
    assert all(node.lock_ref == 0 for node in ex.tree.all_nodes()), "a lock leaked"
    assert ex.metadata.available_size() == ex.metadata.size
    assert ex.stats.speculative_l2_pages == 0


def finish(ex: OptimisticPrefillExecutor) -> None:
    """Run until idle (integrity after every step), then :func:`assert_drained`."""
    ex.run_until_idle(max_steps=10_000, check=True)
    assert_drained(ex)
