"""Host RAM for the host KV pools: how much may be used, pool sizing, and the allocation
(exact-size ``cudaHostRegister`` on CUDA). Tests patch these here.
"""

from __future__ import annotations

import ctypes
import logging
import os

import torch

from hicache_prefill.hicache.memory.allocator import page_ceil

logger = logging.getLogger(__name__)

# Host RAM left free when sizing the host pool: SGLang's 10 GiB, capped at a quarter of the
# machine's RAM so small machines (CI, laptops) can still build small pools.
HOST_MEMORY_RESERVE_BYTES = 10 * 1024**3
RESERVE_ENV = "HICACHE_HOST_MEMORY_RESERVE_BYTES"  # overrides the reserve (bytes)


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
    override = os.environ.get(RESERVE_ENV)
    if override is not None:
        if not override.strip().isdigit():
            raise ValueError(f"{RESERVE_ENV} must be an integer >= 0 (bytes), got {override!r}")
        logger.info("host RAM reserve set by %s: %s bytes", RESERVE_ENV, override.strip())
        return int(override)
    total = _meminfo_bytes("MemTotal")
    if total is None:
        return HOST_MEMORY_RESERVE_BYTES
    return min(HOST_MEMORY_RESERVE_BYTES, total // 4)


def host_pool_tokens(
    device_size: int,
    size_per_token: int,
    page_size: int,
    host_to_device_ratio: float,
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
    return page_ceil(max(1, tokens), page_size)


def alloc_host_buffer(
    dims: tuple[int, ...], dtype: torch.dtype, pin: bool
) -> tuple[torch.Tensor, bool]:
    """Allocate ``dims`` on the host; returns (buffer, registered_with_cudaHostRegister).

    Pinned buffers are not zeroed (``cudaHostRegister`` faults every page in already).
    ``ValueError`` when registration fails and the power-of-two pinned fallback would not fit."""
    if not pin:
        return torch.zeros(dims, dtype=dtype), False
    buf = torch.empty(dims, dtype=dtype)
    nbytes = buf.numel() * buf.element_size()
    cudart = torch.cuda.cudart()
    rc = int(cudart.cudaHostRegister(buf.data_ptr(), nbytes, 0))
    if rc == 0:
        return buf, True
    _clear_cuda_error()
    del buf
    rounded = pinned_fallback_bytes(nbytes)
    budget = host_memory_available_bytes() - host_memory_reserve_bytes()
    if rounded > budget:
        raise ValueError(
            f"cudaHostRegister of {nbytes / 1e9:.2f} GB failed (rc={rc}), and the pinned "
            f"fallback would allocate {rounded / 1e9:.2f} GB (rounded up to a power of two), more "
            f"than the {max(budget, 0) / 1e9:.2f} GB of host RAM that may be used (MemAvailable "
            "minus the reserve); reduce hicache_size or hicache_ratio"
        )
    logger.warning(
        "cudaHostRegister of %.2f GB failed (rc=%d); falling back to a pinned allocation of "
        "%.2f GB (rounded up to a power of two)",
        nbytes / 1e9,
        rc,
        rounded / 1e9,
    )
    return torch.empty(dims, dtype=dtype, pin_memory=True), False


def pinned_fallback_bytes(nbytes: int) -> int:
    """Bytes a ``pin_memory`` allocation of ``nbytes`` takes (torch rounds to a power of two)."""
    return 1 << max(0, (nbytes - 1).bit_length())


def _clear_cuda_error() -> None:
    """Reset the CUDA runtime's last error after a failed ``cudaHostRegister``, which torch
    would otherwise report at an unrelated launch (best effort)."""
    for name in ("libcudart.so.13", "libcudart.so.12", "libcudart.so.11.0", "libcudart.so"):
        try:
            lib = ctypes.CDLL(name, mode=os.RTLD_NOLOAD | os.RTLD_LAZY)
        except OSError:
            continue
        lib.cudaGetLastError()
        return
