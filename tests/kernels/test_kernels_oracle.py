"""Every op of ``kernels.KVCACHEIO_OPS`` against the independent oracle
(``tests/kernels/oracle.py``, which shares no code with the kernels), MHA, MLA and asymmetric K/V
(K head 8, V head 4) wherever the op takes them, byte for byte over every buffer of a small world.

A world is one device pool and a host pool in each layout (layer_first, page_first, page_head,
page_first_direct), filled with random bytes; each case calls one op on one copy of the world and
the oracle on another, then compares every buffer. Kernel-backend cases include a pair with a
negative index (skipped, as upstream). Sized for the CPU interpreter (a few launches per case);
``tests/kernels/test_kernels_gpu.py`` runs the same cases on CUDA with pinned host buffers.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import pytest
import torch

from hicache_prefill import kernels
from tests.kernels.oracle import Oracle

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
L, T, P, H = 2, 8, 2, 2  # layers, slots per pool, page size, heads
DTYPE = torch.bfloat16
GEOMETRY = {"mha": (H, 8, 8), "asym": (H, 8, 4), "mla": (1, 12, None)}  # heads, K dim, V dim


@dataclass
class World:
    """Device pool (per-layer tensors) and host pools; ``v*`` are ``None`` for MLA."""

    dev_k: torch.Tensor  # [L, T, h, dk]
    dev_v: torch.Tensor | None
    lf_k: torch.Tensor  # [L, T, h, dk]
    lf_v: torch.Tensor | None
    pf_k: torch.Tensor  # [T, L, h, dk]
    pf_v: torch.Tensor | None
    ph_k: torch.Tensor  # [T / P, h, P, L, dk]
    ph_v: torch.Tensor | None
    pfd_k: torch.Tensor  # [T / P, L, P, h, dk]
    pfd_v: torch.Tensor | None
    emb_dev: torch.Tensor  # [T, 4]
    emb_host: torch.Tensor

    def buffers(self) -> dict[str, torch.Tensor]:
        return {k: v for k, v in vars(self).items() if v is not None}

    def clone(self) -> World:
        def copy(t: torch.Tensor | None) -> torch.Tensor | None:
            if t is None:
                return None
            return t.clone().pin_memory() if t.is_pinned() else t.clone()

        return World(**{k: copy(v) for k, v in vars(self).items()})

    def layers(self) -> list[torch.Tensor]:
        """Per-layer views a pointer table may name (the device pool and layer_first host)."""
        out = []
        for t in (self.dev_k, self.dev_v, self.lf_k, self.lf_v):
            if t is not None:
                out += [t[i] for i in range(L)]
        return out


def make_world(kind: str, seed: int, device: torch.device = DEVICE, pin: bool = False) -> World:
    heads, dk, dv = GEOMETRY[kind]
    gen = torch.Generator().manual_seed(seed)

    def rand(*shape: int, on: torch.device | None = None) -> torch.Tensor:
        n = 2 * int(torch.tensor(shape).prod())
        raw = torch.randint(0, 256, (n,), dtype=torch.uint8, generator=gen).view(DTYPE)
        t = raw.view(shape)
        if on is not None:
            return t.to(on)
        return t.pin_memory() if pin else t

    def kv(make: Callable[[int], torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor | None]:
        return make(dk), (make(dv) if dv is not None else None)

    dev_k, dev_v = kv(lambda d: rand(L, T, heads, d, on=device))
    lf_k, lf_v = kv(lambda d: rand(L, T, heads, d))
    pf_k, pf_v = kv(lambda d: rand(T, L, heads, d))
    ph_k, ph_v = kv(lambda d: rand(T // P, heads, P, L, d))
    pfd_k, pfd_v = kv(lambda d: rand(T // P, L, P, heads, d))
    return World(dev_k, dev_v, lf_k, lf_v, pf_k, pf_v, ph_k, ph_v, pfd_k, pfd_v,
                 rand(T, 4, on=device), rand(T, 4))  # fmt: skip


def page_slots(pages: list[int]) -> list[int]:
    return [p * P + i for p in pages for i in range(P)]


SRC = page_slots([3, 0, 2])  # whole pages, so the direct page ops accept them too
DST = page_slots([1, 3, 0])


def idx(slots: list[int], negative: bool, device: torch.device) -> torch.Tensor:
    s = list(slots)
    if negative:
        s[1] = -1  # the pair is skipped by the kernel-backend ops
    return torch.tensor(s, dtype=torch.int64, device=device)


def item(t: torch.Tensor) -> int:
    """Bytes of one token of one layer of a layer_first layer ``[T, h, d]``."""
    return t[0].numel() * t.element_size()


def table(layers: torch.Tensor) -> torch.Tensor:
    return kernels.data_ptr_table([layers[i] for i in range(L)], layers.device)


# ---------------------------------------------------------------------------------------------
# Cases: how each op is called on a world (the same call for the kernels and the oracle)
# ---------------------------------------------------------------------------------------------

Args = tuple[tuple, dict]


def _kv(w: World, name_k: str) -> tuple[torch.Tensor, torch.Tensor | None]:
    return getattr(w, name_k), getattr(w, name_k.replace("_k", "_v"))


def c_per_layer(w: World, s, d) -> Args:  # noqa: ANN001 - host layer_first -> device, layer 1
    return (w.lf_k[1], w.dev_k[1], w.lf_v[1], w.dev_v[1], s, d, item(w.lf_k[1])), {}


def c_per_layer_d2h(w: World, s, d) -> Args:  # noqa: ANN001
    return (w.dev_k[0], w.lf_k[0], w.dev_v[0], w.lf_v[0], s, d, item(w.dev_k[0])), {}


def c_pf_lf(w: World, s, d) -> Args:  # noqa: ANN001
    it = item(w.dev_k[0])
    return (w.pf_k, w.dev_k[1], w.pf_v, w.dev_v[1], s, d, 1, it, it * L), {}


def c_ph_lf(w: World, s, d) -> Args:  # noqa: ANN001
    it = item(w.dev_k[0])
    return (w.ph_k, w.dev_k[0], w.ph_v, w.dev_v[0], s, d, 0, it, it * L, P, H), {}


def c_all_layer(w: World, s, d) -> Args:  # noqa: ANN001 - device -> host, tables both sides
    return (table(w.dev_k), table(w.lf_k), table(w.dev_v), table(w.lf_v), s, d,
            item(w.dev_k[0]), L), {}  # fmt: skip


def c_all_layer_lf_pf(w: World, s, d) -> Args:  # noqa: ANN001
    it = item(w.dev_k[0])
    return (table(w.dev_k), w.pf_k, table(w.dev_v), w.pf_v, s, d, it, it * L, L), {}


def c_all_layer_lf_ph(w: World, s, d) -> Args:  # noqa: ANN001
    it = item(w.dev_k[0])
    return (table(w.dev_k), w.ph_k, table(w.dev_v), w.ph_v, s, d, it, it * L, L, P, H), {}


def c_mla(w: World, s, d) -> Args:  # noqa: ANN001
    return (w.lf_k[0], w.dev_k[0], s, d, item(w.dev_k[0])), {}


def c_mla_pf_lf(w: World, s, d) -> Args:  # noqa: ANN001
    it = item(w.dev_k[0])
    return (w.pf_k, w.dev_k[1], s, d, 1, it, it * L), {}


def c_mla_lf_pf(w: World, s, d) -> Args:  # noqa: ANN001
    it = item(w.dev_k[0])
    return (w.dev_k[0], w.pf_k, s, d, 0, it, it * L), {}


def c_all_layer_mla(w: World, s, d) -> Args:  # noqa: ANN001 - host -> device
    return (table(w.lf_k), table(w.dev_k), s, d, item(w.dev_k[0]), L), {}


def c_all_layer_mla_lf_pf(w: World, s, d) -> Args:  # noqa: ANN001
    it = item(w.dev_k[0])
    return (table(w.dev_k), w.pf_k, s, d, it, it * L, L), {}


def _layer_list(*bufs: torch.Tensor | None) -> list[torch.Tensor]:
    return [b[i] for b in bufs if b is not None for i in range(L)]


def c_direct(w: World, s, d) -> Args:  # noqa: ANN001 - all layers, device -> host
    return (_layer_list(w.dev_k, w.dev_v), _layer_list(w.lf_k, w.lf_v), s, d, P), {}


def c_direct_pf_lf(w: World, s, d) -> Args:  # noqa: ANN001 - layer 1 of page_first_direct
    hosts = [b for b in (w.pfd_k, w.pfd_v) if b is not None]
    devs = [b[1] for b in (w.dev_k, w.dev_v) if b is not None]
    return (hosts, devs, s, d, 1, P), {}


def c_direct_lf_pf(w: World, s, d) -> Args:  # noqa: ANN001
    hosts = [b for b in (w.pfd_k, w.pfd_v) if b is not None]
    return (_layer_list(w.dev_k, w.dev_v), hosts, s, d, P), {}


def c_embedding(w: World, s, d) -> Args:  # noqa: ANN001 - device rows -> host rows
    return (w.emb_dev, w.emb_host, [0, 5], [2, 7], [3, 1]), {}


@dataclass(frozen=True)
class Case:
    op: str
    kind: str  # mha | asym | mla
    call: Callable[[World, torch.Tensor, torch.Tensor], Args]
    negative: bool = True  # include a pair with a negative index (kernel-backend ops)

    @property
    def id(self) -> str:
        return f"{self.op}-{self.kind}"


CASES = [
    Case("transfer_kv_per_layer", "mha", c_per_layer),
    Case("transfer_kv_per_layer", "asym", c_per_layer_d2h),
    Case("transfer_kv_per_layer_pf_lf", "mha", c_pf_lf),
    Case("transfer_kv_per_layer_pf_lf", "asym", c_pf_lf),
    Case("transfer_kv_per_layer_ph_lf", "mha", c_ph_lf),
    Case("transfer_kv_per_layer_ph_lf", "asym", c_ph_lf),
    Case("transfer_kv_all_layer", "mha", c_all_layer),
    Case("transfer_kv_all_layer_lf_pf", "mha", c_all_layer_lf_pf),
    Case("transfer_kv_all_layer_lf_pf", "asym", c_all_layer_lf_pf),
    Case("transfer_kv_all_layer_lf_ph", "mha", c_all_layer_lf_ph),
    Case("transfer_kv_all_layer_lf_ph", "asym", c_all_layer_lf_ph),
    Case("transfer_kv_per_layer_mla", "mla", c_mla),
    Case("transfer_kv_per_layer_mla_pf_lf", "mla", c_mla_pf_lf),
    Case("transfer_kv_per_layer_mla_lf_pf", "mla", c_mla_lf_pf),
    Case("transfer_kv_all_layer_mla", "mla", c_all_layer_mla),
    Case("transfer_kv_all_layer_mla_lf_pf", "mla", c_all_layer_mla_lf_pf),
    Case("transfer_kv_direct", "mha", c_direct, negative=False),
    Case("transfer_kv_direct", "asym", c_direct, negative=False),
    Case("transfer_kv_direct", "mla", c_direct, negative=False),
    Case("transfer_kv_per_layer_direct_pf_lf", "mha", c_direct_pf_lf, negative=False),
    Case("transfer_kv_per_layer_direct_pf_lf", "asym", c_direct_pf_lf, negative=False),
    Case("transfer_kv_per_layer_direct_pf_lf", "mla", c_direct_pf_lf, negative=False),
    Case("transfer_kv_all_layer_direct_lf_pf", "mha", c_direct_lf_pf, negative=False),
    Case("transfer_kv_all_layer_direct_lf_pf", "asym", c_direct_lf_pf, negative=False),
    Case("transfer_kv_all_layer_direct_lf_pf", "mla", c_direct_lf_pf, negative=False),
    Case("transfer_embedding_ranges_direct", "mha", c_embedding, negative=False),
]

# Source and destination slots per case: (src buffer kind, dst buffer kind) decide nothing here,
# every pool has T slots; the all-layer and direct D2H ops read the device and write the host.


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.cpu().reshape(-1).view(torch.uint8), b.cpu().reshape(-1).view(torch.uint8))


def run_case(case: Case, seed: int, device: torch.device = DEVICE, pin: bool = False) -> None:
    """The op on one copy of a world, the oracle on another: every buffer equal, and the
    destination changed."""
    world = make_world(case.kind, seed, device, pin)
    ours, theirs = world.clone(), world.clone()
    s, d = idx(SRC, case.negative, device), idx(DST, False, device)
    args, kwargs = case.call(ours, s, d)
    getattr(kernels, case.op)(*args, **kwargs)
    args, kwargs = case.call(theirs, s, d)
    getattr(Oracle(theirs.layers()), case.op)(*args, **kwargs)
    if device.type == "cuda":
        torch.cuda.synchronize()
    changed = []
    for name, buf in ours.buffers().items():
        assert same_bytes(buf, getattr(theirs, name)), f"{name} differs from the oracle"
        if not same_bytes(buf, getattr(world, name)):
            changed.append(name)
    assert changed, "the op wrote nothing"


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_op_matches_the_oracle(case: Case) -> None:
    run_case(case, seed=CASES.index(case))


def test_every_op_has_an_oracle_case() -> None:
    """Each name of ``KVCACHEIO_OPS`` is checked here (``get_device_accessible_ptr`` below), MHA
    and asymmetric wherever an op takes K and V, MLA wherever it takes one buffer."""
    covered = {c.op for c in CASES} | {"get_device_accessible_ptr"}
    assert covered == set(kernels.KVCACHEIO_OPS)
    for op in covered - {"get_device_accessible_ptr", "transfer_embedding_ranges_direct"}:
        kinds = {c.kind for c in CASES if c.op == op}
        assert kinds in ({"mla"}, {"mha", "asym"}, {"mha"}, {"mha", "asym", "mla"}), (op, kinds)


def test_get_device_accessible_ptr_matches_the_oracle() -> None:
    w = make_world("mla", 0)
    for t in (w.dev_k, w.lf_k):
        assert kernels.get_device_accessible_ptr(t, 0) == Oracle.get_device_accessible_ptr(t, 0)
