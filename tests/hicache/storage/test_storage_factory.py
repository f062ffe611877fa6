"""``StorageBackendFactory``: built-in names, registered backends, the ``dynamic`` backend, and
errors that name what is wrong."""

from __future__ import annotations

import os

import pytest

from hicache_prefill.hicache.storage.backend_factory import StorageBackendFactory
from hicache_prefill.hicache.storage.config import HiCacheStorageConfig
from hicache_prefill.hicache.storage.fault_injector import HiCacheStorageFailureInjector
from hicache_prefill.hicache.storage.file_backend import HiCacheFile
from tests.hicache.storage.helpers import MemoryStorage

DYNAMIC = {"backend_name": "mem", "module_path": "tests.hicache.storage.helpers",
           "class_name": "MemoryStorage"}  # fmt: skip


@pytest.fixture(autouse=True)
def _clean(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(StorageBackendFactory, "_registry", dict(StorageBackendFactory._registry))
    for name in list(os.environ):
        if name.startswith(("SGLANG_HICACHE_FILE_BACKEND_", "SGLANG_TEST_HICACHE_")):
            monkeypatch.delenv(name)


def cfg(**extra) -> HiCacheStorageConfig:
    return HiCacheStorageConfig(0, 1, model_name="m", extra_config=extra)


def test_file_is_built_in(tmp_path) -> None:
    names = StorageBackendFactory.backend_names()
    assert "file" in names and names[-1] == "dynamic"
    backend = StorageBackendFactory.create_backend("file", cfg(file_storage_path=str(tmp_path)))
    assert isinstance(backend, HiCacheFile) and backend.file_path == str(tmp_path)


def test_unknown_names_list_the_valid_ones(monkeypatch) -> None:
    with pytest.raises(ValueError, match=r"'nope'.*\['file', 'mooncake', 'dynamic'\]"):
        StorageBackendFactory.create_backend("nope", cfg())
    for var in ("MOONCAKE_MASTER", "MOONCAKE_CLIENT", "SGLANG_HICACHE_MOONCAKE_CONFIG_PATH"):
        monkeypatch.delenv(var, raising=False)
    with pytest.raises(ValueError, match="no Mooncake master configured.*MOONCAKE_MASTER"):
        StorageBackendFactory.create_backend("mooncake", cfg())  # built in, needs a master


def test_dynamic_backend_from_the_extra_config() -> None:
    backend = StorageBackendFactory.create_backend("dynamic", cfg(**DYNAMIC), None, token="t")
    assert isinstance(backend, MemoryStorage)
    assert backend.kwargs == {"token": "t"}  # SGLang: cls(storage_config, kwargs)
    assert backend.storage_config.extra_config["backend_name"] == "mem"


@pytest.mark.parametrize("missing", ["backend_name", "module_path", "class_name"])
def test_dynamic_names_each_missing_key(missing: str) -> None:
    extra = {k: v for k, v in DYNAMIC.items() if k != missing}
    with pytest.raises(ValueError, match=f"missing: \\['{missing}'\\]"):
        StorageBackendFactory.create_backend("dynamic", cfg(**extra))
    with pytest.raises(ValueError, match="missing"):
        StorageBackendFactory.create_backend("dynamic", HiCacheStorageConfig(0, 1))


@pytest.mark.parametrize(
    ("key", "value", "message"),
    [("module_path", "no.such.module", "module_path='no.such.module' does not import"),
     ("class_name", "Missing", "class_name='Missing' is not in"),
     ("class_name", "NotAStorage", "not a HiCacheStorage"),
     ("class_name", 7, "'class_name'.*non-empty string")],
)  # fmt: skip
def test_dynamic_bad_values_name_the_key(key: str, value, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        StorageBackendFactory.create_backend("dynamic", cfg(**{**DYNAMIC, key: value}))


def test_register_backend_by_path_or_class(caplog) -> None:
    StorageBackendFactory.register_backend("mem", "tests.hicache.storage.helpers", "MemoryStorage")
    assert isinstance(StorageBackendFactory.create_backend("mem", cfg()), MemoryStorage)
    StorageBackendFactory.register_backend("mem", MemoryStorage)  # replaces it, with a warning
    assert "already registered" in caplog.text
    assert StorageBackendFactory.create_backend("mem", cfg(), None, a=1).kwargs == {"a": 1}
    assert "mem" in StorageBackendFactory.backend_names()
    with pytest.raises(ValueError, match="not a HiCacheStorage"):
        StorageBackendFactory.register_backend("bad", dict)
    with pytest.raises(ValueError, match="class_name"):
        StorageBackendFactory.register_backend("bad", "tests.hicache.storage.helpers")
    with pytest.raises(ValueError, match="dynamic"):
        StorageBackendFactory.register_backend("dynamic", MemoryStorage)
    StorageBackendFactory.register_backend("lazy", "no.such.module", "X")  # imported when built
    with pytest.raises(ValueError, match="does not import"):
        StorageBackendFactory.create_backend("lazy", cfg())


def test_every_backend_goes_through_the_injector_check(monkeypatch) -> None:
    monkeypatch.setenv("SGLANG_TEST_HICACHE_BACKEND_RANDOM_FAILURE", "0.5")
    backend = StorageBackendFactory.create_backend("dynamic", cfg(**DYNAMIC))
    assert isinstance(backend, HiCacheStorageFailureInjector)
    assert isinstance(backend.backend, MemoryStorage)
    monkeypatch.setenv("SGLANG_TEST_HICACHE_BACKEND_RANDOM_FAILURE", "2")
    with pytest.raises(ValueError, match="SGLANG_TEST_HICACHE_BACKEND_RANDOM_FAILURE"):
        StorageBackendFactory.create_backend("dynamic", cfg(**DYNAMIC))
