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
    out.extend(run_build_kv_host_pool())
    return out
