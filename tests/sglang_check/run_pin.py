"""One ``make sglang-check`` run: one pinned SGLang, one platform mode, in its own process.

``python -m tests.sglang_check.run_pin --site DIR --mode cpu|cuda-shaped --out FILE.json``
(``real-stack`` and ``pd-interop``: :mod:`tests.sglang_check.real_stack`,
:mod:`tests.sglang_check.pd_interop`)

- ``cpu``: SGLang imports as it does on this machine (no CUDA: its host-pool modules skip their
  ``from sgl_kernel.kvcacheio import ...`` branch). :func:`kernels.sglang.compat.install` runs
  after they are imported and binds this project's ops into their globals.
- ``cuda-shaped``: SGLang's platform probe answers CUDA, so the host-pool modules run their CUDA
  import branch at import time. ``install(route_around_jit=True)`` runs first: it registers
  ``sgl_kernel.kvcacheio`` (sgl-kernel is not installed), the modules import this project's ops
  from it, and the JIT predicates are routed around.

Then: the transfer cases (:mod:`tests.sglang_check.transfers`), the L3 cases (pages between this
project's and SGLang's ``HiCacheFile`` and ``MooncakeStore``, the latter also on a real loopback
``mooncake_master`` where Mooncake is installed (this run then re-executes itself with the
loopback shim preloaded), ``build_kv_host_pool`` over this project's device pools:
:mod:`tests.sglang_check.storage`), the compat module's
uninstall / reinstall round trip, and (``cpu`` mode) the gate cross product
(:mod:`tests.sglang_check.gate`). The result is one JSON object.
"""

from __future__ import annotations

import argparse
import importlib
import json
import logging
import os
import sys
import time
import traceback
from typing import Any

logger = logging.getLogger(__name__)

HOST_POOL_MODULES = (
    "sglang.srt.mem_cache.pool_host.mha",
    "sglang.srt.mem_cache.pool_host.mla",
    "sglang.srt.mem_cache.memory_pool_host",
)


def _setup(site: str, cuda_shaped: bool) -> Any:
    sys.path.insert(0, site)
    from hicache_prefill.kernels._env import ensure_triton_interpret

    ensure_triton_interpret()
    from tests.sglang_check import pin_stubs, stubs

    return stubs.install_importer(pin_stubs.stubs(cuda_shaped), pin_stubs.BARE_PACKAGES)


WATCHED = None  # set in main: the names whose bindings the round trip compares


def _snapshot(modules: list[str]) -> dict[str, dict[str, int | None]]:
    """``id`` of each watched name in each module's globals (None when absent)."""
    return {
        m: {n: (id(sys.modules[m].__dict__[n]) if n in sys.modules[m].__dict__ else None)
            for n in WATCHED}
        for m in modules
    }  # fmt: skip


def _roundtrip(compat: Any, handle: Any, before_install: dict) -> tuple[dict[str, Any], Any]:
    """install is idempotent; uninstall restores every binding exactly; reinstall works."""
    modules = list(before_install)
    installed = _snapshot(modules)
    again = compat.install(route_around_jit=handle.route_around_jit)
    handle.uninstall()
    restored = _snapshot(modules)
    fake_left = handle.registered_sgl_kernel and "sgl_kernel.kvcacheio" in sys.modules
    reinstalled = compat.install(route_around_jit=handle.route_around_jit)
    result = {
        "idempotent": again is handle,
        "uninstall_restores_exactly": restored == before_install and not fake_left,
        "differences_after_uninstall": sorted(
            f"{m}.{n}" for m in modules for n in WATCHED if restored[m][n] != before_install[m][n]
        ),
        "reinstall_same_bindings": _snapshot(modules) == installed,
    }
    return result, reinstalled


def _hf_kernels() -> dict[str, Any]:
    """Where ``import kernels`` leads (SGLang's FA3 loader does ``from kernels import get_kernel,
    load_kernel``): HuggingFace's package, never this project's ``hicache_prefill.kernels``."""
    import hicache_prefill.kernels as project

    try:
        import kernels as hf
        from kernels import get_kernel, load_kernel  # noqa: F401 - SGLang's import line
    except ImportError as e:
        return {"ok": False, "error": f"import kernels: {e}", "project_file": project.__file__}
    return {
        "ok": hf is not project and hf.__file__ != project.__file__,
        "kernels_file": hf.__file__,
        "project_file": project.__file__,
        "cwd": os.getcwd(),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--site", required=True)
    parser.add_argument(
        "--mode",
        choices=("cpu", "cuda-shaped", "real-stack", "tree-backend", "pd-interop"),
        required=True,
    )
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    logging.basicConfig(level=os.environ.get("SGLANG_CHECK_LOG", "WARNING"))
    if args.mode == "real-stack":  # SGLang's own device pools, assembler and L2 engine
        from tests.sglang_check import real_stack

        return real_stack.main(args.site, args.out)
    if args.mode == "tree-backend":  # the project's tree as SGLang's radix-cache backend
        from tests.sglang_check import tree_backend

        return tree_backend.main(args.site, args.out)
    if args.mode == "pd-interop":  # SGLang's own Mooncake PD connector against this project's
        from tests.sglang_check import pd_interop

        return pd_interop.main(args.site, args.out)
    _under_loopback_shim()
    cuda_shaped = args.mode == "cuda-shaped"
    finder = _setup(args.site, cuda_shaped)
    from hicache_prefill.kernels.sglang import compat, rebind
    from tests.sglang_check import gate, storage, stubs, transfers

    out: dict[str, Any] = {"mode": args.mode, "sglang_version": compat.sglang_version()}
    out["fork_import"] = _hf_kernels()
    t0 = time.monotonic()
    if not cuda_shaped:  # the gate does not depend on the ops: reported even if install fails
        try:
            out["gate"] = gate.run(out["sglang_version"])
        except Exception as e:
            out["gate_fatal"] = f"{type(e).__name__}: {e}"
            out["gate_traceback"] = traceback.format_exc()
    try:
        global WATCHED
        WATCHED = (*compat.KVCACHEIO_NAMES, *rebind.JIT_PREDICATES)
        if cuda_shaped:
            handle = compat.install(route_around_jit=True)
            before = _import_time_bindings(compat, handle)
        for name in HOST_POOL_MODULES:
            importlib.import_module(name)
        if not cuda_shaped:
            before = _snapshot([m for m in sys.modules if m.startswith(rebind.SCANNED_PACKAGE)])
            handle = compat.install()
            before = {m: before[m] for m in handle.patched_modules}
        out["install"] = {
            "layout": handle.layout,
            "registered_sgl_kernel": handle.registered_sgl_kernel,
            "patched_modules": handle.patched_modules,
            "skipped_modules": handle.skipped,
            "resolved_at_call": handle.resolved_at_call,
            "route_around_jit": handle.route_around_jit,
        }
        out["roundtrip"], handle = _roundtrip(compat, handle, before)
        after = _hf_kernels()  # the fork's one call leaves ``kernels`` HuggingFace's
        out["fork_import"]["ok"] = out["fork_import"]["ok"] and after["ok"]
        out["fork_import"]["after_install"] = after.get("kernels_file", after.get("error"))
        import sglang.srt.mem_cache.pool_host.mha as mha
        import sglang.srt.mem_cache.pool_host.mla as mla

        base = importlib.import_module("sglang.srt.mem_cache.pool_host.base")
        out["host_memory_reserve_bytes_set_to_0"] = _relax_host_reserve(base)
        sglang = {
            "mha": mha,
            "mla": mla,
            "takes_buffer_info": "buffer_info"
            in mha.MHATokenToKVPoolHost.__init__.__code__.co_varnames,
        }
        results = [
            transfers.run_case(sglang, case, handle, seed=i)
            for i, case in enumerate(transfers.cases(transfers.supports_asymmetric()))
        ]
        out["transfers"] = [r.to_dict() for r in results]
        out["storage"] = storage.run(sglang)
        handle.uninstall()
    except Exception as e:
        out["fatal"] = f"{type(e).__name__}: {e}"
        out["traceback"] = traceback.format_exc()
    out["stubs"] = stubs.report(finder)
    out["seconds"] = round(time.monotonic() - t0, 1)
    with open(args.out, "w", encoding="utf-8") as f:
        json.dump(out, f, indent=1, default=str)
    return 0


def _import_time_bindings(compat: Any, handle: Any) -> dict[str, dict[str, int | None]]:
    """What the cuda-shaped modules hold without the compat rebinding: the ops they imported
    from the registered ``sgl_kernel.kvcacheio`` (this project's) and SGLang's own JIT predicates
    (here the stub's)."""
    from hicache_prefill.kernels.sglang import rebind

    ops = compat.provided_ops()
    jit = sys.modules["sglang.kernels.ops.kvcache.hicache"]
    out = {}
    for m, names in handle.patched_modules.items():
        src = rebind.module_source(m)
        preds = rebind.imported_names(src, rebind.JIT_SOURCES, only_ops=False)
        out[m] = {
            n: id(ops[n]) if n in names else (id(getattr(jit, n)) if n in preds else None)
            for n in WATCHED
        }
    return out


def _under_loopback_shim() -> None:
    """Where Mooncake is installed, re-execute this run once with the loopback shim preloaded
    (the L3 rows on a real ``mooncake_master`` host engines in this process); its children do
    not inherit it."""
    from hicache_prefill.hicache.storage.mooncake import availability
    from tests.support import loopback

    if availability.installed():
        loopback.reexec_under_shim()
        loopback.forget_preload()


def _relax_host_reserve(base: Any) -> bool:
    """SGLang keeps 10 GiB of host RAM free when sizing a host pool; on a machine with less
    available the few-KiB pools here would be refused. Only then set to 0 (reported)."""
    import psutil

    reserve = getattr(base, "HICACHE_HOST_MEMORY_RESERVE_BYTES", 0)
    if psutil.virtual_memory().available > reserve + (1 << 30):
        return False
    base.HICACHE_HOST_MEMORY_RESERVE_BYTES = 0
    return True


if __name__ == "__main__":
    sys.exit(main())
