"""Random sequences of backups, loads, evictions and polls with delayed CPU streams.

After every step: ``check_integrity()`` holds, and every device or host copy that is complete
(acked) holds its tokens' KV bit for bit, whatever the tree-like caller freed in between.
"""

from __future__ import annotations

import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hicache_prefill.hicache.memory.host_pool import SUPPORTED_LAYOUT_IO
from tests.hicache.transfer.test_controller import make
from tests.support.kv_content import check_device, check_host, write_device

OPS = ("new", "backup", "load", "load", "start", "poll", "evict_device", "evict_host", "wait")
CONFIGS = [
    (layout, io, mla, page)
    for i, (layout, io) in enumerate(sorted(SUPPORTED_LAYOUT_IO))
    for mla, page in [((i % 2) == 0, 1 if i < 2 else 4)]
]


class Seg:
    """A run of slots in one tier and the (tokens, positions) it holds once ready."""

    def __init__(self, slots: torch.Tensor, tokens: torch.Tensor, ready: bool) -> None:
        self.slots, self.tokens, self.ready = slots, tokens, ready
        self.positions = torch.arange(tokens.numel())


@pytest.mark.parametrize("layout,io,mla,page", CONFIGS)
@settings(max_examples=20, deadline=None)
@given(steps=st.lists(st.integers(0, 10**6), min_size=15, max_size=50), seed=st.integers(0, 2**16))
def test_random_controller_sequences(layout, io, mla, page, steps, seed) -> None:
    rng = random.Random(seed)
    c = make(
        page=page,
        size=16 * page,
        layout=layout,
        io=io,
        mla=mla,
        ratio=1.5,
        delay=lambda: rng.choice([0.0, 0.0005, 0.002]),
    )
    dev: list[Seg] = []
    host: list[Seg] = []
    pending_w: dict[int, Seg] = {}  # node id -> host seg
    pending_l: dict[int, Seg] = {}  # node id -> device seg
    next_id = 0
    try:
        for step in steps:
            # each step picks among the operations that apply now, so every step does something
            applicable = [
                o
                for o in OPS
                if (o not in ("backup", "evict_device") or dev)
                and (o not in ("evict_host",) or host)
                and (o != "load" or any(x.ready for x in host))
                and (o != "start" or c.load_queue)
            ]
            mixed = (step * 2654435761 + seed) % (1 << 32)  # small hypothesis ints spread out
            op, k = applicable[mixed % len(applicable)], mixed // len(applicable)
            if op == "new":
                n = (1 + k % 3) * page
                slots = c.device_allocator.alloc(n)
                if slots is not None:
                    gen = torch.Generator().manual_seed(k)
                    tokens = torch.randint(0, 50, (n,), generator=gen)
                    write_device(c.device_pool, slots, tokens, torch.arange(n))
                    dev.append(Seg(slots, tokens, True))
            elif op == "backup" and dev:
                s = dev[k % len(dev)]
                queued = any(s.slots is op.device_indices for op in c.load_queue)
                try:
                    h = c.write(s.slots, node_id=next_id)
                except ValueError:
                    assert queued  # backing up a load that has not started is refused
                    continue
                assert not queued
                if h is not None:
                    seg = Seg(h, s.tokens, False)
                    host.append(seg)
                    pending_w[next_id] = seg
                    next_id += 1
            elif op == "load":
                ready = [x for x in host if x.ready]
                s = ready[k % len(ready)]
                d = c.load(s.slots, node_id=next_id)
                if d is not None:
                    seg = Seg(d, s.tokens, False)
                    dev.append(seg)
                    pending_l[next_id] = seg
                    next_id += 1
            elif op == "start":
                c.start_loading()
            elif op in ("poll", "wait"):
                w, ld = c.wait_all() if op == "wait" else (c.writing_check(), c.loading_check())
                for i in w:
                    pending_w.pop(i).ready = True
                for i in ld:
                    pending_l.pop(i).ready = True
            elif op == "evict_device" and dev:
                c.evict_device(dev.pop(k % len(dev)).slots)
            elif op == "evict_host" and host:
                s = host.pop(k % len(host))
                c.evict_host(s.slots)
            c.check_integrity()
            for s in dev:
                if s.ready:
                    check_device(c.device_pool, s.slots, s.tokens, s.positions)
            for s in host:
                if s.ready:
                    check_host(c.host_pool, s.slots, s.tokens, s.positions)
        c.start_loading()
        c.wait_all()
        c.check_integrity()
        assert c.device_in_flight() == 0 and c.host_in_flight() == 0
    finally:
        c.close()
