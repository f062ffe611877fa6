"""``HiCacheFile``: the embedded L3 backend, one file per KV page (SGLang 0.5.23's names and page
bytes), and its counters (``HiCacheFileStats``).

A read returns a page or a miss, never wrong KV: a page file is the flat page then a 16-byte footer
(``HCKVCRC1``, the CRC-32 of the file's name then the page), checked on every read (interop pages,
``storage_format_tag: "none"``, carry none). Another size or a failed check is a counted miss (a
failed check removes the file). Writes are renamed into place; the directory must be this user's
(created 0700), pages are 0600. Format and budget: docs/GUIDE.md.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import stat
import struct
import threading
import uuid
import zlib
from dataclasses import dataclass, fields
from typing import Any

import torch

from hicache_prefill.hicache.storage.base import HiCacheStorage
from hicache_prefill.hicache.storage.config import (
    HiCacheStorageConfig,
    as_extra_config,
    as_storage_config,
)
from hicache_prefill.hicache.storage.lru_file_evictor import LRUFileEvictor

logger = logging.getLogger(__name__)

DEFAULT_DIR = f"/tmp/hicache-{os.getuid()}"
ENV_DIR = "SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR"
_TMP_NAME = re.compile(r"\.[0-9a-f]{32}\.tmp")
PAGE_NAME = re.compile(r"[0-9a-f]{64}(?:_.*)?\.bin", re.DOTALL)
FOOTER = struct.Struct("<8sI4x")
MAGIC = b"HCKVCRC1"


@dataclass(frozen=True)
class HiCacheFileStats:
    """Pages unless named ``bytes``; misses by cause (no file, another size, a failed check, any
    other IO error)."""

    read_hits: int = 0
    read_misses: int = 0
    read_bad_size: int = 0
    read_corrupt: int = 0
    read_errors: int = 0
    writes: int = 0
    writes_skipped: int = 0
    write_failures: int = 0
    writes_refused: int = 0
    bytes_read: int = 0
    bytes_written: int = 0
    evicted_files: int = 0
    evicted_bytes: int = 0
    budget_bytes: int = 0


_COUNTED = tuple(f.name for f in fields(HiCacheFileStats))


class FileCounters:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._values = dict.fromkeys(_COUNTED, 0)

    def add(self, name: str, n: int = 1) -> None:
        with self._lock:
            self._values[name] += n

    def snapshot(self, **overrides: int) -> HiCacheFileStats:
        with self._lock:
            values = dict(self._values)
        values.update(overrides)
        return HiCacheFileStats(**values)


def page_checksum(name: str, data: bytes | memoryview) -> int:
    """CRC-32 of ``name`` (the file's name without ``.bin``) then ``data``."""
    return zlib.crc32(data, zlib.crc32(name.encode()))


def file_suffixes(config: HiCacheStorageConfig) -> tuple[str, str]:
    """``(config_suffix, tp_config_suffix)``: this rank's page suffix and its TP-sharded one."""
    model = "-".join(config.model_name.split("/")) if config.model_name else ""
    shard = f"_{config.pp_size}_{config.pp_rank}" if config.pp_size > 1 else ""
    if config.attn_cp_size > 1:
        shard += f"_cp{config.attn_cp_rank}_{config.attn_cp_size}"
    tp_suffix = f"_{model}_{config.tp_rank}_{config.tp_size}{shard}"
    return (f"_{model}{shard}" if config.is_mla_model else tp_suffix), tp_suffix


def _storage_dir(extra: dict, default: str) -> tuple[str, str]:
    env = os.environ.get(ENV_DIR)
    if env:
        return env, f"environment variable {ENV_DIR}"
    path = extra.get("file_storage_path")
    if path is not None and not isinstance(path, str):
        raise ValueError(f"extra config key 'file_storage_path' must be a path, got {path!r}")
    if path:
        return path, "extra config key 'file_storage_path'"
    return default, "file_path"


def _prepare_dir(path: str, source: str) -> None:
    probe = os.path.join(path, f".{uuid.uuid4().hex}.tmp")
    try:
        os.makedirs(path, mode=0o700, exist_ok=True)
        owner = os.stat(path).st_uid
        if owner != os.geteuid():
            raise ValueError(
                f"{source}={path!r} is owned by uid {owner}, not by this user "
                f"(uid {os.geteuid()}): its pages cannot be trusted"
            )
        with open(probe, "wb"):
            pass
        os.remove(probe)
    except OSError as e:
        raise ValueError(f"{source}={path!r} is not a writable directory: {e}") from e


def _read_into(f: Any, view: memoryview) -> bool:
    """Fill ``view`` from ``f``; ``False`` if the file ends first."""
    got = 0
    while got < len(view):
        n = f.readinto(view[got:])
        if not n:
            return False
        got += n
    return True


def _byte_view(t: torch.Tensor) -> memoryview:
    return memoryview(t.reshape(-1).view(torch.uint8).numpy())


class HiCacheFile(HiCacheStorage):
    """``file_path``: the directory when neither ``SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR`` nor
    ``file_storage_path`` names one (SGLang's ``dynamic`` factory passes its keyword dict here:
    anything but a string is the default). ``storage_config``: this project's or SGLang's
    (``as_storage_config``)."""

    def __init__(self, storage_config: Any, file_path: Any = DEFAULT_DIR) -> None:
        storage_config = as_storage_config(storage_config)
        if not isinstance(file_path, str) or not file_path:
            file_path = DEFAULT_DIR
        extra = as_extra_config(storage_config.extra_config)
        self.file_path, source = _storage_dir(extra, file_path)
        _prepare_dir(self.file_path, source)
        self.config_suffix, self.tp_config_suffix = file_suffixes(storage_config)
        self.checked = storage_config.format_tag is not None
        self._footer = FOOTER.size if self.checked else 0
        owned: tuple[str, ...] = (self.tp_config_suffix,)
        if storage_config.is_mla_model and storage_config.is_storage_writer:
            owned += (self.config_suffix,)
        self._evictor = LRUFileEvictor(
            self.file_path, owned_suffixes=owned, extra_config=extra, key_pattern=r"[0-9a-f]{64}"
        )
        self._counters = FileCounters()
        self._page_bytes: int | None = None
        if extra.get("enable_metadata_cache"):
            logger.warning("HiCacheFile: enable_metadata_cache is not implemented; ignored")
        logger.info(
            "HiCacheFile at %s (%s), names *%s.bin", self.file_path, source, self.config_suffix
        )

    def register_mem_pool_host(self, mem_pool_host: Any) -> None:
        """Also learns the page size, which ``exists`` then checks."""
        super().register_mem_pool_host(mem_pool_host)
        page = mem_pool_host.get_dummy_flat_data_page()
        self._page_bytes = page.numel() * page.element_size()

    def path_of(self, key: str) -> str:
        return self._names(key)[1]

    def get(
        self, key: str, target_location: Any | None = None, target_sizes: Any | None = None
    ) -> torch.Tensor | None:
        """``target_location``: a contiguous CPU tensor of the page's size (unspecified after a
        miss)."""
        name, path = self._names(key)
        target = target_location
        if not (
            isinstance(target, torch.Tensor)
            and target.device.type == "cpu"
            and target.is_contiguous()
        ):
            raise ValueError("HiCacheFile.get: target_location must be a contiguous CPU tensor")
        expected = target.numel() * target.element_size()
        footer = bytearray(self._footer)
        try:
            with open(path, "rb", buffering=0) as f:
                st = os.fstat(f.fileno())
                if st.st_size != expected + self._footer:
                    return self._bad_size(key)
                view = _byte_view(target)
                if not (_read_into(f, view) and _read_into(f, memoryview(footer))):
                    return self._bad_size(key)
            if self.checked and bytes(footer) != FOOTER.pack(MAGIC, page_checksum(name, view)):
                return self._corrupt(key, path, st)
        except FileNotFoundError:
            self._counters.add("read_misses")
            return None
        except OSError as e:
            self._counters.add("read_errors")
            logger.warning("HiCacheFile: reading %s failed: %s", key, e)
            return None
        self._evictor.touch(name, path)
        self._counters.add("read_hits")
        self._counters.add("bytes_read", expected)
        return target_location

    def exists(self, key: str) -> bool:
        size = self._file_size(self._names(key)[1])
        if size is None or size < self._footer:
            return False
        return self._page_bytes is None or size == self._page_bytes + self._footer

    def set(
        self,
        key: str,
        value: Any | None = None,
        target_location: Any | None = None,
        target_sizes: Any | None = None,
    ) -> bool:
        """``True`` when written or already on disk with that size."""
        name, path = self._names(key)
        if not isinstance(value, torch.Tensor):
            raise ValueError("HiCacheFile.set: value must be a tensor")
        nbytes = value.numel() * value.element_size() + self._footer
        if self._file_size(path) == nbytes:
            self._evictor.touch(name, path)
            self._counters.add("writes_skipped")
            return True
        if not self._evictor.reserve(name, nbytes):
            self._counters.add("writes_refused")
            return False
        tmp = os.path.join(self.file_path, f".{uuid.uuid4().hex}.tmp")
        try:
            data = _byte_view(value.detach().cpu().contiguous())
            with open(tmp, "wb") as f:
                os.chmod(tmp, 0o600)  # before any byte is in it
                f.write(data)
                if self.checked:
                    f.write(FOOTER.pack(MAGIC, page_checksum(name, data)))
            os.replace(tmp, path)
        except Exception as e:  # noqa: BLE001 - a failed write is a result, never an exception
            self._evictor.abort(name)
            with contextlib.suppress(OSError):
                os.remove(tmp)
            self._counters.add("write_failures")
            logger.error("HiCacheFile: writing %s failed: %s", key, e)
            return False
        self._evictor.commit(name)
        self._counters.add("writes")
        self._counters.add("bytes_written", nbytes)
        return True

    def clear(self) -> bool:
        """Remove every page and temporary file; ``False`` if one could not be."""
        ok = True
        try:
            names = os.listdir(self.file_path)
        except OSError as e:
            logger.error("HiCacheFile: clearing %s failed: %s", self.file_path, e)
            return False
        for name in names:
            if PAGE_NAME.fullmatch(name) or _TMP_NAME.fullmatch(name):
                try:
                    os.remove(os.path.join(self.file_path, name))
                except FileNotFoundError:
                    pass
                except OSError as e:
                    ok = False
                    logger.error("HiCacheFile: could not remove %s: %s", name, e)
        self._evictor.clear()
        return ok

    def get_stats(self) -> HiCacheFileStats:
        ev = self._evictor
        return self._counters.snapshot(
            evicted_files=ev.evicted_files,
            evicted_bytes=ev.evicted_bytes,
            budget_bytes=ev.total_bytes,
        )

    def _names(self, key: str) -> tuple[str, str]:
        """(``key`` with this rank's suffix, its file's path)."""
        if not isinstance(key, str) or not key or "/" in key or os.sep in key or "\0" in key:
            raise ValueError(f"storage key must be a non-empty name without '/', got {key!r}")
        name = key + self.config_suffix
        return name, os.path.join(self.file_path, f"{name}.bin")

    def _file_size(self, path: str) -> int | None:
        try:
            st = os.stat(path)
        except OSError:
            return None
        return st.st_size if stat.S_ISREG(st.st_mode) else None

    def _corrupt(self, key: str, path: str, st: os.stat_result) -> None:
        """Removes the file unless it was replaced meanwhile."""
        self._counters.add("read_corrupt")
        logger.warning("HiCacheFile: %s fails its checksum (damaged or another page); removed", key)
        with contextlib.suppress(OSError):
            now = os.stat(path)
            if (now.st_ino, now.st_dev) == (st.st_ino, st.st_dev):
                os.remove(path)
        return None

    def _bad_size(self, key: str) -> None:
        self._counters.add("read_bad_size")
        logger.warning("HiCacheFile: %s has the wrong size (truncated or another geometry)", key)
        return None
