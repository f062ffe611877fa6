"""``make sglang-check``, L3 part: pages cross between this project's ``HiCacheFile`` and SGLang
0.5.23's own ``HiCacheFile`` (``sglang.srt.mem_cache.hicache_storage``, unmodified), both ways,
and SGLang's own ``build_kv_host_pool`` builds its host pool from this project's device pools.

Per case (MHA / MLA x ``layer_first`` / ``page_first`` / ``page_first_direct``, bfloat16, page
4): this project's host pool and SGLang's host pool class over this project's device pool (as
``transfers.host_pool`` builds it), both filled with random bytes, then

1. this project's ``HiCacheFile`` stores 5 pages (its model name untagged: extra-config
   ``storage_format_tag: "none"``); SGLang's ``HiCacheFile`` over the same directory and model
   name finds each (``exists``) and reads it (``get`` into ``get_dummy_flat_data_page``, then
   ``set_from_flat_data_page``) into other slots of its host pool: every token, layer and
   part of those slots must equal this project's source slots, byte for byte;
2. the other way round (SGLang stores from its host pool, this project reads into its own);
3. both write the same file names for the same keys.

Once: the format tag. This project's default key (model name tagged with the page format) is a
miss for SGLang under the plain model name, and a hit, read correctly, for SGLang served under
the tagged name (``--served-model-name``).

``build_kv_host_pool``: SGLang's own function, compiled from the installed
``hybrid_pool_assembler.py`` (whose module imports the whole runtime) with the runtime context
it reads given explicitly (host ratio, size, layout; no DCP), over this project's MHA and MLA
device pools: it reads ``get_device_pool_infos()``, ``host_capacity_tokens``,
``hicache_write_back_staging``, the layer range and, for MLA, ``kv_cache_dim`` and the layer
sharding fields; the host pool it returns must have this project's host pool's layout, dtype and
per-token geometry (layers, heads, widths; its token count follows SGLang's sizing). The
one change: its host pool classes get ``pin_memory=False`` (pinning needs CUDA).

``factory/{dynamic|registered}/{file|mooncake}/{MHA|MLA}``: SGLang's own ``StorageBackendFactory``
builds this project's ``HiCacheFile`` / ``MooncakeStore`` (``dynamic`` with ``module_path`` /
``class_name``, or ``register_backend`` over SGLang's ``file`` / ``mooncake``) over SGLang's host
pool (``page_first``); the attach calls and the controller's calls (generic or zero-copy, and v2)
store and read pages; SGLang's own ``HiCacheFile`` / ``MooncakeStore`` read what they stored and
store what they read, byte for byte. Mooncake runs over this project's fake
(``tests/hicache/storage/mooncake/fake_mooncake.py`` as ``mooncake.store``); a real
``mooncake.store`` importing fails the row (not written).
"""

from __future__ import annotations

import ast
import functools
import importlib
import importlib.util
import logging
import os
import tempfile
import types
from typing import Any

import torch

from tests.sglang_check import transfers

logger = logging.getLogger(__name__)

PAGE = 4
PAGES = 5
MODEL = "Org/Model"
CASES = [
    ("MHA", "layer_first", "kernel"), ("MHA", "page_first", "kernel"),
    ("MHA", "page_first_direct", "direct"), ("MLA", "layer_first", "kernel"),
    ("MLA", "page_first", "kernel"), ("MLA", "page_first_direct", "direct"),
]  # fmt: skip


def _ours(kind: str, layout: str, dev: Any) -> Any:
    from hicache_prefill.hicache.memory.host_pool import make_host_pool

    return make_host_pool(dev, transfers.HOST_RATIO, 0, layout)


def _our_file(host: Any, path: str, tag: str | None = "none") -> Any:
    from hicache_prefill.hicache.storage.config import storage_config_for_pool
    from hicache_prefill.hicache.storage.file_backend import HiCacheFile

    extra = {"file_storage_path": path}
    if tag is not None:
        extra["storage_format_tag"] = tag
    backend = HiCacheFile(storage_config_for_pool(host, MODEL, extra_config=extra))
    backend.register_mem_pool_host(host)
    return backend


def _sglang_file(hs: Any, host: Any, path: str, model: str) -> Any:
    config = hs.HiCacheStorageConfig(
        tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1,
        is_mla_model=hasattr(host, "kv_cache_dim"), enable_storage_metrics=False,
        is_page_first_layout=host.layout == "page_first", model_name=model,
        extra_config={"file_storage_path": path},
    )  # fmt: skip
    backend = hs.HiCacheFile(config)
    backend.register_mem_pool_host(host)
    return backend


def _slots(start_page: int) -> list[int]:
    return [(start_page + i) * PAGE for i in range(PAGES)]


def _same_slots(kind: str, a: Any, a_starts: list[int], b: Any, b_starts: list[int]) -> bool:
    """Every token, layer and part of the pages at ``a_starts`` of ``a`` equals ``b``'s."""
    ra, rb = transfers.host_rows(kind, a), transfers.host_rows(kind, b)
    ia = torch.tensor([s + t for s in a_starts for t in range(PAGE)])
    ib = torch.tensor([s + t for s in b_starts for t in range(PAGE)])

    def raw(t: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
        return t[:, idx].contiguous().view(torch.uint8)

    return all(torch.equal(raw(x, ia), raw(y, ib)) for x, y in zip(ra, rb, strict=True))


def _keys(seed: int) -> list[str]:
    from hicache_prefill.hicache.storage.hash_keys import page_hashes

    return page_hashes(list(range(seed, seed + PAGES * PAGE)), PAGE)


def run_case(hs: Any, sglang: dict[str, Any], kind: str, layout: str, io: str,
             seed: int) -> dict[str, Any]:  # fmt: skip
    out: dict[str, Any] = {"case": f"{kind}/{layout}", "ok": False}
    gen = torch.Generator().manual_seed(seed)
    try:
        dev = transfers.device_pool(kind, PAGE)
        ours = _ours(kind, layout, dev)
        theirs = transfers.host_pool(sglang, transfers.Case(kind, PAGE, layout, io), dev)
        transfers._randomize([ours.kv_buffer], gen)
        keys = _keys(seed)
        with tempfile.TemporaryDirectory() as d1, tempfile.TemporaryDirectory() as d2:
            mine = _our_file(ours, d1)
            assert mine.batch_set(keys, [ours.get_data_page(s) for s in _slots(0)])
            sg = _sglang_file(hs, theirs, d1, MODEL)
            for key, dst in zip(keys, _slots(3), strict=True):
                assert sg.exists(key), f"SGLang does not find {key[:12]}"
                page = sg.get(key, theirs.get_dummy_flat_data_page())
                assert page is not None, f"SGLang misses {key[:12]}"
                theirs.set_from_flat_data_page(dst, page)
            assert _same_slots(kind, theirs, _slots(3), ours, _slots(0)), "ours -> SGLang bytes"
            out["ours_to_sglang"] = True

            kv = theirs.kv_buffer
            transfers._randomize(list(kv) if isinstance(kv, tuple | list) else [kv], gen)
            sg2 = _sglang_file(hs, theirs, d2, MODEL)
            for key, src in zip(keys, _slots(1), strict=True):
                assert sg2.set(key, theirs.get_data_page(src, flat=True))
            mine2 = _our_file(ours, d2)
            for key, dst in zip(keys, _slots(6), strict=True):
                page = mine2.get(key, ours.get_dummy_flat_data_page())
                assert page is not None, f"this project misses {key[:12]}"
                ours.set_from_flat_data_page(dst, page)
            assert _same_slots(kind, ours, _slots(6), theirs, _slots(1)), "SGLang -> ours bytes"
            out["sglang_to_ours"] = True
            names = sorted(os.listdir(d1)), sorted(os.listdir(d2))
            assert names[0] == names[1], names
            out["file_names"] = names[0][:1]
        out["ok"] = True
    except Exception as e:  # noqa: BLE001 - reported
        out["error"] = f"{type(e).__name__}: {e}"
    return out


def run_format_tag(hs: Any, sglang: dict[str, Any]) -> dict[str, Any]:
    """The default (tagged) key is a miss under the plain name, a correct hit under the tag."""
    out: dict[str, Any] = {"case": "format_tag", "ok": False}
    try:
        gen = torch.Generator().manual_seed(99)
        dev = transfers.device_pool("MHA", PAGE)
        ours = _ours("MHA", "page_first", dev)
        theirs = transfers.host_pool(sglang, transfers.Case("MHA", PAGE, "page_first", "kernel"),
                                     dev)  # fmt: skip
        transfers._randomize([ours.kv_buffer], gen)
        keys = _keys(7)
        with tempfile.TemporaryDirectory() as d:
            mine = _our_file(ours, d, tag=None)  # the default: tagged with the page format
            assert mine.batch_set(keys, [ours.get_data_page(s) for s in _slots(0)])
            plain = _sglang_file(hs, theirs, d, MODEL)
            out["plain_name_misses"] = not any(plain.exists(k) for k in keys)
            tagged_name = f"{MODEL}-{ours.storage_format_tag}"
            tagged = _sglang_file(hs, theirs, d, tagged_name)
            for key, dst in zip(keys, _slots(2), strict=True):
                page = tagged.get(key, theirs.get_dummy_flat_data_page())
                theirs.set_from_flat_data_page(dst, page)
            out["tagged_name_reads"] = _same_slots("MHA", theirs, _slots(2), ours, _slots(0))
            out["tagged_name"] = tagged_name
        out["ok"] = out["plain_name_misses"] and out["tagged_name_reads"]
    except Exception as e:  # noqa: BLE001 - reported
        out["error"] = f"{type(e).__name__}: {e}"
    return out


def _file_names(kind: str, keys: list[str], tp_size: int) -> list[str]:
    """SGLang 0.5.23's ``HiCacheFile`` names of ``keys`` on TP ``tp_size``: MHA
    ``{key}_{model}_{rank}_{size}.bin`` per rank; MLA one ``{key}_{model}.bin`` for all ranks."""
    model = "-".join(MODEL.split("/"))
    if kind == "MLA":
        return sorted(f"{k}_{model}.bin" for k in keys)
    return sorted(f"{k}_{model}_{r}_{tp_size}.bin" for k in keys for r in range(tp_size))


def _read_pages(store: Any, who: str, keys: list[str], pool: Any, slots: list[int]) -> None:
    """``exists`` + ``get`` of each key through ``store`` into ``pool``'s page at each slot."""
    for key, dst in zip(keys, slots, strict=True):
        assert store.exists(key), f"{who} does not find {key[:12]}"
        page = store.get(key, pool.get_dummy_flat_data_page())
        assert page is not None, f"{who} misses {key[:12]}"
        pool.set_from_flat_data_page(dst, page)


def run_file_tp(hs: Any, sglang: dict[str, Any], kind: str, tp_size: int,
                seed: int) -> dict[str, Any]:  # fmt: skip
    """Per rank (``tp_rank`` r of ``tp_size`` on one directory, each over its own host pools, as
    ``tp_size`` ranks would): this project's ``HiCacheFile`` stores pages that SGLang's of the
    same rank reads byte for byte, and the reverse; only storage writers store (SGLang's
    controller skips the others: MHA every rank, MLA rank 0, whose one file every rank reads);
    both directories hold exactly SGLang's file names."""
    from hicache_prefill.hicache.storage.config import storage_config_for_pool
    from hicache_prefill.hicache.storage.file_backend import HiCacheFile

    out: dict[str, Any] = {"case": f"file/{kind}/tp{tp_size}", "ok": False}
    gen = torch.Generator().manual_seed(seed)
    try:
        keys = _keys(700 + 10 * seed)
        ours, theirs = [], []
        for rank in range(tp_size):
            dev = transfers.device_pool(kind, PAGE)
            o = _ours(kind, "page_first", dev)
            t = transfers.host_pool(sglang, transfers.Case(kind, PAGE, "page_first", "kernel"),
                                    dev)  # fmt: skip
            if kind == "MLA" and rank:  # MLA: every rank holds the same latent cache
                o.kv_buffer.copy_(ours[0].kv_buffer)
            else:
                transfers._randomize([o.kv_buffer], gen)
            ours.append(o)
            theirs.append(t)
        writers = []
        with tempfile.TemporaryDirectory() as d1, tempfile.TemporaryDirectory() as d2:

            def pair(rank: int, d: str) -> tuple[Any, Any]:
                extra = {"file_storage_path": d}
                mine = HiCacheFile(storage_config_for_pool(
                    ours[rank], MODEL, tp_rank=rank, tp_size=tp_size,
                    extra_config={**extra, "storage_format_tag": "none"}))  # fmt: skip
                mine.register_mem_pool_host(ours[rank])
                cfg = _config(hs, theirs[rank], extra, tp_rank=rank, tp_size=tp_size)
                sg = hs.HiCacheFile(cfg)
                sg.register_mem_pool_host(theirs[rank])
                writers.append(cfg.is_storage_writer)
                return mine, sg

            pairs1 = [pair(r, d1) for r in range(tp_size)]
            want_writers = [kind == "MHA" or r == 0 for r in range(tp_size)]
            assert writers == want_writers, f"SGLang's writers {writers}"
            # ours -> SGLang
            for rank, (mine, _) in enumerate(pairs1):
                if want_writers[rank]:
                    pages = [ours[rank].get_data_page(s) for s in _slots(0)]
                    assert mine.batch_set(keys, pages), f"ours rank {rank} set"
            for rank, (_, sg) in enumerate(pairs1):
                _read_pages(sg, f"SGLang rank {rank}", keys, theirs[rank], _slots(3))
                assert _same_slots(kind, theirs[rank], _slots(3), ours[rank], _slots(0)), (
                    f"ours -> SGLang bytes, rank {rank}"
                )
            out["ours_to_sglang"] = True
            # SGLang -> ours (SGLang's host pools refilled; MLA ranks again alike)
            for rank in range(tp_size):
                kv = theirs[rank].kv_buffer
                if kind == "MLA" and rank:
                    kv.copy_(theirs[0].kv_buffer)
                else:
                    transfers._randomize(list(kv) if isinstance(kv, tuple | list) else [kv], gen)
            writers.clear()
            pairs2 = [pair(r, d2) for r in range(tp_size)]
            for rank, (_, sg) in enumerate(pairs2):
                if want_writers[rank]:
                    for key, src in zip(keys, _slots(1), strict=True):
                        assert sg.set(key, theirs[rank].get_data_page(src, flat=True)), (
                            f"SGLang rank {rank} set"
                        )
            for rank, (mine, _) in enumerate(pairs2):
                _read_pages(mine, f"ours rank {rank}", keys, ours[rank], _slots(6))
                assert _same_slots(kind, ours[rank], _slots(6), theirs[rank], _slots(1)), (
                    f"SGLang -> ours bytes, rank {rank}"
                )
            out["sglang_to_ours"] = True
            want = _file_names(kind, keys, tp_size)
            for d in (d1, d2):
                got = sorted(os.listdir(d))
                assert got == want, f"file names {got[:2]}..., want {want[:2]}..."
            out["file_suffixes"] = sorted({n[64:] for n in want})
        out["ok"] = True
    except Exception as e:  # noqa: BLE001 - reported
        out["error"] = f"{type(e).__name__}: {e}"
    return out


def _build_kv_host_pool(layout: str) -> Any:
    """SGLang's ``build_kv_host_pool`` (and ``_mha_host_inputs``) compiled from the installed
    file, with the runtime context it reads (module docstring)."""
    import sglang.srt.mem_cache.hybrid_cache.host_pool_config as hpc
    import sglang.srt.mem_cache.pool_host.mha as mha
    import sglang.srt.mem_cache.pool_host.mla as mla

    spec = importlib.util.find_spec("sglang.srt.mem_cache.hybrid_cache.hybrid_pool_assembler")
    with open(spec.origin, encoding="utf-8") as f:
        tree = ast.parse(f.read(), filename=spec.origin)
    wanted = {"_mha_host_inputs", "build_kv_host_pool"}
    body = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name in wanted]
    assert {n.name for n in body} == wanted, "build_kv_host_pool not found"
    env = {
        "__name__": "sglang.srt.mem_cache.hybrid_cache.hybrid_pool_assembler",
        "Any": Any, "Optional": __import__("typing").Optional,
        # No CUDA here: SGLang's host pools default to pinned memory; the one change made.
        "MLATokenToKVPoolHost": functools.partial(mla.MLATokenToKVPoolHost, pin_memory=False),
        "get_mha_host_pool_cls": lambda info: functools.partial(
            mha.get_mha_host_pool_cls(info), pin_memory=False),
        "is_mla_pool": hpc.is_mla_pool, "check_packed_kv_rows": hpc.check_packed_kv_rows,
        "is_npu": lambda: False,
        "get_memory": lambda: types.SimpleNamespace(
            hicache_ratio=transfers.HOST_RATIO, hicache_size=0, hicache_mem_layout=layout),
        "get_parallel": lambda: types.SimpleNamespace(dcp_enabled=False),
        "_get_allocator_type": lambda: "default",
        "PageInterleaveKVPoolMixin": type("PageInterleaveKVPoolMixin", (), {}),
        "PageInterleaveHostPool": None,
    }  # fmt: skip
    exec(compile(ast.Module(body=body, type_ignores=[]), spec.origin, "exec"), env)  # noqa: S102
    return env["build_kv_host_pool"]


def run_build_kv_host_pool() -> list[dict[str, Any]]:
    results = []
    for kind, layout in (("MHA", "page_first"), ("MHA", "layer_first"), ("MLA", "page_first")):
        out: dict[str, Any] = {"case": f"build_kv_host_pool/{kind}/{layout}", "ok": False}
        try:
            dev = transfers.device_pool(kind, PAGE)
            host = _build_kv_host_pool(layout)(kv_pool=dev, page_size=PAGE,
                                               use_mla=kind == "MLA")  # fmt: skip
            ours = _ours(kind, layout, dev)
            out["sglang_host_class"] = type(host).__name__
            out["size"] = (host.size, ours.size)
            # Per token: layers and each part's row (the token counts differ by SGLang's own
            # sizing rule, documented in the README).
            rows = [(r.shape[0], *r.shape[2:]) for r in transfers.host_rows(kind, host)]
            our_rows = [(r.shape[0], *r.shape[2:]) for r in transfers.host_rows(kind, ours)]
            out["rows"] = [list(r) for r in rows]
            out["ok"] = rows == our_rows and host.layout == layout and host.dtype == ours.dtype
        except Exception as e:  # noqa: BLE001 - reported
            out["error"] = f"{type(e).__name__}: {e}"
        results.append(out)
    return results


def run(sglang: dict[str, Any]) -> list[dict[str, Any]]:
    """Every L3 check for the installed SGLang (skipped, reported, when it has no
    ``hicache_storage`` module or host pools that take a buffer description)."""
    if importlib.util.find_spec("sglang.srt.mem_cache.hicache_storage") is None:
        return [{"case": "storage", "ok": True, "skipped": "no hicache_storage module"}]
    if not sglang["takes_buffer_info"]:
        return [{"case": "storage", "ok": True, "skipped": "host pools take the device pool"}]
    hs = importlib.import_module("sglang.srt.mem_cache.hicache_storage")
    out = [run_case(hs, sglang, kind, layout, io, seed)
           for seed, (kind, layout, io) in enumerate(CASES)]  # fmt: skip
    out.append(run_format_tag(hs, sglang))
    out.extend(run_file_tp(hs, sglang, kind, 2, seed) for seed, kind in enumerate(("MHA", "MLA")))
    out.extend(run_build_kv_host_pool())
    out.extend(run_factory(hs, sglang))
    return out


# --- SGLang's factory builds this project's backends; SGLang's controller calls; cross-reads ---

FILE_MODULE = "hicache_prefill.hicache.storage.file_backend"
MOONCAKE_MODULE = "hicache_prefill.hicache.storage.mooncake.store"
MASTER = {"master_server_address": "127.0.0.1:50051", "protocol": "tcp",
          "global_segment_size": 0}  # fmt: skip


def _config(hs: Any, host: Any, extra: dict, model: str = MODEL, tp_rank: int = 0,
            tp_size: int = 1) -> Any:  # fmt: skip
    """SGLang's ``HiCacheStorageConfig`` as its controller builds it for ``host`` on one rank."""
    return hs.HiCacheStorageConfig(
        tp_rank=tp_rank, tp_size=tp_size, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1,
        is_mla_model=hasattr(host, "kv_cache_dim"), enable_storage_metrics=False,
        is_page_first_layout=host.layout == "page_first", model_name=model,
        extra_config=dict(extra),
    )  # fmt: skip


def _indices(starts: list[int]) -> torch.Tensor:
    return torch.tensor([s + t for s in starts for t in range(PAGE)], dtype=torch.int64)


def _factory_build(hs: Any, how: str, name: str, module: str, cls: str, host: Any,
                   extra: dict) -> Any:  # fmt: skip
    """SGLang's own ``StorageBackendFactory``: ``dynamic`` (``module_path`` / ``class_name``),
    or the fork guide's registration over SGLang's built-in ``name`` (restored after)."""
    from sglang.srt.mem_cache.storage import StorageBackendFactory as F

    if how == "dynamic":
        extra = {**extra, "backend_name": f"hicache_prefill_{name}", "module_path": module,
                 "class_name": cls}  # fmt: skip
        return F.create_backend("dynamic", _config(hs, host, extra), host)
    saved = F._registry.get(name)
    F.register_backend(name, module, cls)
    try:
        return F.create_backend(name, _config(hs, host, extra), host)
    finally:
        F._registry[name] = saved


def _attach(hs: Any, backend: Any, host: Any) -> None:
    """What SGLang 0.5.23's ``HybridCacheController.attach_storage_backend`` calls after the
    factory: the anchor pool, the KV pool group entry by name, then the registration hook."""
    backend.register_mem_pool_host(host)
    backend.register_mem_host_pool_v2(host, hs.PoolName.KV)
    backend.on_host_pools_registered()


def _controller_calls(hs: Any, backend: Any, host: Any, keys: list[str], src: list[int],
                      zero_copy: bool) -> dict[str, Any]:  # fmt: skip
    """Store ``keys`` from ``src`` slots of ``host`` through the calls SGLang's controller makes
    (generic ``batch_set`` of ``get_data_page`` pages, or zero-copy ``batch_set_v1``; then
    ``batch_set_v2`` for the KV pool), and query them (``batch_exists``, ``batch_exists_v2``)."""
    out: dict[str, Any] = {}
    if zero_copy:
        out["batch_set_v1"] = backend.batch_set_v1(keys[:3], _indices(src[:3]))
        assert out["batch_set_v1"] == [True] * 3, out
    else:
        out["batch_set"] = backend.batch_set(keys[:3],
                                             [host.get_data_page(s) for s in src[:3]])  # fmt: skip
        assert out["batch_set"] is True, out
    t = hs.PoolTransfer(name=hs.PoolName.KV, host_indices=_indices(src[3:]), keys=keys[3:])
    v2 = backend.batch_set_v2([t])
    assert v2 == {hs.PoolName.KV: [True] * len(keys[3:])}, v2
    assert backend.batch_exists(keys) == len(keys)
    r = backend.batch_exists_v2(keys, None, hs.HiCacheStorageExtraInfo())
    assert isinstance(r, hs.PoolTransferResult), type(r)
    assert r.kv_hit_pages == len(keys) and r.restorable_prefix_pages == list(
        range(1, len(keys) + 1)), r  # fmt: skip
    mamba = hs.PoolTransfer(name=hs.PoolName.MAMBA, keys=keys[-1:],
                            hit_policy=hs.PoolHitPolicy.TRAILING_PAGES)  # fmt: skip
    assert backend.batch_exists_v2(keys, [mamba]).kv_hit_pages == 0, "sidecars are misses"
    out["batch_exists_v2"] = r.kv_hit_pages
    return out


def _read_back(hs: Any, backend: Any, host: Any, keys: list[str], dst: list[int],
               zero_copy: bool) -> None:  # fmt: skip
    """Read ``keys`` into ``dst`` slots as SGLang's controller does (generic: ``batch_get`` of
    dummy pages then ``set_from_flat_data_page``; zero copy: ``batch_get_v1``), the last pages
    through ``batch_get_v2``."""
    if zero_copy:
        assert backend.batch_get_v1(keys[:3], _indices(dst[:3])) == [True] * 3
    else:
        pages = backend.batch_get(keys[:3], [host.get_dummy_flat_data_page() for _ in dst[:3]])
        for s, page in zip(dst[:3], pages, strict=True):
            assert page is not None, "generic batch_get missed"
            host.set_from_flat_data_page(s, page)
    t = hs.PoolTransfer(name=hs.PoolName.KV, host_indices=_indices(dst[3:]), keys=keys[3:])
    v2 = backend.batch_get_v2([t])
    assert v2 == {hs.PoolName.KV: [True] * len(keys[3:])}, v2


def run_factory_file(hs: Any, sglang: dict[str, Any], kind: str, how: str,
                     seed: int) -> dict[str, Any]:  # fmt: skip
    """SGLang's factory builds this project's ``HiCacheFile`` over SGLang's host pool; the
    controller's calls store and read pages; SGLang's own ``HiCacheFile`` over the same folder
    reads what it stored and stores what it reads, byte for byte."""
    out: dict[str, Any] = {"case": f"factory/{how}/file/{kind}", "ok": False}
    gen = torch.Generator().manual_seed(seed)
    try:
        dev = transfers.device_pool(kind, PAGE)
        theirs = transfers.host_pool(sglang, transfers.Case(kind, PAGE, "page_first", "kernel"),
                                     dev)  # fmt: skip
        kv = theirs.kv_buffer
        transfers._randomize(list(kv) if isinstance(kv, tuple | list) else [kv], gen)
        keys, keys2 = _keys(100 + seed), _keys(200 + seed)
        with tempfile.TemporaryDirectory() as d:
            mine = _factory_build(hs, how, "file", FILE_MODULE, "HiCacheFile", theirs,
                                  {"file_storage_path": d})  # fmt: skip
            assert isinstance(mine, hs.HiCacheStorage), "not SGLang's HiCacheStorage"
            assert type(mine).__module__ == FILE_MODULE, type(mine)
            out["built"] = f"{type(mine).__module__}.{type(mine).__name__}"
            _attach(hs, mine, theirs)
            out.update(_controller_calls(hs, mine, theirs, keys, _slots(0), zero_copy=False))
            sg = _sglang_file(hs, theirs, d, MODEL)
            for key, dst in zip(keys, _slots(5), strict=True):
                page = sg.get(key, theirs.get_dummy_flat_data_page())
                assert page is not None, f"SGLang's HiCacheFile misses {key[:12]}"
                theirs.set_from_flat_data_page(dst, page)
            assert _same_slots(kind, theirs, _slots(5), theirs, _slots(0)), "ours -> SGLang"
            out["ours_to_sglang"] = True
            for key, src in zip(keys2, _slots(10), strict=True):
                assert sg.set(key, theirs.get_data_page(src, flat=True))
            _read_back(hs, mine, theirs, keys2, _slots(15), zero_copy=False)
            assert _same_slots(kind, theirs, _slots(15), theirs, _slots(10)), "SGLang -> ours"
            out["sglang_to_ours"] = True
        out["ok"] = True
    except Exception as e:  # noqa: BLE001 - reported
        out["error"] = f"{type(e).__name__}: {e}"
    return out


def _fake_mooncake() -> tuple[Any, dict[str, Any]]:
    """The project's fake Mooncake (``tests/hicache/storage/mooncake/fake_mooncake.py``) as
    ``mooncake.store`` for SGLang's ``MooncakeStore`` and as this project's store factory, and
    the ``mooncake`` modules it stands in for (a real ``mooncake.store`` already imported: put
    back by ``_drop_fake_mooncake``)."""
    import sys

    from tests.hicache.storage.mooncake.fake_mooncake import FakeCluster

    saved = {n: m for n, m in sys.modules.items() if n == "mooncake" or n.startswith("mooncake.")}
    cluster = FakeCluster()
    store_mod = types.ModuleType("mooncake.store")
    store_mod.MooncakeDistributedStore = cluster.factory
    pkg = types.ModuleType("mooncake")
    pkg.__path__ = []
    pkg.store = store_mod
    for name in saved:
        del sys.modules[name]
    sys.modules["mooncake"], sys.modules["mooncake.store"] = pkg, store_mod
    return cluster, saved


def _drop_fake_mooncake(saved: dict[str, Any]) -> None:
    import sys

    for name in ("mooncake.store", "mooncake"):
        sys.modules.pop(name, None)
    sys.modules.update(saved)


def run_factory_mooncake(hs: Any, sglang: dict[str, Any], kind: str, how: str, seed: int,
                         cluster: Any) -> dict[str, Any]:  # fmt: skip
    """SGLang's factory builds this project's ``MooncakeStore`` over SGLang's host pool (no
    ``page_regions()``); the controller's zero-copy calls store and read pages; SGLang's own
    ``MooncakeStore`` on the same (fake) master reads what it stored and the reverse."""
    from hicache_prefill.hicache.storage.mooncake.store import MooncakeStore

    out: dict[str, Any] = {"case": f"factory/{how}/mooncake/{kind}", "ok": False}
    gen = torch.Generator().manual_seed(seed)
    sg_mod = importlib.import_module("sglang.srt.mem_cache.storage.mooncake_store.mooncake_store")
    mine = sg = None
    try:
        MooncakeStore.store_factory = cluster.factory
        dev = transfers.device_pool(kind, PAGE)
        theirs = transfers.host_pool(sglang, transfers.Case(kind, PAGE, "page_first", "kernel"),
                                     dev)  # fmt: skip
        assert not hasattr(theirs, "page_regions")
        kv = theirs.kv_buffer
        transfers._randomize(list(kv) if isinstance(kv, tuple | list) else [kv], gen)
        keys, keys2 = _keys(300 + seed), _keys(400 + seed)
        extra = {**MASTER, **({"interface_v1": 1} if how == "dynamic" else {})}
        mine = _factory_build(hs, how, "mooncake", MOONCAKE_MODULE, "MooncakeStore", theirs,
                              extra)  # fmt: skip
        assert isinstance(mine, hs.HiCacheStorage), "not SGLang's HiCacheStorage"
        assert type(mine).__module__ == MOONCAKE_MODULE, type(mine)
        out["built"] = f"{type(mine).__module__}.{type(mine).__name__}"
        _attach(hs, mine, theirs)
        out["registered_regions"] = len(mine.client._registered)
        out.update(_controller_calls(hs, mine, theirs, keys, _slots(0), zero_copy=True))
        sg = sg_mod.MooncakeStore(_config(hs, theirs, MASTER), theirs)
        sg.register_mem_pool_host(theirs)
        assert sg.batch_exists(keys) == len(keys), "SGLang's MooncakeStore does not find them"
        assert sg.batch_get_v1(keys, _indices(_slots(5))) == [True] * len(keys)
        assert _same_slots(kind, theirs, _slots(5), theirs, _slots(0)), "ours -> SGLang"
        out["ours_to_sglang"] = True
        assert sg.batch_set_v1(keys2, _indices(_slots(10))) == [True] * len(keys2)
        assert mine.batch_exists(keys2) == len(keys2), "this project does not find SGLang's"
        _read_back(hs, mine, theirs, keys2, _slots(15), zero_copy=True)
        assert _same_slots(kind, theirs, _slots(15), theirs, _slots(10)), "SGLang -> ours"
        out["sglang_to_ours"] = True
        out["objects"] = sorted(n for n in cluster.objects if keys[0] in n)
        out["ok"] = True
    except Exception as e:  # noqa: BLE001 - reported
        out["error"] = f"{type(e).__name__}: {e}"
    finally:
        MooncakeStore.store_factory = None
        for b in (mine, sg):
            if b is not None:
                try:
                    b.close()
                except Exception:  # noqa: BLE001 - closing a fake client
                    logger.exception("close")
    return out


def run_factory(hs: Any, sglang: dict[str, Any]) -> list[dict[str, Any]]:
    """Every factory row (file: dynamic and registered; Mooncake: registered (SGLang's
    zero-copy dispatch by name) and dynamic with ``interface_v1``), MHA and MLA."""
    out = [run_factory_file(hs, sglang, kind, how, seed)
           for seed, (kind, how) in enumerate(
               (k, h) for k in ("MHA", "MLA") for h in ("dynamic", "registered"))]  # fmt: skip
    cluster, saved = _fake_mooncake()
    try:
        for seed, (kind, how) in enumerate(
            (k, h) for k in ("MHA", "MLA") for h in ("registered", "dynamic")
        ):
            out.append(run_factory_mooncake(hs, sglang, kind, how, 10 + seed, cluster))
    finally:
        _drop_fake_mooncake(saved)
    out.extend(run_real_mooncake(hs, sglang))
    return out


# --- the same crossings on a real Mooncake master (loopback), TP 1 and TP 2 ---

REAL_SEGMENT = 64 << 20  # global_segment_size: split over the ranks (Mooncake's minimum: 16 MiB)


def _real_extra(address: str) -> dict[str, Any]:
    return {"master_server_address": address, "protocol": "tcp", "local_hostname": "127.0.0.1",
            "metadata_server": "P2PHANDSHAKE", "global_segment_size": REAL_SEGMENT}  # fmt: skip


def _real_names(kind: str, key: str, tp_size: int) -> tuple[list[str], list[str]]:
    """SGLang 0.5.23's object names of one page on a TP ``tp_size`` deployment (prefix: the model
    name), and names that must not exist: MHA ``{key}_{rank}_k`` / ``_v`` per rank; MLA one
    ``{key}__k`` for every rank (no per-rank copies)."""
    base = f"{'-'.join(MODEL.split('/'))}_{key}"
    if kind == "MLA":
        return [f"{base}__k"], [f"{base}_{r}_k" for r in range(tp_size)]
    return [f"{base}_{r}_{p}" for r in range(tp_size) for p in ("k", "v")], [f"{base}__k"]


def run_real_mooncake_case(hs: Any, sglang: dict[str, Any], master: Any, kind: str,
                           tp_size: int, seed: int) -> dict[str, Any]:  # fmt: skip
    """Per rank (``tp_rank`` r of ``tp_size``, its own host pool, as ``tp_size`` ranks would):
    this project's ``MooncakeStore`` stores pages (``batch_set_v1``) that SGLang's
    ``MooncakeStore`` of the same rank reads (``batch_get_v1``) byte for byte, and the reverse
    with other keys; then every rank's object names are SGLang's (MLA: one object, written by
    rank 0 only: this project's rank 1 writes nothing)."""
    from hicache_prefill.hicache.storage.mooncake.store import MooncakeStore

    out: dict[str, Any] = {"case": f"mooncake-real/{kind}/tp{tp_size}", "ok": False,
                           "master": f"{master.address} (pid {master.pid})"}  # fmt: skip
    sg_mod = importlib.import_module("sglang.srt.mem_cache.storage.mooncake_store.mooncake_store")
    gen = torch.Generator().manual_seed(seed)
    mine: list[Any] = []
    try:
        assert MooncakeStore.store_factory is None, "a fake store factory is set"
        extra = _real_extra(master.address)
        keys, keys2 = _keys(500 + 10 * seed), _keys(600 + 10 * seed)
        hosts, sgs = [], []
        for rank in range(tp_size):
            dev = transfers.device_pool(kind, PAGE)
            host = transfers.host_pool(sglang, transfers.Case(kind, PAGE, "page_first", "kernel"),
                                       dev)  # fmt: skip
            kv = host.kv_buffer
            bufs = list(kv) if isinstance(kv, tuple | list) else [kv]
            if kind == "MLA" and rank:  # MLA: every rank holds the same latent cache
                for b, b0 in zip(
                    bufs,
                    hosts[0].kv_buffer
                    if isinstance(hosts[0].kv_buffer, tuple | list)
                    else [hosts[0].kv_buffer],
                    strict=True,
                ):
                    b.copy_(b0)  # fmt: skip
            else:
                transfers._randomize(bufs, gen)
            hosts.append(host)
            cfg = _config(hs, host, extra, tp_rank=rank, tp_size=tp_size)
            m = MooncakeStore(cfg, host)
            mine.append(m)
            m.register_mem_pool_host(host)
            sg = sg_mod.MooncakeStore(cfg, host)
            sg.register_mem_pool_host(host)
            sgs.append(sg)
        # ours -> SGLang (the last rank first: an MLA rank other than 0 writes nothing and
        # answers whether the page is stored: not yet, then yes once rank 0 wrote it)
        for rank in reversed(range(tp_size)):
            got = mine[rank].batch_set_v1(keys, _indices(_slots(0)))
            if kind == "MLA" and rank:
                assert got == [False] * len(keys), f"MLA rank {rank} set before rank 0: {got}"
                gone = mine[rank]._exists(_real_names(kind, keys[0], tp_size)[0])
                assert gone == [0], f"MLA rank {rank} wrote {gone}"
            else:
                assert got == [True] * len(keys), f"ours rank {rank} set {got}"
        for rank in range(1, tp_size if kind == "MLA" else 1):
            got = mine[rank].batch_set_v1(keys, _indices(_slots(0)))
            assert got == [True] * len(keys), f"MLA rank {rank} after rank 0: {got}"
        for rank in range(tp_size):
            assert sgs[rank].batch_exists(keys) == len(keys), f"SGLang rank {rank} misses"
            got = sgs[rank].batch_get_v1(keys, _indices(_slots(5)))
            assert got == [True] * len(keys), f"SGLang rank {rank} get {got}"
            assert _same_slots(kind, hosts[rank], _slots(5), hosts[rank], _slots(0)), (
                f"ours -> SGLang bytes, rank {rank}"
            )
        out["ours_to_sglang"] = True
        # SGLang -> ours
        for rank in range(tp_size):
            got = sgs[rank].batch_set_v1(keys2, _indices(_slots(10)))
            assert got == [True] * len(keys2), f"SGLang rank {rank} set {got}"
        for rank in range(tp_size):
            assert mine[rank].batch_exists(keys2) == len(keys2), f"ours rank {rank} misses"
            got = mine[rank].batch_get_v1(keys2, _indices(_slots(15)))
            assert got == [True] * len(keys2), f"ours rank {rank} get {got}"
            assert _same_slots(kind, hosts[rank], _slots(15), hosts[rank], _slots(10)), (
                f"SGLang -> ours bytes, rank {rank}"
            )
        out["sglang_to_ours"] = True
        for k in (keys[0], keys2[0]):
            want, absent = _real_names(kind, k, tp_size)
            assert mine[0]._exists(want) == [1] * len(want), f"missing among {want}"
            assert mine[0]._exists(absent) == [0] * len(absent), f"unexpected among {absent}"
        out["objects"] = _real_names(kind, keys[0], tp_size)[0]
        out["object_suffixes"] = [o[o.index(keys[0]) + len(keys[0]) :] for o in out["objects"]]
        out["ok"] = True
    except Exception as e:  # noqa: BLE001 - reported
        out["error"] = f"{type(e).__name__}: {e}"
    finally:
        for m in mine:
            try:
                m.close()
            except Exception:  # noqa: BLE001 - reported in the log
                logger.exception("close")
    return out


def run_real_mooncake(hs: Any, sglang: dict[str, Any]) -> list[dict[str, Any]]:
    """The real-master rows (MHA / MLA x TP 1 / 2) on one ``mooncake_master`` started on free
    loopback ports and stopped by its pid; reported skipped, with the reason, where the real
    ``mooncake.store`` or the loopback shim (preloaded in this process) is missing."""
    cases = [(k, n) for k in ("MHA", "MLA") for n in (1, 2)]
    from tests.support.loopback import skip_reason

    why = skip_reason("store", shim_in_process=True)
    if why is not None:
        return [{"case": f"mooncake-real/{k}/tp{n}", "ok": True, "skipped": why}
                for k, n in cases]  # fmt: skip
    from tests.support.mooncake_master import MooncakeMaster

    master = MooncakeMaster.start()
    try:
        return [run_real_mooncake_case(hs, sglang, master, k, n, seed)
                for seed, (k, n) in enumerate(cases)]  # fmt: skip
    finally:
        master.stop()
