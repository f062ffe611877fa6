"""``HiCacheFile`` trusts no byte on disk: a damaged page is a counted miss, ``clear()`` removes
only page names, the directory is private (0700, pages 0600) and must be this user's."""

from __future__ import annotations

import os
import stat

import pytest
import torch

import hicache_prefill.hicache.storage.file_backend as file_backend
from hicache_prefill.hicache.storage.config import HiCacheStorageConfig, storage_config_for_pool
from hicache_prefill.hicache.storage.file_backend import HiCacheFile
from hicache_prefill.hicache.storage.hash_keys import page_hashes
from tests.hicache.storage.helpers import fill_random, host_pool, same_slots


@pytest.fixture(autouse=True)
def _no_storage_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in list(os.environ):
        if name.startswith(("SGLANG_HICACHE_FILE_BACKEND_", "SGLANG_TEST_HICACHE_")):
            monkeypatch.delenv(name)


def backend_for(host, path, **extra) -> HiCacheFile:
    extra = {"file_storage_path": str(path), **extra}
    backend = HiCacheFile(storage_config_for_pool(host, "m", extra_config=extra))
    backend.register_mem_pool_host(host)
    return backend


def test_a_damaged_page_is_a_counted_miss(tmp_path) -> None:
    src = host_pool("mha", "page_first")
    fill_random(src, 1)
    writer = backend_for(src, tmp_path)
    keys = page_hashes(list(range(16)), 4)
    assert writer.batch_set_v1(keys, torch.arange(16)) == [True] * 4
    size = os.path.getsize(writer.path_of(keys[0]))
    with open(writer.path_of(keys[1]), "wb") as f:
        f.write(os.urandom(size))  # random bytes of the right size
    with open(writer.path_of(keys[2]), "r+b") as f:
        f.truncate(size - 1)
    with open(writer.path_of(keys[0]), "rb") as f:
        first = f.read()
    with open(writer.path_of(keys[3]), "wb") as f:
        f.write(first)  # another page's bytes under this page's name
    dst = host_pool("mha", "page_first")
    reader = backend_for(dst, tmp_path)
    got = [reader.batch_get_v1([k], torch.arange(4 * i, 4 * i + 4))[0] for i, k in enumerate(keys)]
    assert got == [True, False, False, False]
    assert same_slots(src, range(4), dst, range(4))
    stats = reader.get_stats()
    assert stats.read_corrupt == 2 and stats.read_bad_size == 1 and stats.read_hits == 1
    assert writer.batch_set_v1(keys, torch.arange(16)) == [True] * 4  # damaged pages rewritten
    assert reader.batch_get_v1(keys, torch.arange(16, 32)) == [True] * 4
    assert same_slots(src, range(16), dst, range(16, 32))


def test_old_headerless_pages_are_misses(tmp_path) -> None:
    src = host_pool("mha", "page_first")
    fill_random(src, 2)
    backend = backend_for(src, tmp_path)
    key = page_hashes(list(range(4)), 4)[0]
    with open(backend.path_of(key), "wb") as f:
        f.write(src.get_data_page(0).numpy().tobytes())  # no check: an older version's page
    assert not backend.exists(key)
    assert backend.batch_get_v1([key], torch.arange(4, 8)) == [False]
    assert backend.get_stats().read_bad_size == 1


def test_interop_pages_are_sglangs_raw_bytes(tmp_path) -> None:
    src = host_pool("mha", "page_first")
    fill_random(src, 3)
    backend = backend_for(src, tmp_path, storage_format_tag="none")
    key = page_hashes(list(range(4)), 4)[0]
    assert backend.batch_set_v1([key], torch.arange(4)) == [True]
    with open(backend.path_of(key), "rb") as f:
        assert f.read() == src.get_data_page(0).numpy().tobytes()


def test_clear_keeps_files_it_did_not_name(tmp_path) -> None:
    cfg = HiCacheStorageConfig(
        0, 1, is_mla_model=True, extra_config={"file_storage_path": str(tmp_path), "max_size": "1M"}
    )
    (tmp_path / "pytorch_model.bin").write_bytes(b"weights")
    backend = HiCacheFile(cfg)  # MLA, no model name: every page is "{hash}.bin"
    key = "ab" * 32
    assert backend.set(key, torch.ones(4))
    assert backend.clear()
    assert os.listdir(tmp_path) == ["pytorch_model.bin"]
    for i in range(3):  # the budget evicts only its own pages
        assert backend.set(f"{i:064x}", torch.ones(100_000))
    assert os.path.exists(tmp_path / "pytorch_model.bin")


def test_directory_and_pages_are_private(tmp_path) -> None:
    path = tmp_path / "kv"
    backend = HiCacheFile(HiCacheStorageConfig(0, 1, extra_config={"file_storage_path": str(path)}))
    assert backend.set("cd" * 32, torch.ones(4))
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o700
    assert stat.S_IMODE(os.stat(backend.path_of("cd" * 32)).st_mode) == 0o600
    assert file_backend.DEFAULT_DIR.endswith(f"-{os.getuid()}")


def test_a_directory_of_another_user_is_refused(tmp_path, monkeypatch) -> None:
    path = str(tmp_path / "theirs")
    os.mkdir(path)
    real_stat = os.stat

    def other_owner(p, *args, **kwargs):
        st = real_stat(p, *args, **kwargs)
        if os.fspath(p) == path:
            return os.stat_result(
                (st.st_mode, st.st_ino, st.st_dev, st.st_nlink, os.getuid() + 1, *tuple(st)[5:])
            )
        return st

    monkeypatch.setattr(file_backend.os, "stat", other_owner)
    with pytest.raises(ValueError, match="theirs"):
        HiCacheFile(HiCacheStorageConfig(0, 1, extra_config={"file_storage_path": path}))
