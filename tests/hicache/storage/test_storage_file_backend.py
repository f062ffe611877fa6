"""``HiCacheFile``: SGLang's names and bytes, atomic writes, misses instead of wrong KV, the LRU
byte budget, the format tag, and bad settings refused at construction."""

from __future__ import annotations

import errno
import os

import pytest
import torch

import hicache_prefill.hicache.storage.file_backend as file_backend
from hicache_prefill.hicache.storage.config import HiCacheStorageConfig, storage_config_for_pool
from hicache_prefill.hicache.storage.file_backend import HiCacheFile
from hicache_prefill.hicache.storage.hash_keys import page_hashes
from hicache_prefill.hicache.storage.lru_file_evictor import LRUFileEvictor
from tests.hicache.storage.helpers import fill_random, host_pool, same_slots, slot_bytes

V1 = "77d735ce838418aa151bd96b5b1e78ee63860892e0a95c00fe34178442be9b07"


@pytest.fixture(autouse=True)
def _no_storage_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in list(os.environ):
        if name.startswith(("SGLANG_HICACHE_FILE_BACKEND_", "SGLANG_TEST_HICACHE_")):
            monkeypatch.delenv(name)


def at(tmp_path, **extra) -> dict:
    """An extra config pointing at ``tmp_path``."""
    return {"file_storage_path": str(tmp_path), **extra}


def config(tmp_path, model="Qwen/Qwen3-8B", **extra) -> HiCacheStorageConfig:
    return HiCacheStorageConfig(0, 1, model_name=model, extra_config=at(tmp_path, **extra))


def backend_for(host, tmp_path, model="m", **extra) -> HiCacheFile:
    extra = {"file_storage_path": str(tmp_path), **extra}
    backend = HiCacheFile(storage_config_for_pool(host, model, extra_config=extra))
    backend.register_mem_pool_host(host)
    return backend


def pages(n: int, page: int = 4, first: int = 0) -> list[str]:
    return page_hashes(list(range(first, first + n * page)), page)


def bins(tmp_path) -> list[str]:
    return sorted(n for n in os.listdir(tmp_path) if n.endswith(".bin"))


# --- names and bytes ---------------------------------------------------------------------------
def test_names_are_sglangs(tmp_path) -> None:
    def name(**fields) -> str:
        base = {"tp_rank": 0, "tp_size": 1, "model_name": "Qwen/Qwen3-8B"}
        cfg = HiCacheStorageConfig(**{**base, "extra_config": at(tmp_path), **fields})
        return os.path.basename(HiCacheFile(cfg).path_of(V1))

    assert name() == f"{V1}_Qwen-Qwen3-8B_0_1.bin"
    assert name(is_mla_model=True) == f"{V1}_Qwen-Qwen3-8B.bin"
    assert name(tp_rank=1, tp_size=2, pp_rank=1, pp_size=2) == f"{V1}_Qwen-Qwen3-8B_1_2_2_1.bin"
    assert name(attn_cp_rank=1, attn_cp_size=2) == f"{V1}_Qwen-Qwen3-8B_0_1_cp1_2.bin"
    assert name(model_name=None) == f"{V1}__0_1.bin"


def test_a_page_is_its_raw_bytes(tmp_path) -> None:
    backend = HiCacheFile(config(tmp_path))
    value = torch.arange(12, dtype=torch.float32)
    assert backend.set(V1, value) and backend.exists(V1)
    with open(backend.path_of(V1), "rb") as f:
        assert f.read() == value.numpy().tobytes()
    out = backend.get(V1, torch.zeros(12))
    assert torch.equal(out, value)
    assert backend.set(V1, value)  # already there: skipped, still True
    stats = backend.get_stats()
    assert (stats.writes, stats.writes_skipped, stats.read_hits, stats.bytes_read) == (1, 1, 1, 48)
    assert backend.get("0" * 64, torch.zeros(12)) is None
    assert backend.get_stats().read_misses == 1
    with pytest.raises(ValueError, match="'/'"):
        backend.exists("../escape")


def test_batch_set_stops_at_the_first_failure(tmp_path, monkeypatch) -> None:
    """``batch_set`` (the base class's, as every backend's): pages in order, ``False`` at the
    first failed ``set`` with nothing after it tried; one value per key or ``ValueError``."""
    backend = HiCacheFile(config(tmp_path))
    keys = pages(3)
    with pytest.raises(ValueError, match="HiCacheFile.batch_set needs one value per key"):
        backend.batch_set(keys, [torch.ones(4)])
    assert not any(backend.exists(k) for k in keys)
    tried = []
    real_set = backend.set

    def failing_second(key, value):
        tried.append(key)
        return key != keys[1] and real_set(key, value)

    monkeypatch.setattr(backend, "set", failing_second)
    assert backend.batch_set(keys, [torch.ones(4)] * 3) is False
    assert tried == keys[:2] and backend.exists(keys[0]) and not backend.exists(keys[2])
    with pytest.raises(ValueError, match="HiCacheFile.batch_get needs one target location"):
        backend.batch_get(keys, [torch.zeros(4)])
    got = backend.batch_get(keys[:1] + keys[2:], [torch.zeros(4), torch.zeros(4)])
    assert torch.equal(got[0], torch.ones(4)) and got[1] is None


def test_writes_are_atomic_renames(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    backend = HiCacheFile(config(tmp_path))
    value = torch.ones(256)
    real_replace = os.replace
    seen = []

    def replace(src: str, dst: str) -> None:
        assert not os.path.exists(dst)  # the page appears only by the rename
        assert os.path.dirname(src) == os.path.dirname(dst) == str(tmp_path)
        assert os.path.getsize(src) == 1024  # complete before it is renamed
        seen.append(os.path.basename(src))
        real_replace(src, dst)

    monkeypatch.setattr(file_backend.os, "replace", replace)
    assert backend.set(V1, value)
    assert seen[0].startswith(".") and seen[0].endswith(".tmp")
    assert os.listdir(tmp_path) == [os.path.basename(backend.path_of(V1))]


def test_a_full_disk_is_a_counted_false(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    host = host_pool("mha", "page_first")
    fill_random(host, 1)
    backend = backend_for(host, tmp_path, max_size=10**6)

    class FullDisk:
        def __init__(self, path, mode):
            self.f = open(path, mode)

        def __enter__(self):
            return self

        def write(self, data):
            raise OSError(errno.ENOSPC, "No space left on device")

        def __exit__(self, *exc):
            self.f.close()

    monkeypatch.setattr(file_backend, "open", FullDisk, raising=False)
    keys = pages(2)
    assert backend.batch_set_v1(keys, torch.arange(8)) == [False, False]
    assert not backend.set(keys[0], host.get_data_page(0))
    stats = backend.get_stats()
    assert stats.write_failures == 3 and stats.writes == 0 and stats.budget_bytes == 0
    assert os.listdir(tmp_path) == []  # no page, no temporary file
    assert backend.batch_exists(keys) == 0


# --- misses, never wrong KV --------------------------------------------------------------------
def test_a_truncated_or_longer_file_is_a_miss(tmp_path) -> None:
    host = host_pool("mha", "layer_first")
    fill_random(host, 2)
    backend = backend_for(host, tmp_path)
    keys = pages(3)
    assert backend.batch_set_v1(keys, torch.arange(12)) == [True] * 3
    with open(backend.path_of(keys[1]), "r+b") as f:
        f.truncate(100)  # truncated
    with open(backend.path_of(keys[2]), "ab") as f:
        f.write(b"x")  # longer
    assert backend.batch_exists(keys) == 1
    dst = host_pool("mha", "layer_first")
    fill_random(dst, 3)
    before = slot_bytes(dst, range(4, 12))
    reader = backend_for(dst, tmp_path)
    assert reader.batch_get_v1(keys, torch.arange(12)) == [True, False, False]
    assert same_slots(host, range(0, 4), dst, range(0, 4))
    after = slot_bytes(dst, range(4, 12))
    assert all(torch.equal(a, b) for a, b in zip(before, after, strict=True))  # untouched
    assert reader.get_stats().read_bad_size == 2
    assert backend.set(keys[1], host.get_data_page(4))  # a bad file is rewritten, not kept
    assert backend.get_stats().writes == 4 and backend.exists(keys[1])


def test_a_file_shrinking_while_read_is_a_miss(tmp_path, monkeypatch) -> None:
    backend = HiCacheFile(config(tmp_path))
    backend.set(V1, torch.ones(64))
    with open(backend.path_of(V1), "r+b") as f:
        f.truncate(10)
    real_fstat = os.fstat

    def fstat(fd):  # the size seen before the read: still whole
        st = real_fstat(fd)
        return os.stat_result((st.st_mode, *tuple(st)[1:6], 256, *tuple(st)[7:]))

    monkeypatch.setattr(file_backend.os, "fstat", fstat)
    assert backend.get(V1, torch.zeros(64)) is None
    assert backend.get_stats().read_bad_size == 1


# --- v1 over a real host pool -----------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("layout", ["layer_first", "page_first", "page_first_direct"])
@pytest.mark.parametrize("kind", ["mha", "mha_v", "mla"])
def test_v1_round_trip_between_pools(tmp_path, kind: str, layout: str, dtype) -> None:
    src, dst = host_pool(kind, layout, dtype=dtype), host_pool(kind, layout, dtype=dtype)
    fill_random(src, 4)
    writer, reader = backend_for(src, tmp_path), backend_for(dst, tmp_path)
    keys = pages(3)
    src_slots = torch.cat([torch.arange(8, 12), torch.arange(0, 4), torch.arange(28, 32)])
    assert writer.batch_set_v1(keys, src_slots) == [True] * 3
    assert reader.batch_exists(keys) == 3
    dst_slots = torch.arange(12, 24)
    assert reader.batch_get_v1(keys, dst_slots) == [True] * 3
    assert same_slots(src, src_slots, dst, dst_slots)
    assert reader.batch_get_v1(keys, torch.arange(8)) == [False] * 3  # wrong count: all False
    unregistered = HiCacheFile(storage_config_for_pool(src, "m", extra_config=at(tmp_path)))
    with pytest.raises(ValueError, match="register_mem_pool_host"):
        unregistered.batch_get_v1(keys, dst_slots)


# --- the format tag ----------------------------------------------------------------------------
def test_format_tag_keeps_other_formats_out(tmp_path) -> None:
    lf, pf, pfd = (host_pool("mha", x) for x in ("layer_first", "page_first", "page_first_direct"))
    fill_random(lf, 5)
    keys = pages(2)
    slots = torch.arange(0, 8)
    assert backend_for(lf, tmp_path).batch_set_v1(keys, slots) == [True, True]
    assert backend_for(pf, tmp_path).batch_exists(keys) == 0  # token-major: other names
    half = host_pool("mha", "layer_first", dtype=torch.float16)
    assert backend_for(half, tmp_path).batch_exists(keys) == 0
    same_order = backend_for(pfd, tmp_path)  # layer-major as well: the same bytes, a hit
    assert same_order.batch_get_v1(keys, slots) == [True, True]
    assert same_slots(lf, slots, pfd, slots)
    assert all("_m-float32-layer-major_0_1.bin" in n for n in bins(tmp_path))


def test_without_the_tag_other_formats_read_as_wrong_kv(tmp_path) -> None:
    """``storage_format_tag: none`` gives SGLang's untagged names; a page of the other byte order
    then reads back whole but scrambled, which is what the default tag prevents."""
    lf, pf = host_pool("mha", "layer_first"), host_pool("mha", "page_first")
    fill_random(lf, 6)
    writer = backend_for(lf, tmp_path, storage_format_tag="none")
    keys = pages(1)
    assert writer.batch_set_v1(keys, torch.arange(4)) == [True]
    assert bins(tmp_path) == [f"{keys[0]}_m_0_1.bin"]
    reader = backend_for(pf, tmp_path, storage_format_tag="none")
    assert reader.batch_get_v1(keys, torch.arange(4)) == [True]
    assert not same_slots(lf, range(4), pf, range(4))
    custom = storage_config_for_pool(lf, "org/m", extra_config={"storage_format_tag": "v2"})
    assert custom.model_name == "org/m-v2" and "storage_format_tag" not in custom.extra_config
    with pytest.raises(ValueError, match="storage_format_tag"):
        storage_config_for_pool(lf, "m", extra_config={"storage_format_tag": 3})


# --- the byte budget ---------------------------------------------------------------------------
def test_budget_evicts_least_recently_used(tmp_path) -> None:
    host = host_pool("mha", "page_first")
    fill_random(host, 7)
    page = host.page_nbytes + file_backend.FOOTER.size  # a page file: the page and its check
    backend = backend_for(host, tmp_path, max_size=4 * page, eviction_ratio=0.5)
    keys = pages(6)
    assert backend.batch_set_v1(keys[:4], torch.arange(16)) == [True] * 4
    assert backend.batch_get_v1(keys[:1], torch.arange(16, 20)) == [True]  # k0 most recent
    assert backend.batch_set_v1(keys[4:5], torch.arange(4)) == [True]  # evicts to 2 pages - 1
    assert [backend.exists(k) for k in keys[:5]] == [True, False, False, False, True]
    stats = backend.get_stats()
    assert (stats.evicted_files, stats.budget_bytes) == (3, 2 * page)
    assert not backend.set(keys[5], torch.zeros(5 * page // 4))  # larger than the cap
    assert backend.get_stats().writes_refused == 1


def test_budget_starts_from_the_files_on_disk(tmp_path) -> None:
    host = host_pool("mha", "page_first")
    keys = pages(3)
    plain = backend_for(host, tmp_path)
    model = plain.config_suffix[1:-4]
    other_rank = HiCacheFile(
        HiCacheStorageConfig(1, 2, model_name=model, extra_config=at(tmp_path))
    )
    assert plain.batch_set_v1(keys, torch.arange(12)) == [True] * 3
    assert other_rank.set(keys[0], torch.zeros(10_000))  # not this rank's: never evicted by it
    for age, key in enumerate(reversed(keys)):  # keys[2] oldest
        os.utime(plain.path_of(key), (1000 + age, 1000 + age))
    page = host.page_nbytes + file_backend.FOOTER.size
    bounded = backend_for(host, tmp_path, max_size=2 * page, eviction_ratio=1.0)
    assert [bounded.exists(k) for k in keys] == [True, True, False]
    assert os.path.exists(other_rank.path_of(keys[0]))
    assert bounded.get_stats().budget_bytes == 2 * page


def test_min_free_space_evicts_before_the_disk_fills(tmp_path, monkeypatch) -> None:
    host = host_pool("mha", "page_first")
    page = host.page_nbytes + file_backend.FOOTER.size  # a page file: the page and its check
    min_free = 10 * page
    disk = 3 * page + min_free  # room for three pages above the watermark

    def fs_stats(self) -> tuple[int, int]:
        used = sum(os.path.getsize(os.path.join(tmp_path, n)) for n in os.listdir(tmp_path))
        return 10**12, disk - used

    monkeypatch.setattr(LRUFileEvictor, "_fs_stats", fs_stats)
    backend = backend_for(host, tmp_path, min_free_space=min_free)
    keys = pages(4)
    assert backend.batch_set_v1(keys, torch.arange(16)) == [True] * 4
    assert [backend.exists(k) for k in keys] == [False, True, True, True]
    assert backend.get_stats().evicted_files == 1


def test_a_non_writer_mla_rank_writes_nothing_under_a_budget(tmp_path) -> None:
    extra = at(tmp_path, max_size="1M")
    cfg = HiCacheStorageConfig(1, 2, is_mla_model=True, model_name="m", extra_config=extra)
    assert not cfg.is_storage_writer
    backend = HiCacheFile(cfg)
    assert not backend.set(V1, torch.zeros(4))
    assert backend.get_stats().writes_refused == 1


# --- clear -------------------------------------------------------------------------------------
def test_clear_removes_pages_and_temporaries_only(tmp_path) -> None:
    backend = HiCacheFile(config(tmp_path, max_size="1M"))
    backend.set(V1, torch.ones(4))
    (tmp_path / f"{'a' * 64}_other-model_3_4.bin").write_bytes(b"x")
    (tmp_path / f".{'0' * 32}.tmp").write_bytes(b"x")
    (tmp_path / "notes.txt").write_text("keep me")
    assert backend.clear()
    assert os.listdir(tmp_path) == ["notes.txt"]
    assert backend.get_stats().budget_bytes == 0 and not backend.exists(V1)


# --- bad settings ------------------------------------------------------------------------------
def test_directory_precedence_and_unwritable_directories(tmp_path, monkeypatch) -> None:
    env_dir = tmp_path / "env"
    monkeypatch.setenv("SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR", str(env_dir))
    assert HiCacheFile(config(tmp_path / "extra")).file_path == str(env_dir)  # SGLang: env first
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    monkeypatch.setenv("SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR", str(blocker / "sub"))
    with pytest.raises(ValueError, match="SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR"):
        HiCacheFile(config(tmp_path))
    monkeypatch.delenv("SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR")
    with pytest.raises(ValueError, match="file_storage_path"):
        HiCacheFile(config(blocker / "sub"))
    with pytest.raises(ValueError, match="file_storage_path"):
        HiCacheFile(HiCacheStorageConfig(0, 1, extra_config={"file_storage_path": 3}))
    default = HiCacheFile(HiCacheStorageConfig(0, 1), file_path=str(tmp_path / "default"))
    assert default.file_path == str(tmp_path / "default")


@pytest.mark.parametrize(
    ("key", "value"),
    [("max_size", "200GBs"), ("max_size", True), ("max_size", -1), ("max_size", "1.5Gi"),
     ("min_free_space", []), ("eviction_ratio", 0), ("eviction_ratio", 1.5),
     ("eviction_ratio", "x")],
)  # fmt: skip
def test_bad_budget_settings_name_the_key(tmp_path, key: str, value) -> None:
    with pytest.raises(ValueError, match=key):
        HiCacheFile(config(tmp_path, **{key: value}))


def test_budget_settings_from_the_environment(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("SGLANG_HICACHE_FILE_BACKEND_MAX_SIZE", "lots")
    with pytest.raises(ValueError, match="SGLANG_HICACHE_FILE_BACKEND_MAX_SIZE"):
        HiCacheFile(config(tmp_path))
    monkeypatch.setenv("SGLANG_HICACHE_FILE_BACKEND_MAX_SIZE", "1Mi")
    assert HiCacheFile(config(tmp_path))._evictor.max_size_bytes == 2**20
    assert HiCacheFile(config(tmp_path, max_size="2k"))._evictor.max_size_bytes == 2000  # key wins


def test_bad_configs_raise() -> None:
    with pytest.raises(ValueError, match="tp_rank"):
        HiCacheStorageConfig(2, 2)
    with pytest.raises(ValueError, match="extra-config"):
        HiCacheStorageConfig(0, 1, extra_config="{}")
    with pytest.raises(ValueError, match="dcp"):
        HiCacheStorageConfig(0, 1, dcp_size=2)


def test_a_write_in_flight_is_never_evicted(tmp_path) -> None:
    evictor = LRUFileEvictor(str(tmp_path), owned_suffixes=("_r",), extra_config={"max_size": 20})
    for key in ("a_r", "b_r"):
        (tmp_path / f"{key}.bin").write_bytes(b"x" * 8)
    assert evictor.reserve("a_r", 8) and evictor.reserve("b_r", 8)
    evictor.commit("b_r")  # a_r is still being written
    assert evictor.reserve("c_r", 8)  # 24 > 20: evicts to 18 - 8, skipping a_r
    assert os.path.exists(tmp_path / "a_r.bin") and not os.path.exists(tmp_path / "b_r.bin")
    evictor.abort("c_r")  # a failed write refunds its bytes
    assert evictor.total_bytes == 8
    assert not evictor.reserve("x_other", 1)  # another rank's key
    assert evictor.refused_writes == 1
