"""``insert(counted_from=)``: SGLang 0.5.23's hit counting (``inserted_len``), which the SGLang
backend's ``checkpoint`` uses: each request counts each node once, chunked checkpoints included;
without it the executor's counting (chunked inserts never count) is unchanged."""

from __future__ import annotations

import torch

from hicache_prefill.hicache.builder import KVCache
from tests.hicache.tree.test_hiradix_cache import caches, drain, make_cache  # noqa: F401

PROMPT = list(range(300, 316))  # four pages of 4


def checkpoint(kv: KVCache, key: list[int], counted_from: int | None, chunked: bool) -> None:
    """A request's insert of ``key`` (its slots: the cached prefix, then new ones)."""
    tree = kv.tree
    m = tree.match_prefix(key)
    hit = len(m.device_indices)
    new = kv.allocator.alloc(len(key) - hit)
    assert new is not None
    value = torch.cat([m.device_indices, new])
    present = tree.insert(key, value, chunked=chunked, counted_from=counted_from)
    kv.allocator.free(value[hit:present])
    kv.check_integrity()


def hits(kv: KVCache, key: list[int]) -> list[int]:
    x, out = kv.tree.match_prefix(key).last_device_node, []
    while x is not kv.tree.root_node:
        out.append(x.hit_count)
        x = x.parent
    return out[::-1]


def test_a_request_counts_each_node_once_chunks_included(caches) -> None:  # noqa: F811
    kv = make_cache("write_through_selective")
    caches.append(kv)
    checkpoint(kv, PROMPT[:8], counted_from=0, chunked=True)  # first chunk: counted
    checkpoint(kv, PROMPT, counted_from=8, chunked=False)  # finish: only [8, 16) counted
    assert hits(kv, PROMPT) == [1, 1]
    drain(kv)
    assert kv.stats.backed_up_tokens == 0  # selective: backed up at the second hit
    checkpoint(kv, PROMPT, counted_from=0, chunked=False)  # a second request
    assert hits(kv, PROMPT) == [2, 2]
    drain(kv)
    assert kv.stats.backed_up_tokens == 16
    kv.check_integrity()


def test_without_counted_from_chunked_inserts_do_not_count(caches) -> None:  # noqa: F811
    kv = make_cache("write_through_selective")
    caches.append(kv)
    checkpoint(kv, PROMPT[:8], counted_from=None, chunked=True)
    checkpoint(kv, PROMPT, counted_from=None, chunked=False)
    assert hits(kv, PROMPT) == [1, 1]  # the final insert counts the chunk's node, once
    checkpoint(kv, PROMPT[:8], counted_from=None, chunked=True)
    assert hits(kv, PROMPT) == [1, 1]
    drain(kv)
    assert kv.stats.backed_up_tokens == 0
    kv.check_integrity()


def test_counted_from_past_the_key_counts_nothing(caches) -> None:  # noqa: F811
    kv = make_cache("write_through")
    caches.append(kv)
    checkpoint(kv, PROMPT, counted_from=0, chunked=False)
    drain(kv)
    checkpoint(kv, PROMPT, counted_from=16, chunked=False)  # the same request again
    assert hits(kv, PROMPT) == [1]
    assert kv.stats.backed_up_tokens == 16  # backed up once, at the first count
    kv.check_integrity()
