"""``python -m tests.support.node_commands``: a node process (``node_main``) that runs prefill
executors over a shared L3 store on command, each under a name, and the bare stores of
``node_stores``.

Executors (one per name; under ``--world 2`` a ``tp_size=2`` executor spans both ranks, a
``tp_size=1`` one lives on rank 0 only):

- ``build {name, args}``: ``make_executor(ServerArgs(**args))`` (virtual clock, decode side that
  keeps received KV); a startup error is the command's error (its message names the setting);
- ``serve {name, requests: [[rid, tokens], ...], check}``: rank 0 submits them all, every rank
  runs to idle and drains the cache's copies; per result: the outcome, the tokens from each
  tier and, with ``check`` (the default; it also runs ``check_integrity`` after every step),
  the decode-side KV as one SHA-256 per page (this rank's shard) and its largest deviation from
  the single-rank model's full recompute; then the executor's, the tier's and the backend's
  counters;
- ``exists {name, prompts}``: per prompt, how many of its whole pages the backend finds
  (``batch_exists`` of SGLang's keys under this executor's model name);
- ``evict {name}``: everything evictable leaves the device and the host pool; returns the
  tree's device tokens left and ``host_free`` (every host slot free again: none leaked);
- ``wait_health {name, healthy, timeout_s}``: polls the Mooncake client's ``health_check``
  until it is 0 (``healthy``) or not 0;
- ``close {name}``.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import sys
import time
from typing import Any

import torch

from hicache_prefill.hicache.storage.hash_keys import page_hashes
from hicache_prefill.hicache.tp.group import new_cache_group
from hicache_prefill.prefill.clock import VirtualClock, WallClock
from hicache_prefill.prefill.model.factory import build_model
from hicache_prefill.prefill.request.state import Outcome
from hicache_prefill.server_args import ServerArgs
from tests.support.harness import make_executor
from tests.support.node_main import Node, main
from tests.support.node_stores import STORE_COMMANDS

logger = logging.getLogger(__name__)


def _lives_here(node: Node, args: ServerArgs) -> bool:
    if args.tp_size not in (1, node.world):
        raise ValueError(f"tp_size={args.tp_size} on a node of {node.world} ranks")
    return args.tp_size == node.world or node.rank == 0


def _backend(ex: Any) -> Any:
    backend = ex.cache.storage.backend
    return getattr(backend, "backend", backend)  # under the fault injector


# ---------------------------------------------------------------------- executors
def build(node: Node, msg: dict) -> Any:
    args = ServerArgs(**msg["args"])
    if not _lives_here(node, args):
        return None
    group = new_cache_group() if args.tp_size > 1 else None
    clock = WallClock() if msg.get("clock") == "wall" else VirtualClock()
    ex = make_executor(args, clock=clock, group=group, send_log_size=None)
    node.executors[msg["name"]] = ex
    return {"model_name": args.storage_model_name(), "kv_heads": _kv_heads(ex)}


def _kv_heads(ex: Any) -> tuple[int, int] | None:
    shard = getattr(ex.model, "shard", None)
    return None if shard is None else tuple(shard.kv_heads)


def _reference(node: Node, name: str, ex: Any) -> Any:
    """The single-rank model of ``ex`` (its full recompute is the KV check's reference)."""
    if name not in node.references:
        args = ex.args
        node.references[name] = (
            build_model(dataclasses.replace(args, tp_size=1)) if args.tp_size > 1 else ex.model
        )
    return node.references[name]


def _page_digests(got: list[torch.Tensor], page_size: int) -> list[str]:
    n = got[0].shape[1]
    out = []
    for start in range(0, n - n % page_size, page_size):
        h = hashlib.sha256()
        for g in got:
            h.update(g[:, start : start + page_size].contiguous().view(torch.uint8).numpy())
        out.append(h.hexdigest()[:16])
    return out


def _kv_error(node: Node, name: str, ex: Any, rid: str, got: list[torch.Tensor]) -> float:
    dpl = ex.decode.received_kv(rid)[0]
    ids = torch.tensor(ex.decode.peers[rid].token_ids, dtype=torch.int64)
    _, *ref = _reference(node, name, ex).forward_reference(ids)
    heads = _kv_heads(ex) if ex.args.tp_size > 1 else None
    worst = 0.0
    for g, r in zip(got, ref, strict=True):
        r = r[:, dpl:] if heads is None else r[:, dpl:, heads[0] : heads[1]]
        if g.numel():
            worst = max(worst, float((g.float() - r.float()).abs().max()))
    return worst


def serve(node: Node, msg: dict) -> Any:
    ex = node.executors.get(msg["name"])
    if ex is None:
        return None
    if node.rank == 0:
        for rid, tokens in msg["requests"]:
            ex.submit(rid, tokens)
    ex.run_until_idle(check=msg.get("check", True))
    ex.drain_cache_events()
    ex.check_integrity()
    results = []
    for res in sorted(ex.pop_results(), key=lambda r: r.rid):
        row = {"rid": res.rid, "outcome": res.outcome.value, "tokens": res.num_tokens,
               "device": res.cached_device_tokens, "host": res.cached_host_tokens,
               "storage": res.cached_storage_tokens, "computed": res.computed_tokens,
               "ttft": res.ttft, "attempts": res.attempts, "yields": res.yields}  # fmt: skip
        if res.outcome == Outcome.SUCCESS and msg.get("check", True):
            dpl, *got = ex.decode.received_kv(res.rid)
            row["decode_prefix_len"] = dpl
            row["pages"] = _page_digests(got, ex.args.page_size)
            row["kv_error"] = _kv_error(node, msg["name"], ex, res.rid, got)
        if res.outcome == Outcome.SUCCESS:
            ex.decode.release(res.rid)
        results.append(row)
    return {"results": results, **_counters(ex)}


def _counters(ex: Any) -> dict:
    stats = {k: v for k, v in ex.stats.to_dict().items() if k != "ttft_samples"}
    storage = ex.cache.storage
    out = {"stats": stats, "cache": ex.cache.stats.as_dict()}
    if storage is not None:
        out["storage"] = storage.stats.as_dict()
        backend_stats = _backend(ex).get_stats()
        out["backend"] = (dataclasses.asdict(backend_stats)
                          if dataclasses.is_dataclass(backend_stats) else None)  # fmt: skip
    return out


def stats(node: Node, msg: dict) -> Any:
    ex = node.executors.get(msg["name"])
    return None if ex is None else _counters(ex)


def exists(node: Node, msg: dict) -> Any:
    ex = node.executors.get(msg["name"])
    if ex is None:
        return None
    ps, backend = ex.args.page_size, _backend(ex)
    out = []
    for tokens in msg["prompts"]:
        keys = page_hashes(tokens[: len(tokens) // ps * ps], ps)
        out.append(backend.batch_exists(keys) if keys else 0)
    return out


def evict(node: Node, msg: dict) -> Any:
    ex = node.executors.get(msg["name"])
    if ex is None:
        return None
    ex.drain_cache_events()
    ex.tree.evict(ex.allocator.size)
    ex.drain_cache_events()
    host = getattr(ex.tree, "host_allocator", None)
    if host is not None:
        ex.tree.evict_host(host.size)
    ex.drain_cache_events()
    ex.check_integrity()
    free = None if host is None else host.available_size() == host.size
    return {"device_tokens": ex.tree.total_size(), "host_free": free}


def wait_health(node: Node, msg: dict) -> Any:
    ex = node.executors.get(msg["name"])
    if ex is None:
        return None
    client, want = _backend(ex).client, bool(msg.get("healthy", True))
    timeout = msg.get("timeout_s", 30.0)
    t0 = time.monotonic()
    while (client.health() == 0) != want:
        if time.monotonic() - t0 > timeout:
            raise TimeoutError(f"Mooncake health_check still {client.health()} after {timeout} s")
        time.sleep(0.05)
    return client.health()


def close(node: Node, msg: dict) -> Any:
    ex = node.executors.pop(msg["name"], None)
    if ex is not None:
        ex.cache.close()
    return None


COMMANDS = {
    **STORE_COMMANDS, "build": build, "serve": serve, "stats": stats, "exists": exists,
    "evict": evict, "wait_health": wait_health, "close": close,
}  # fmt: skip


if __name__ == "__main__":
    sys.exit(main(COMMANDS))
