"""KV copy ops against the torch reference, bit for bit, and each validation error.

Every test builds a small "world": a device pool (one allocation, per-layer views, slot page 0 is
padding) and a host pool in each layout, filled with random bytes (so NaN payloads and fp8 codes
count too). An op runs on one copy of the world, its reference on another; then

- the two worlds are byte-identical;
- the source and every buffer the op does not write are unchanged;
- in the destination, named slots hold the source bytes and every other slot is unchanged
  (checked against the snapshot directly, not through the reference).

Runs on the kernel device: CUDA when present, else CPU with Triton interpreted. Host buffers are
plain CPU tensors here; tests/kernels/test_kernels_gpu.py repeats the matrix with pinned host
memory.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hicache_prefill import kernels
from hicache_prefill.kernels.layout.byte_views import page_rows, token_rows
from hicache_prefill.kernels.ops import reference
from tests.kernels.oracle import Oracle

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
PIN = DEVICE.type == "cuda"  # kernels read host memory directly on CUDA: it must be pinned
FP8 = torch.float8_e4m3fn
L = 3  # layers


def sync() -> None:
    """Wait for queued copies: host tensors are read by the CPU, outside stream order."""
    if DEVICE.type == "cuda":
        torch.cuda.synchronize()


# ---------------------------------------------------------------------------------------------
# Cases and worlds
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Case:
    dtype: torch.dtype
    item_size: int  # bytes per token per layer (K or V)
    n: int  # index pairs
    order: str  # "sorted" | "shuffled"
    page_size: int

    @property
    def id(self) -> str:
        dt = str(self.dtype).removeprefix("torch.")
        return f"{dt}-{self.item_size}B-n{self.n}-{self.order}-ps{self.page_size}"


# A pairwise cover rather than a full product: every dtype, item size kind (multiple of 16 bytes
# or not, odd, larger than one column chunk), index count (0, 1, odd, large-ish), order and page
# size appears, and each op runs every case, MHA and MLA.
CASES = [
    Case(torch.bfloat16, 32, 0, "sorted", 1),
    Case(torch.float16, 12, 1, "shuffled", 1),
    Case(FP8, 5, 7, "shuffled", 1),
    Case(torch.float32, 32, 16, "sorted", 16),
    Case(torch.bfloat16, 12, 48, "shuffled", 16),
    Case(FP8, 48, 257, "shuffled", 1),
    Case(torch.float32, 5128, 33, "shuffled", 1),  # > 4 KiB: several column chunks + a tail
    Case(torch.float16, 2048, 96, "sorted", 16),  # one token-layer of an 8B model
]


def token_shape(case: Case, mla: bool) -> tuple[int, int]:
    """``(H, D)`` for MHA or ``(1, C)`` for MLA with ``item_size`` bytes."""
    width = case.item_size // torch.tensor([], dtype=case.dtype).element_size()
    if mla:
        return (1, width)
    return (2, width // 2) if width % 2 == 0 else (1, width)


def random_bytes(shape: tuple[int, ...], dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    elem = torch.tensor([], dtype=dtype).element_size()
    n = elem * int(torch.tensor(shape).prod().item())
    raw = torch.randint(0, 256, (n,), dtype=torch.uint8, generator=gen)
    return raw.view(dtype).view(shape)


@dataclass
class World:
    """Device pool and host pools. ``kv`` is 2 (K, V) for MHA, 1 for MLA."""

    dev: torch.Tensor  # [kv, L, T_dev, *tok]
    host_lf: torch.Tensor  # [kv, L, T_host, *tok]
    host_pf: torch.Tensor  # [kv, T_host, L, *tok]
    host_pfd: torch.Tensor  # [kv, P, L, page_size, *tok]
    item_size: int
    page_size: int

    BUFFERS = ("dev", "host_lf", "host_pf", "host_pfd")

    @property
    def kv(self) -> int:
        return self.dev.shape[0]

    def clone(self) -> World:
        def copy(t: torch.Tensor) -> torch.Tensor:
            return t.clone().pin_memory() if t.is_pinned() else t.clone()

        return World(
            *(copy(getattr(self, b)) for b in self.BUFFERS), self.item_size, self.page_size
        )

    def rows(self, buf: str, kv: int, layer: int) -> torch.Tensor:
        """``[slots, item_size]`` bytes of one layer of one buffer (a copy where not a view)."""
        it = self.item_size
        if buf in ("dev", "host_lf"):
            return token_rows(getattr(self, buf)[kv, layer], it)
        if buf == "host_pf":
            return token_rows(self.host_pf[kv], it * L)[:, layer * it : (layer + 1) * it]
        pages = page_rows(self.host_pfd[kv], self.page_size)
        return pages[:, layer].reshape(-1, it)


def make_world(case: Case, mla: bool, seed: int, pin_host: bool = PIN) -> World:
    gen = torch.Generator().manual_seed(seed)
    ps = case.page_size
    pages = -(-case.n // ps)
    t_dev, t_host = ps * (pages + 3), ps * (pages + 3)
    kv = 1 if mla else 2
    tok = token_shape(case, mla)

    def host(shape: tuple[int, ...]) -> torch.Tensor:
        t = random_bytes(shape, case.dtype, gen)
        return t.pin_memory() if pin_host else t

    return World(
        dev=random_bytes((kv, L, t_dev, *tok), case.dtype, gen).to(DEVICE),
        host_lf=host((kv, L, t_host, *tok)),
        host_pf=host((kv, t_host, L, *tok)),
        host_pfd=host((kv, t_host // ps, L, ps, *tok)),
        item_size=case.item_size,
        page_size=ps,
    )


def pick_slots(n: int, first: int, end: int, case: Case, rng: random.Random) -> list[int]:
    """``n`` distinct slots in ``[first, end)``, whole pages when ``page_size > 1``."""
    ps = case.page_size
    pages = rng.sample(range(first // ps, end // ps), -(-n // ps))
    if case.order == "sorted":
        pages.sort()
    slots = [p * ps + i for p in pages for i in range(ps)][:n]
    if case.order == "shuffled" and ps == 1:
        rng.shuffle(slots)
    return slots


def indices(case: Case, w: World, src: str, dst: str, seed: int) -> tuple[torch.Tensor, ...]:
    rng = random.Random(seed)

    def slots(buf: str) -> list[int]:
        n_slots = w.rows(buf, 0, 0).shape[0]
        first = case.page_size if buf == "dev" else 0  # device page 0 is padding
        return pick_slots(case.n, first, n_slots, case, rng)

    s = torch.tensor(slots(src), dtype=torch.int64, device=DEVICE)
    d = torch.tensor(slots(dst), dtype=torch.int64, device=DEVICE)
    return s, d


# ---------------------------------------------------------------------------------------------
# Ops: how each one is called on a world
# ---------------------------------------------------------------------------------------------


_TABLES: dict[tuple[int, ...], torch.Tensor] = {}


def table(layers: list[torch.Tensor], signed: bool) -> torch.Tensor:
    """The ``data_ptr()`` table of ``layers``, built once per address list (a table holds
    nothing but those addresses): a repeated call makes no host-to-device copy, so an op called
    twice synchronizes nothing the second time."""
    key = tuple(t.data_ptr() for t in layers)
    if key not in _TABLES:
        _TABLES[key] = kernels.data_ptr_table(layers, DEVICE)
    t = _TABLES[key]
    return t.view(torch.int64) if signed else t


@dataclass(frozen=True)
class OpSpec:
    """An op family: MHA and MLA function names, source and destination buffers, and whether
    it covers one layer (``layer_id``) or all of them."""

    mha: str
    mla: str | None
    src: str
    dst: str
    per_layer: bool
    call: Callable[[Callable[..., None], World, torch.Tensor, torch.Tensor, int, bool], None]


def _layers(w: World, buf: str, kv: int) -> list[torch.Tensor]:
    return [getattr(w, buf)[kv, layer] for layer in range(L)]


def call_per_layer(fn, w, s, d, layer, signed, src="host_lf", dst="dev"):
    srcs = [getattr(w, src)[kv, layer] for kv in range(w.kv)]
    dsts = [getattr(w, dst)[kv, layer] for kv in range(w.kv)]
    if w.kv == 2:
        fn(srcs[0], dsts[0], srcs[1], dsts[1], s, d, w.item_size)
    else:
        fn(srcs[0], dsts[0], s, d, w.item_size)


def call_per_layer_d2h(fn, w, s, d, layer, signed):
    call_per_layer(fn, w, s, d, layer, signed, src="dev", dst="host_lf")


def call_pf_lf(fn, w, s, d, layer, signed):
    dim = w.item_size * L
    if w.kv == 2:
        fn(w.host_pf[0], w.dev[0, layer], w.host_pf[1], w.dev[1, layer], s, d,
           layer, w.item_size, dim)  # fmt: skip
    else:
        fn(w.host_pf[0], w.dev[0, layer], s, d, layer, w.item_size, dim)


def call_all_layer(fn, w, s, d, layer, signed, src="dev", dst="host_lf"):
    st = [table(_layers(w, src, kv), signed) for kv in range(w.kv)]
    dt = [table(_layers(w, dst, kv), signed) for kv in range(w.kv)]
    if w.kv == 2:
        fn(st[0], dt[0], st[1], dt[1], s, d, w.item_size, L)
    else:
        fn(st[0], dt[0], s, d, w.item_size, L)


def call_all_layer_h2d(fn, w, s, d, layer, signed):
    call_all_layer(fn, w, s, d, layer, signed, src="host_lf", dst="dev")


def call_lf_pf(fn, w, s, d, layer, signed):
    st = [table(_layers(w, "dev", kv), signed) for kv in range(w.kv)]
    dim = w.item_size * L
    if w.kv == 2:
        fn(st[0], w.host_pf[0], st[1], w.host_pf[1], s, d, w.item_size, dim, L)
    else:
        fn(st[0], w.host_pf[0], s, d, w.item_size, dim, L)


def call_direct(fn, w, s, d, layer, signed, src="dev", dst="host_lf"):
    srcs = [t for kv in range(w.kv) for t in _layers(w, src, kv)]
    dsts = [t for kv in range(w.kv) for t in _layers(w, dst, kv)]
    fn(srcs, dsts, s, d, w.page_size)


def call_direct_h2d_one_layer(fn, w, s, d, layer, signed):
    srcs = [w.host_lf[kv, layer] for kv in range(w.kv)]
    dsts = [w.dev[kv, layer] for kv in range(w.kv)]
    fn(srcs, dsts, s, d, w.page_size)


def call_direct_pf_lf(fn, w, s, d, layer, signed):
    hosts = [w.host_pfd[kv] for kv in range(w.kv)]
    fn(hosts, [w.dev[kv, layer] for kv in range(w.kv)], s, d, layer, w.page_size)


def call_direct_lf_pf(fn, w, s, d, layer, signed):
    srcs = [t for kv in range(w.kv) for t in _layers(w, "dev", kv)]
    fn(srcs, [w.host_pfd[kv] for kv in range(w.kv)], s, d, w.page_size)


OPS = {
    "per_layer_h2d": OpSpec("transfer_kv_per_layer", "transfer_kv_per_layer_mla",
                            "host_lf", "dev", True, call_per_layer),
    "per_layer_d2h": OpSpec("transfer_kv_per_layer", "transfer_kv_per_layer_mla",
                            "dev", "host_lf", True, call_per_layer_d2h),
    "per_layer_pf_lf": OpSpec("transfer_kv_per_layer_pf_lf", "transfer_kv_per_layer_mla_pf_lf",
                              "host_pf", "dev", True, call_pf_lf),
    "all_layer_d2h": OpSpec("transfer_kv_all_layer", "transfer_kv_all_layer_mla",
                            "dev", "host_lf", False, call_all_layer),
    "all_layer_h2d": OpSpec("transfer_kv_all_layer", "transfer_kv_all_layer_mla",
                            "host_lf", "dev", False, call_all_layer_h2d),
    "all_layer_lf_pf": OpSpec("transfer_kv_all_layer_lf_pf", "transfer_kv_all_layer_mla_lf_pf",
                              "dev", "host_pf", False, call_lf_pf),
    "direct_d2h": OpSpec("transfer_kv_direct", "transfer_kv_direct",
                         "dev", "host_lf", False, call_direct),
    "direct_h2d_one_layer": OpSpec("transfer_kv_direct", "transfer_kv_direct",
                                   "host_lf", "dev", True, call_direct_h2d_one_layer),
    "direct_pf_lf": OpSpec("transfer_kv_per_layer_direct_pf_lf",
                           "transfer_kv_per_layer_direct_pf_lf",
                           "host_pfd", "dev", True, call_direct_pf_lf),
    "direct_lf_pf": OpSpec("transfer_kv_all_layer_direct_lf_pf",
                           "transfer_kv_all_layer_direct_lf_pf",
                           "dev", "host_pfd", False, call_direct_lf_pf),
}  # fmt: skip


# ---------------------------------------------------------------------------------------------
# The check
# ---------------------------------------------------------------------------------------------


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.cpu().reshape(-1).view(torch.uint8), b.cpu().reshape(-1).view(torch.uint8))


def assert_spec(before: World, after: World, spec: OpSpec, s, d, layer: int) -> None:
    """Independent of the reference: only the named destination slots changed, to the source."""
    for buf in World.BUFFERS:
        if buf != spec.dst:
            assert same_bytes(getattr(before, buf), getattr(after, buf)), f"{buf} changed"
    keep = (s >= 0) & (d >= 0)
    s, d = s[keep].cpu(), d[keep].cpu()
    layers = [layer] if spec.per_layer else range(L)
    for kv in range(before.kv):
        for layer_ in range(L):
            expected = before.rows(spec.dst, kv, layer_).cpu().clone()
            if layer_ in layers:
                expected[d] = before.rows(spec.src, kv, layer_).cpu()[s]
            got = after.rows(spec.dst, kv, layer_).cpu()
            assert torch.equal(got, expected), f"kv={kv} layer={layer_} differs"


def run_and_check(
    op: str,
    case: Case,
    mla: bool,
    seed: int,
    pin_host: bool = PIN,
    impl: Callable[[str], Callable[..., None]] | None = None,
) -> None:
    spec = OPS[op]
    name = spec.mla if mla else spec.mha
    assert name is not None
    fn = impl(name) if impl else getattr(kernels, name)
    layer = seed % L
    signed = seed % 2 == 0
    world = make_world(case, mla, seed, pin_host)
    s, d = indices(case, world, spec.src, spec.dst, seed)
    snapshot, ref_world = world.clone(), world.clone()

    spec.call(fn, world, s, d, layer, signed)
    ref_op = getattr(reference, name, None) or getattr(Oracle(), name)  # direct ops: the oracle
    spec.call(ref_op, ref_world, s, d, layer, signed)
    sync()

    for buf in World.BUFFERS:
        assert same_bytes(getattr(world, buf), getattr(ref_world, buf)), f"{buf} != reference"
    assert_spec(snapshot, world, spec, s, d, layer)


# ---------------------------------------------------------------------------------------------
# Tests
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("mla", [False, True], ids=["mha", "mla"])
@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
@pytest.mark.parametrize("op", list(OPS))
def test_op_matches_reference(op: str, case: Case, mla: bool) -> None:
    run_and_check(op, case, mla, seed=CASES.index(case) * 7 + list(OPS).index(op))


def test_reference_story_page_first_round_trip() -> None:
    """Hand-checked: back up 3 slots of a 2-layer MLA device pool into page_first, load back."""
    dev = torch.arange(2 * 6 * 2, dtype=torch.float32).view(2, 6, 1, 2)  # [L, T, 1, C]
    host = torch.zeros(4, 2, 1, 2)  # [T_host, L, 1, C]
    tbl = torch.tensor([dev[0].data_ptr(), dev[1].data_ptr()], dtype=torch.int64)
    s, d = torch.tensor([5, 1, 3]), torch.tensor([0, 2, 3])
    reference.transfer_kv_all_layer_mla_lf_pf(tbl, host, s, d, 8, 16, 2)
    # host slot 0 <- dev slot 5: layer 0 holds (10, 11), layer 1 holds (22, 23)
    assert host[0].flatten().tolist() == [10, 11, 22, 23]
    assert host[1].flatten().tolist() == [0, 0, 0, 0]
    assert host[2].flatten().tolist() == [2, 3, 14, 15]
    back = torch.zeros(6, 1, 2)
    reference.transfer_kv_per_layer_mla_pf_lf(host, back, d, s, 1, 8, 16)
    assert back.flatten().tolist() == [0, 0, 14, 15, 0, 0, 18, 19, 0, 0, 22, 23]


def test_reference_story_direct_page_first() -> None:
    """Hand-checked: page_size 2, device slots 4,5 -> host page 1 of layer 1."""
    dev = [torch.arange(8, dtype=torch.int32).view(8, 1, 1) + 100 * j for j in range(2)]
    host = torch.zeros(2, 2, 2, 1, 1, dtype=torch.int32)  # [P, L, ps, 1, C]
    kernels.transfer_kv_all_layer_direct_lf_pf(dev, [host], torch.tensor([4, 5]),
                                               torch.tensor([2, 3]), 2)  # fmt: skip
    assert host[1].flatten().tolist() == [4, 5, 104, 105]
    assert host[0].flatten().tolist() == [0, 0, 0, 0]


@pytest.mark.parametrize("op", ["per_layer_pf_lf", "all_layer_d2h", "all_layer_lf_pf"])
def test_negative_indices_are_skipped(op: str) -> None:
    """As upstream: a pair with a negative index is skipped, the others copied."""
    case = CASES[5]
    spec = OPS[op]
    world = make_world(case, False, 3)
    s, d = indices(case, world, spec.src, spec.dst, 3)
    s[::3] = -1
    d[1::5] = -7
    snapshot, ref_world = world.clone(), world.clone()
    spec.call(getattr(kernels, spec.mha), world, s, d, 1, False)
    spec.call(getattr(reference, spec.mha), ref_world, s, d, 1, False)
    sync()
    for buf in World.BUFFERS:
        assert same_bytes(getattr(world, buf), getattr(ref_world, buf))
    assert_spec(snapshot, world, spec, s, d, 1)


@pytest.mark.parametrize("layout", ["layer_first", "page_first", "page_first_direct"])
def test_backup_then_load_back_round_trip(layout: str) -> None:
    """D2H of all layers, wipe the device slots, H2D layer by layer: the KV comes back exact."""
    case = Case(torch.bfloat16, 256, 32, "shuffled", 16)
    w = make_world(case, False, 11)
    dev_idx, host_idx = indices(case, w, "dev", "host_lf", 11)
    original = w.dev.clone()
    k_tbl, v_tbl = (kernels.data_ptr_table(_layers(w, "dev", kv), DEVICE) for kv in (0, 1))
    if layout == "layer_first":
        host_tbls = [kernels.data_ptr_table(_layers(w, "host_lf", kv), DEVICE) for kv in (0, 1)]
        kernels.transfer_kv_all_layer(k_tbl, host_tbls[0], v_tbl, host_tbls[1],
                                      dev_idx, host_idx, 256, L)  # fmt: skip
    elif layout == "page_first":
        kernels.transfer_kv_all_layer_lf_pf(k_tbl, w.host_pf[0], v_tbl, w.host_pf[1],
                                            dev_idx, host_idx, 256, 256 * L, L)  # fmt: skip
    else:
        kernels.transfer_kv_all_layer_direct_lf_pf(
            _layers(w, "dev", 0) + _layers(w, "dev", 1), [w.host_pfd[0], w.host_pfd[1]],
            dev_idx, host_idx, case.page_size,
        )  # fmt: skip
    w.dev[:, :, dev_idx] = 0
    for layer in range(L):
        k, v = w.dev[0, layer], w.dev[1, layer]
        if layout == "layer_first":
            kernels.transfer_kv_per_layer(w.host_lf[0, layer], k, w.host_lf[1, layer], v,
                                          host_idx, dev_idx, 256)  # fmt: skip
        elif layout == "page_first":
            kernels.transfer_kv_per_layer_pf_lf(w.host_pf[0], k, w.host_pf[1], v,
                                                host_idx, dev_idx, layer, 256, 256 * L)  # fmt: skip
        else:
            kernels.transfer_kv_per_layer_direct_pf_lf([w.host_pfd[0], w.host_pfd[1]], [k, v],
                                                       host_idx, dev_idx, layer, 16)  # fmt: skip
    sync()
    assert same_bytes(w.dev, original)


def test_block_quota_and_warps_do_not_change_the_result() -> None:
    case = CASES[5]
    for bq, warps in [(1, 1), (3, 4), (64, 32), (2, 48)]:
        w = make_world(case, False, 5)
        s, d = indices(case, w, "host_pf", "dev", 5)
        ref = w.clone()
        kernels.transfer_kv_per_layer_pf_lf(w.host_pf[0], w.dev[0, 2], w.host_pf[1], w.dev[1, 2],
                                            s, d, 2, 48, 48 * L, bq, warps)  # fmt: skip
        reference.transfer_kv_per_layer_pf_lf(ref.host_pf[0], ref.dev[0, 2], ref.host_pf[1],
                                              ref.dev[1, 2], s, d, 2, 48, 48 * L)  # fmt: skip
        sync()
        assert same_bytes(w.dev, ref.dev), (bq, warps)


@pytest.mark.parametrize("warps", [3, 12])
def test_warps_that_are_not_a_power_of_two_are_refused(warps: int) -> None:
    case = CASES[5]
    w = make_world(case, False, 5)
    s, d = indices(case, w, "host_pf", "dev", 5)
    before = w.clone()
    with pytest.raises(ValueError, match=f"num_warps_per_block={warps}"):
        kernels.transfer_kv_per_layer_pf_lf(
            w.host_pf[0], w.dev[0, 2], w.host_pf[1], w.dev[1, 2], s, d, 2, 48, 48 * L, 2, warps
        )
    assert same_bytes(w.dev, before.dev)


def test_kernel_skips_and_records_out_of_range_slots_when_unchecked() -> None:
    """Even past validation (e.g. CUDA without debug checks), a tensor side is never written or
    read past its end: the launcher is called directly with out-of-range indices, and the
    kernel records the skipped pair for the copy's check."""
    from hicache_prefill.kernels.layout.addressing import Part, Side
    from hicache_prefill.kernels.triton.launch import (
        cache_hints_supported,
        launch_kv_copy,
        plan_launch,
    )

    guard = torch.full((64, 8), 7, dtype=torch.uint8, device=DEVICE)
    dst = guard[:16]  # slots 16.. of `guard` lie past the end of `dst`
    src = torch.arange(16 * 8, dtype=torch.uint8, device=DEVICE).view(16, 8)
    s = torch.tensor([0, 1, 40, 2], device=DEVICE)
    d = torch.tensor([3, 20, 4, 5], device=DEVICE)
    watch = kernels.watch_copies(DEVICE)
    with watch:
        launch_kv_copy(plan_launch(
            Part(Side((src,), False, 8, 0, 16), Side((dst,), False, 8, 0, 16), 8, 1), s, d,
            layer_begin=0, num_layers=1, block_quota=2, num_warps=4,
            cache_hints=cache_hints_supported(DEVICE), op="a_launch",
        ))  # fmt: skip
    sync()
    expected = torch.full((64, 8), 7, dtype=torch.uint8)
    expected[3], expected[5] = src[0].cpu(), src[2].cpu()
    assert torch.equal(guard.cpu(), expected)
    with pytest.raises(kernels.KVIndexError, match="a_launch: src_indices holds slot 40"):
        watch.check()


# ---------------------------------------------------------------------------------------------
# Validation: every bad argument raises ValueError naming it, and writes nothing
# ---------------------------------------------------------------------------------------------


def _mha_args(w: World, s, d) -> dict[str, dict[str, object]]:
    it, dim = w.item_size, w.item_size * L
    kt, vt = (kernels.data_ptr_table(_layers(w, "dev", kv), DEVICE) for kv in (0, 1))
    hk, hv = (kernels.data_ptr_table(_layers(w, "host_lf", kv), DEVICE) for kv in (0, 1))
    return {
        "transfer_kv_per_layer": dict(src_k=w.host_lf[0, 1], dst_k=w.dev[0, 1],
            src_v=w.host_lf[1, 1], dst_v=w.dev[1, 1], src_indices=s, dst_indices=d,
            item_size=it),
        "transfer_kv_per_layer_pf_lf": dict(src_k=w.host_pf[0], dst_k=w.dev[0, 1],
            src_v=w.host_pf[1], dst_v=w.dev[1, 1], src_indices=s, dst_indices=d, layer_id=1,
            item_size=it, src_layout_dim=dim),
        "transfer_kv_all_layer": dict(src_k_layers=hk, dst_k_layers=kt, src_v_layers=hv,
            dst_v_layers=vt, src_indices=s, dst_indices=d, item_size=it, num_layers=L),
        "transfer_kv_all_layer_lf_pf": dict(src_k_layers=kt, dst_k=w.host_pf[0],
            src_v_layers=vt, dst_v=w.host_pf[1], src_indices=d, dst_indices=s, item_size=it,
            dst_layout_dim=dim, num_layers=L),
        "transfer_kv_per_layer_mla": dict(src=w.host_lf[0, 1], dst=w.dev[0, 1], src_indices=s,
            dst_indices=d, item_size=it),
        "transfer_kv_per_layer_mla_pf_lf": dict(src=w.host_pf[0], dst=w.dev[0, 1],
            src_indices=s, dst_indices=d, layer_id=1, item_size=it, src_layout_dim=dim),
        "transfer_kv_all_layer_mla": dict(src_layers=hk, dst_layers=kt, src_indices=s,
            dst_indices=d, item_size=it, num_layers=L),
        "transfer_kv_direct": dict(src_layers=[w.host_lf[0, 1]], dst_layers=[w.dev[0, 1]],
            src_indices=s, dst_indices=d, page_size=w.page_size),
        "transfer_kv_per_layer_direct_pf_lf": dict(src_ptrs=[w.host_pfd[0], w.host_pfd[1]],
            dst_ptrs=[w.dev[0, 1], w.dev[1, 1]], src_indices=s, dst_indices=d, layer_id=1,
            page_size=w.page_size),
        "transfer_kv_all_layer_direct_lf_pf": dict(
            src_ptrs=_layers(w, "dev", 0) + _layers(w, "dev", 1),
            dst_ptrs=[w.host_pfd[0], w.host_pfd[1]], src_indices=d, dst_indices=s,
            page_size=w.page_size),
    }  # fmt: skip


def _null_entry(a: dict) -> torch.Tensor:
    t = a["src_layers"].view(torch.int64).clone()
    t[1] = 0
    return t


def _strided(a: dict, key: str) -> torch.Tensor:
    t = a[key]
    return torch.empty(t.shape[::-1], dtype=t.dtype, device=t.device).transpose(0, -1)


# (op, argument to replace, replacement given the valid args, text the message must contain)
BAD = [
    ("transfer_kv_per_layer", "src_indices", lambda a: a["src_indices"].int(), "src_indices"),
    ("transfer_kv_per_layer", "dst_indices", lambda a: a["dst_indices"][None], "dst_indices"),
    ("transfer_kv_per_layer", "dst_indices", lambda a: a["dst_indices"][:-1],
     "src_indices and dst_indices"),
    ("transfer_kv_per_layer", "item_size", lambda a: a["item_size"] + 2, "item_size"),
    ("transfer_kv_per_layer", "item_size", lambda a: 0, "item_size"),
    ("transfer_kv_per_layer", "block_quota", lambda a: 0, "block_quota"),
    ("transfer_kv_per_layer", "num_warps_per_block", lambda a: -1, "num_warps_per_block"),
    ("transfer_kv_per_layer", "src_k", lambda a: _strided(a, "src_k"), "src_k"),
    ("transfer_kv_per_layer", "dst_v", lambda a: a["dst_v"][:-1], "dst_k and dst_v"),
    ("transfer_kv_per_layer", "dst_k", lambda a: a["dst_k"].to("meta"), "dst_k"),
    ("transfer_kv_per_layer", "src_indices", lambda a: a["src_indices"] + 10_000, "src_indices"),
    ("transfer_kv_per_layer", "dst_indices", lambda a: a["dst_indices"] + 10_000, "dst_indices"),
    ("transfer_kv_per_layer_pf_lf", "layer_id", lambda a: L, "layer_id"),
    ("transfer_kv_per_layer_pf_lf", "layer_id", lambda a: -1, "layer_id"),
    ("transfer_kv_per_layer_pf_lf", "src_layout_dim", lambda a: a["src_layout_dim"] + 8,
     "src_layout_dim"),
    ("transfer_kv_per_layer_mla_pf_lf", "src", lambda a: a["src"][:, :2].contiguous(),
     "src_layout_dim"),
    ("transfer_kv_per_layer_pf_lf", "src_indices", lambda a: a["src_indices"] + 10_000,
     "src_indices"),
    ("transfer_kv_all_layer", "num_layers", lambda a: L + 1, "src_k_layers"),
    ("transfer_kv_all_layer", "dst_k_layers", lambda a: a["dst_k_layers"].double(),
     "dst_k_layers"),
    ("transfer_kv_all_layer", "src_v_layers", lambda a: a["src_v_layers"][:, None],
     "src_v_layers"),
    ("transfer_kv_all_layer_lf_pf", "num_layers", lambda a: L - 1, "num_layers"),
    ("transfer_kv_all_layer_lf_pf", "dst_layout_dim", lambda a: a["dst_layout_dim"] * 2,
     "dst_layout_dim"),
    ("transfer_kv_all_layer_lf_pf", "dst_indices", lambda a: a["dst_indices"] + 10_000,
     "dst_indices"),
    ("transfer_kv_all_layer_mla", "src_layers", _null_entry, "src_layers"),
    ("transfer_kv_per_layer_mla", "dst", lambda a: [a["dst"]], "dst"),
    ("transfer_kv_direct", "page_size", lambda a: 5, "page_size"),
    ("transfer_kv_direct", "dst_layers", lambda a: a["dst_layers"] * 2,
     "src_layers and dst_layers"),
    ("transfer_kv_direct", "src_indices", lambda a: a["src_indices"] - 10_000, "src_indices"),
    ("transfer_kv_direct", "dst_indices", lambda a: a["dst_indices"] + 10_000, "dst_indices"),
    ("transfer_kv_direct", "dst_layers", lambda a: [a["dst_layers"][0][:, :1].contiguous()],
     "dst_layers[0]"),
    ("transfer_kv_per_layer_direct_pf_lf", "layer_id", lambda a: L, "layer_id"),
    ("transfer_kv_per_layer_direct_pf_lf", "src_indices", lambda a: a["src_indices"] + 1,
     "src_indices"),
    ("transfer_kv_per_layer_direct_pf_lf", "dst_ptrs", lambda a: a["dst_ptrs"][:1] * 3,
     "dst_ptrs"),
    ("transfer_kv_all_layer_direct_lf_pf", "dst_indices", lambda a: a["dst_indices"].flip(0),
     "dst_indices"),
    ("transfer_kv_all_layer_direct_lf_pf", "src_ptrs", lambda a: a["src_ptrs"][:-2],
     "src_ptrs"),
]  # fmt: skip


@pytest.mark.parametrize("op, key, bad, needle", BAD, ids=[f"{b[0]}-{b[3]}" for b in BAD])
def test_bad_argument_raises_and_writes_nothing(op, key, bad, needle) -> None:
    case = Case(torch.bfloat16, 32, 32, "sorted", 16)
    w = make_world(case, False, 1)
    s, d = indices(case, w, "host_lf", "dev", 1)
    valid = _mha_args(w, s, d)[op]
    getattr(kernels, op)(**valid)  # the unmodified call is accepted
    sync()
    snapshot = w.clone()
    args = dict(valid, **{key: bad(valid)})
    kernels.set_debug_checks(True)  # index ranges and table entries; always checked on CPU
    try:
        with pytest.raises(ValueError, match=needle.replace("[", r"\[").replace("]", r"\]")):
            getattr(kernels, op)(**args)
    finally:
        kernels.set_debug_checks(False)
    sync()
    for buf in World.BUFFERS:
        assert same_bytes(getattr(w, buf), getattr(snapshot, buf)), f"{buf} written"


def test_pinned_host_memory_is_required_on_cuda_only() -> None:
    """Pageable host memory cannot be read by a CUDA kernel: refused on CUDA, fine on CPU."""
    case = Case(torch.bfloat16, 32, 8, "sorted", 1)
    w = make_world(case, True, 2, pin_host=False)
    s, d = indices(case, w, "host_lf", "dev", 2)
    src = w.host_lf[0, 0]
    if DEVICE.type == "cuda":
        with pytest.raises(ValueError, match="src.*pageable"):
            kernels.transfer_kv_per_layer_mla(src, w.dev[0, 0], s, d, 32)
    else:
        kernels.transfer_kv_per_layer_mla(src, w.dev[0, 0], s, d, 32)
        sync()
        assert same_bytes(token_rows(w.dev[0, 0], 32)[d], token_rows(src, 32)[s])


def test_cpu_tensors_without_the_interpreter_use_the_reference(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """On a CUDA machine Triton compiles for the GPU, so CPU tensors take the torch reference."""
    from hicache_prefill.kernels.ops import dispatch

    monkeypatch.setattr(kernels, "TRITON_INTERPRETED", False)
    launched: list[object] = []
    monkeypatch.setattr(dispatch, "launch_kv_copy", lambda *a, **k: launched.append(a))
    src = torch.arange(8 * 4, dtype=torch.float32).view(8, 1, 4)
    dst = torch.zeros(8, 1, 4)
    kernels.transfer_kv_per_layer_mla(src, dst, torch.tensor([6, 2]), torch.tensor([1, 7]), 16)
    assert not launched
    assert torch.equal(dst[1], src[6]) and torch.equal(dst[7], src[2])
    assert not dst[[0, 2, 3, 4, 5, 6]].any()


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    item_size=st.integers(1, 300),
    n_layers=st.integers(1, 4),
    n=st.integers(0, 40),
    layer=st.integers(0, 3),
    block_quota=st.sampled_from([1, 2, 5]),
    seed=st.integers(0, 2**16),
)
def test_backup_and_load_back_any_item_size(
    item_size: int, n_layers: int, n: int, layer: int, block_quota: int, seed: int
) -> None:
    """Any item size (any word width, tile and column-chunk shape): D2H all layers into
    page_first, then H2D one layer back into a clean pool, equals the reference and the source."""
    layer %= n_layers
    gen = torch.Generator().manual_seed(seed)
    t_dev, t_host = n + 5, n + 3
    dev = torch.randint(0, 256, (n_layers, t_dev, item_size), dtype=torch.uint8, generator=gen)
    dev = dev.to(DEVICE)
    host = torch.zeros(t_host, n_layers, item_size, dtype=torch.uint8)
    host = host.pin_memory() if PIN else host
    s = torch.randperm(t_dev, generator=gen)[:n].to(DEVICE)
    d = torch.randperm(t_host, generator=gen)[:n].to(DEVICE)
    table = kernels.data_ptr_table(list(dev), DEVICE)
    kernels.transfer_kv_all_layer_mla_lf_pf(
        table, host, s, d, item_size, item_size * n_layers, n_layers, block_quota
    )
    ref_host = torch.zeros_like(host)
    reference.transfer_kv_all_layer_mla_lf_pf(
        table, ref_host, s, d, item_size, item_size * n_layers, n_layers
    )
    back = torch.zeros(t_dev, item_size, dtype=torch.uint8, device=DEVICE)
    kernels.transfer_kv_per_layer_mla_pf_lf(
        host, back, d, s, layer, item_size, item_size * n_layers, block_quota, 4
    )
    sync()
    assert torch.equal(host, ref_host)
    assert torch.equal(back[s].cpu(), dev[layer][s].cpu())
    untouched = torch.ones(t_dev, dtype=torch.bool)
    untouched[s.cpu()] = False
    assert not back.cpu()[untouched].any()
