"""Host KV pools (``MHATokenToKVPoolHost``, ``MLATokenToKVPoolHost``), ``make_host_pool``.

One host allocation of ``size`` token slots in one of three layouts (docs/DESIGN.md section 3),
split into parts (K and V, or the MLA latent), with its own page allocator (no padding page).
The MHA and MLA pools only name their parts and where a device pool (SGLang's attribute names)
keeps them. Copies launch on the current stream and never synchronize.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from typing import Any

import torch

from hicache_prefill import kernels
from hicache_prefill.hicache.memory import host_ram
from hicache_prefill.hicache.memory.allocator import TokenToKVPoolAllocator
from hicache_prefill.hicache.memory.host_pool_pages import HostPoolPages
from hicache_prefill.kernels.ops.checks import slot_indices

logger = logging.getLogger(__name__)

LAYOUTS = ("layer_first", "page_first", "page_first_direct")
SUPPORTED_LAYOUT_IO = frozenset(
    {
        ("layer_first", "kernel"),
        ("layer_first", "direct"),
        ("page_first", "kernel"),
        ("page_first_direct", "direct"),
    }
)

# The ``kernel`` io backend's op per (layout, direction): (one part, two parts).
KERNEL_OPS = {
    ("layer_first", "d2h"): ("transfer_kv_all_layer_mla", "transfer_kv_all_layer"),
    ("page_first", "d2h"): ("transfer_kv_all_layer_mla_lf_pf", "transfer_kv_all_layer_lf_pf"),
    ("layer_first", "h2d"): ("transfer_kv_per_layer_mla", "transfer_kv_per_layer"),
    ("page_first", "h2d"): ("transfer_kv_per_layer_mla_pf_lf", "transfer_kv_per_layer_pf_lf"),
}

DEVICE_POOL_FIELDS = ("page_size", "size", "layer_num", "device")  # and store_dtype or dtype


def require_fields(device_pool: Any, names: Sequence[str], kind: str) -> None:
    """``ValueError`` naming every attribute (SGLang's name) ``device_pool`` lacks."""
    missing = [n for n in (*DEVICE_POOL_FIELDS, *names) if not hasattr(device_pool, n)]
    if not hasattr(device_pool, "store_dtype") and not hasattr(device_pool, "dtype"):
        missing.append("store_dtype")
    if missing:
        raise ValueError(
            f"device_pool ({type(device_pool).__name__}) is not an {kind} device pool: it lacks "
            f"{missing}"
        )


def _store_dtype(device_pool: Any) -> torch.dtype:
    return getattr(device_pool, "store_dtype", None) or device_pool.dtype


class HostKVPool(HostPoolPages):
    """A host pool over a list of parts, which a subclass names. The constructor is SGLang's."""

    FIELDS: tuple[str, ...] = ()
    KIND = ""

    def __init__(
        self,
        device_pool: Any,
        host_to_device_ratio: float,
        host_size: float,
        page_size: int,
        layout: str,
        pin_memory: bool = True,
    ) -> None:
        require_fields(device_pool, self.FIELDS, self.KIND)
        if layout not in LAYOUTS:
            raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
        if page_size != device_pool.page_size:
            raise ValueError(
                f"page_size={page_size} differs from the device pool's {device_pool.page_size}"
            )
        self.device_pool = device_pool
        self.device = torch.device(device_pool.device)
        self.page_size = page_size
        self.layout = layout
        self.dtype = _store_dtype(device_pool)
        self.layer_num = device_pool.layer_num
        self.token_shapes = self.token_shapes_of(device_pool)
        self.part_item_sizes = [
            math.prod(shape) * self.dtype.itemsize for shape in self.token_shapes
        ]
        self.item_size = self.part_item_sizes[0]
        self.size_per_token = sum(self.part_item_sizes) * self.layer_num
        self.size = self._tokens_for(device_pool, host_to_device_ratio, host_size)
        self.page_num = self.size // page_size
        self.layout_dim = self.item_size * self.layer_num  # bytes of one token, all layers

        requested = self.size * self.size_per_token
        reserve = host_ram.host_memory_reserve_bytes()
        budget = host_ram.host_memory_available_bytes() - reserve
        if requested > budget:
            raise ValueError(
                f"host KV pool of {self.size} tokens needs {requested / 1e9:.2f} GB but only "
                f"{max(budget, 0) / 1e9:.2f} GB of host RAM may be used (MemAvailable minus a "
                f"{reserve / 1e9:.2f} GB reserve); reduce hicache_size or hicache_ratio"
            )
        if self.size <= device_pool.size:
            logger.warning(
                "host KV pool (%d tokens) is not larger than the device pool (%d tokens); "
                "write-through needs a larger host pool",
                self.size,
                device_pool.size,
            )
        self.pinned = pin_memory and self.device.type == "cuda"
        self._allocate(self.pinned)
        # Per part, the layers' data_ptr() table (layer_first: what the all-layer kernels take).
        self.part_ptr_tables: list[torch.Tensor] = []
        if layout == "layer_first":
            self.part_ptr_tables = [
                kernels.data_ptr_table([part[i] for i in range(self.layer_num)], self.device)
                for part in self.parts
            ]
        self.allocator = self._new_allocator()
        self._name_parts()
        logger.info(
            "%s: %d tokens (%d pages), layout %s, %.3f GB, pinned=%s (registered=%s)",
            type(self).__name__,
            self.size,
            self.page_num,
            layout,
            requested / 1e9,
            self.pinned,
            self._registered,
        )

    # --- what a kind of pool names --------------------------------------------------------------
    @staticmethod
    def token_shapes_of(device_pool: Any) -> list[tuple[int, ...]]:
        """One token of one layer of each part: ``[(H, D), (H, D_v)]`` or ``[(1, C)]``."""
        raise NotImplementedError

    @staticmethod
    def device_layers(device_pool: Any) -> list[list[torch.Tensor]]:
        raise NotImplementedError

    @staticmethod
    def device_ptr_tables(device_pool: Any) -> list[torch.Tensor]:
        raise NotImplementedError

    def _name_parts(self) -> None:
        """Set SGLang's attribute names for the parts."""
        raise NotImplementedError

    # --- sizing and memory ----------------------------------------------------------------------
    def _tokens_for(self, device_pool: Any, ratio: float, host_size: float) -> int:
        return host_ram.host_pool_tokens(
            device_pool.size, self.size_per_token, self.page_size, ratio, host_size
        )

    def _new_allocator(self) -> TokenToKVPoolAllocator:
        return TokenToKVPoolAllocator(self.size, self.page_size, "cpu", reserve_padding=False)

    def _slot_dims(self) -> tuple[int, ...]:
        if self.layout == "layer_first":
            return (self.layer_num, self.size)
        if self.layout == "page_first":
            return (self.size, self.layer_num)
        return (self.page_num, self.layer_num, self.page_size)

    def _allocate(self, pin: bool) -> None:
        """``kv_buffer`` (one host allocation) and ``parts``: its leading axis when the parts
        share a shape, else its split."""
        shapes = [self._slot_dims() + tok for tok in self.token_shapes]
        if len(shapes) == 1 or shapes[0] == shapes[1]:
            lead = (len(shapes),) if len(shapes) > 1 else ()
            self.kv_buffer, self._registered = host_ram.alloc_host_buffer(
                lead + shapes[0], self.dtype, pin
            )
            self.parts = list(self.kv_buffer) if lead else [self.kv_buffer]
            return
        sizes = [math.prod(shape) for shape in shapes]
        self.kv_buffer, self._registered = host_ram.alloc_host_buffer(
            (sum(sizes),), self.dtype, pin
        )
        self.parts = [
            part.view(shape)
            for part, shape in zip(self.kv_buffer.split(sizes), shapes, strict=True)
        ]

    def reuse_for(
        self, device_pool: Any, host_to_device_ratio: float, host_size: float, layout: str
    ) -> None:
        """Serve ``device_pool`` with this buffer and a fresh allocator (a benchmark pins one pool
        for all its caches). ``ValueError`` (nothing changes) unless it asks for exactly this
        pool. The previous user must be closed (no copy of it in flight)."""
        same_kind = isinstance(self, host_pool_class(device_pool))
        have = {
            "layout": (self.layout, layout),
            "device": (self.device, torch.device(device_pool.device)),
            "page_size": (self.page_size, device_pool.page_size),
            "dtype": (self.dtype, _store_dtype(device_pool)),
            "layer_num": (self.layer_num, device_pool.layer_num),
            "token shapes": (
                self.token_shapes,
                self.token_shapes_of(device_pool)
                if same_kind
                else "another kind of device pool (MHA / MLA)",
            ),
        }
        differ = {k: pair for k, pair in have.items() if pair[0] != pair[1]}
        if not differ:
            tokens = self._tokens_for(device_pool, host_to_device_ratio, host_size)
            if tokens != self.size:
                differ["tokens"] = (self.size, tokens)
        if differ:
            raise ValueError(f"host_pool cannot serve this device pool: (has, asked) {differ}")
        self.device_pool = device_pool
        self.allocator = self._new_allocator()
        logger.info("%s reused: %d tokens, a fresh allocator", type(self).__name__, self.size)

    # --- allocator (SGLang calls these on the host pool) ---------------------------------------
    def alloc(self, need_size: int) -> torch.Tensor | None:
        """Host slots (CPU int64, whole pages) or ``None`` when short."""
        return self.allocator.alloc(need_size)

    def free(self, indices: torch.Tensor) -> int:
        self.allocator.free(indices)
        return indices.numel()

    def available_size(self) -> int:
        return self.allocator.available_size()

    @property
    def logical_size(self) -> int:
        """Tokens the pool holds (SGLang's name; its scheduler's metrics read it)."""
        return self.size

    def check_integrity(self) -> None:
        self.allocator.check_integrity()

    def mem_bytes(self) -> int:
        return self.kv_buffer.numel() * self.kv_buffer.element_size()

    def destroy(self) -> None:
        """Unregister a ``cudaHostRegister``ed buffer after waiting for the device (idempotent;
        the pool is unusable after)."""
        if self._registered:
            torch.cuda.synchronize(self.device)
            kernels.clear_plans()  # cached launch plans assume the buffer stays registered
            torch.cuda.cudart().cudaHostUnregister(self.kv_buffer.data_ptr())
            self._registered = False

    def __del__(self) -> None:
        try:
            self.destroy()
        except Exception:  # noqa: BLE001 - interpreter shutdown
            pass

    # --- copies ----------------------------------------------------------------------------------
    def check_copy_args(
        self,
        host_indices: torch.Tensor,
        device_indices: torch.Tensor,
        io_backend: str,
        layer_id: int | None = None,
    ) -> None:
        """``ValueError`` for an unsupported pair, malformed indices, or a bad ``layer_id``."""
        if (self.layout, io_backend) not in SUPPORTED_LAYOUT_IO:
            raise ValueError(
                f"io_backend={io_backend!r} is not supported with layout {self.layout!r}; "
                f"supported pairs: {sorted(SUPPORTED_LAYOUT_IO)}"
            )
        slot_indices("host_indices", host_indices)
        slot_indices("device_indices", device_indices)
        if host_indices.numel() != device_indices.numel():
            raise ValueError(
                f"host_indices ({host_indices.numel()}) and device_indices "
                f"({device_indices.numel()}) differ in length"
            )
        if layer_id is not None:
            self._check_layer(layer_id)

    def _check_layer(self, layer_id: int) -> None:
        if not 0 <= layer_id < self.layer_num:
            raise ValueError(f"layer_id must be in [0, {self.layer_num}), got {layer_id}")

    def backup_from_device_all_layer(
        self,
        device_pool: Any,
        host_indices: torch.Tensor,
        device_indices: torch.Tensor,
        io_backend: str,
    ) -> None:
        """D2H of all layers. ``kernel``: indices on the device pool's device; ``direct``: CPU."""
        self.check_copy_args(host_indices, device_indices, io_backend)
        if host_indices.numel() == 0:
            return
        idx = (device_indices, host_indices)
        if io_backend == "direct":
            src = [b for layers in self.device_layers(device_pool) for b in layers]
            if self.layout == "layer_first":
                dst = [part[i] for part in self.parts for i in range(self.layer_num)]
                kernels.transfer_kv_direct(src, dst, *idx, self.page_size)
            else:  # page_first_direct
                kernels.transfer_kv_all_layer_direct_lf_pf(src, self.parts, *idx, self.page_size)
            return
        src_tables = self.device_ptr_tables(device_pool)
        if self.layout == "page_first":  # V's size comes from the host V buffer
            pairs = list(zip(src_tables, self.parts, strict=True))
            self._kernel_op("d2h", pairs, idx, (self.item_size, self.layout_dim, self.layer_num))
            return
        pairs = list(zip(src_tables, self.part_ptr_tables, strict=True))
        if len(set(self.part_item_sizes)) == 1:
            self._kernel_op("d2h", pairs, idx, (self.item_size, self.layer_num))
            return
        # Tables alone carry no V size: each part with its own item size, as upstream does.
        for pair, item in zip(pairs, self.part_item_sizes, strict=True):
            self._kernel_op("d2h", [pair], idx, (item, self.layer_num))

    def load_to_device_per_layer(
        self,
        device_pool: Any,
        host_indices: torch.Tensor,
        device_indices: torch.Tensor,
        layer_id: int,
        io_backend: str,
        validate: bool = True,
    ) -> None:
        """H2D of one layer. ``validate=False``: the caller ran ``check_copy_args`` already."""
        if validate:
            self.check_copy_args(host_indices, device_indices, io_backend, layer_id)
        if host_indices.numel() == 0:
            return
        dst = [layers[layer_id] for layers in self.device_layers(device_pool)]
        idx = (host_indices, device_indices)
        if io_backend == "direct" and self.layout == "layer_first":
            src = [part[layer_id] for part in self.parts]
            kernels.transfer_kv_direct(src, dst, *idx, self.page_size)
        elif io_backend == "direct":  # page_first_direct
            kernels.transfer_kv_per_layer_direct_pf_lf(
                self.parts, dst, *idx, layer_id, self.page_size
            )
        elif self.layout == "layer_first":
            pairs = [(part[layer_id], d) for part, d in zip(self.parts, dst, strict=True)]
            self._kernel_op("h2d", pairs, idx, (self.item_size,))
        else:  # page_first
            pairs = list(zip(self.parts, dst, strict=True))
            self._kernel_op("h2d", pairs, idx, (layer_id, self.item_size, self.layout_dim))

    def _kernel_op(
        self,
        direction: str,
        pairs: list[tuple[torch.Tensor, torch.Tensor]],
        indices: tuple[torch.Tensor, torch.Tensor],
        sizes: tuple[int, ...],
    ) -> None:
        name = KERNEL_OPS[self.layout, direction][len(pairs) - 1]
        op = getattr(kernels, name)  # looked up now: a replaced op (tests) is the one that runs
        op(*[t for pair in pairs for t in pair], *indices, *sizes)

    # --- single slots on the CPU (tests and debugging; blocking) --------------------------------
    def _slot_key(self, layer_id: int, indices: torch.Tensor) -> tuple[Any, ...]:
        self._check_layer(layer_id)
        idx = slot_indices("indices", indices, n_slots=self.size).cpu()
        if self.layout == "layer_first":
            return (layer_id, idx)
        if self.layout == "page_first":
            return (idx, layer_id)
        return (idx // self.page_size, layer_id, idx % self.page_size)

    def get_kv_slots(self, layer_id: int, indices: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Copies of host slots of a layer, one ``[n, *token]`` per part (CPU)."""
        key = self._slot_key(layer_id, indices)
        return tuple(part[key] for part in self.parts)

    def _set_slots(
        self, layer_id: int, indices: torch.Tensor, values: tuple[torch.Tensor, ...], names: str
    ) -> None:
        key = self._slot_key(layer_id, indices)
        want = [(indices.numel(), *tok) for tok in self.token_shapes]
        if len(values) != len(want) or any(
            tuple(v.shape) != w for v, w in zip(values, want, strict=True)
        ):
            raise ValueError(f"{names} must have shapes {want}")
        for part, value in zip(self.parts, values, strict=True):
            part[key] = value.to(self.dtype).cpu()


class MHATokenToKVPoolHost(HostKVPool):
    """Host copy of an MHA device pool: parts K (``k_buffer``) and V (``v_buffer``)."""

    FIELDS = ("head_num", "head_dim", "k_buffer", "v_buffer", "k_data_ptrs", "v_data_ptrs")
    KIND = "MHA"

    def _name_parts(self) -> None:
        (self.head_num, self.head_dim), (_, self.v_head_dim) = self.token_shapes
        self.k_buffer, self.v_buffer = self.parts
        self.v_item_size = self.part_item_sizes[1]
        if self.layout == "layer_first":
            self.k_data_ptrs, self.v_data_ptrs = self.part_ptr_tables

    @staticmethod
    def token_shapes_of(device_pool: Any) -> list[tuple[int, ...]]:
        v_dim = getattr(device_pool, "v_head_dim", None) or device_pool.head_dim
        return [(device_pool.head_num, device_pool.head_dim), (device_pool.head_num, v_dim)]

    @staticmethod
    def device_layers(device_pool: Any) -> list[list[torch.Tensor]]:
        return [device_pool.k_buffer, device_pool.v_buffer]

    @staticmethod
    def device_ptr_tables(device_pool: Any) -> list[torch.Tensor]:
        return [device_pool.k_data_ptrs, device_pool.v_data_ptrs]

    def set_kv_slots(
        self, layer_id: int, indices: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> None:
        self._set_slots(layer_id, indices, (k, v), "k and v")


class MLATokenToKVPoolHost(HostKVPool):
    """Host copy of an MLA device pool: one part, the latent (``kv_cache_dim`` wide)."""

    FIELDS = ("kv_lora_rank", "qk_rope_head_dim", "kv_buffer", "data_ptrs")
    KIND = "MLA"

    def _name_parts(self) -> None:
        self.kv_cache_dim = self.token_shapes[0][1]
        if self.layout == "layer_first":
            self.data_ptrs = self.part_ptr_tables[0]

    @staticmethod
    def token_shapes_of(device_pool: Any) -> list[tuple[int, ...]]:
        dim = getattr(device_pool, "kv_cache_dim", None) or (
            device_pool.kv_lora_rank + device_pool.qk_rope_head_dim
        )
        return [(1, dim)]

    @staticmethod
    def device_layers(device_pool: Any) -> list[list[torch.Tensor]]:
        return [device_pool.kv_buffer]

    @staticmethod
    def device_ptr_tables(device_pool: Any) -> list[torch.Tensor]:
        return [device_pool.data_ptrs]

    def set_kv_slots(self, layer_id: int, indices: torch.Tensor, kv: torch.Tensor) -> None:
        self._set_slots(layer_id, indices, (kv,), "kv")


def host_pool_class(device_pool: Any) -> type[HostKVPool]:
    """MLA when the device pool has a latent (``kv_lora_rank``), else MHA (as SGLang chooses)."""
    return MLATokenToKVPoolHost if hasattr(device_pool, "kv_lora_rank") else MHATokenToKVPoolHost


def make_host_pool(
    device_pool: Any,
    host_to_device_ratio: float,
    host_size: float,
    layout: str,
    pin_memory: bool = True,
) -> HostKVPool:
    """The host pool for ``device_pool`` (this project's or any with SGLang's attributes)."""
    page_size = getattr(device_pool, "page_size", None)  # the pool names it when missing
    cls = host_pool_class(device_pool)
    return cls(device_pool, host_to_device_ratio, host_size, page_size, layout, pin_memory)
