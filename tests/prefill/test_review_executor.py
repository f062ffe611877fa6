"""Regression stories for bugs an independent review of the executor found (both fixed):

1. a transfer failure of an earlier chunk made the last send raise out of ``step()`` instead of
   aborting the request (a send to a failed peer is now dropped and the request aborts);
2. the executor used ``optimistic_prefill_attempts`` outside ``--disaggregation-mode prefill``,
   where the gate does not run, so it speculated under ``write_through``.

CPU only, tiny model, virtual clock.
"""

from __future__ import annotations

import pytest

from hicache_prefill.prefill.disagg.simulated import PeerConfig
from hicache_prefill.prefill.request.state import Outcome
from tests.prefill.executor_helpers import NEVER, NOW, executor_args, prompt
from tests.support.harness import make_executor

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.mark.parametrize("attempts", [0, 2], ids=["plain-PD", "optimistic"])
def test_failed_earlier_chunk_transfer_aborts_instead_of_crashing_at_the_last_send(attempts):
    # Peer ready at once (finalized at admission); every send fails, acked at once (latency 0).
    # Step 1 computes [0, 16); step 2 sends [0, 16) at the boundary and computes [16, 24);
    # finishing, the executor sends [16, 24) to a peer that is Failed by now.
    ex = make_executor(
        executor_args(optimistic_prefill_attempts=attempts),
        peer_config=PeerConfig(
            bootstrap_delay=NOW, transfer_latency_s=0.0, transfer_failure_prob=1.0
        ),
    )
    ex.submit("a", prompt(24))
    ex.run_until_idle(max_steps=100, check=True)  # raises RuntimeError("a: send in state Failed")
    r = ex.result("a")
    assert r.outcome == Outcome.ABORTED and "transfer" in r.error
    assert ex.request_owned_slots() == 0
    assert all(node.lock_ref == 0 for node in ex.tree.all_nodes())


def test_executor_never_runs_optimistically_under_write_through():
    # docs/DESIGN.md section 7: by default optimistic prefill runs with L2 only under write_back.
    # Forgetting --disaggregation-mode=prefill skips the gate (as upstream, where the flag is
    # then unused), but this executor still uses the attempts and speculates under write_through.
    args = executor_args(disaggregation_mode="null", enable_hierarchical_cache=True)
    assert args.hicache_write_policy == "write_through"
    ex = make_executor(args, peer_config=PeerConfig(bootstrap_delay=NEVER))
    try:
        ex.submit("a", prompt(20))
        ex.step()
        assert ex.stats.optimistic_admissions == 0 and ex.stats.forward_passes == 0
    finally:
        ex.cache.close()
