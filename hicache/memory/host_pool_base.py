"""What the MHA and MLA host pools share: layouts, construction and sizing, the allocator, checks.

A host pool is one buffer of ``T`` token slots (``P = T / page_size`` pages) in one of three
layouts (docs/DESIGN.md section 3), plus its own page allocator (no padding page: every host slot is
usable). Sizing, the RAM check and pinning come from ``host_ram``.

The device pool is duck-typed on SGLang's attribute names (``page_size``, ``size``,
``layer_num``, ``device``, ``store_dtype`` or ``dtype``, and per model kind the head geometry and
per-layer buffers and pointer tables), so a host pool backs this project's device pools and
SGLang's alike. K and V of different head widths get one allocation split into ``k_buffer``
and ``v_buffer`` (``kv_buffer`` is then that flat allocation).

| layout              | MHA ``kv_buffer``              | MLA ``kv_buffer``          |
|---------------------|--------------------------------|----------------------------|
| ``layer_first``     | ``(2, L, T, H, D)``            | ``(L, T, 1, C)``           |
| ``page_first``      | ``(2, T, L, H, D)``            | ``(T, L, 1, C)``           |
| ``page_first_direct`` | ``(2, P, L, page_size, H, D)`` | ``(P, L, page_size, 1, C)`` |

Supported (layout, io_backend) pairs, as upstream: ``layer_first`` with ``kernel`` or ``direct``,
``page_first`` with ``kernel``, ``page_first_direct`` with ``direct`` (``ServerArgs`` resolves the
other two pairs the way SGLang does). The ``direct`` copies are the same for MHA and MLA (a list
of per-layer device buffers per part: K and V, or the latent) and live in ``host_pool_direct``;
each subclass keeps its ``kernel`` copies. Reading and writing single slots on the host (tests,
debugging) is ``host_pool_slots``. Copies only launch work on the current stream (the controller
calls them inside its side streams); they never synchronize.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, TypeVar

import torch

import kernels
from hicache.memory import host_ram
from hicache.memory.allocator import TokenToKVPoolAllocator
from hicache.memory.host_pool_direct import DirectCopies
from hicache.memory.host_pool_pages import HostPoolPagesMixin
from hicache.memory.host_pool_slots import SlotAccess
from kernels.ops.checks import slot_indices

if TYPE_CHECKING:
    from hicache.memory.device_pool import MHATokenToKVPool, MLATokenToKVPool
    from server_args import ServerArgs

logger = logging.getLogger(__name__)

LAYOUTS = ("layer_first", "page_first", "page_first_direct")
IO_BACKENDS = ("kernel", "direct")
SUPPORTED_LAYOUT_IO = frozenset(
    {
        ("layer_first", "kernel"),
        ("layer_first", "direct"),
        ("page_first", "kernel"),
        ("page_first_direct", "direct"),
    }
)

_PoolT = TypeVar("_PoolT", bound="_HostKVPoolBase")

DEVICE_POOL_FIELDS = ("page_size", "size", "layer_num", "device")
"""What every host pool reads of any device pool (besides ``store_dtype`` or ``dtype``)."""


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


class _HostKVPoolBase(DirectCopies, SlotAccess, HostPoolPagesMixin):
    """Sizing, RAM check, allocation, pinning and the allocator shared by MHA and MLA.

    A subclass sets what ``_token_shapes()`` reads before calling ``__init__`` (one token shape
    per part: K and V, or the MLA latent); ``__init__`` allocates ``kv_buffer`` and the part
    buffers ``_host_parts`` (each with the layout's axes). Whole-page access for storage
    backends comes from ``HostPoolPagesMixin`` (``host_pool_pages``).
    """

    _host_parts: list[torch.Tensor]

    def __init__(
        self,
        device_pool: MHATokenToKVPool | MLATokenToKVPool,
        host_to_device_ratio: float,
        host_size: float,
        page_size: int,
        layout: str,
        pin_memory: bool = True,
    ) -> None:
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
        self.dtype = getattr(device_pool, "store_dtype", None) or device_pool.dtype
        self.layer_num = device_pool.layer_num
        elem = torch.empty(0, dtype=self.dtype).element_size()
        self.part_item_sizes = [math.prod(shape) * elem for shape in self._token_shapes()]
        self.item_size = self.part_item_sizes[0]
        self.size_per_token = sum(self.part_item_sizes) * self.layer_num
        self.size = host_ram.host_pool_tokens(
            device_pool.size, self.size_per_token, page_size, host_to_device_ratio, host_size
        )
        self.page_num = self.size // page_size
        self.layout_dim = self.item_size * self.layer_num  # bytes of one token, all layers

        requested = self.size * self.size_per_token
        available = host_ram.host_memory_available_bytes()
        reserve = host_ram.host_memory_reserve_bytes()
        budget = available - reserve
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
        want_pin = pin_memory and self.device.type == "cuda"
        self._allocate(want_pin)
        self.pinned = want_pin
        self.allocator = TokenToKVPoolAllocator(self.size, page_size, "cpu", reserve_padding=False)
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

    @classmethod
    def from_server_args(
        cls: type[_PoolT], args: ServerArgs, device_pool: MHATokenToKVPool | MLATokenToKVPool
    ) -> _PoolT:
        return cls(
            device_pool,
            args.hicache_ratio,
            args.hicache_size,
            args.page_size,
            args.hicache_mem_layout,
        )

    def _token_shapes(self) -> list[tuple[int, ...]]:
        """One token of one layer of each part: ``[(H, D), (H, D_v)]`` or ``[(1, C)]``."""
        raise NotImplementedError

    def _token_shapes_of(self, device_pool: Any) -> list[tuple[int, ...]]:
        """What ``_token_shapes`` would be for a host pool of ``device_pool``."""
        raise NotImplementedError

    def _same_kind(self, device_pool: Any) -> bool:
        """``device_pool`` is of the kind this pool serves (MLA pools have a latent)."""
        return hasattr(device_pool, "kv_lora_rank") == hasattr(self, "kv_cache_dim")

    def reuse_for(
        self, device_pool: Any, host_to_device_ratio: float, host_size: float, layout: str
    ) -> None:
        """Serve ``device_pool`` from now on with this pool's buffer (pinned or registered once)
        and a fresh, empty allocator: how a benchmark gives one host pool to its calibration
        and every configuration instead of registering gigabytes per cache. ``ValueError``
        (nothing changes) unless ``device_pool``, the sizing flags and ``layout`` ask for
        exactly this pool: device, page size, dtype, layers, per-token shapes, token count.
        The previous user must be closed (no copy of it in flight)."""
        dtype = getattr(device_pool, "store_dtype", None) or device_pool.dtype
        want = {
            "layout": layout, "device": torch.device(device_pool.device),
            "page_size": device_pool.page_size, "dtype": dtype,
            "layer_num": device_pool.layer_num,
            "token shapes": self._token_shapes_of(device_pool) if self._same_kind(device_pool)
            else "another kind of device pool (MHA / MLA)",
        }  # fmt: skip
        have = {
            "layout": self.layout, "device": self.device, "page_size": self.page_size,
            "dtype": self.dtype, "layer_num": self.layer_num,
            "token shapes": self._token_shapes(),
        }  # fmt: skip
        differ = {k: (have[k], want[k]) for k in want if have[k] != want[k]}
        if not differ:
            tokens = host_ram.host_pool_tokens(device_pool.size, self.size_per_token,
                                               self.page_size, host_to_device_ratio,
                                               host_size)  # fmt: skip
            if tokens != self.size:
                differ["tokens"] = (self.size, tokens)
        if differ:
            raise ValueError(f"host_pool cannot serve this device pool: (has, asked) {differ}")
        self.device_pool = device_pool
        self.allocator = TokenToKVPoolAllocator(self.size, self.page_size, "cpu",
                                                reserve_padding=False)  # fmt: skip
        logger.info("%s reused: %d tokens, a fresh allocator", type(self).__name__, self.size)

    def _slot_dims(self) -> tuple[int, ...]:
        n_l = self.layer_num
        if self.layout == "layer_first":
            return (n_l, self.size)
        if self.layout == "page_first":
            return (self.size, n_l)
        return (self.page_num, n_l, self.page_size)

    def _allocate(self, pin: bool) -> None:
        """``kv_buffer`` (one host allocation, registered once when pinned) and its parts."""
        shapes = [self._slot_dims() + tok for tok in self._token_shapes()]
        if len(shapes) == 1 or shapes[0] == shapes[1]:
            lead = (len(shapes),) if len(shapes) > 1 else ()
            self.kv_buffer, self._registered = host_ram.alloc_host_buffer(
                lead + shapes[0], self.dtype, pin
            )
            self._host_parts = list(self.kv_buffer) if lead else [self.kv_buffer]
            return
        sizes = [math.prod(shape) for shape in shapes]
        self.kv_buffer, self._registered = host_ram.alloc_host_buffer(
            (sum(sizes),), self.dtype, pin
        )
        self._host_parts = [
            part.view(shape)
            for part, shape in zip(self.kv_buffer.split(sizes), shapes, strict=True)
        ]

    def _layer_data_ptrs(self, part: torch.Tensor) -> torch.Tensor:
        """``data_ptr()`` of each layer's view of a ``layer_first`` part: uint64 ``[L]`` on the
        device pool's device (the all-layer kernels' pointer table, alignment recorded)."""
        return kernels.data_ptr_table([part[i] for i in range(self.layer_num)], self.device)

    # --- allocator (SGLang calls these on the host pool) ---------------------------------------
    def alloc(self, need_size: int) -> torch.Tensor | None:
        """Host slots (CPU int64, whole pages) or ``None`` when short."""
        return self.allocator.alloc(need_size)

    def free(self, indices: torch.Tensor) -> int:
        self.allocator.free(indices)
        return indices.numel()

    def available_size(self) -> int:
        return self.allocator.available_size()

    def check_integrity(self) -> None:
        self.allocator.check_integrity()

    def mem_bytes(self) -> int:
        return self.kv_buffer.numel() * self.kv_buffer.element_size()

    def destroy(self) -> None:
        """Unregister a ``cudaHostRegister``ed buffer (idempotent); the pool is unusable after.
        Waits for the device first: a copy still queued on any stream would otherwise touch
        host memory the GPU can no longer address."""
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

    # --- checks ---------------------------------------------------------------------------------
    def check_copy_args(
        self,
        host_indices: torch.Tensor,
        device_indices: torch.Tensor,
        io_backend: str,
        layer_id: int | None = None,
    ) -> None:
        """Raise ``ValueError`` for an unsupported pair, malformed indices, or (when given) a
        ``layer_id`` out of range; in that order. The copies run it first; a caller that checked
        a copy's indices once (the controller, before launching every layer of a load) passes
        ``validate=False`` to the per-layer calls."""
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
