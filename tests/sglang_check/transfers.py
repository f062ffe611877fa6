"""Drive SGLang's own host pools through this project's ops and device pools, byte for byte.

For each case (MHA / asymmetric MHA (K head 192, V head 128) / MLA / MLA on SGLang's
layer-sharded backup path x page size x layout x io backend) one of this project's device pools
(``hicache.memory.device_pool``) and SGLang's host pool class over it are built; device and host are
filled with random bytes; then SGLang's ``backup_from_device_all_layer`` and, layer by layer,
``load_to_device_per_layer`` (and the ``*_physical`` variants where the version has them) run
with shuffled page-granular indices. After every call the whole destination is compared byte
for byte with a plain torch copy of the same slots, and the source must be unchanged.

Before the transfers, :func:`kernels.sglang.compat.warm_up` runs on the pair (kernel io backend).
Every kernel launch is recorded by the key Triton's own binder computes for an sm_90 target
(``tests/support/triton_keys.py``): the key a CUDA launch looks its compiled kernel up by. A
transfer launch whose key the warm-up did not launch would be a compile on the scheduler thread on
CUDA: counted as ``unwarmed_launches`` (must be 0). After the warm-up every pointer table of both
pools must have a verified alignment (on CUDA the kernels read it instead of the table; here the
tables are on the CPU and read directly, so both give the same launch).
"""

from __future__ import annotations

import inspect
import logging
from dataclasses import dataclass, field
from typing import Any

import torch

logger = logging.getLogger(__name__)

DTYPE = torch.bfloat16
LAYERS = 3
HEADS = 2
HEAD_DIM = 8
ASYM_HEAD_DIM, ASYM_V_HEAD_DIM = 192, 128  # asymmetric MHA (K 192 / V 128, as MiMo-V2)
KV_LORA_RANK, QK_ROPE_HEAD_DIM = 16, 8
DEVICE_TOKENS = 64
HOST_RATIO = 2.0

LAYOUTS = {
    ("MHA", "kernel"): ("layer_first", "page_first", "page_head"),
    ("MHA", "direct"): ("layer_first", "page_first_direct"),
    ("MHA-asym", "kernel"): ("page_first",),
    ("MHA-asym", "direct"): ("page_first_direct",),
    ("MLA", "kernel"): ("layer_first", "page_first"),
    ("MLA", "direct"): ("layer_first", "page_first_direct"),
    ("MLA-sharded", "kernel"): ("layer_first",),
    ("MLA-sharded", "direct"): ("layer_first",),
}
"""Every layout SGLang's host pools dispatch to a kvcacheio op, per io backend (kernel_ascend is
NPU only; page_unified has no kvcacheio path). ``MLA-sharded``: the MLA host pool on its
layer-sharded path (one shard holding every layer), whose backup copies layer by layer with the
per-layer ops; SGLang serves only layer_first there without its JIT kernels."""


@dataclass(frozen=True)
class Case:
    kind: str
    page_size: int
    layout: str
    io_backend: str

    @property
    def name(self) -> str:
        return f"{self.kind}/p{self.page_size}/{self.layout}/{self.io_backend}"


@dataclass
class CaseResult:
    case: Case
    ok: bool
    calls: list[str] = field(default_factory=list)
    error: str | None = None
    launches: int = 0
    variants: int = 0
    unwarmed_launches: int = 0
    warm_calls: int = 0
    warm_skipped: list[str] = field(default_factory=list)
    verified_tables: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return {
            "case": self.case.name,
            "ok": self.ok,
            "calls": self.calls,
            "error": self.error,
            "launches": self.launches,
            "variants": self.variants,
            "unwarmed_launches": self.unwarmed_launches,
            "warm_calls": self.warm_calls,
            "warm_skipped": self.warm_skipped,
            "verified_tables": self.verified_tables,
        }


def cases(asymmetric: bool) -> list[Case]:
    kinds = ("MHA", "MHA-asym", "MLA", "MLA-sharded") if asymmetric else (
        "MHA", "MLA", "MLA-sharded")  # fmt: skip
    return [
        Case(kind, page, layout, io)
        for kind in kinds
        for page in (1, 16)
        for io in ("kernel", "direct")
        for layout in LAYOUTS[(kind, io)]
    ]


class LaunchRecorder:
    """Wraps the kernel where ``kernels.triton.launch`` launches it, recording each launch's Triton
    specialization key (sm_90)."""

    def __init__(self) -> None:
        import hicache_prefill.kernels.triton.launch as launch_module
        from tests.support.triton_keys import launch_key

        self._module = launch_module
        self._kernel = launch_module.kv_copy_kernel
        self.keys: list[str] = []
        recorder = self

        class _Wrapped:
            def __getitem__(self, grid: Any) -> Any:
                launch = recorder._kernel[grid]

                def run(*args: Any, **kwargs: Any) -> Any:
                    recorder.keys.append(launch_key(*args, **kwargs))
                    return launch(*args, **kwargs)

                return run

        launch_module.kv_copy_kernel = _Wrapped()

    def close(self) -> None:
        self._module.kv_copy_kernel = self._kernel


# ----------------------------------------------------------------------------------------------
# Pools
# ----------------------------------------------------------------------------------------------


def device_pool(kind: str, page_size: int) -> Any:
    """One of this project's device pools (CPU)."""
    from hicache_prefill.hicache.memory.device_pool import MHATokenToKVPool, MLATokenToKVPool

    if kind.startswith("MLA"):
        pool = MLATokenToKVPool(
            DEVICE_TOKENS, page_size, DTYPE, KV_LORA_RANK, QK_ROPE_HEAD_DIM, LAYERS, "cpu"
        )
        if kind == "MLA-sharded":
            # One shard holding every layer (layer_shard_size 1, owned range [0, L)): what
            # SGLang's sharded path reads of the device pool, with nothing else changed.
            pool.layer_shard_enabled = True
        return pool
    if kind == "MHA-asym":
        return MHATokenToKVPool(
            DEVICE_TOKENS, page_size, DTYPE, HEADS, ASYM_HEAD_DIM, LAYERS, "cpu",
            v_head_dim=ASYM_V_HEAD_DIM,
        )  # fmt: skip
    return MHATokenToKVPool(DEVICE_TOKENS, page_size, DTYPE, HEADS, HEAD_DIM, LAYERS, "cpu")


def supports_asymmetric() -> bool:
    from hicache_prefill.hicache.memory.device_pool import MHATokenToKVPool

    return "v_head_dim" in inspect.signature(MHATokenToKVPool).parameters


def host_pool(sglang: dict[str, Any], case: Case, dev: Any) -> Any:
    """SGLang's host pool class for ``case`` over ``dev``, built as SGLang's own builder does."""
    mha, mla = sglang["mha"], sglang["mla"]
    cls = {
        "MHA": mha.MHATokenToKVPoolHost,
        "MHA-asym": mha.AsymmetricMHATokenToKVPoolHost,
        "MLA": mla.MLATokenToKVPoolHost,
        "MLA-sharded": mla.MLATokenToKVPoolHost,
    }[case.kind]
    common = dict(
        host_to_device_ratio=HOST_RATIO, host_size=0, page_size=case.page_size,
        layout=case.layout, pin_memory=False, device="cpu",
    )  # fmt: skip
    if not sglang["takes_buffer_info"]:
        return cls(dev, **common)
    from hicache_prefill.kernels.sglang.pool_info import sglang_buffer_info

    kwargs = dict(
        device_capacity_tokens=dev.size, start_layer=dev.start_layer, end_layer=dev.end_layer
    )
    if case.kind.startswith("MLA"):
        kwargs["target_layer_num"] = dev.layer_num
    if case.kind == "MLA-sharded":
        kwargs["layer_shard_enabled"] = True
    return cls(sglang_buffer_info(dev), **common, **kwargs)


# ----------------------------------------------------------------------------------------------
# Byte views: per component, [layer, token, ...]
# ----------------------------------------------------------------------------------------------


def device_rows(kind: str, dev: Any) -> list[torch.Tensor]:
    """Copies of the device pool's K and V (or latent) as ``[L, T, ...]`` each."""
    if kind.startswith("MLA"):
        return [torch.stack(list(dev.kv_buffer)).clone()]
    return [torch.stack(list(dev.k_buffer)).clone(), torch.stack(list(dev.v_buffer)).clone()]


def _component_rows(buf: torch.Tensor, layout: str, page_size: int) -> torch.Tensor:
    if layout == "layer_first":  # [L, T, ...]
        return buf.clone()
    if layout == "page_first":  # [T, L, ...]
        return buf.transpose(0, 1).clone()
    if layout == "page_first_direct":  # [pages, L, P, ...]
        perm = (1, 0, 2, *range(3, buf.dim()))
        t = buf.permute(perm)
        return t.reshape(t.shape[0], t.shape[1] * t.shape[2], *t.shape[3:]).clone()
    if layout == "page_head":  # [pages, H, P, L, D]
        t = buf.permute(3, 0, 2, 1, 4)  # [L, pages, P, H, D]
        return t.reshape(t.shape[0], t.shape[1] * t.shape[2], *t.shape[3:]).clone()
    raise ValueError(f"layout {layout!r} has no byte view here")


def host_rows(kind: str, host: Any) -> list[torch.Tensor]:
    """Copies of SGLang's host buffer as ``[L, T, ...]`` per component (K, V or latent)."""
    kv = host.kv_buffer
    if kind.startswith("MLA"):
        comps = [kv]
    elif isinstance(kv, (tuple, list)):
        comps = list(kv)
    else:
        comps = [kv[0], kv[1]]
    return [_component_rows(c, host.layout, host.page_size) for c in comps]


def _randomize(tensors: list[torch.Tensor], gen: torch.Generator) -> None:
    for t in tensors:
        b = t.view(torch.uint8)
        b.copy_(torch.randint(0, 256, b.shape, dtype=torch.uint8, generator=gen))


def _bytes_equal(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return all(
        x.shape == y.shape and torch.equal(x.contiguous().view(torch.uint8),
                                           y.contiguous().view(torch.uint8))
        for x, y in zip(a, b, strict=True)
    )  # fmt: skip


def _page_indices(slots: torch.Tensor, page_size: int, gen: torch.Generator) -> torch.Tensor:
    """``slots`` (whole pages) with the page order shuffled."""
    pages = slots.view(-1, page_size)
    return pages[torch.randperm(pages.shape[0], generator=gen)].reshape(-1).contiguous()


def _misaligned(idx: torch.Tensor) -> torch.Tensor:
    """``idx``'s values in a slice that starts 8 bytes past a 16-byte boundary."""
    buf = torch.empty(idx.numel() + 2, dtype=idx.dtype)
    start = 1 if buf.data_ptr() % 16 == 0 else 0
    out = buf[start : start + idx.numel()]
    out.copy_(idx)
    assert out.data_ptr() % 16 == 8
    return out


def _device_indices(dev: Any, n_pages: int, page: int, gen: torch.Generator) -> torch.Tensor:
    usable = torch.arange(1, DEVICE_TOKENS // page + 1)  # page 0 is padding
    pick = usable[torch.randperm(usable.numel(), generator=gen)[:n_pages]]
    return (pick[:, None] * page + torch.arange(page)[None, :]).reshape(-1).contiguous()


# ----------------------------------------------------------------------------------------------
# One case
# ----------------------------------------------------------------------------------------------


def run_case(sglang: dict[str, Any], case: Case, handle: Any, seed: int) -> CaseResult:
    result = CaseResult(case, ok=False)
    gen = torch.Generator().manual_seed(seed)
    recorder = LaunchRecorder()
    try:
        dev = device_pool(case.kind, case.page_size)
        host = host_pool(sglang, case, dev)
        if case.io_backend == "kernel":
            report = handle.warm_up(host, dev)
            result.warm_calls = len(report.calls)
            result.warm_skipped = [s[2] for s in report.skipped]
            result.verified_tables = [f"{o}.{n}: {a} B" for o, n, a in report.verified_tables]
            _check_tables_verified(host, dev)
        warmed = set(recorder.keys)
        recorder.keys.clear()
        n_pages = 2 if case.page_size > 1 else 24
        methods = [("backup_from_device_all_layer", "load_to_device_per_layer")]
        if hasattr(host, "backup_from_device_all_layer_physical"):
            methods.append(
                ("backup_from_device_all_layer_physical", "load_to_device_per_layer_physical")
            )
        for backup_name, load_name in methods:
            host_idx = _page_indices(host.alloc(n_pages * case.page_size), case.page_size, gen)
            # As slices of an allocator's lists: 8 bytes off the 16-byte alignment of the
            # warm-up's fresh index tensors (a kernel specialized on it would compile anew).
            host_idx = _misaligned(host_idx)
            dev_idx = _misaligned(_device_indices(dev, n_pages, case.page_size, gen))
            _backup(case, dev, host, getattr(host, backup_name), host_idx, dev_idx, gen)
            result.calls.append(backup_name)
            _load(case, dev, host, getattr(host, load_name), host_idx, dev_idx, gen)
            result.calls.append(f"{load_name} x{LAYERS}")
            host.free(host_idx)
        result.launches = len(recorder.keys)
        result.variants = len(set(recorder.keys))
        if case.io_backend == "kernel" and not recorder.keys:
            raise AssertionError("no kernel launch recorded on the kernel io backend")
        if case.io_backend == "direct" and recorder.keys:
            raise AssertionError("the direct io backend launched the copy kernel")
        result.unwarmed_launches = sum(1 for k in recorder.keys if k not in warmed)
        if result.unwarmed_launches:
            raise AssertionError(
                f"{result.unwarmed_launches} kernel launches with a specialization the warm-up "
                f"did not launch"
            )
        result.ok = True
    except Exception as e:  # reported per case; the check fails on any
        result.error = f"{type(e).__name__}: {e}"
        logger.debug("case %s failed", case.name, exc_info=True)
    finally:
        recorder.close()
    return result


def _check_tables_verified(host: Any, dev: Any) -> None:
    """After the warm-up every pointer table of both pools has a verified alignment (so on CUDA
    the kernels copy it with the widest word its addresses allow, in the variant warmed)."""
    from hicache_prefill.kernels import verified_alignment

    unknown = [
        f"{type(pool).__name__}.{name}"
        for pool in (host, dev)
        for name, value in vars(pool).items()
        if name.endswith("ptrs") and isinstance(value, torch.Tensor) and value.dim() == 1
        and value.dtype in (torch.int64, torch.uint64) and verified_alignment(value) == 0
    ]  # fmt: skip
    if unknown:
        raise AssertionError(f"pointer tables of unknown alignment after warm-up: {unknown}")


def _backup(case, dev, host, method, host_idx, dev_idx, gen) -> None:
    _randomize(_device_buffers(case.kind, dev), gen)
    _randomize(_host_buffers(host), gen)
    dev_before, host_before = device_rows(case.kind, dev), host_rows(case.kind, host)
    expected = [h.clone() for h in host_before]
    for e, d in zip(expected, dev_before, strict=True):
        e[:, host_idx] = d[:, dev_idx]
    method(dev, host_idx, dev_idx, case.io_backend)
    if not _bytes_equal(host_rows(case.kind, host), expected):
        raise AssertionError("backup: host bytes differ from a plain torch copy")
    if not _bytes_equal(device_rows(case.kind, dev), dev_before):
        raise AssertionError("backup: the device pool changed")


def _load(case, dev, host, method, host_idx, dev_idx, gen) -> None:
    _randomize(_device_buffers(case.kind, dev), gen)
    host_before = host_rows(case.kind, host)
    expected = device_rows(case.kind, dev)
    for layer in range(LAYERS):
        for e, h in zip(expected, host_before, strict=True):
            e[layer, dev_idx] = h[layer, host_idx]
        method(dev, host_idx, dev_idx, layer, case.io_backend)
        if not _bytes_equal(device_rows(case.kind, dev), expected):
            raise AssertionError(f"load layer {layer}: device bytes differ from a torch copy")
    if not _bytes_equal(host_rows(case.kind, host), host_before):
        raise AssertionError("load: the host pool changed")


def _device_buffers(kind: str, dev: Any) -> list[torch.Tensor]:
    return list(dev.kv_buffer) if kind.startswith("MLA") else [*dev.k_buffer, *dev.v_buffer]


def _host_buffers(host: Any) -> list[torch.Tensor]:
    kv = host.kv_buffer
    return list(kv) if isinstance(kv, (tuple, list)) else [kv]
