"""What the SGLang radix-cache backend refuses and builds, read from SGLang-shaped server
arguments (plain attributes: no SGLang needed)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from hicache_prefill.hicache.tree.sglang_backend_config import (
    StorageArgs,
    backend_options,
    refusals,
)


def sglang_args(**kw: object) -> SimpleNamespace:
    """SGLang 0.5.23's ServerArgs defaults for the fields the backend reads."""
    base = dict(
        disable_radix_cache=False, hicache_host_memory_mode="cache",
        enable_session_radix_cache=False, enable_streaming_session=False, enable_lmcache=False,
        enable_flexkv=False, enable_unified_cache_external_linker=False,
        disaggregation_decode_retraction_backup="none", enable_hisparse=False,
        radix_eviction_policy="lru", speculative_algorithm=None, pp_size=1,
        enable_hierarchical_cache=True, hicache_write_policy="write_through",
        hicache_storage_backend=None, hicache_ratio=None, hicache_size=0,
        hicache_io_backend="kernel", hicache_mem_layout="page_first",
    )  # fmt: skip
    base.update(kw)
    return SimpleNamespace(**base)


def test_defaults_are_served() -> None:
    assert refusals(sglang_args()) == []
    assert refusals(sglang_args(enable_hierarchical_cache=False)) == []


@pytest.mark.parametrize(
    ("kw", "flag"),
    [
        ({"disable_radix_cache": True}, "--disable-radix-cache"),
        ({"hicache_host_memory_mode": "buffer_only"}, "--hicache-host-memory-mode buffer_only"),
        ({"enable_session_radix_cache": True}, "--enable-session-radix-cache"),
        ({"enable_streaming_session": True}, "--enable-streaming-session"),
        ({"enable_lmcache": True}, "--enable-lmcache"),
        ({"enable_flexkv": True}, "--enable-flexkv"),
        ({"enable_unified_cache_external_linker": True}, "--enable-unified-cache-external-linker"),
        ({"disaggregation_decode_retraction_backup": "host_pool"},
         "--disaggregation-decode-retraction-backup host_pool"),
        ({"enable_hisparse": True}, "--enable-hisparse"),
        ({"radix_eviction_policy": "lfu"}, "--radix-eviction-policy lfu"),
        ({"speculative_algorithm": "EAGLE"}, "--speculative-algorithm EAGLE"),
        ({"pp_size": 2}, "--pp-size 2"),
        ({"hicache_write_policy": "write_around"}, "--hicache-write-policy write_around"),
        ({"hicache_storage_backend": "dynamic"}, "--hicache-storage-backend dynamic"),
        ({"hicache_storage_backend": "hf3fs"}, "--hicache-storage-backend hf3fs"),
    ],
)  # fmt: skip
def test_each_refused_flag_is_named(kw: dict, flag: str) -> None:
    problems = refusals(sglang_args(**kw))
    assert len(problems) >= 1 and all(p.startswith(flag) for p in problems), problems


@pytest.mark.parametrize("model", ["is_hybrid_swa", "is_hybrid_ssm", "is_dsa"])
def test_unified_only_models_are_refused(model: str) -> None:
    (problem,) = refusals(sglang_args(), **{model: True})
    assert "unified tree" in problem or "indexer" in problem


def test_every_problem_is_reported_at_once() -> None:
    problems = refusals(sglang_args(enable_lmcache=True, pp_size=2), is_hybrid_swa=True)
    assert len(problems) == 3


def test_options_fill_sglang_unset_values_with_its_defaults() -> None:
    opts = backend_options(sglang_args(hicache_ratio=None, hicache_size=None), page_size=16)
    assert (opts.page_size, opts.hierarchical, opts.write_policy) == (16, True, "write_through")
    assert (opts.hicache_ratio, opts.hicache_size, opts.mem_layout) == (2.0, 0.0, "page_first")
    opts = backend_options(sglang_args(hicache_write_policy="write_back", hicache_ratio=3), 1)
    assert (opts.write_policy, opts.hicache_ratio) == ("write_back", 3.0)


@pytest.mark.parametrize("page_size", [0, -4, True, 2.0])
def test_bad_page_size(page_size: object) -> None:
    with pytest.raises(ValueError, match="page_size"):
        backend_options(sglang_args(), page_size)  # type: ignore[arg-type]


@pytest.mark.parametrize("backend", ["file", "mooncake"])
def test_l3_backends_built_by_name_are_served(backend: str) -> None:
    assert refusals(sglang_args(hicache_storage_backend=backend)) == []
    assert backend_options(sglang_args(hicache_storage_backend=backend), 4).storage_backend == (
        backend
    )


def test_storage_args_read_sglang_flags_as_the_storage_builder_does() -> None:
    extra = '{"file_storage_path": "/tmp/l3", "prefetch_threshold": 8}'
    args = sglang_args(
        hicache_storage_backend="file",
        hicache_storage_prefetch_policy="best_effort",
        hicache_storage_backend_extra_config=extra,
        served_model_name=None,
        model_path="Org/Model",
    )
    sa = StorageArgs.from_server_args(args, page_size=4)
    assert (sa.hicache_storage_backend, sa.page_size) == ("file", 4)
    assert (sa.hicache_storage_prefetch_policy, sa.hicache_host_memory_mode) == (
        "best_effort", "cache",
    )  # fmt: skip
    assert sa.storage_extra_config() == {"file_storage_path": "/tmp/l3", "prefetch_threshold": 8}
    assert sa.storage_model_name() == "Org/Model"  # SGLang's served name defaults to the path
    named = StorageArgs.from_server_args(
        sglang_args(hicache_storage_backend="mooncake", served_model_name="served"), 1
    )
    assert named.storage_model_name() == "served" and named.storage_extra_config() == {}
    assert named.hicache_storage_prefetch_policy == "timeout"  # SGLang's default


@pytest.mark.parametrize("backend", [None, "dynamic", "hf3fs"])
def test_storage_args_refuse_backends_not_built_by_name(backend: object) -> None:
    with pytest.raises(ValueError, match="--hicache-storage-backend"):
        StorageArgs.from_server_args(sglang_args(hicache_storage_backend=backend), 4)


def test_storage_args_name_the_flag_of_a_malformed_extra_config() -> None:
    sa = StorageArgs.from_server_args(
        sglang_args(hicache_storage_backend="file", hicache_storage_backend_extra_config="{"), 4
    )
    with pytest.raises(ValueError, match="--hicache-storage-backend-extra-config"):
        sa.storage_extra_config()
