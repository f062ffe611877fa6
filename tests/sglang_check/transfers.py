"""Drive SGLang's own host pools through this project's ops and device pools, byte for byte.

For each case (MHA / asymmetric MHA / MLA x page size x layout x io backend) one of this project's
device pools (``hicache.memory_pool``) and SGLang's host pool class over it are built; device and
host are filled with random bytes; then SGLang's ``backup_from_device_all_layer`` and, layer by
layer, ``load_to_device_per_layer`` (and the ``*_physical`` variants where the version has them)
run with shuffled page-granular indices. After every call the whole destination is compared byte
for byte with a plain torch copy of the same slots, and the source must be unchanged.

Before the transfers, :func:`kernels.sglang_compat.warm_up` runs on the pair; every kernel launch
is recorded by its Triton specialization key (constexprs, warps, dtype and 16-byte alignment of
each pointer, 1 / multiple-of-16 of each specialized integer). A launch during the transfers whose
key the warm-up did not launch would be a compile on the scheduler thread on CUDA: counted as
``unwarmed_launches`` (must be 0).
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
V_HEAD_DIM = 4  # asymmetric MHA only
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
}
"""Every layout SGLang's host pools dispatch per io backend (kernel_ascend is NPU only)."""

# kv_copy_kernel's integer arguments that Triton does not specialize (do_not_specialize).
_NOT_SPECIALIZED = {6, 7, 13, 14}


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
    unwarmed_launches: int = 0
    warm_calls: int = 0
    warm_skipped: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return {
            "case": self.case.name,
            "ok": self.ok,
            "calls": self.calls,
            "error": self.error,
            "unwarmed_launches": self.unwarmed_launches,
            "warm_calls": self.warm_calls,
            "warm_skipped": self.warm_skipped,
        }


def cases(asymmetric: bool) -> list[Case]:
    kinds = ("MHA", "MHA-asym", "MLA") if asymmetric else ("MHA", "MLA")
    return [
        Case(kind, page, layout, io)
        for kind in kinds
        for page in (1, 16)
        for io in ("kernel", "direct")
        for layout in LAYOUTS[(kind, io)]
    ]


class LaunchRecorder:
    """Wraps ``kernels.copy_kernel.kv_copy_kernel`` to record each launch's specialization key."""

    def __init__(self) -> None:
        import kernels.copy_kernel as ck

        self._module = ck
        self._kernel = ck.kv_copy_kernel
        self.keys: list[tuple] = []
        recorder = self

        class _Wrapped:
            def __getitem__(self, grid: Any) -> Any:
                launch = recorder._kernel[grid]

                def run(*args: Any, **kwargs: Any) -> Any:
                    recorder.keys.append(_key(args, kwargs))
                    return launch(*args, **kwargs)

                return run

        ck.kv_copy_kernel = _Wrapped()

    def close(self) -> None:
        self._module.kv_copy_kernel = self._kernel


def _key(args: tuple, kwargs: dict) -> tuple:
    parts: list[Any] = []
    for i, a in enumerate(args):
        if isinstance(a, torch.Tensor):
            parts.append((str(a.dtype), a.data_ptr() % 16 == 0))
        elif isinstance(a, int) and i not in _NOT_SPECIALIZED:
            parts.append((a == 1, a % 16 == 0))
        else:
            parts.append(None)
    return (tuple(parts), tuple(sorted((k, str(v)) for k, v in kwargs.items())))


# ----------------------------------------------------------------------------------------------
# Pools
# ----------------------------------------------------------------------------------------------


def device_pool(kind: str, page_size: int) -> Any:
    """One of this project's device pools (CPU)."""
    from hicache.memory_pool import MHATokenToKVPool, MLATokenToKVPool

    if kind == "MLA":
        return MLATokenToKVPool(
            DEVICE_TOKENS, page_size, DTYPE, KV_LORA_RANK, QK_ROPE_HEAD_DIM, LAYERS, "cpu"
        )
    extra = {"v_head_dim": V_HEAD_DIM} if kind == "MHA-asym" else {}
    return MHATokenToKVPool(
        DEVICE_TOKENS, page_size, DTYPE, HEADS, HEAD_DIM, LAYERS, "cpu", **extra
    )


def supports_asymmetric() -> bool:
    from hicache.memory_pool import MHATokenToKVPool

    return "v_head_dim" in inspect.signature(MHATokenToKVPool).parameters


def host_pool(sglang: dict[str, Any], case: Case, dev: Any) -> Any:
    """SGLang's host pool class for ``case`` over ``dev``, built as SGLang's own builder does."""
    mha, mla = sglang["mha"], sglang["mla"]
    cls = {"MHA": mha.MHATokenToKVPoolHost, "MLA": mla.MLATokenToKVPoolHost}.get(case.kind)
    if case.kind == "MHA-asym":
        cls = mha.AsymmetricMHATokenToKVPoolHost
    common = dict(
        host_to_device_ratio=HOST_RATIO, host_size=0, page_size=case.page_size,
        layout=case.layout, pin_memory=False, device="cpu",
    )  # fmt: skip
    if not sglang["takes_buffer_info"]:
        return cls(dev, **common)
    from kernels.sglang_pool_info import sglang_buffer_info

    kwargs = dict(
        device_capacity_tokens=dev.size, start_layer=dev.start_layer, end_layer=dev.end_layer
    )
    if case.kind == "MLA":
        kwargs["target_layer_num"] = dev.layer_num
    return cls(sglang_buffer_info(dev), **common, **kwargs)


# ----------------------------------------------------------------------------------------------
# Byte views: per component, [layer, token, ...]
# ----------------------------------------------------------------------------------------------


def device_rows(kind: str, dev: Any) -> list[torch.Tensor]:
    """Copies of the device pool's K and V (or latent) as ``[L, T, ...]`` each."""
    if kind == "MLA":
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
    if kind == "MLA":
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
            dev_idx = _device_indices(dev, n_pages, case.page_size, gen)
            _backup(case, dev, host, getattr(host, backup_name), host_idx, dev_idx, gen)
            result.calls.append(backup_name)
            _load(case, dev, host, getattr(host, load_name), host_idx, dev_idx, gen)
            result.calls.append(f"{load_name} x{LAYERS}")
            host.free(host_idx)
        result.unwarmed_launches = (
            sum(1 for k in recorder.keys if k not in warmed) if case.io_backend == "kernel" else 0
        )
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


def _backup(case, dev, host, method, host_idx, dev_idx, gen) -> None:
    _randomize(list(dev.kv_buffer if case.kind == "MLA" else [*dev.k_buffer, *dev.v_buffer]), gen)
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
    _randomize(list(dev.kv_buffer if case.kind == "MLA" else [*dev.k_buffer, *dev.v_buffer]), gen)
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


def _host_buffers(host: Any) -> list[torch.Tensor]:
    kv = host.kv_buffer
    return list(kv) if isinstance(kv, (tuple, list)) else [kv]
