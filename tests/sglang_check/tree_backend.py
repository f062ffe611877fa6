"""SGLang 0.5.23 driving this project's tree as its radix-cache backend, on a CPU.

``python -m tests.sglang_check.run_pin --site DIR --mode tree-backend --out FILE.json``

Set up as the ``real-stack`` mode (:mod:`tests.sglang_check.real_stack`). Rows: **build**
(SGLang's ``prepare_server_args`` / ``ServerArgs`` with ``--radix-cache-backend hicache_prefill``
and ``create_tree_cache`` over a real ``TreeCacheBuildContext``; refused modes name their flag);
**scheduler** (SGLang's ``Req`` through its scheduler-side helpers and
``ScheduleBatch.prepare_for_extend``, prefix KV read through the pool's ``get_key_buffer``, which
waits on the tree's layer-done counter; no lock, slot or row left, then a ``flush_cache``
reset); **differential** (the same random operation sequences on SGLang's ``UnifiedRadixCache``
with HiCache, built by its shipped kit, and on the backend with copy delays: every observation
equal, both return the KV written).
"""

from __future__ import annotations

import argparse
import functools
import importlib
import json
import logging
import os
import random
import sys
import time
import traceback
from array import array
from types import SimpleNamespace
from typing import Any

from tests.sglang_check.rows import recorded_row

logger = logging.getLogger(__name__)

LAYERS, HEADS, HEAD_DIM = 3, 2, 8
KV_LORA_RANK, QK_ROPE_HEAD_DIM = 16, 8
DEVICE_TOKENS = 128
MAX_REQS = 8
CONTEXT = 512
BACKEND = "hicache_prefill"
DELAYED = "hicache_prefill_copy_delay"
COPY_DELAY = 0.002
WRITE_POLICIES = ("write_through", "write_through_selective", "write_back")
SEQUENCES = 12
OPS_PER_SEQUENCE = 30
REFUSED = {
    "--disable-radix-cache": {"disable_radix_cache": True},
    "--enable-session-radix-cache": {"enable_session_radix_cache": True},
    "--radix-eviction-policy": {"radix_eviction_policy": "lfu"},
    "--hicache-host-memory-mode buffer_only": {"hicache_host_memory_mode": "buffer_only"},
    "--hicache-storage-backend dynamic": {"hicache_storage_backend": "dynamic"},
}
SGLANG_UNIT_TESTS = {
    "run": 0,
    "not_run": "SGLang 0.5.23's radix-cache unit tests live in its repository "
    "(test/registered/unit/mem_cache/), not in the wheel, and the wheel records no commit "
    "(sglang._version.commit_id is None) to fetch them at, PyPI has no sdist for 0.5.23, and "
    "CI does not reach SGLang's repository; the wheel's kit "
    "(sglang/test/kits/unified_radix_cache) holds fixtures and steps, not tests: the "
    "differential rows build UnifiedRadixCache with it",
}
MODEL_CONFIG = SimpleNamespace(vocab_size=32000, is_encoder_decoder=False)
"""What ``ScheduleBatch.init_new`` reads of a ``ModelConfig`` (a real one loads a HF config)."""
STUBS = {
    "ModelConfig (vocab_size, is_encoder_decoder)": "ScheduleBatch.init_new reads these two "
    "fields; SGLang's ModelConfig would load a HuggingFace model config",
    "TpModelWorker (object.__new__, no model runner)": "the factory registers the tree's "
    "layer-done counter with the TP worker and the batch sets its consumer; both are SGLang's own "
    "TpModelWorker methods (register_hicache_layer_transfer_counter, set_hicache_consumer) called "
    "on an instance built without __init__, which would load a model",
}


# ---------------------------------------------------------------------------- pools and KV
def _server_args(page: int, policy: str, layout: str, **extra: Any) -> Any:
    from sglang.srt.server_args import ServerArgs, set_global_server_args_for_scheduler

    hierarchical = extra.pop("hierarchical", True)
    args = ServerArgs(model_path="dummy", page_size=page, enable_hierarchical_cache=hierarchical,
                      hicache_write_policy=policy, hicache_io_backend="kernel",
                      hicache_mem_layout=layout, hicache_ratio=extra.pop("ratio", 2.0),
                      radix_cache_backend=extra.pop("backend", BACKEND), **extra)  # fmt: skip
    set_global_server_args_for_scheduler(args)
    return args


def _pools(kind: str, page: int) -> Any:
    """SGLang's device pool, token allocator (paged above page 1) and request row pool."""
    import torch
    from sglang.srt.mem_cache.allocator import TokenToKVPoolAllocator
    from sglang.srt.mem_cache.allocator.paged import PagedTokenToKVPoolAllocator
    from sglang.srt.mem_cache.cache_init_params import CacheInitParams
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, MLATokenToKVPool, ReqToTokenPool

    common = dict(size=DEVICE_TOKENS, page_size=page, dtype=torch.bfloat16, layer_num=LAYERS,
                  device="cpu", enable_memory_saver=False)  # fmt: skip
    if kind == "MLA":
        dev = MLATokenToKVPool(kv_lora_rank=KV_LORA_RANK, qk_rope_head_dim=QK_ROPE_HEAD_DIM,
                               **common)  # fmt: skip
    else:
        dev = MHATokenToKVPool(head_num=HEADS, head_dim=HEAD_DIM, **common)
    if page == 1:
        alloc = TokenToKVPoolAllocator(DEVICE_TOKENS, torch.bfloat16, "cpu", dev, need_sort=False)
    else:
        alloc = PagedTokenToKVPoolAllocator(DEVICE_TOKENS, page, torch.bfloat16, "cpu", dev,
                                            need_sort=False)  # fmt: skip
    rtp = ReqToTokenPool(size=MAX_REQS, max_context_len=CONTEXT, device="cpu",
                         enable_memory_saver=False)  # fmt: skip
    params = CacheInitParams(disable=False, req_to_token_pool=rtp,
                             token_to_kv_pool_allocator=alloc, page_size=page)  # fmt: skip
    return params


def _worker() -> Any:
    from sglang.srt.managers.tp_worker import TpModelWorker

    worker = object.__new__(TpModelWorker)
    worker.hicache_layer_transfer_counter = None
    return worker


def _context(args: Any, params: Any, worker: Any, **flags: Any) -> Any:
    from sglang.srt.mem_cache.registry import TreeCacheBuildContext

    return TreeCacheBuildContext(
        server_args=args, params=params, is_hybrid_swa=flags.get("swa", False),
        is_hybrid_ssm=flags.get("ssm", False),
        enable_hierarchical_cache=args.enable_hierarchical_cache,
        disable_radix_cache=getattr(args, "disable_radix_cache", False), tp_worker=worker,
        model_config=None, tp_size=1, tp_rank=0, tp_group=None,
    )  # fmt: skip


def truth(tokens: list[int]) -> list[int]:
    """The KV value written for each token: a hash of its prefix (0..99, exact in bf16)."""
    out, h = [], 0
    for t in tokens:
        h = (h * 1000003 + t + 1) % (1 << 61)
        out.append(h % 100)
    return out


class KVPool:
    """Writes and reads every layer of a token's KV in SGLang's device pool (reads through
    ``get_key_buffer`` / ``get_value_buffer``, which wait on a registered layer-done counter)."""

    def __init__(self, dev: Any, kind: str) -> None:
        self.dev, self.kind = dev, kind
        self.bytes_compared = 0

    def write(self, slots: Any, values: list[int]) -> None:
        import torch

        v = torch.tensor(values, dtype=torch.float32)
        for layer in range(LAYERS):
            if self.kind == "MLA":
                self.dev.kv_buffer[layer][slots] = (v + layer)[:, None, None].to(torch.bfloat16)
            else:
                self.dev.k_buffer[layer][slots] = (v + layer)[:, None, None].to(torch.bfloat16)
                self.dev.v_buffer[layer][slots] = (v + 50 + layer)[:, None, None].to(torch.bfloat16)

    def check(self, slots: Any, values: list[int], what: str) -> None:
        import torch

        v = torch.tensor(values, dtype=torch.float32)
        for layer in range(LAYERS):
            k = self.dev.get_key_buffer(layer)[slots].float()
            if not bool((k == (v + layer)[:, None, None]).all()):
                raise AssertionError(f"{what}: layer {layer} K differs from the KV written")
            self.bytes_compared += k.numel() * 2
            if self.kind != "MLA":
                vv = self.dev.get_value_buffer(layer)[slots].float()
                if not bool((vv == (v + 50 + layer)[:, None, None]).all()):
                    raise AssertionError(f"{what}: layer {layer} V differs from the KV written")
                self.bytes_compared += vv.numel() * 2


# ---------------------------------------------------------------------------- the scheduler side
class SchedulerDriver:
    """A prefill request's path through SGLang's scheduler-side helpers, over any
    ``BasePrefixCache``; records what each step saw in ``log``."""

    def __init__(self, cache: Any, params: Any, kv: KVPool, worker: Any) -> None:
        self.cache, self.params, self.kv, self.worker = cache, params, kv, worker
        self.log: list[tuple] = []
        self.calls: dict[str, int] = {}
        self._rid = 0

    def _call(self, name: str) -> None:
        self.calls[name] = self.calls.get(name, 0) + 1

    def start_loads(self) -> None:
        """Once per batch, after every admission (SGLang's ``get_new_batch_prefill``): launch
        the queued loads; the TP worker makes their producer the forward's consumer."""
        consumer = self.cache.ready_to_load_host_cache()
        self._call("ready_to_load_host_cache")
        self.worker.set_hicache_consumer(consumer)

    def new_req(self, tokens: list[int]) -> Any:
        from sglang.srt.managers.schedule_batch import Req
        from sglang.srt.sampling.sampling_params import SamplingParams

        self._rid += 1
        return Req(rid=str(self._rid), origin_input_text="", origin_input_ids=array("q", tokens),
                   sampling_params=SamplingParams(temperature=0, max_new_tokens=1))  # fmt: skip

    def admit(self, tokens: list[int], start_loads: bool = True) -> Any:
        return self.admit_req(self.new_req(tokens), start_loads)

    def admit_req(self, req: Any, start_loads: bool = True) -> Any:
        from sglang.srt.mem_cache.base_prefix_cache import InitLoadBackParams

        tokens = list(req.origin_input_ids)
        req.init_next_round_input(self.cache)  # match_kv_cache, capped one token short
        self._call("match_prefix")
        loaded = 0
        if req.host_hit_length > 0:
            loaded, req.last_node = self.cache.init_load_back(InitLoadBackParams(
                best_match_node=req.best_match_node, host_hit_length=req.host_hit_length,
                req=req))  # fmt: skip
            self._call("init_load_back")
            req.prefix_len += loaded
        req.lock = self.cache.lock(req.last_node)
        self._call("lock")
        if start_loads:
            self.start_loads()
        self.log.append(("admit", len(tokens), req.prefix_len - loaded, req.host_hit_length,
                         loaded))  # fmt: skip
        req.kv.cache_protected_len = req.prefix_len  # a load back's slots are the tree's
        return req

    def extend(self, reqs: list[Any], ends: list[int]) -> None:
        """One prefill batch: SGLang's ``ScheduleBatch.prepare_for_extend`` allocates rows and
        ``[prefix_len, end)`` (``alloc_for_extend``: ``prefix_device_indices``, eviction through
        ``evict_for_alloc``); attention then reads each prefix (waiting for a load back), the new
        KV is written, and a request stopping at a chunk boundary is checkpointed."""
        from sglang.srt.managers.schedule_batch import ScheduleBatch
        from sglang.srt.mem_cache.common import checkpoint_kv_cache
        from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

        alloc = self.params.token_to_kv_pool_allocator
        starts = [req.prefix_len for req in reqs]
        for req, end in zip(reqs, ends, strict=True):
            req.extend_end = end
        if alloc.available_size() < sum(e - s for s, e in zip(starts, ends, strict=True)):
            self._call("evict_for_alloc (allocator short)")
        batch = ScheduleBatch.init_new(reqs, self.params.req_to_token_pool, alloc, self.cache,
                                       MODEL_CONFIG, False, SpeculativeAlgorithm.NONE)  # fmt: skip
        batch.prepare_for_extend()
        self._call("prepare_for_extend (alloc_for_extend)")
        for req, start, end in zip(reqs, starts, ends, strict=True):
            row = self.params.req_to_token_pool.req_to_token[req.kv.req_pool_idx]
            values = truth(list(req.full_untruncated_fill_ids)[:end])
            if start:
                self.kv.check(row[:start].long(), values[:start], f"req {req.rid} prefix {start}")
            self.kv.write(row[start:end].long(), values[start:end])
            if end < len(req.full_untruncated_fill_ids):
                checkpoint_kv_cache(req, self.cache)
                self._call("checkpoint")
        self.cache.check_hicache_events()
        self._call("check_hicache_events")

    def finish(self, req: Any) -> None:
        from sglang.srt.managers.schedule_batch import FINISH_LENGTH
        from sglang.srt.mem_cache.common import release_kv_cache

        req.finished_reason = FINISH_LENGTH(length=0)
        release_kv_cache(req, self.cache, checkpoint=True)
        self._call("release_kv_cache(checkpoint)")

    def abort(self, req: Any) -> None:
        from sglang.srt.managers.schedule_batch import FINISH_ABORT
        from sglang.srt.mem_cache.common import release_kv_cache

        req.finished_reason = FINISH_ABORT()
        release_kv_cache(req, self.cache, checkpoint=False)
        self._call("release_kv_cache(abort)")

    def request(self, tokens: list[int], chunks: list[int], abort_after: int | None = None) -> None:
        req = self.admit(tokens)
        for i, end in enumerate(e for e in chunks if e > req.prefix_len):
            self.extend([req], [end])
            if abort_after is not None and i + 1 >= abort_after:
                self.abort(req)
                return
        if req.prefix_len < len(tokens) and (not chunks or chunks[-1] != len(tokens)):
            self.extend([req], [len(tokens)])
        self.finish(req)

    def batch(self, prompts: list[list[int]]) -> None:
        """Several requests matched and locked together, then run and finished in turn."""
        reqs = [self.admit(tokens, start_loads=False) for tokens in prompts]
        self.start_loads()
        self.extend(reqs, [len(req.full_untruncated_fill_ids) for req in reqs])
        for req in reqs:
            self.finish(req)

    def evict(self, num_tokens: int) -> None:
        from sglang.srt.mem_cache.base_prefix_cache import EvictParams

        got = self.cache.evict(EvictParams(num_tokens=num_tokens)).num_tokens_evicted
        self._call("evict")
        self.log.append(("evict", num_tokens, got))

    def probe(self, tokens: list[int]) -> None:
        from sglang.srt.managers.schedule_batch import Req
        from sglang.srt.sampling.sampling_params import SamplingParams

        req = Req(rid="probe", origin_input_text="", origin_input_ids=array("q", tokens),
                  sampling_params=SamplingParams(temperature=0, max_new_tokens=1))  # fmt: skip
        req.init_next_round_input(self.cache)
        self._call("match_prefix")
        self.log.append(("probe", len(tokens), req.prefix_len, req.host_hit_length))

    def settle(self) -> None:
        """Apply every copy's ack (polling as the scheduler's event loop does)."""
        for _ in range(5000):
            self.cache.check_hicache_events()
            if not (self.cache.ongoing_write_through or self.cache.ongoing_load_back):
                break
            time.sleep(0.001)
        else:
            raise AssertionError("copies still in flight after 5 s")
        free = self.params.token_to_kv_pool_allocator.available_size()
        self.log.append(("sizes", self.cache.evictable_size(), self.cache.protected_size(), free))


def _check_clean(cache: Any, params: Any) -> dict[str, int]:
    """No lock left, the tree consistent, every device slot free or in the tree."""
    tree = cache.tree
    if cache.protected_size():
        raise AssertionError(f"{cache.protected_size()} tokens still locked after every request")
    tree.check_integrity(request_owned=0)
    alloc = params.token_to_kv_pool_allocator
    in_tree = tree.total_size()
    in_flight = tree.device_in_flight() if hasattr(tree, "device_in_flight") else 0
    if alloc.available_size() + in_tree + in_flight != alloc.size:
        raise AssertionError(f"leak: free {alloc.available_size()} + tree {in_tree} != "
                             f"{alloc.size}")  # fmt: skip
    rtp = params.req_to_token_pool
    if rtp.available_size() != rtp.size:
        raise AssertionError(f"{rtp.size - rtp.available_size()} request rows not freed")
    return {"device_in_tree": in_tree, "host_in_tree": _host_tokens(tree)}


def _host_tokens(tree: Any) -> int:
    return sum(len(x.host_value) for x in tree.all_nodes() if x.host_value is not None)


# ---------------------------------------------------------------------------- rows
def build_row(kind: str, page: int, policy: str, layout: str) -> dict[str, Any]:
    """``create_tree_cache`` builds the project's tree from a real build context."""
    from sglang.srt.mem_cache.registry import create_tree_cache

    from hicache_prefill.hicache.tree.sglang_backend import HiRadixCacheBackend

    out: dict[str, Any] = {"case": f"build/{kind}/p{page}/{policy}/{layout}", "ok": False}
    with recorded_row(out):
        params = _pools(kind, page)
        worker = _worker()
        cache = create_tree_cache(_context(_server_args(page, policy, layout), params, worker))
        if not isinstance(cache, HiRadixCacheBackend):
            raise AssertionError(f"create_tree_cache built a {type(cache).__name__}")
        cc = cache.cache_controller
        dev = params.token_to_kv_pool_allocator.get_kvcache()
        if worker.hicache_layer_transfer_counter is not cc.layer_done_counter:
            raise AssertionError("the TP worker does not hold the tree's layer-done counter")
        if dev.layer_transfer_counter is not cc.layer_done_counter:
            raise AssertionError("the device pool does not wait on the tree's layer-done counter")
        if (cache.tree.write_policy, cache.host_pool.layout) != (policy, layout):
            raise AssertionError(f"built {cache.tree.write_policy}/{cache.host_pool.layout}")
        out["classes"] = [type(cache).__name__, type(cache.tree).__name__, type(dev).__name__,
                          type(cache.host_pool).__name__]  # fmt: skip
        cc.close()
        out["ok"] = True
    return out


def cli_row() -> dict[str, Any]:
    """The flag as a fork's user types it: SGLang's ``prepare_server_args`` parses
    ``--radix-cache-backend hicache_prefill`` with the HiCache flags, and ``create_tree_cache``
    builds the project's tree from the parsed arguments."""
    from sglang.srt.mem_cache.registry import create_tree_cache
    from sglang.srt.server_args import prepare_server_args, set_global_server_args_for_scheduler

    from hicache_prefill.hicache.tree.sglang_backend import HiRadixCacheBackend

    argv = ["--model-path", "dummy", "--page-size", "4", "--enable-hierarchical-cache",
            "--hicache-write-policy", "write_back", "--hicache-mem-layout", "page_first",
            "--hicache-io-backend", "kernel", "--radix-cache-backend", BACKEND]  # fmt: skip
    out: dict[str, Any] = {"case": "build/cli: " + " ".join(argv[2:]), "ok": False}
    with recorded_row(out):
        args = prepare_server_args(argv)
        set_global_server_args_for_scheduler(args)
        cache = create_tree_cache(_context(args, _pools("MHA", 4), _worker()))
        if not isinstance(cache, HiRadixCacheBackend) or cache.tree.write_policy != "write_back":
            raise AssertionError(f"built {type(cache).__name__}")
        cache.release_host_resources()
        out["ok"] = True
    return out


def refusal_rows() -> list[dict[str, Any]]:
    """Each refused mode raises one ``ValueError`` naming its flag, from ``create_tree_cache``."""
    from sglang.srt.mem_cache.registry import create_tree_cache

    rows = []
    cases = [(flag, kw, {}) for flag, kw in REFUSED.items()]
    cases += [("sliding-window (SWA)", {}, {"swa": True}), ("mamba", {}, {"ssm": True})]
    for flag, kw, model in cases:
        out: dict[str, Any] = {"case": f"refuse/{flag}", "ok": False}
        try:
            args = _server_args(4, "write_through", "layer_first", **kw)
            create_tree_cache(_context(args, _pools("MHA", 4), _worker(), **model))
            out["error"] = "built"
        except ValueError as e:
            out["message"] = str(e)
            out["ok"] = flag.split(" ")[0] in str(e) and f"--radix-cache-backend {BACKEND}" in str(
                e
            )
            if not out["ok"]:
                out["error"] = f"the error does not name {flag}: {e}"
        except Exception as e:
            out["error"] = f"{type(e).__name__}: {e}"
        rows.append(out)
    return rows


def _backend(
    kind: str, page: int, policy: str, layout: str, name: str = BACKEND, ratio: float = 2.0
) -> Any:
    from sglang.srt.mem_cache.registry import create_tree_cache

    params = _pools(kind, page)
    worker = _worker()
    args = _server_args(page, policy, layout, backend=name, ratio=ratio)
    cache = create_tree_cache(_context(args, params, worker))
    return cache, params, worker


def scheduler_row(kind: str, page: int, policy: str) -> dict[str, Any]:
    """Prefill requests through SGLang's scheduler helpers: a whole request, the same prompt
    again (device hit), a chunked one sharing a prefix, an aborted one, then every unlocked
    leaf evicted (backed up to the host under write_back) and the prompts again (host hits
    loaded back layer by layer, under copy delays), all KV checked."""
    out: dict[str, Any] = {"case": f"scheduler/{kind}/p{page}/{policy}", "ok": False}
    with recorded_row(out):
        cache, params, worker = _backend(kind, page, policy, "layer_first", name=DELAYED)
        kv = KVPool(params.token_to_kv_pool_allocator.get_kvcache(), kind)
        d = SchedulerDriver(cache, params, kv, worker)
        ps = max(page, 4)  # host hits above the load-back threshold (10 tokens)
        a = [1000 + i for i in range(6 * ps)]
        b = a[: 4 * ps] + [2000 + i for i in range(4 * ps)]
        c = [3000 + i for i in range(5 * ps)]
        d.request(a, [len(a)])
        d.request(a, [len(a)])
        d.request(b, [2 * ps, 6 * ps, len(b)])
        d.request(c, [2 * ps, 4 * ps], abort_after=1)
        d.settle()
        d.request(a + [4000 + i for i in range(2 * ps)], [len(a) + 2 * ps])  # a twice: backed up
        d.settle()
        d.evict(DEVICE_TOKENS)
        d.settle()
        host_before = _host_tokens(cache.tree)
        d.request(a, [len(a)])
        d.request(b, [len(b)])
        d.settle()
        loads = [e for e in d.log if e[0] == "admit" and e[4] > 0]
        out["host_tokens_after_evict"] = host_before
        out["loads_back"] = len(loads)
        if not loads:
            raise AssertionError(f"no host hit was loaded back ({d.log})")
        out.update(_check_clean(cache, params))
        census = cache.all_values_flatten()
        if census.numel() != out["device_in_tree"] or cache.token_to_kv_pool_host is None:
            raise AssertionError(f"all_values_flatten: {census.numel()} slots")
        cache.reset()  # SGLang's flush_cache: the tree, then its row pool and allocator
        params.req_to_token_pool.clear()
        params.token_to_kv_pool_allocator.clear()
        d.calls["reset (flush_cache)"] = 1
        d.request(b, [len(b)])  # a miss after the flush, then a clean tree again
        d.settle()
        if d.log[-2][2:] != (0, 0, 0):
            raise AssertionError(f"a match after reset: {d.log[-2]}")
        _check_clean(cache, params)
        out["calls"] = d.calls
        out["kv_bytes_compared"] = kv.bytes_compared
        out["log"] = d.log
        cache.release_host_resources()
        out["ok"] = True
    return out


def device_only_row(page: int) -> dict[str, Any]:
    """Without ``--enable-hierarchical-cache`` the backend is the device-only tree: the same
    requests through SGLang's helpers share prefixes, evict, and leave nothing behind."""
    from sglang.srt.mem_cache.registry import create_tree_cache

    from hicache_prefill.hicache.tree.radix_cache import RadixCache

    out: dict[str, Any] = {"case": f"scheduler/MHA/p{page}/device-only", "ok": False}
    with recorded_row(out):
        params = _pools("MHA", page)
        worker = _worker()
        args = _server_args(page, "write_through", "layer_first", hierarchical=False)
        cache = create_tree_cache(_context(args, params, worker))
        if type(cache.tree) is not RadixCache or cache.cache_controller is not None:
            raise AssertionError(f"built {type(cache.tree).__name__} / {cache.cache_controller}")
        kv = KVPool(params.token_to_kv_pool_allocator.get_kvcache(), "MHA")
        d = SchedulerDriver(cache, params, kv, worker)
        a = [1000 + i for i in range(24)]
        b = a[:16] + [2000 + i for i in range(16)]
        d.request(a, [len(a)])
        d.request(b, [8, 24, len(b)])
        d.request(a + [3000] * 8, [28], abort_after=1)
        d.settle()
        d.evict(DEVICE_TOKENS)
        d.settle()
        d.request(a, [len(a)])
        d.settle()
        admits = [e for e in d.log if e[0] == "admit"]
        if [e[2] for e in admits] != [0, 16, 24, 0]:  # evicted everything before the last
            raise AssertionError(f"device hits {admits}")
        out.update(_check_clean(cache, params))
        out.update(calls=d.calls, kv_bytes_compared=kv.bytes_compared, loads_back=0, log=d.log)
        out["ok"] = True
    return out


# ---------------------------------------------------------------------------- the L3 tier
STORAGE_POLICIES = (("MHA", 4, "write_through"), ("MHA", 4, "write_through_selective"),
                    ("MHA", 4, "write_back"), ("MHA", 1, "write_through"),
                    ("MLA", 4, "write_through"))  # fmt: skip
FAULT_CASES = (("MHA", 4, "write_through", "file", "wait_complete"),
               ("MLA", 4, "write_back", "file", "timeout"),
               ("MHA", 4, "write_through", "mooncake", "wait_complete"))  # fmt: skip
L3_FAKES = {
    "mooncake.store (L3 mooncake rows)": "no mooncake_master runs in this mode: the project's "
    "fake Mooncake (tests/hicache/storage/mooncake/fake_mooncake.py) stands in as mooncake.store "
    "and as the project's MooncakeStore.store_factory while those rows run; a real master is "
    "the storage mode's mooncake-real rows",
}
STORAGE_DELAY = 0.01
"""Upper bound of the fault injector's random sleep before every storage call (seconds)."""
READ_FAILURE = 0.5
FAULT_ROUNDS = 16
ABORT_ROUNDS = 4


def _storage_backend(kind: str, page: int, policy: str, l3: str, path: str,
                     prefetch_policy: str = "wait_complete") -> Any:  # fmt: skip
    """The backend with ``--hicache-storage-backend l3`` (``file`` over ``path``; ``mooncake``
    on the fake master; prefetch threshold one page), through ``create_tree_cache``."""
    from sglang.srt.mem_cache.registry import create_tree_cache

    from tests.sglang_check import storage

    params = _pools(kind, page)
    worker = _worker()
    where = {"file_storage_path": path} if l3 == "file" else dict(storage.MASTER)
    extra = json.dumps({**where, "prefetch_threshold": page})
    args = _server_args(page, policy, "page_first", backend=DELAYED, ratio=4.0,
                        hicache_storage_backend=l3,
                        hicache_storage_backend_extra_config=extra,
                        hicache_storage_prefetch_policy=prefetch_policy)  # fmt: skip
    cache = create_tree_cache(_context(args, params, worker))
    if not cache.enable_storage or cache.storage is None:
        raise AssertionError(f"--hicache-storage-backend {l3} built no L3 tier")
    return cache, params, worker


class _L3:
    """Where the pages live for one row: a temporary directory (``file``), or the project's
    fake Mooncake master (``mooncake``: ``tests/hicache/storage/mooncake/fake_mooncake.py`` as
    ``mooncake.store`` and the store's factory), removed on exit."""

    def __init__(self, l3: str) -> None:
        self.l3 = l3

    def __enter__(self) -> str:
        import tempfile

        self.path = tempfile.mkdtemp(prefix="hicache-l3-")
        if self.l3 == "mooncake":
            from hicache_prefill.hicache.storage.mooncake.store import MooncakeStore
            from tests.sglang_check import storage

            cluster, self.saved = storage._fake_mooncake()
            MooncakeStore.store_factory = cluster.factory
        return self.path

    def __exit__(self, *exc: Any) -> None:
        import shutil

        if self.l3 == "mooncake":
            from hicache_prefill.hicache.storage.mooncake.store import MooncakeStore
            from tests.sglang_check import storage

            MooncakeStore.store_factory = None
            storage._drop_fake_mooncake(self.saved)
        shutil.rmtree(self.path, ignore_errors=True)


def _inject_faults(cache: Any, read_failure: float, seed: int) -> Any:
    """The project's fault injector around the built backend: a random sleep of up to
    :data:`STORAGE_DELAY` before every call; with probability ``read_failure`` a batch read
    fails from a random page on (SGLang's failure value for that page and every later one: a
    failed read, or the tail of a partial one). ``injected``: the reads failed."""
    from hicache_prefill.hicache.storage.fault_injector import HiCacheStorageFailureInjector

    class ReadFaults(HiCacheStorageFailureInjector):
        def _fails(self, call: str) -> bool:
            self._sleep(self._draw(lambda r: r.uniform(0.0, self._random_delay_limit)))
            return False

        def _cut(self, call: str, got: Any, bad: Any) -> Any:
            if not got or self._draw(lambda r: r.random()) >= self._failure_prob:
                return got
            k = int(self._draw(lambda r: r.randrange(len(got))))
            self.injected[call] += 1
            return [*got[:k], *([bad] * (len(got) - k))]

        def batch_get(self, keys: Any, *args: Any, **kwargs: Any) -> Any:
            return self._cut("batch_get", super().batch_get(keys, *args, **kwargs), None)

        def batch_get_v1(self, keys: Any, *args: Any, **kwargs: Any) -> Any:
            return self._cut("batch_get_v1", super().batch_get_v1(keys, *args, **kwargs), False)

    injector = ReadFaults(cache.storage.backend, STORAGE_DELAY, read_failure, seed=seed)
    cache.storage.backend = injector
    cache.storage.workers.backend = injector
    return injector


def _settle_storage(cache: Any) -> None:
    """Poll as the scheduler's loop does until no copy, L3 backup or prefetch is in flight,
    the tree and its L3 tier checked at every poll."""
    for _ in range(30000):
        cache.check_hicache_events()
        cache.sanity_check()
        if not (cache.ongoing_write_through or cache.ongoing_load_back or cache.ongoing_backup
                or cache.storage.ops_in_flight()):  # fmt: skip
            return
        time.sleep(0.001)
    raise AssertionError("storage operations still in flight after 30 s")


def _check_storage_clean(cache: Any, params: Any) -> dict[str, int]:
    """:func:`_check_clean`, and on the host: no protection left, every host slot free or in
    the tree, no prefetch, orphaned read or loaded count left."""
    out = _check_clean(cache, params)
    cache.sanity_check()
    tree, book = cache.tree, cache.storage.prefetches
    held = [x for x in tree.all_nodes() if x.host_ref]
    if held:
        raise AssertionError(f"host protection left on {held}")
    host = tree.host_allocator
    if host.available_size() + _host_tokens(tree) + tree.host_in_flight() != host.size:
        raise AssertionError(f"host leak: free {host.available_size()} + tree "
                             f"{_host_tokens(tree)} != {host.size}")  # fmt: skip
    if book.ongoing or book.orphans or book.loaded or book.loaded_start or book.occupied_tokens:
        raise AssertionError("prefetch state left after every attempt ended")
    return out


def _drop_everything(cache: Any, params: Any, kind: str) -> None:
    """Evict the device and the host tiers completely (write_back backs up first, and its L3
    stores follow), then zero both pools, so only L3 still holds the KV."""
    from sglang.srt.mem_cache.base_prefix_cache import EvictParams

    cache.evict(EvictParams(num_tokens=DEVICE_TOKENS))
    _settle_storage(cache)
    cache.evict_host(cache.tree.host_allocator.size)
    _settle_storage(cache)
    if cache.total_size() or _host_tokens(cache.tree):
        raise AssertionError("the tree still holds KV after evicting both tiers")
    dev = params.token_to_kv_pool_allocator.get_kvcache()
    for buffers in (getattr(dev, "k_buffer", []), getattr(dev, "v_buffer", []),
                    getattr(dev, "kv_buffer", [])):  # fmt: skip
        for t in buffers:
            t.zero_()
    cache.host_pool.kv_buffer.zero_()


class StorageScheduler:
    """SGLang's scheduler storage steps, its own ``Scheduler`` methods over a namespace holding
    the tree: ``_prefetch_kvcache`` at arrival; ``check_prefetch_progress`` (polled with
    ``check_hicache_events``), ``pop_prefetch_loaded_span``, ``init_next_round_input`` and
    ``_prefetch_after_device_hit_loss`` at admission; ``_release_aborted_request`` (``finish``
    with ``CacheRequestOutcome.ABORT``) on an abort."""

    def __init__(self, driver: SchedulerDriver) -> None:
        from sglang.srt.managers.scheduler import Scheduler

        ns = SimpleNamespace(enable_hicache_storage=True, enable_lmcache=False,
                             tree_cache=driver.cache)  # fmt: skip
        for name in ("_prefetch_kvcache", "_retry_storage_prefetch",
                     "_prefetch_after_device_hit_loss", "_release_aborted_request"):  # fmt: skip
            setattr(ns, name, functools.partial(getattr(Scheduler, name), ns))
        self.ns, self.d, self.cache = ns, driver, driver.cache
        self.counts: dict[str, int] = {}

    def _count(self, name: str, n: int = 1) -> None:
        self.counts[name] = self.counts.get(name, 0) + n

    def arrive(self, tokens: list[int]) -> Any:
        req = self.d.new_req(tokens)
        issued = self.ns._prefetch_kvcache(req)
        self._count("prefetch_from_storage issued" if issued else "prefetch_from_storage declined")
        self.cache.sanity_check()
        return req

    def wait_ready(self, req: Any) -> tuple[int, int | None]:
        handle = req.cache_request_handle
        for _ in range(30000):
            self.cache.check_hicache_events()
            self.cache.sanity_check()
            if self.cache.check_prefetch_progress(handle):
                break
            self._count("check_prefetch_progress not ready")
            time.sleep(0.001)
        else:
            raise AssertionError(f"prefetch of {req.rid} not done after 30 s")
        self._count("check_prefetch_progress ready")
        loaded, start = self.cache.pop_prefetch_loaded_span(handle)
        if loaded:
            req.storage_hit_length, req.storage_hit_start = loaded, start
            self._count("tokens loaded from L3", loaded)
        return loaded, start

    def run(self, tokens: list[int]) -> tuple[int, int | None, int]:
        """One request through arrival, admission (prefetch waited for), one extend (prefix KV
        checked against what was written) and finish: (loaded from L3, its start, the host hit
        loaded back)."""
        req = self.arrive(tokens)
        loaded, start = self.wait_ready(req)
        req.init_next_round_input(self.cache)
        if self.ns._prefetch_after_device_hit_loss(req):
            raise AssertionError("the matched prefix shrank between prefetch and admission")
        self.d.admit_req(req)
        host_hit = self.d.log[-1][4]
        self.d.extend([req], [len(tokens)])
        self.d.finish(req)
        self.cache.sanity_check()
        return loaded, start, host_hit

    def abort(self, tokens: list[int], after_done: bool) -> bool:
        """A request aborted while waiting for its prefetch (``after_done``: once it is done,
        before admission); returns whether the prefetch was still in flight."""
        from hicache_prefill.hicache.tree.sglang_backend import attempt

        req = self.arrive(tokens)
        if after_done:
            while not self.cache.check_prefetch_progress(req.cache_request_handle):
                self.cache.check_hicache_events()
                time.sleep(0.001)
        in_flight = attempt(req.cache_request_handle) in self.cache.ongoing_prefetch
        self.ns._release_aborted_request(req)
        self.cache.sanity_check()
        self._count("aborted in flight" if in_flight else "aborted after the prefetch")
        return in_flight


def storage_row(kind: str, page: int, policy: str, l3: str = "file") -> dict[str, Any]:
    """``--hicache-storage-backend l3`` through SGLang's scheduler storage sequence: request A
    computes and finishes (backed up to the host, stored to L3); both tiers evicted and zeroed;
    B sharing A's first pages is prefetched from L3, admitted, loaded back and reads A's KV
    byte for byte; a fresh backend over the same directory (master) serves C the same way,
    and after ``clear_storage_backend`` finds nothing; aborted prefetches (in flight, and done
    before admission) leave no lock, host slot or state, also across a ``flush_cache`` reset."""
    out: dict[str, Any] = {"case": f"storage/{kind}/p{page}/{policy}/{l3}", "ok": False}
    store = _L3(l3)
    path = store.__enter__()
    with recorded_row(out) as stops:
        stops.append(store.__exit__)
        cache, params, worker = _storage_backend(kind, page, policy, l3, path)
        stops.append(cache.release_host_resources)
        _inject_faults(cache, 0.0, seed=page)
        kv = KVPool(params.token_to_kv_pool_allocator.get_kvcache(), kind)
        d = SchedulerDriver(cache, params, kv, worker)
        st = StorageScheduler(d)
        ps = max(page, 4)
        a = [5000 + i for i in range(6 * ps)]
        for _ in range(2 if policy == "write_through_selective" else 1):
            st.run(a)
        _settle_storage(cache)
        _drop_everything(cache, params, kind)
        stored = cache.storage.stats.backup_tokens
        if stored < len(a):
            raise AssertionError(f"{stored} tokens stored to L3, A has {len(a)}")
        b = a[: 4 * ps] + [6000 + i for i in range(2 * ps)]
        loaded, start, host_hit = st.run(b)
        if (loaded, start, host_hit) != (4 * ps, 0, 4 * ps):
            raise AssertionError(f"B: loaded {loaded} from {start}, host hit {host_hit}")
        _settle_storage(cache)
        out["evicted_tiers"] = _check_storage_clean(cache, params)
        for i in range(ABORT_ROUNDS):
            _drop_everything(cache, params, kind)
            st.abort(a[: (3 + i % 3) * ps] + [7000 + i] * ps, after_done=bool(i % 2))
            _settle_storage(cache)
            _check_storage_clean(cache, params)
        loaded, _, host_hit = st.run(a)  # an L3 hit still, after the aborts
        if loaded == 0 or host_hit == 0:
            raise AssertionError(f"A after the aborts: loaded {loaded}, host hit {host_hit}")
        _settle_storage(cache)
        _check_storage_clean(cache, params)
        fresh, fparams, fworker = _storage_backend(kind, page, policy, l3, path)
        stops.append(fresh.release_host_resources)
        _inject_faults(fresh, 0.0, seed=page + 1)
        fkv = KVPool(fparams.token_to_kv_pool_allocator.get_kvcache(), kind)
        fst = StorageScheduler(SchedulerDriver(fresh, fparams, fkv, fworker))
        c = a[: 5 * ps] + [8000 + i for i in range(ps)]
        loaded, start, host_hit = fst.run(c)
        if (loaded, start, host_hit) != (5 * ps, 0, 5 * ps):
            raise AssertionError(f"C (fresh backend): loaded {loaded} from {start}, "
                                 f"host hit {host_hit}")  # fmt: skip
        _settle_storage(fresh)
        out["fresh_backend"] = _check_storage_clean(fresh, fparams)
        if not fresh.clear_storage_backend():  # SGLang's clear-HiCache call: L3 emptied
            raise AssertionError("clear_storage_backend failed")
        _drop_everything(fresh, fparams, kind)
        if fst.run(c)[0] != 0:
            raise AssertionError("a prefetch found pages after clear_storage_backend")
        _settle_storage(fresh)
        _check_storage_clean(fresh, fparams)
        _drop_everything(fresh, fparams, kind)
        fst.abort(c, after_done=False)  # its read may still run: reset waits for it
        fresh.reset()  # SGLang's flush_cache: the tree, then its row pool and allocator
        fparams.req_to_token_pool.clear()
        fparams.token_to_kv_pool_allocator.clear()
        _check_storage_clean(fresh, fparams)
        if fresh.tree.host_allocator.available_size() != fresh.tree.host_allocator.size:
            raise AssertionError("host slots held after reset")
        if fresh.attach_storage_backend("file")[0] or fresh.detach_storage_backend()[0]:
            raise AssertionError("runtime attach / detach of an L3 backend did not refuse")
        out["calls"] = {**d.calls, **st.counts,
                        **{f"fresh: {k}": v for k, v in fst.counts.items()}}  # fmt: skip
        out["l3_tokens_stored"] = stored
        out["l3_tokens_loaded"] = st.counts.get("tokens loaded from L3", 0) + fst.counts.get(
            "tokens loaded from L3", 0
        )
        aborts = [n for counts in (st.counts, fst.counts) for k, n in counts.items()
                  if k.startswith("aborted")]  # fmt: skip
        out["aborted_prefetches"] = sum(aborts)
        out["loads_back"] = sum(1 for drv in (d, fst.d) for e in drv.log
                                if e[0] == "admit" and e[4] > 0)  # fmt: skip
        out["kv_bytes_compared"] = kv.bytes_compared + fkv.bytes_compared
        out["ok"] = True
    return out


def storage_faults_row(
    kind: str, page: int, policy: str, l3: str, prefetch_policy: str, seed: int
) -> dict[str, Any]:
    """L3 reads failing at random (:data:`READ_FAILURE`, seeded) under injected delays: in
    :data:`FAULT_ROUNDS` rounds both tiers are evicted and zeroed and a request sharing a random
    number of A's pages is prefetched; what a failed read did not bring is recomputed, every
    prefix read equals the KV written, and the same prompt again (a device hit) reads it back."""
    out: dict[str, Any] = {"case": f"storage-faults/{kind}/p{page}/{policy}/{l3}/"
                           f"{prefetch_policy}", "ok": False}  # fmt: skip
    store = _L3(l3)
    path = store.__enter__()
    with recorded_row(out) as stops:
        stops.append(store.__exit__)
        cache, params, worker = _storage_backend(kind, page, policy, l3, path, prefetch_policy)
        stops.append(cache.release_host_resources)
        kv = KVPool(params.token_to_kv_pool_allocator.get_kvcache(), kind)
        d = SchedulerDriver(cache, params, kv, worker)
        st = StorageScheduler(d)
        ps = max(page, 4)
        a = [9000 + i for i in range(6 * ps)]
        st.run(a)
        _settle_storage(cache)
        injector = _inject_faults(cache, READ_FAILURE, seed=seed)
        rng = random.Random(seed)
        tally = {"full L3 hits": 0, "partial L3 hits": 0, "L3 misses (recomputed)": 0}
        for i in range(FAULT_ROUNDS):
            _drop_everything(cache, params, kind)
            shared = rng.randint(2, 6) * ps
            prompt = a[:shared] + [10000 + 100 * i + j for j in range(ps)]
            loaded, _, host_hit = st.run(prompt)
            loads_back = loaded if loaded >= cache.tree.load_back_threshold else 0
            if loaded % page or loaded > shared or host_hit != loads_back:
                raise AssertionError(f"round {i}: loaded {loaded} of {shared}, host hit "
                                     f"{host_hit}")  # fmt: skip
            key = ("full L3 hits" if loaded == shared else
                   "partial L3 hits" if loaded else "L3 misses (recomputed)")  # fmt: skip
            tally[key] += 1
            tally["L3 hits below the load-back threshold (recomputed)"] = tally.get(
                "L3 hits below the load-back threshold (recomputed)", 0
            ) + int(0 < loaded < cache.tree.load_back_threshold)
            st.run(prompt)  # the whole prompt again: its computed and loaded KV read back
            _settle_storage(cache)
            _check_storage_clean(cache, params)
        if not injector.injected:
            raise AssertionError("no storage read failed: the row proves nothing")
        out.update(tally)
        out["reads_failed"] = sum(injector.injected.values())
        out["l3_tokens_loaded"] = st.counts.get("tokens loaded from L3", 0)
        out["loads_back"] = sum(1 for e in d.log if e[0] == "admit" and e[4] > 0)
        out["calls"] = {**d.calls, **st.counts}
        out["kv_bytes_compared"] = kv.bytes_compared
        out["ok"] = True
    return out


# ---------------------------------------------------------------------------- differential
def _unified(policy: str, page: int, kind: str = "MHA") -> Any:
    """SGLang's ``UnifiedRadixCache`` with HiCache through its kit's ``build_fixture``, with
    SGLang's own thresholds (``init_hicache`` directly, not the kit's test overrides). What the
    kit is given while it builds: :data:`DIFF_PATCHES`."""
    import contextlib
    from unittest import mock

    from sglang.srt.mem_cache.allocator.paged import PagedTokenToKVPoolAllocator
    from sglang.srt.mem_cache.memory_pool import MLATokenToKVPool
    from sglang.test.kits.unified_radix_cache.config import CacheConfig

    fixtures = importlib.import_module("sglang.test.kits.unified_radix_cache.fixtures")

    def mla_pool(*, head_num: int, head_dim: int, **kwargs: Any) -> Any:
        return MLATokenToKVPool(
            kv_lora_rank=KV_LORA_RANK, qk_rope_head_dim=QK_ROPE_HEAD_DIM, **kwargs
        )

    cfg = CacheConfig(page_size=page, num_layers=LAYERS, kv_size=DEVICE_TOKENS,
                      head_num=HEADS, head_dim=HEAD_DIM, max_num_reqs=MAX_REQS,
                      max_context_len=CONTEXT)  # fmt: skip

    def paged_allocator(**kwargs: Any) -> Any:
        return PagedTokenToKVPoolAllocator(page_size=page, **kwargs)

    with contextlib.ExitStack() as patches:
        if kind == "MLA":
            patches.enter_context(mock.patch.object(fixtures, "MHATokenToKVPool", mla_pool))
        if page > 1:
            patches.enter_context(
                mock.patch.object(fixtures, "TokenToKVPoolAllocator", paged_allocator)
            )
        cache, alloc, rtp = fixtures.build_fixture(cfg)
    args = _server_args(page, policy, "layer_first", backend=None, ratio=DIFF_HOST_RATIO)
    cache.init_hicache(args, cache.cache_init_params)
    fixtures.drop_hicache_atexit_pin(cache)
    params = cache.cache_init_params
    return cache, params, _worker_with(cache)


def _worker_with(cache: Any) -> Any:
    worker = _worker()
    worker.register_hicache_layer_transfer_counter(cache.cache_controller.layer_done_counter)
    return worker


DIFF_PATCHES: dict[str, str] = {
    "sglang.test.kits.unified_radix_cache.fixtures.TokenToKVPoolAllocator (differential, page "
    "4)": "the kit pairs a page-4 tree with SGLang's page-1 allocator, whose alloc_extend raises "
    "(NotImplementedError: only for paged allocator) under SGLang's own alloc_for_extend; the "
    "differential rows give the kit SGLang's PagedTokenToKVPoolAllocator at the tree's page "
    "size, as a server builds it",
    "sglang.test.kits.unified_radix_cache.fixtures.MHATokenToKVPool (differential, MLA)": "as "
    "the real-stack MLA tree rows: SGLang's MLATokenToKVPool while build_fixture runs",
}
DIFF_PAGES = (1, 4)
DIFF_HOST_RATIO = 16.0
"""Host pools large enough that no host eviction runs: under host pressure the two trees differ
on purpose (``docs/GUIDE.md``, "LRU holds under host pressure"; SGLang's host pool also holds one
token more at page 1), so the differential compares everything else."""


def _ops(rng: random.Random) -> list[tuple]:
    """A random operation sequence over a few shared prompts (in units of 4 tokens, so host hits
    pass the load-back threshold of 10 tokens at any page size)."""
    u = 4
    bases = [[rng.randrange(1, 50000) for _ in range(rng.randint(2, 6) * u)] for _ in range(4)]

    def prompt() -> list[int]:
        tail = [rng.randrange(1, 50000) for _ in range(rng.randint(0, 4) * u)]
        return rng.choice(bases) + tail + ([7] * u if not tail else [])

    ops: list[tuple] = []
    for _ in range(OPS_PER_SEQUENCE):
        r = rng.random()
        tokens = prompt()
        cut = rng.randint(1, len(tokens) // u - 1) * u
        if r < 0.35:
            ops.append(("request", tokens, [len(tokens)], None))
        elif r < 0.5:
            ops.append(("request", tokens, [cut, len(tokens)], None))
        elif r < 0.6:
            ops.append(("request", tokens, [cut, len(tokens)], 1))
        elif r < 0.75:
            ops.append(("batch", [tokens, prompt(), prompt()]))
        elif r < 0.87:
            ops.append(("evict", rng.choice([u, 4 * u, DEVICE_TOKENS])))
        else:
            ops.append(("probe", tokens))
    return ops


def _replay(driver: SchedulerDriver, ops: list[tuple]) -> None:
    for op in ops:
        if op[0] == "request":
            driver.request(op[1], op[2], abort_after=op[3])
        elif op[0] == "batch":
            driver.batch(op[1])
        elif op[0] == "evict":
            driver.evict(op[1])
        else:
            driver.probe(op[1])
        driver.settle()


def differential_row(policy: str, page: int, seed: int, kind: str = "MHA") -> dict[str, Any]:
    """:data:`SEQUENCES` random sequences of :data:`OPS_PER_SEQUENCE` operations, each on a fresh
    ``UnifiedRadixCache`` and a fresh backend (copy delay :data:`COPY_DELAY` s): every logged
    observation equal, every KV read equal to what was written, the backend clean at the end."""
    out: dict[str, Any] = {"case": f"differential/{kind}/p{page}/{policy}", "ok": False,
                           "sequences": 0, "operations": 0, "observations": 0,
                           "kv_bytes_compared": 0}  # fmt: skip
    try:
        rng = random.Random(seed)
        for s in range(SEQUENCES):
            ops = _ops(rng)
            ucache, uparams, uworker = _unified(policy, page, kind)
            udrv = SchedulerDriver(ucache, uparams, KVPool(
                uparams.token_to_kv_pool_allocator.get_kvcache(), kind), uworker)  # fmt: skip
            _replay(udrv, ops)
            bcache, bparams, bworker = _backend(
                kind, page, policy, "layer_first", DELAYED, ratio=DIFF_HOST_RATIO
            )
            bdrv = SchedulerDriver(bcache, bparams, KVPool(
                bparams.token_to_kv_pool_allocator.get_kvcache(), kind), bworker)  # fmt: skip
            _replay(bdrv, ops)
            for i, (u, b) in enumerate(zip(udrv.log, bdrv.log, strict=True)):
                if u != b:
                    raise AssertionError(f"sequence {s}, observation {i}: UnifiedRadixCache {u}, "
                                         f"backend {b}; ops {ops}")  # fmt: skip
            _check_clean(bcache, bparams)
            bcache.release_host_resources()
            ucache.release_host_resources()
            out["sequences"] += 1
            out["operations"] += len(ops)
            out["observations"] += len(bdrv.log)
            out["kv_bytes_compared"] += udrv.kv.bytes_compared + bdrv.kv.bytes_compared
            out.setdefault("loads_back", 0)
            out["loads_back"] += sum(1 for e in bdrv.log if e[0] == "admit" and e[4] > 0)
            for name, n in bdrv.calls.items():
                out.setdefault("calls", {})[name] = out.get("calls", {}).get(name, 0) + n
        out["ok"] = True
    except Exception as e:
        out["error"] = f"{type(e).__name__}: {e}"[:6000]
        out["traceback"] = traceback.format_exc()
    return out


def main(site: str, out_path: str) -> int:
    from tests.sglang_check import real_stack

    t0 = time.monotonic()
    out: dict[str, Any] = {"mode": "tree-backend"}
    finder = real_stack._setup(site)
    try:
        from hicache_prefill.kernels.sglang import compat

        out["sglang_version"] = compat.sglang_version()
        handle = compat.install(route_around_jit=True)
        real_stack._patch()
        importlib.import_module("sglang.test.kits.unified_radix_cache.fixtures").get_device = (
            lambda *a, **k: "cpu"
        )
        base = importlib.import_module("sglang.srt.mem_cache.pool_host.base")
        from tests.sglang_check.run_pin import _relax_host_reserve

        out["host_memory_reserve_bytes_set_to_0"] = _relax_host_reserve(base)
        from hicache_prefill.hicache.tree import sglang_backend

        sglang_backend.register()
        sglang_backend.register(
            DELAYED, functools.partial(sglang_backend.build_backend, copy_delay=COPY_DELAY)
        )
        rows = [build_row(k, p, pol, lay) for k in ("MHA", "MLA") for p in (1, 4)
                for pol in WRITE_POLICIES for lay in ("layer_first", "page_first")]  # fmt: skip
        rows += [cli_row(), *refusal_rows()]
        rows += [scheduler_row(k, p, pol) for k in ("MHA", "MLA") for p in (1, 4)
                 for pol in WRITE_POLICIES]  # fmt: skip
        rows += [device_only_row(p) for p in (1, 4)]
        rows += [storage_row(k, p, pol) for k, p, pol in STORAGE_POLICIES]
        rows += [storage_row("MHA", 4, "write_through", "mooncake")]
        rows += [storage_faults_row(*case, seed=i) for i, case in enumerate(FAULT_CASES)]
        diffs = [("MHA", pol, page) for pol in WRITE_POLICIES for page in DIFF_PAGES]
        diffs += [("MLA", pol, 4) for pol in WRITE_POLICIES]
        rows += [differential_row(pol, page, seed=i, kind=kind)
                 for i, (kind, pol, page) in enumerate(diffs)]  # fmt: skip
        out["tree_backend"] = rows
        out["sglang_unit_tests"] = SGLANG_UNIT_TESTS
        handle.uninstall()
    except Exception as e:
        out["fatal"] = f"{type(e).__name__}: {e}"
        out["traceback"] = traceback.format_exc()
    out["stubs"] = real_stack._stub_rows(finder) + [
        {"module": k, "kind": "bare instance", "reason": v} for k, v in STUBS.items()
    ]
    out["stubs"] += [{"module": k, "kind": "patched name", "reason": v}
                     for k, v in DIFF_PATCHES.items()]  # fmt: skip
    out["stubs"] += [{"module": k, "kind": "fake module", "reason": v}
                     for k, v in L3_FAKES.items()]  # fmt: skip
    out["seconds"] = round(time.monotonic() - t0, 1)
    with open(out_path, "w", encoding="utf-8") as f:
        json.dump(out, f, indent=1, default=str)
    return 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--site", required=True)
    parser.add_argument("--out", required=True)
    a = parser.parse_args()
    logging.basicConfig(level=os.environ.get("SGLANG_CHECK_LOG", "WARNING"))
    sys.exit(main(a.site, a.out))
