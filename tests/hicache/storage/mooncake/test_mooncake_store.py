"""``MooncakeStore`` over an in-process fake of Mooncake (``fake_mooncake``): SGLang's object
names, the zero-copy v1 calls byte for byte in every pool kind and layout it accepts, puts of
missing objects only, a page stored or read only when every object of it succeeded, MLA written
by rank 0 only, each Mooncake return code a counted failure, health gating, the close guard, and
startup errors naming the setting."""

from __future__ import annotations

import pytest
import torch

from hicache_prefill.hicache.storage.config import storage_config_for_pool
from hicache_prefill.hicache.storage.hash_keys import get_hash_str, page_hashes
from hicache_prefill.hicache.storage.mooncake import availability
from hicache_prefill.hicache.storage.mooncake import client as client_module
from hicache_prefill.hicache.storage.mooncake.names import ObjectNames
from hicache_prefill.hicache.storage.mooncake.store import MooncakeStore
from tests.hicache.storage.helpers import fill_random, host_pool, same_slots, slot_bytes
from tests.hicache.storage.mooncake.fake_mooncake import FakeCluster

MASTER = {"master_server_address": "127.0.0.1:50051", "protocol": "tcp",
          "global_segment_size": 0}  # fmt: skip
PAGE = 4


@pytest.fixture
def cluster(monkeypatch) -> FakeCluster:
    c = FakeCluster()
    monkeypatch.setattr(MooncakeStore, "store_factory", c.factory)
    return c


def make(pool, *, tp_rank=0, tp_size=1, model="org/m", **extra) -> MooncakeStore:
    cfg = storage_config_for_pool(pool, model, tp_rank=tp_rank, tp_size=tp_size,
                                  extra_config={**MASTER, **extra})  # fmt: skip
    store = MooncakeStore(cfg, pool)
    store.register_mem_pool_host(pool)
    return store


def slots(page: int, n: int = 1) -> torch.Tensor:
    return torch.arange(page * PAGE, (page + n) * PAGE, dtype=torch.int64)


def test_object_names_are_sglangs():
    key = get_hash_str(list(range(1, 17)))
    pool = host_pool("mha", "page_first")
    cfg = storage_config_for_pool(pool, "Qwen/Qwen3-8B", tp_rank=1, tp_size=2,
                                  extra_config={"storage_format_tag": "none"})  # fmt: skip
    assert ObjectNames.for_config(cfg).objects([key]) == [
        f"Qwen-Qwen3-8B_{key}_1_k", f"Qwen-Qwen3-8B_{key}_1_v"]  # fmt: skip
    mla = host_pool("mla", "page_first")
    cfg = storage_config_for_pool(mla, "Qwen/Qwen3-8B", tp_rank=1, tp_size=2,
                                  extra_config={"storage_format_tag": "none"})  # fmt: skip
    assert ObjectNames.for_config(cfg).objects([key]) == [f"Qwen-Qwen3-8B_{key}__k"]
    assert ObjectNames.for_config(cfg, "tenantA").objects([key]) == [
        f"tenantA_Qwen-Qwen3-8B_{key}__k"]  # fmt: skip
    cfg.pp_size, cfg.pp_rank = 2, 1
    assert ObjectNames.for_config(cfg).objects([key]) == [f"Qwen-Qwen3-8B_{key}_1_k"]
    tagged = storage_config_for_pool(pool, "Qwen/Qwen3-8B")  # this project's format tag
    assert ObjectNames.for_config(tagged).objects([key])[0] == (
        f"Qwen-Qwen3-8B-float32-token-major_{key}_0_k")  # fmt: skip


@pytest.mark.parametrize("kind", ["mha", "mha_v", "mla"])
@pytest.mark.parametrize("layout", ["page_first", "page_first_direct"])
def test_pages_round_trip_between_two_stores_byte_for_byte(cluster, kind, layout):
    a, b = host_pool(kind, layout), host_pool(kind, layout)
    fill_random(a, seed=1)
    fill_random(b, seed=2)
    sa, sb = make(a), make(b)
    keys = page_hashes(list(range(3 * PAGE)), PAGE)
    assert sa.batch_set_v1(keys, slots(1, 3)) == [True] * 3
    assert len(cluster.objects) == 3 * (1 if kind == "mla" else 2)  # (warm-ups removed)
    assert sb.batch_exists(keys) == 3
    others = torch.cat([slots(0, 4), slots(7, b.size // PAGE - 7)])
    before = slot_bytes(b, others)
    assert sb.batch_get_v1(keys, slots(4, 3)) == [True] * 3
    assert same_slots(a, slots(1, 3), b, slots(4, 3))
    assert all(torch.equal(x, y) for x, y in zip(before, slot_bytes(b, others), strict=True))
    s = sb.get_stats()
    assert (s.pages_read, s.pages_read_failed, s.errors) == (3, 0, {})
    # the generic (copying) calls address the same objects
    page = b.get_dummy_flat_data_page()
    assert sb.get(keys[0], page) is page
    assert torch.equal(page.view(torch.uint8), a.get_data_page(PAGE, flat=True).view(torch.uint8))
    assert sb.get(page_hashes([7] * PAGE, PAGE)[0], page) is None


def test_layer_first_and_mismatched_pools_are_refused(cluster):
    with pytest.raises(ValueError, match="--hicache-mem-layout=layer_first"):
        make(host_pool("mha", "layer_first"))


def test_only_missing_objects_are_put_and_a_page_needs_all_its_objects(cluster):
    pool = host_pool("mha", "page_first")
    fill_random(pool, seed=3)
    store = make(pool)
    keys = page_hashes(list(range(3 * PAGE)), PAGE)
    names = store.names.objects(keys)
    assert store.batch_set_v1(keys[:1], slots(0)) == [True]
    cluster.put_names.clear()
    cluster.put_codes[names[3]] = -200  # page 1's V object: segment full
    assert store.batch_set_v1(keys, slots(0, 3)) == [True, False, True]
    assert cluster.put_names == names[2:]  # page 0's two objects existed: not put again
    assert names[2] in cluster.objects and names[3] not in cluster.objects
    assert store.batch_exists(keys) == 1  # page 1 lacks V: the hit stops there
    s = store.get_stats()
    assert s.errors == {"-200 NO_AVAILABLE_HANDLE": 1}
    assert (s.pages_stored, s.pages_store_failed, s.objects_already_stored) == (3, 1, 2)
    del cluster.put_codes[names[3]]
    cluster.put_names.clear()
    assert store.batch_set_v1(keys, slots(0, 3)) == [True] * 3
    assert cluster.put_names == [names[3]]


@pytest.mark.parametrize(
    "fault, counted",
    [("missing", "-704 OBJECT_NOT_FOUND"), ("bigger", "-600 INVALID_PARAMS"),
     ("smaller", "wrong_size"), ("transfer", "-800 TRANSFER_FAIL"),
     ("lease", "-707 LEASE_EXPIRED")],
)  # fmt: skip
def test_a_failed_object_fails_its_page_only_and_is_counted(cluster, fault, counted):
    pool = host_pool("mha", "page_first")
    fill_random(pool, seed=4)
    store = make(pool)
    keys = page_hashes(list(range(3 * PAGE)), PAGE)
    assert store.batch_set_v1(keys, slots(0, 3)) == [True] * 3
    victim = store.names.objects(keys)[3]  # page 1's V
    if fault == "missing":
        del cluster.objects[victim]
    elif fault == "bigger":  # another geometry wrote a larger object under the name
        cluster.objects[victim] += b"\0" * 16
    elif fault == "smaller":  # ... or a smaller one: Mooncake returns its size, not an error
        cluster.objects[victim] = cluster.objects[victim][:-16]
    else:
        cluster.get_codes[victim] = {"transfer": -800, "lease": -707}[fault]
    assert store.batch_get_v1(keys, slots(4, 3)) == [True, False, True]
    s = store.get_stats()
    assert s.pages_read == 2 and s.pages_read_failed == 1
    assert (s.wrong_size == 1) if counted == "wrong_size" else (s.errors == {counted: 1})
    assert same_slots(pool, slots(0), pool, slots(4))  # the good pages landed
    assert same_slots(pool, slots(2), pool, slots(6))


def test_mla_ranks_other_than_0_write_nothing(cluster):
    pool0, pool1 = host_pool("mla", "page_first"), host_pool("mla", "page_first")
    fill_random(pool0, seed=5)
    fill_random(pool1, seed=6)
    r0, r1 = make(pool0, tp_rank=0, tp_size=2), make(pool1, tp_rank=1, tp_size=2)
    keys = page_hashes(list(range(2 * PAGE)), PAGE)
    assert r1.batch_set_v1(keys, slots(0, 2)) == [False, False]  # not stored, and not by it
    assert not cluster.put_names
    assert r0.batch_set_v1(keys, slots(0, 2)) == [True, True]
    assert r1.batch_set_v1(keys, slots(0, 2)) == [True, True]  # rank 0 stored them
    assert r1.batch_get_v1(keys, slots(3, 2)) == [True, True]
    assert same_slots(pool0, slots(0, 2), pool1, slots(3, 2))
    assert r1.get_stats().objects_written == 0 and r0.get_stats().objects_written == 2


def test_a_down_master_is_skipped_without_calling_mooncake_and_service_resumes(cluster):
    pool = host_pool("mha", "page_first")
    fill_random(pool, seed=7)
    store = make(pool)
    keys = page_hashes(list(range(2 * PAGE)), PAGE)
    cluster.master_down = True
    n_calls = len(cluster.data_calls())
    assert store.batch_set_v1(keys, slots(0, 2)) == [False, False]
    assert store.batch_exists(keys) == 0
    assert store.batch_get_v1(keys, slots(4, 2)) == [False, False]
    assert len(cluster.data_calls()) == n_calls  # gated: Mooncake was not called
    assert store.get_stats().skipped_unhealthy == 3
    cluster.master_down = False
    assert store.batch_set_v1(keys, slots(0, 2)) == [True, True]
    assert store.batch_get_v1(keys, slots(4, 2)) == [True, True]


def test_after_close_every_call_fails_without_touching_mooncake(cluster):
    pool = host_pool("mha", "page_first")
    store = make(pool)
    keys = page_hashes(list(range(PAGE)), PAGE)
    store.close()
    store.close()  # idempotent
    assert store.batch_set_v1(keys, slots(0)) == [False]  # the fake raises if called
    assert store.batch_exists(keys) == 0
    assert store.batch_get_v1(keys, slots(1)) == [False]
    assert not cluster.clients[0].registered  # buffers unregistered before close


def test_bad_arguments_and_count_mismatches(cluster):
    pool = host_pool("mha", "page_first")
    store = make(pool)
    keys = page_hashes(list(range(2 * PAGE)), PAGE)
    assert store.batch_set_v1(keys, slots(0)) == [False, False]  # SGLang: all False
    with pytest.raises(ValueError, match="consecutive"):
        store.batch_set_v1(keys[:1], torch.tensor([0, 2, 1, 3]))
    with pytest.raises(ValueError, match="non-empty strings"):
        store.batch_get_v1([""], slots(0))
    with pytest.raises(ValueError, match="contiguous CPU tensor"):
        store.set(keys[0], [1, 2, 3])
    assert store.batch_set_v1([], slots(0, 0)) == [] and store.batch_exists([]) == 0


def test_group_semantics_pass_sglangs_group_ids(cluster):
    reason = availability.module_reason("store")  # ReplicateConfig is Mooncake's
    if reason is not None:
        pytest.skip(f"Mooncake unavailable: {reason}")
    pool = host_pool("mha", "page_first")
    store = make(pool, enable_group_semantics=True)
    if store._replicate_config is None:
        pytest.skip("this Mooncake has no ReplicateConfig.group_ids")
    key = page_hashes(list(range(PAGE)), PAGE)[0]
    assert store.batch_set_v1([key], slots(0)) == [True]
    assert cluster.group_ids == [[f"sglang-hicache:{store.names.tagged(key)}"] * 2]


def test_startup_errors_name_the_setting(cluster, monkeypatch):
    pool = host_pool("mha", "page_first")
    with pytest.raises(ValueError, match="'global_segment_size'.*minimum segment"):
        make(pool, global_segment_size="8mb")
    with pytest.raises(ValueError, match="'global_segment_size'.*minimum segment"):
        make(pool, global_segment_size="24mb", tp_size=2)  # 12 MiB per rank
    cluster.capacity_bytes = 0  # no segment anywhere: the warm-up put gets -200
    with pytest.raises(ValueError, match="'global_segment_size'.*no segment.*mounts none"):
        make(pool)
    cluster.capacity_bytes = None
    cluster.setup_rc = -1
    with pytest.raises(ValueError, match="setup failed.*'master_server_address'"):
        make(pool)
    monkeypatch.setattr(MooncakeStore, "store_factory", None)
    monkeypatch.setattr(availability, "module_reason", lambda module: "import failed (x)")
    with pytest.raises(ValueError, match="needs Mooncake: import failed"):
        make(pool)


def test_no_master_at_the_address_is_one_error_at_once():
    from tests.support.mooncake_master import free_port

    port = free_port()
    with pytest.raises(ValueError, match=f"'master_server_address'=127.0.0.1:{port}.*no Mooncake"):
        client_module.probe_master("127.0.0.1", port, "extra config key 'master_server_address'")


@pytest.mark.parametrize("kind", ["mha", "mla"])
@pytest.mark.parametrize("damage", ["random", "swapped"])
def test_a_damaged_or_swapped_object_is_a_counted_miss_never_kv(cluster, kind, damage):
    pool = host_pool(kind, "page_first")
    fill_random(pool, seed=8)
    store = make(pool)
    keys = page_hashes(list(range(3 * PAGE)), PAGE)
    assert store.batch_set_v1(keys, slots(0, 3)) == [True] * 3
    names = store.names.objects(keys)
    victim, other = names[store.names.per_page], names[0]  # page 1's first object, page 0's
    size = len(cluster.objects[victim])
    if damage == "random":
        cluster.objects[victim] = (
            torch.randint(0, 256, (size,), dtype=torch.uint8).numpy().tobytes()
        )
    else:  # another page's object, footer and all, under page 1's name
        cluster.objects[victim] = cluster.objects[other]
    assert store.batch_get_v1(keys, slots(4, 3)) == [True, False, True]
    s = store.get_stats()
    assert (s.read_corrupt, s.pages_read, s.pages_read_failed, s.errors) == (1, 2, 1, {})
    assert same_slots(pool, slots(0), pool, slots(4)) and same_slots(pool, slots(2), pool, slots(6))
    assert victim not in cluster.objects  # removed: the next backup puts it again
    assert store.batch_exists(keys) == 1
    flat = pool.get_dummy_flat_data_page()
    assert store.get(keys[1], flat) is None
    assert store.batch_set_v1(keys, slots(0, 3)) == [True] * 3
    assert store.batch_get_v1(keys[1:2], slots(5)) == [True]
    assert same_slots(pool, slots(1), pool, slots(5))


def test_sglangs_pages_carry_no_check_and_say_so(cluster):
    pool = host_pool("mha", "page_first")
    fill_random(pool, seed=9)
    store = make(pool, storage_format_tag="none")
    assert store.footers is None
    key = page_hashes(list(range(PAGE)), PAGE)[0]
    assert store.batch_set_v1([key], slots(0)) == [True]
    names = store.names.objects([key])
    assert [len(cluster.objects[n]) for n in names] == store._object_sizes  # SGLang's bytes only
    assert {c[0] for c in cluster.data_calls()} == {"batch_is_exist", "batch_put_from"}


def test_a_mooncake_without_multi_buffer_calls_is_refused_for_checked_pages(cluster, monkeypatch):
    from tests.hicache.storage.mooncake.fake_mooncake import FakeDistributedStore

    monkeypatch.delattr(FakeDistributedStore, "batch_get_into_multi_buffers")
    with pytest.raises(ValueError, match="storage_format_tag"):
        make(host_pool("mha", "page_first"))
    assert cluster.clients[-1].closed
