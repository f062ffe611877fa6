"""An aborted request keeps its slots while its transport still reads them (the real transport's
call runs on after the room failed): the executor drains it, then frees and reports.

The simulated peer reads nothing once failed, so a wrapper stands for a transport whose last
call has not returned yet: its sends stay "read" until the story lets them go."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from hicache_prefill.prefill.disagg.simulated import PeerConfig
from hicache_prefill.prefill.request.state import Outcome, Stage
from tests.prefill.executor_helpers import NOW, executor_args, prompt, step
from tests.support.harness import make_executor

pytestmark = pytest.mark.usefixtures("one_torch_thread")


class CallStillRunning:
    """A decode link whose sends are read until ``finish()`` (a call that has not returned)."""

    def __init__(self, peer: Any) -> None:
        self.peer = peer
        self.running = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self.peer, name)

    def send(self, *args: Any, **kwargs: Any) -> bool:
        ok = self.peer.send(*args, **kwargs)
        self.running = 1 if ok else self.running
        return ok

    def inflight_reads(self) -> int:
        return self.peer.inflight_reads() + self.running

    def finish(self) -> None:
        self.running = 0


def test_abort_keeps_slots_until_no_call_reads_them() -> None:
    ex = make_executor(executor_args(optimistic_prefill_attempts=0),
                       peer_config=PeerConfig(bootstrap_delay=NOW))  # fmt: skip
    ids = prompt(40)
    link = CallStillRunning(ex.decode.create_peer("a", len(ids), ids))
    ex.submit("a", ids, peer=link)
    while ex.stats.sends == 0:  # finalized at admission; a chunk boundary sends its pages
        step(ex)
    link.peer.fail("the decode peer failed mid-call (injected)")
    step(ex)
    (req,) = ex.draining_queue
    assert req.stage == Stage.DRAINING and req.slots is not None and "a" not in ex.results
    assert req.metadata_buffer_index >= 0  # the metadata row may be read too
    slots, own = req.slots.clone(), req.slots[req.tree_len :]
    for i in range(3):  # nothing is freed while the call runs, whatever else happens
        ex.submit(f"b{i}", prompt(12, seed=i))
        step(ex, 4)
        assert ex.draining_queue == [req] and torch.equal(req.slots, slots)
        assert own.numel() == 0 or ex.allocator.is_allocated(own)
        assert req.last_node.lock_ref > 0
    link.finish()
    ex.run_until_idle(check=True)
    results = {r.rid: r for r in ex.pop_results()}
    assert results["a"].outcome == Outcome.ABORTED and "mid-call" in results["a"].error
    assert all(results[f"b{i}"].outcome == Outcome.SUCCESS for i in range(3))
    assert ex.stats.abort_drains == 1 and not ex.draining_queue
    assert ex.request_owned_slots() == 0
    ex.check_integrity()
