"""One size grammar for every backend setting (``hicache.storage.config.parse_size``): the file
backend's budget and the Mooncake store's segment accept the same strings and refuse the same
garbage with a ``ValueError`` naming the setting."""

from __future__ import annotations

import pytest

from hicache_prefill.hicache.storage.config import HiCacheStorageConfig, parse_size
from hicache_prefill.hicache.storage.file_backend import HiCacheFile
from hicache_prefill.hicache.storage.mooncake.config import load_mooncake_config

GOOD = {
    "200G": 200 * 10**9,
    "200g": 200 * 10**9,
    "25.6k": 25600,
    "32K": 32000,
    "1 G": 10**9,
    "4gb": 4 << 30,
    "4GB": 4 << 30,
    "512MB": 512 << 20,
    "1Gi": 1 << 30,
    "1gib": 1 << 30,
    "512MiB": 512 << 20,
    "2Ti": 2 << 40,
    "1048576": 1 << 20,
    " 17 ": 17,
    "0": 0,
    7: 7,
    0: 0,
    1e9: 10**9,
}
BAD = ["", "  ", "-5", "-1G", "1.5Mi", "1.5GB", "1.5", "nan", "inf", "lots", "1X", "G", "1GBB"]
BAD += [-5, float("nan"), float("inf"), True, [1]]


def file_config(tmp_path, size) -> HiCacheStorageConfig:
    extra = {"file_storage_path": str(tmp_path), "min_free_space": size}
    return HiCacheStorageConfig(0, 1, extra_config=extra)


@pytest.mark.parametrize("text, size", GOOD.items())
def test_sizes_parse_the_same_for_every_backend(text, size, tmp_path, monkeypatch):
    assert parse_size(text, "s") == size
    monkeypatch.delenv("SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR", raising=False)
    cfg = file_config(tmp_path, text)
    assert HiCacheFile(cfg)._evictor.min_free_bytes == size
    mooncake = {"master_server_address": "127.0.0.1:50051", "global_segment_size": text}
    assert load_mooncake_config(mooncake, env={}).global_segment_size == size


@pytest.mark.parametrize("text", BAD, ids=repr)
def test_bad_sizes_are_refused_naming_the_setting(text, tmp_path, monkeypatch):
    with pytest.raises(ValueError, match="^s"):
        parse_size(text, "s")
    monkeypatch.delenv("SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR", raising=False)
    cfg = file_config(tmp_path, text)
    with pytest.raises(ValueError, match="'min_free_space'"):
        HiCacheFile(cfg)
    mooncake = {"master_server_address": "127.0.0.1:50051", "global_segment_size": text}
    with pytest.raises(ValueError, match="'global_segment_size'"):
        load_mooncake_config(mooncake, env={})
