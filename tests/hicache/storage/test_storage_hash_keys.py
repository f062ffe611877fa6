"""Page keys: SGLang 0.5.23's SHA-256 chain, checked against vectors from SGLang's own hash."""

from __future__ import annotations

import hashlib

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from hicache_prefill.hicache.storage.hash_keys import (
    get_hash_str,
    get_storage_hash_str,
    page_hashes,
    storage_namespace_seed,
)

V1 = "77d735ce838418aa151bd96b5b1e78ee63860892e0a95c00fe34178442be9b07"
V2_P1 = "1170426cf2449cebf4d17f087ce5bb43b6a910ce91b3f40922868e913e8ee91d"
V3 = [
    "2594b6a92ebfb1c3312deb7d01c015fb95e9fbe9bd7bc6b527af07813ec7b910",
    "93f92de8eb9430469914f16f03328368decd98f0c29632932c57d422fdb4ae5f",
    "7a39f08985ef83b27785d23b09dee4d20d93dd832c44489ca8a1fdb1f5eca994",
]


def test_sglang_vectors() -> None:
    assert get_hash_str(list(range(1, 17)), page_size=16) == [V1]
    assert get_hash_str(list(range(1, 33)), page_size=16) == [V1, V2_P1]
    assert get_hash_str([5, 6, 7], page_size=1) == V3
    one = "2e4c4603cb0dea8636f8e802bfa0f24caef5f9943377f91d89fd6fbd9577cd1c"
    assert get_hash_str([5, 6, 7]) == one  # no page size: one key over all tokens


def test_chain_and_partial_page() -> None:
    assert get_hash_str(list(range(17, 33)), prior_hash=V1, page_size=16) == [V2_P1]
    partial = get_hash_str(list(range(1, 21)), page_size=16)
    assert partial[0] == V1 and partial[1].startswith("9b8421c3") and partial[1].endswith("ac98")
    assert get_hash_str([1, 2], prior_hash="", page_size=2) == get_hash_str([1, 2], page_size=2)


def test_namespace_seeds() -> None:
    tokens = list(range(1, 17))
    cases = [  # (extra_key, cache_salt, seed, first page)
        ("lora-A", None, "19091e73108efe79001c7f32d5a406346de6d857c582ce3b77311ba43e5ab43a",
         "7fa7a3f25cea948900a956f4818f24257b2dfef1d88fc8937af17c7f3f4e9c25"),
        (None, "salt1", "0472d63bddb2feea167190e9ddff24ac6721a27b582db66ad063479226d2fa47",
         "b8ef3372cb4ac33ac87342b21566042ec64a5ebb86b88c13e6aa17286c7b3b37"),
        ("", None, "fd649dd1", "11fd89f2"),
    ]  # fmt: skip
    for extra_key, salt, seed, first in cases:
        got_seed = storage_namespace_seed(extra_key, salt)
        assert got_seed.startswith(seed)
        keys = page_hashes(tokens, 16, extra_key=extra_key, cache_salt=salt)
        assert keys[0].startswith(first)
        assert get_hash_str(tokens, prior_hash=got_seed, page_size=16) == keys
    assert storage_namespace_seed(None, None) is None
    assert page_hashes(tokens, 16, cache_salt="") == [V1]  # an empty salt is no salt
    assert page_hashes(tokens, 16, extra_key="") != [V1]  # an empty extra key is a namespace


def test_storage_wrapper_reads_the_key_namespace() -> None:
    class Key:
        def __init__(self, token_ids, extra_key=None, cache_salt=None):
            self.token_ids, self.extra_key, self.cache_salt = token_ids, extra_key, cache_salt

    tokens = list(range(1, 17))
    assert get_storage_hash_str(Key(tokens), page_size=16) == [V1]
    seeded = get_storage_hash_str(Key(tokens, extra_key="lora-A"), page_size=16)
    assert seeded[0].startswith("7fa7a3f2")
    assert get_storage_hash_str(Key(tokens, "lora-A"), prior_hash=V1, page_size=16) == (
        get_hash_str(tokens, V1, 16)
    )  # a continued chain ignores the namespace


def test_wide_tokens_and_input_kinds() -> None:
    wide = "7a1e03f3a0a3d91292f66550382eac3f3ebcbaec13e371e1cb6289fa5db189a6"
    assert get_hash_str([2**33], page_size=1) == [wide]
    assert wide == hashlib.sha256(b"\xff" + (2**33).to_bytes(8, "little")).hexdigest()
    tokens = list(range(1, 17))
    for kind in (torch.tensor(tokens), torch.tensor(tokens, dtype=torch.int32),
                 np.array(tokens, dtype=np.uint32), np.array(tokens)):  # fmt: skip
        assert get_hash_str(kind, page_size=16) == [V1]
    assert get_hash_str([], page_size=4) == []


@pytest.mark.parametrize(
    "tokens", [[-1], [2**63], [1.5], [True], torch.tensor([1.0]), [[1, 2]]], ids=str
)
def test_bad_tokens_raise(tokens) -> None:
    with pytest.raises(ValueError):
        get_hash_str(tokens, page_size=1)


def test_bad_arguments_raise() -> None:
    with pytest.raises(ValueError, match="page_size"):
        get_hash_str([1], page_size=0)
    with pytest.raises(ValueError, match="prior_hash"):
        get_hash_str([1], prior_hash="abc", page_size=1)
    with pytest.raises(ValueError, match="whole pages"):
        page_hashes([1, 2, 3], 2)


@given(st.lists(st.integers(0, 2**40), max_size=40), st.integers(1, 8))
def test_page_keys_are_a_chain(tokens: list[int], page: int) -> None:
    """Hashing in two halves with the first half's last key as prior equals hashing at once."""
    cut = (len(tokens) // 2) // page * page
    whole = get_hash_str(tokens, page_size=page)
    head = get_hash_str(tokens[:cut], page_size=page)
    tail = get_hash_str(tokens[cut:], prior_hash=head[-1] if head else None, page_size=page)
    assert head + tail == whole
    assert all(len(k) == 64 and k == k.lower() for k in whole)
