"""``HiCacheFile``: the embedded L3 backend, one file per KV page (SGLang 0.5.23's ``HiCacheFile``,
same names and bytes, so either side reads what the other wrote for the same model name, layout
and dtype).

**Names.** ``{key}{suffix}.bin`` in one flat directory, with ``model`` the config's
``model_name`` with ``/`` replaced by ``-`` (``""`` when unset) and

- MHA: ``suffix = _{model}_{tp_rank}_{tp_size}{shard}`` (one file per page and TP shard);
- MLA: ``suffix = _{model}{shard}`` (one file per page for every rank);
- ``shard = _{pp_size}_{pp_rank}`` when ``pp_size > 1``, plus ``_cp{rank}_{size}`` when
  ``attn_cp_size > 1``; empty otherwise.

For tokens 1..16 at page 16, model ``Qwen/Qwen3-8B``, TP rank 0 of 1:
``77d735ce…9b07_Qwen-Qwen3-8B_0_1.bin`` (MLA ``77d735ce…9b07_Qwen-Qwen3-8B.bin``).

**Bytes.** The host pool's flat page (``get_data_page(index, flat=True)``), then a 16-byte footer:
``HCKVCRC1`` and the CRC-32 (``zlib.crc32``, little-endian) of the file's name (key and suffix,
without ``.bin``) followed by the page bytes, then 4 zero bytes. Every read checks it: a page of
random bytes, another key's page or one of another size is a miss, counted. SGLang reads only the
page's bytes and ignores the footer. Interop mode (``storage_format_tag: "none"``, the config's
``format_tag`` is ``None``): pages are SGLang's, the bytes alone, and carry **no check**; a damaged
page of the right size is then read as KV. Pages of older versions of this backend (no footer)
have the wrong size: misses, rewritten by the next ``set``.

A write goes to ``.{uuid4 hex}.tmp`` in the same directory and is renamed over the final name
(``os.replace``, atomic on POSIX), so a reader sees no file or a whole one, never a half-written
page. No ``fsync``: after a power loss a renamed page may read short, which is a miss.

**Format tag.** A file does not say in which byte order or dtype it was written, so a page of
another format but the same size would read as wrong KV. The storage config's ``model_name``
carries the page format (``"{model}-{dtype}-{layer-major|token-major}"``, built by
``storage_config_for_pool``; see ``format_tag`` for the table): pages of another format then have
other names and are misses. The cost: stock SGLang, whose MHA / MLA pools carry no tag, looks for
the untagged name and misses our pages (and we its pages) unless the extra config sets
``storage_format_tag: "none"`` (then one layout and dtype per directory is the operator's
promise) or SGLang is served under the tagged model name.

**Misses, never wrong KV.** ``get`` reads only a file whose size is exactly the target's (plus
the footer) and whose check holds; a missing, truncated or longer file, one that shrinks while
being read, or a failed check is a miss (``None``), counted by cause; a page failing its check is
removed. SGLang raises ``IOError`` on a short read instead. Once a host pool is registered,
``exists`` also requires the page's size (it does not read the check), and ``set`` rewrites a file
of the wrong size (SGLang keeps any existing file).

**Directory.** ``SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR`` if set, else the extra-config key
``file_storage_path``, else ``file_path`` (default ``/tmp/hicache-{uid}``, per user; SGLang's is
``/tmp/hicache``), SGLang's precedence. Every rank creates it (mode 0700, ``exist_ok``; SGLang
only rank 0) and writes a probe file at construction; pages are written 0600. A directory owned by
another user, or unusable, is a ``ValueError`` naming it and where the path came from.

**Budget.** ``max_size``, ``min_free_space``, ``eviction_ratio`` (``lru_file_evictor``): off by
default; a refused write is ``False`` and counted.

**Errors.** Bad settings raise ``ValueError`` at construction, naming the key or variable. At run
time a failed write (full disk, IO error) returns ``False`` and a failed read ``None``, logged and
counted (``get_stats()``); nothing raises into the calling thread except bad arguments (a key with
``/``, a target that is not a contiguous CPU tensor). Thread-safe; every call blocks on the
filesystem.

``clear()`` removes every page file (``{64 hex digits}[_…].bin``, all ranks and models) and
leftover temporary files in the directory, nothing else (SGLang removes every file in it); the
budget likewise evicts only page files. SGLang's positive existence cache
(``enable_metadata_cache``) is not implemented: an existence check is one ``stat``.
"""

from __future__ import annotations

import logging
import os
import re
import stat
import struct
import uuid
import zlib
from typing import Any

import torch

from hicache.storage.base import HiCacheStorage
from hicache.storage.config import HiCacheStorageConfig, as_extra_config
from hicache.storage.file_stats import FileCounters, HiCacheFileStats
from hicache.storage.lru_file_evictor import LRUFileEvictor

logger = logging.getLogger(__name__)

DEFAULT_DIR = f"/tmp/hicache-{os.getuid()}"
ENV_DIR = "SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR"
_TMP_NAME = re.compile(r"\.[0-9a-f]{32}\.tmp")
PAGE_NAME = re.compile(r"[0-9a-f]{64}(?:_.*)?\.bin", re.DOTALL)
FOOTER = struct.Struct("<8sI4x")
MAGIC = b"HCKVCRC1"


def page_checksum(name: str, data) -> int:
    """CRC-32 of ``name`` (the file's name without ``.bin``) then ``data`` (the page's bytes)."""
    return zlib.crc32(data, zlib.crc32(name.encode()))


def file_suffixes(config: HiCacheStorageConfig) -> tuple[str, str]:
    """``(config_suffix, tp_config_suffix)``: the name suffix of this rank's KV pages and of its
    TP-sharded state (equal for MHA)."""
    model = "-".join(config.model_name.split("/")) if config.model_name else ""
    shard = f"_{config.pp_size}_{config.pp_rank}" if config.pp_size > 1 else ""
    if config.attn_cp_size > 1:
        shard += f"_cp{config.attn_cp_rank}_{config.attn_cp_size}"
    tp_suffix = f"_{model}_{config.tp_rank}_{config.tp_size}{shard}"
    return (f"_{model}{shard}" if config.is_mla_model else tp_suffix), tp_suffix


def _storage_dir(extra: dict, default: str) -> tuple[str, str]:
    """(directory, where it came from)."""
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


def _remove_quietly(path: str) -> None:
    try:
        os.remove(path)
    except OSError:
        pass


def _read_into(f: Any, view: memoryview) -> bool:
    """Fill ``view`` from ``f``; ``False`` if the file ends first."""
    got = 0
    while got < len(view):
        n = f.readinto(view[got:])
        if not n:
            return False
        got += n
    return True


def _is_cpu_contiguous(t: torch.Tensor) -> bool:
    return t.device.type == "cpu" and t.is_contiguous()


def _byte_view(t: torch.Tensor) -> memoryview:
    """The bytes of a contiguous CPU tensor, writable, without a copy."""
    return memoryview(t.reshape(-1).view(torch.uint8).numpy())


class HiCacheFile(HiCacheStorage):
    """One file per page in a directory (module docstring)."""

    def __init__(self, storage_config: HiCacheStorageConfig, file_path: str = DEFAULT_DIR) -> None:
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
        logger.info("HiCacheFile at %s (%s), names *%s.bin", self.file_path, source,
                    self.config_suffix)  # fmt: skip

    def register_mem_pool_host(self, mem_pool_host: Any) -> None:
        """Also learns the page size in bytes, which ``exists`` then checks."""
        super().register_mem_pool_host(mem_pool_host)
        page = mem_pool_host.get_dummy_flat_data_page()
        self._page_bytes = page.numel() * page.element_size()

    def path_of(self, key: str) -> str:
        """The file that holds ``key``'s page."""
        return self._names(key)[1]

    # --- reads ---------------------------------------------------------------------------------
    def get(
        self, key: str, target_location: Any | None = None, target_sizes: Any | None = None
    ) -> torch.Tensor | None:
        """Read ``key``'s page into ``target_location`` (a contiguous CPU tensor of the page's
        size; its contents are unspecified after a miss); that tensor, or ``None``."""
        name, path = self._names(key)
        target = target_location
        if not isinstance(target, torch.Tensor) or not _is_cpu_contiguous(target):
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

    # --- writes --------------------------------------------------------------------------------
    def set(
        self,
        key: str,
        value: Any | None = None,
        target_location: Any | None = None,
        target_sizes: Any | None = None,
    ) -> bool:
        """Store ``value`` (a tensor; its bytes) under ``key``: ``True`` when written or already
        on disk with that size, ``False`` when the budget refused or the write failed."""
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
            _remove_quietly(tmp)
            self._counters.add("write_failures")
            logger.error("HiCacheFile: writing %s failed: %s", key, e)
            return False
        self._evictor.commit(name)
        self._counters.add("writes")
        self._counters.add("bytes_written", nbytes)
        return True

    # --- housekeeping --------------------------------------------------------------------------
    def clear(self) -> bool:
        """Remove every page file and leftover temporary file; ``False`` if one could not be."""
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
            evicted_files=ev.evicted_files, evicted_bytes=ev.evicted_bytes,
            budget_bytes=ev.total_bytes,
        )  # fmt: skip

    # --- helpers -------------------------------------------------------------------------------
    def _names(self, key: str) -> tuple[str, str]:
        """(``key`` with this rank's suffix, its file's path); ``ValueError`` for a key that is
        not a plain name."""
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
        """Count a page failing its check and remove it (unless it was replaced meanwhile)."""
        self._counters.add("read_corrupt")
        logger.warning("HiCacheFile: %s fails its checksum (damaged or another page); removed", key)
        try:
            now = os.stat(path)
            if (now.st_ino, now.st_dev) == (st.st_ino, st.st_dev):
                os.remove(path)
        except OSError:
            pass
        return None

    def _bad_size(self, key: str) -> None:
        self._counters.add("read_bad_size")
        logger.warning("HiCacheFile: %s has the wrong size (truncated or another geometry)", key)
        return None
