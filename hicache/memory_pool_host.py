"""Host KV pools (SGLang ``MHATokenToKVPoolHost`` / ``MLATokenToKVPoolHost``).

A host pool is one buffer of ``T`` token slots (``P = T / page_size`` pages) in one of three
layouts (DESIGN.md section 3), plus its own page allocator (no padding page: every host slot is
usable). On CUDA the buffer is plain host memory of the exact size registered with
``cudaHostRegister`` (``pin_memory()`` would round it up to a power of two), falling back to
``pin_memory=True`` if registration fails; without CUDA it is plain memory.

| layout              | MHA ``kv_buffer``              | MLA ``kv_buffer``          |
|---------------------|--------------------------------|----------------------------|
| ``layer_first``     | ``(2, L, T, H, D)``            | ``(L, T, 1, C)``           |
| ``page_first``      | ``(2, T, L, H, D)``            | ``(T, L, 1, C)``           |
| ``page_first_direct`` | ``(2, P, L, page_size, H, D)`` | ``(P, L, page_size, 1, C)`` |

Supported (layout, io_backend) pairs, as upstream: ``layer_first`` with ``kernel`` or ``direct``,
``page_first`` with ``kernel``, ``page_first_direct`` with ``direct`` (``ServerArgs`` resolves the
other two pairs the way SGLang does). The copy methods only launch work on the current stream
(the controller calls them inside its side streams); they never synchronize.
"""

from __future__ import annotations

import logging
import math
import os
from typing import TYPE_CHECKING

import torch

import kernels
from hicache.allocator import TokenToKVPoolAllocator
from hicache.memory_pool import MHATokenToKVPool, MLATokenToKVPool

if TYPE_CHECKING:
    from server_args import ServerArgs

logger = logging.getLogger(__name__)

LAYOUTS = ("layer_first", "page_first", "page_first_direct")
IO_BACKENDS = ("kernel", "direct")
SUPPORTED_LAYOUT_IO = frozenset(
    {("layer_first", "kernel"), ("layer_first", "direct"), ("page_first", "kernel"),
     ("page_first_direct", "direct")}
)

# Host RAM left free when sizing the host pool: SGLang's 10 GiB, capped at a quarter of the
# machine's RAM so small machines (CI, laptops) can still build small pools.
HOST_MEMORY_RESERVE_BYTES = 10 * 1024**3


def _meminfo_bytes(field: str) -> int | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def host_memory_available_bytes() -> int:
    """``MemAvailable`` (psutil if installed, else /proc/meminfo)."""
    try:
        import psutil  # type: ignore[import-not-found]

        return int(psutil.virtual_memory().available)
    except ImportError:
        pass
    avail = _meminfo_bytes("MemAvailable")
    if avail is None:
        pages = os.sysconf("SC_AVPHYS_PAGES")
        avail = pages * os.sysconf("SC_PAGE_SIZE")
    return avail


def host_memory_reserve_bytes() -> int:
    """Bytes of available RAM the host pool must leave free."""
    total = _meminfo_bytes("MemTotal")
    if total is None:
        return HOST_MEMORY_RESERVE_BYTES
    return min(HOST_MEMORY_RESERVE_BYTES, total // 4)


def host_pool_tokens(
    device_size: int, size_per_token: int, page_size: int, host_to_device_ratio: float,
    host_size_gb: float,
) -> int:
    """Host tokens: ``host_size_gb`` GB if > 0, else ``ratio * device_size``; rounded UP to pages
    (at least one page)."""
    if host_size_gb < 0:
        raise ValueError(f"host_size must be >= 0 GB, got {host_size_gb}")
    if host_size_gb > 0:
        tokens = int(host_size_gb * 1e9 // size_per_token)
    else:
        if host_to_device_ratio <= 0:
            raise ValueError(f"host_to_device_ratio must be > 0, got {host_to_device_ratio}")
        tokens = int(device_size * host_to_device_ratio)
    return max(1, math.ceil(tokens / page_size)) * page_size


def _alloc_host_buffer(
    dims: tuple[int, ...], dtype: torch.dtype, pin: bool
) -> tuple[torch.Tensor, bool]:
    """Allocate ``dims`` on the host; returns (buffer, registered_with_cudaHostRegister)."""
    buf = torch.zeros(dims, dtype=dtype)
    if not pin:
        return buf, False
    nbytes = buf.numel() * buf.element_size()
    cudart = torch.cuda.cudart()
    rc = int(cudart.cudaHostRegister(buf.data_ptr(), nbytes, 0))
    if rc == 0:
        return buf, True
    logger.warning(
        "cudaHostRegister of %.2f GB failed (rc=%d); falling back to pin_memory(), which rounds "
        "the allocation up to a power of two", nbytes / 1e9, rc,
    )
    del buf
    return torch.zeros(dims, dtype=dtype).pin_memory(), False


class _HostKVPoolBase:
    """Sizing, RAM check, allocation, pinning and the allocator shared by MHA and MLA."""

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
        self.page_size = page_size
        self.layout = layout
        self.dtype = device_pool.dtype
        self.layer_num = device_pool.layer_num
        self.item_size = device_pool.item_size
        self.size_per_token = device_pool.get_size_per_token()
        self.size = host_pool_tokens(
            device_pool.size, self.size_per_token, page_size, host_to_device_ratio, host_size
        )
        self.page_num = self.size // page_size
        self.layout_dim = self.item_size * self.layer_num  # bytes of one token, all layers

        requested = self.size * self.size_per_token
        budget = host_memory_available_bytes() - host_memory_reserve_bytes()
        if requested > budget:
            raise ValueError(
                f"host KV pool of {self.size} tokens needs {requested / 1e9:.2f} GB but only "
                f"{max(budget, 0) / 1e9:.2f} GB of host RAM may be used (MemAvailable minus a "
                f"{host_memory_reserve_bytes() / 1e9:.2f} GB reserve); reduce hicache_size or "
                f"hicache_ratio"
            )
        if self.size <= device_pool.size:
            logger.warning(
                "host KV pool (%d tokens) is not larger than the device pool (%d tokens); "
                "write-through needs a larger host pool", self.size, device_pool.size,
            )
        want_pin = pin_memory and device_pool.device.type == "cuda"
        self.kv_buffer, self._registered = _alloc_host_buffer(
            self._buffer_dims(), self.dtype, want_pin
        )
        self.pinned = want_pin
        self.allocator = TokenToKVPoolAllocator(self.size, page_size, "cpu", reserve_padding=False)
        logger.info(
            "%s: %d tokens (%d pages), layout %s, %.3f GB, pinned=%s (registered=%s)",
            type(self).__name__, self.size, self.page_num, layout, requested / 1e9, self.pinned,
            self._registered,
        )

    def _buffer_dims(self) -> tuple[int, ...]:
        raise NotImplementedError

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
        """Unregister a ``cudaHostRegister``ed buffer (idempotent); the pool is unusable after."""
        if self._registered:
            torch.cuda.cudart().cudaHostUnregister(self.kv_buffer.data_ptr())
            self._registered = False

    def __del__(self) -> None:
        try:
            self.destroy()
        except Exception:  # noqa: BLE001 - interpreter shutdown
            pass

    # --- helpers -------------------------------------------------------------------------------
    def _check_copy_args(
        self, host_indices: torch.Tensor, device_indices: torch.Tensor, io_backend: str
    ) -> None:
        if (self.layout, io_backend) not in SUPPORTED_LAYOUT_IO:
            raise ValueError(
                f"io_backend={io_backend!r} is not supported with layout {self.layout!r}; "
                f"supported pairs: {sorted(SUPPORTED_LAYOUT_IO)}"
            )
        for name, t in (("host_indices", host_indices), ("device_indices", device_indices)):
            if not isinstance(t, torch.Tensor) or t.dim() != 1 or t.dtype != torch.int64:
                raise ValueError(f"{name} must be a 1-D torch.int64 tensor")
        if host_indices.numel() != device_indices.numel():
            raise ValueError(
                f"host_indices ({host_indices.numel()}) and device_indices "
                f"({device_indices.numel()}) differ in length"
            )

    def _check_slots(self, indices: torch.Tensor) -> torch.Tensor:
        idx = indices.cpu()
        if idx.dim() != 1 or idx.dtype != torch.int64:
            raise ValueError("indices must be a 1-D torch.int64 tensor")
        if idx.numel() and (int(idx.min()) < 0 or int(idx.max()) >= self.size):
            raise ValueError(f"indices out of range [0, {self.size})")
        return idx

    def _slot_view(self, part: torch.Tensor, layer_id: int, idx: torch.Tensor) -> torch.Tensor:
        """Rows ``[n, ...]`` of ``part`` (K, V or the MLA buffer) for ``layer_id``; a copy."""
        if not 0 <= layer_id < self.layer_num:
            raise ValueError(f"layer_id must be in [0, {self.layer_num}), got {layer_id}")
        if self.layout == "layer_first":
            return part[layer_id][idx]
        if self.layout == "page_first":
            return part[idx, layer_id]
        return part[idx // self.page_size, layer_id, idx % self.page_size]

    def _slot_assign(
        self, part: torch.Tensor, layer_id: int, idx: torch.Tensor, value: torch.Tensor
    ) -> None:
        if self.layout == "layer_first":
            part[layer_id][idx] = value
        elif self.layout == "page_first":
            part[idx, layer_id] = value
        else:
            part[idx // self.page_size, layer_id, idx % self.page_size] = value


class MHATokenToKVPoolHost(_HostKVPoolBase):
    """Host copy of an ``MHATokenToKVPool`` (see the module docstring for layouts and pinning).

    ``k_buffer = kv_buffer[0]``, ``v_buffer = kv_buffer[1]``. For ``layer_first`` the per-layer
    views' ``data_ptr()`` tables ``k_data_ptrs`` / ``v_data_ptrs`` (int64 ``[L]``, on the device
    pool's device) feed the all-layer kernel.
    """

    def __init__(
        self,
        device_pool: MHATokenToKVPool,
        host_to_device_ratio: float,
        host_size: float,
        page_size: int,
        layout: str,
        pin_memory: bool = True,
    ) -> None:
        if not isinstance(device_pool, MHATokenToKVPool):
            raise ValueError("device_pool must be an MHATokenToKVPool")
        self.head_num = device_pool.head_num
        self.head_dim = device_pool.head_dim
        super().__init__(device_pool, host_to_device_ratio, host_size, page_size, layout,
                         pin_memory)
        self.k_buffer = self.kv_buffer[0]
        self.v_buffer = self.kv_buffer[1]
        if layout == "layer_first":
            dev = device_pool.device
            self.k_data_ptrs = torch.tensor(
                [self.k_buffer[i].data_ptr() for i in range(self.layer_num)],
                dtype=torch.int64, device=dev,
            )
            self.v_data_ptrs = torch.tensor(
                [self.v_buffer[i].data_ptr() for i in range(self.layer_num)],
                dtype=torch.int64, device=dev,
            )

    @classmethod
    def from_server_args(
        cls, args: ServerArgs, device_pool: MHATokenToKVPool
    ) -> MHATokenToKVPoolHost:
        return cls(device_pool, args.hicache_ratio, args.hicache_size, args.page_size,
                   args.hicache_mem_layout)

    def _buffer_dims(self) -> tuple[int, ...]:
        h, d, n_l = self.head_num, self.head_dim, self.layer_num
        if self.layout == "layer_first":
            return (2, n_l, self.size, h, d)
        if self.layout == "page_first":
            return (2, self.size, n_l, h, d)
        return (2, self.page_num, n_l, self.page_size, h, d)

    # --- copies --------------------------------------------------------------------------------
    def backup_from_device_all_layer(
        self,
        device_pool: MHATokenToKVPool,
        host_indices: torch.Tensor,
        device_indices: torch.Tensor,
        io_backend: str,
    ) -> None:
        """D2H, all layers, K and V: ``host[host_indices[i]] = device[device_indices[i]]``.

        Launches on the current stream; does not synchronize. ``kernel``: indices on the device
        pool's device; ``direct``: indices on the CPU.
        """
        self._check_copy_args(host_indices, device_indices, io_backend)
        if host_indices.numel() == 0:
            return
        dp = device_pool
        if self.layout == "layer_first" and io_backend == "kernel":
            kernels.transfer_kv_all_layer(
                dp.k_data_ptrs, self.k_data_ptrs, dp.v_data_ptrs, self.v_data_ptrs,
                device_indices, host_indices, self.item_size, self.layer_num,
            )
        elif self.layout == "page_first":
            kernels.transfer_kv_all_layer_lf_pf(
                dp.k_data_ptrs, self.k_buffer, dp.v_data_ptrs, self.v_buffer,
                device_indices, host_indices, self.item_size, self.layout_dim, self.layer_num,
            )
        elif self.layout == "layer_first":  # direct
            kernels.transfer_kv_direct(
                dp.k_buffer + dp.v_buffer,
                [self.k_buffer[i] for i in range(self.layer_num)]
                + [self.v_buffer[i] for i in range(self.layer_num)],
                device_indices, host_indices, self.page_size,
            )
        else:  # page_first_direct, direct
            kernels.transfer_kv_all_layer_direct_lf_pf(
                dp.k_buffer + dp.v_buffer, [self.k_buffer, self.v_buffer],
                device_indices, host_indices, self.page_size,
            )

    def load_to_device_per_layer(
        self,
        device_pool: MHATokenToKVPool,
        host_indices: torch.Tensor,
        device_indices: torch.Tensor,
        layer_id: int,
        io_backend: str,
    ) -> None:
        """H2D of one layer, K and V: ``device[device_indices[i]] = host[host_indices[i]]``.

        Launches on the current stream; does not synchronize.
        """
        self._check_copy_args(host_indices, device_indices, io_backend)
        if not 0 <= layer_id < self.layer_num:
            raise ValueError(f"layer_id must be in [0, {self.layer_num}), got {layer_id}")
        if host_indices.numel() == 0:
            return
        dk, dv = device_pool.k_buffer[layer_id], device_pool.v_buffer[layer_id]
        if self.layout == "layer_first" and io_backend == "kernel":
            kernels.transfer_kv_per_layer(
                self.k_buffer[layer_id], dk, self.v_buffer[layer_id], dv,
                host_indices, device_indices, self.item_size,
            )
        elif self.layout == "page_first":
            kernels.transfer_kv_per_layer_pf_lf(
                self.k_buffer, dk, self.v_buffer, dv, host_indices, device_indices,
                layer_id, self.item_size, self.layout_dim,
            )
        elif self.layout == "layer_first":  # direct
            kernels.transfer_kv_direct(
                [self.k_buffer[layer_id], self.v_buffer[layer_id]], [dk, dv],
                host_indices, device_indices, self.page_size,
            )
        else:  # page_first_direct, direct
            kernels.transfer_kv_per_layer_direct_pf_lf(
                [self.k_buffer, self.v_buffer], [dk, dv], host_indices, device_indices,
                layer_id, self.page_size,
            )

    # --- test helpers --------------------------------------------------------------------------
    def get_kv_slots(self, layer_id: int, indices: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Copies ``(k, v)``, each ``[n, H, D]`` (CPU), of host slots ``indices`` in a layer."""
        idx = self._check_slots(indices)
        return (self._slot_view(self.k_buffer, layer_id, idx),
                self._slot_view(self.v_buffer, layer_id, idx))

    def set_kv_slots(
        self, layer_id: int, indices: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> None:
        """Write ``k``, ``v`` (``[n, H, D]``) into host slots ``indices`` of a layer (blocking)."""
        idx = self._check_slots(indices)
        want = (idx.numel(), self.head_num, self.head_dim)
        if tuple(k.shape) != want or tuple(v.shape) != want:
            raise ValueError(f"k and v must have shape {want}")
        self._slot_assign(self.k_buffer, layer_id, idx, k.to(self.dtype).cpu())
        self._slot_assign(self.v_buffer, layer_id, idx, v.to(self.dtype).cpu())


class MLATokenToKVPoolHost(_HostKVPoolBase):
    """Host copy of an ``MLATokenToKVPool``; ``data_ptrs`` (int64 ``[L]``) for ``layer_first``."""

    def __init__(
        self,
        device_pool: MLATokenToKVPool,
        host_to_device_ratio: float,
        host_size: float,
        page_size: int,
        layout: str,
        pin_memory: bool = True,
    ) -> None:
        if not isinstance(device_pool, MLATokenToKVPool):
            raise ValueError("device_pool must be an MLATokenToKVPool")
        self.kv_cache_dim = device_pool.kv_cache_dim
        super().__init__(device_pool, host_to_device_ratio, host_size, page_size, layout,
                         pin_memory)
        if layout == "layer_first":
            self.data_ptrs = torch.tensor(
                [self.kv_buffer[i].data_ptr() for i in range(self.layer_num)],
                dtype=torch.int64, device=device_pool.device,
            )

    @classmethod
    def from_server_args(
        cls, args: ServerArgs, device_pool: MLATokenToKVPool
    ) -> MLATokenToKVPoolHost:
        return cls(device_pool, args.hicache_ratio, args.hicache_size, args.page_size,
                   args.hicache_mem_layout)

    def _buffer_dims(self) -> tuple[int, ...]:
        c, n_l = self.kv_cache_dim, self.layer_num
        if self.layout == "layer_first":
            return (n_l, self.size, 1, c)
        if self.layout == "page_first":
            return (self.size, n_l, 1, c)
        return (self.page_num, n_l, self.page_size, 1, c)

    def backup_from_device_all_layer(
        self,
        device_pool: MLATokenToKVPool,
        host_indices: torch.Tensor,
        device_indices: torch.Tensor,
        io_backend: str,
    ) -> None:
        """D2H, all layers (see ``MHATokenToKVPoolHost.backup_from_device_all_layer``)."""
        self._check_copy_args(host_indices, device_indices, io_backend)
        if host_indices.numel() == 0:
            return
        dp = device_pool
        if self.layout == "layer_first" and io_backend == "kernel":
            kernels.transfer_kv_all_layer_mla(
                dp.kv_data_ptrs, self.data_ptrs, device_indices, host_indices,
                self.item_size, self.layer_num,
            )
        elif self.layout == "page_first":
            kernels.transfer_kv_all_layer_mla_lf_pf(
                dp.kv_data_ptrs, self.kv_buffer, device_indices, host_indices,
                self.item_size, self.layout_dim, self.layer_num,
            )
        elif self.layout == "layer_first":  # direct
            kernels.transfer_kv_direct(
                list(dp.kv_buffer), [self.kv_buffer[i] for i in range(self.layer_num)],
                device_indices, host_indices, self.page_size,
            )
        else:  # page_first_direct, direct
            kernels.transfer_kv_all_layer_direct_lf_pf(
                list(dp.kv_buffer), [self.kv_buffer], device_indices, host_indices,
                self.page_size,
            )

    def load_to_device_per_layer(
        self,
        device_pool: MLATokenToKVPool,
        host_indices: torch.Tensor,
        device_indices: torch.Tensor,
        layer_id: int,
        io_backend: str,
    ) -> None:
        """H2D of one layer (see ``MHATokenToKVPoolHost.load_to_device_per_layer``)."""
        self._check_copy_args(host_indices, device_indices, io_backend)
        if not 0 <= layer_id < self.layer_num:
            raise ValueError(f"layer_id must be in [0, {self.layer_num}), got {layer_id}")
        if host_indices.numel() == 0:
            return
        dst = device_pool.kv_buffer[layer_id]
        if self.layout == "layer_first" and io_backend == "kernel":
            kernels.transfer_kv_per_layer_mla(
                self.kv_buffer[layer_id], dst, host_indices, device_indices, self.item_size
            )
        elif self.layout == "page_first":
            kernels.transfer_kv_per_layer_mla_pf_lf(
                self.kv_buffer, dst, host_indices, device_indices, layer_id, self.item_size,
                self.layout_dim,
            )
        elif self.layout == "layer_first":  # direct
            kernels.transfer_kv_direct(
                [self.kv_buffer[layer_id]], [dst], host_indices, device_indices, self.page_size
            )
        else:  # page_first_direct, direct
            kernels.transfer_kv_per_layer_direct_pf_lf(
                [self.kv_buffer], [dst], host_indices, device_indices, layer_id, self.page_size
            )

    def get_kv_slots(self, layer_id: int, indices: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """A copy ``(kv,)`` of shape ``[n, 1, C]`` (CPU) of host slots ``indices`` in a layer."""
        idx = self._check_slots(indices)
        return (self._slot_view(self.kv_buffer, layer_id, idx),)

    def set_kv_slots(self, layer_id: int, indices: torch.Tensor, kv: torch.Tensor) -> None:
        """Write ``kv`` (``[n, 1, C]``) into host slots ``indices`` of a layer (blocking)."""
        idx = self._check_slots(indices)
        want = (idx.numel(), 1, self.kv_cache_dim)
        if tuple(kv.shape) != want:
            raise ValueError(f"kv must have shape {want}")
        self._slot_assign(self.kv_buffer, layer_id, idx, kv.to(self.dtype).cpu())


HostKVPool = MHATokenToKVPoolHost | MLATokenToKVPoolHost


def make_host_pool(
    device_pool: MHATokenToKVPool | MLATokenToKVPool,
    host_to_device_ratio: float,
    host_size: float,
    layout: str,
    pin_memory: bool = True,
) -> MHATokenToKVPoolHost | MLATokenToKVPoolHost:
    """The host pool class matching ``device_pool`` (MHA or MLA)."""
    cls = MLATokenToKVPoolHost if isinstance(device_pool, MLATokenToKVPool) else (
        MHATokenToKVPoolHost)
    return cls(device_pool, host_to_device_ratio, host_size, device_pool.page_size, layout,
               pin_memory)
