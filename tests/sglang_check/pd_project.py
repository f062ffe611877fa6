"""This project's prefill side serving SGLang 0.5.23's own decode connector, on loopback.

The prefill side is the product's: ``OptimisticPrefillExecutor`` over ``build_kv_cache`` with
``--disaggregation-transfer-backend mooncake`` (``make_decode_backend``: its bootstrap server,
its ZMQ listener, its Mooncake engine in this process, under the loopback shim). Its ``decode``
is :class:`SGLangDecodeRouter`: SGLang's router role, handing each request's room and the
prefill's bootstrap address to SGLang's ``MooncakeKVReceiver`` in a child
(:mod:`tests.sglang_check.pd_sglang_node`), which picks decode pages and an aux row as
``DecodePreallocQueue`` does and polls through SGLang's metadata gate.

Rows (:func:`run`): many requests byte-exact (every token row the prefill sent, read from SGLang's
decode pool, against the prefill's KV snapshotted at send time; the aux row as SGLang's decode
reads it); the fault cases (SGLang's receiver killed mid-transfer, frozen past the bootstrap
timeout, frozen mid-transfer, aborting first); optimistic attempts that are never finalized
write nothing SGLang's decode pool can see.
"""

from __future__ import annotations

import base64
import os
import random
import time
import traceback
from typing import Any

from tests.sglang_check import pd_interop
from tests.sglang_check.pd_node_process import NodeError, SGLangNodeProcess

SUCCESS, FAILED, WAITING = 4, 0, 2
POISON = 0xA5
WIRE_PENDING = (
    "pending: this checkout's prefill side still speaks the home-made framing "
    "(prefill.disagg.mooncake.wire.encode_frames), not SGLang's ZMQ wire"
)


def wire_pending() -> str | None:
    """Why the project side cannot serve SGLang's decode in this checkout, or None."""
    from hicache_prefill.prefill.disagg.mooncake import wire

    return WIRE_PENDING if hasattr(wire, "encode_frames") else None


class SGLangDecodeRouter:
    """The executor's ``DecodeBackend``: the product's ``MooncakeBackend`` (prefill side) plus
    SGLang's decode receiver in ``node``. Decode pages and aux rows come from free lists of the
    node's pool; ``hold(rid)`` keeps a request from reaching decode until ``route(rid)``."""

    def __init__(self, backend: Any, node: SGLangNodeProcess, pool: Any, decode_pages: int,
                 aux_rows: int, seed: int) -> None:  # fmt: skip
        self.backend = backend
        self.node = node
        self.pool = pool
        self.page_size = pool.page_size
        self.rng = random.Random(seed)
        self.free_pages = list(range(1, decode_pages))
        self.rng.shuffle(self.free_pages)
        self.free_aux = list(range(aux_rows))
        self.rng.shuffle(self.free_aux)
        self.routes: dict[str, dict[str, Any]] = {}
        self.sent: dict[str, dict[int, list[bytes]]] = {}  # rid -> token -> row bytes per buffer
        self.hold: Any = lambda rid: False
        self.prefix: Any = lambda rid, n: 0  # tokens SGLang's decode claims to hold already

    # DecodeBackend ----------------------------------------------------------------------------
    @property
    def clock(self) -> Any:
        return self.backend.clock

    @property
    def force_not_ready_prob(self) -> float:
        return self.backend.force_not_ready_prob

    @property
    def peers(self) -> dict[str, Any]:
        return self.backend.peers

    @property
    def send_log(self) -> Any:
        return self.backend.send_log

    def create_peer(self, rid: str, num_tokens: int, token_ids: Any = None) -> Any:
        link = self.backend.create_peer(rid, num_tokens, token_ids)
        prefix = int(self.prefix(rid, num_tokens))
        npages = -(-(num_tokens - prefix) // self.page_size)
        if npages > len(self.free_pages) or not self.free_aux:
            raise RuntimeError(f"{rid}: the SGLang decode pool is full (test sizing)")
        pages = [self.free_pages.pop() for _ in range(npages)]
        if self.rng.random() < 0.4:
            pages.sort()
        self.routes[rid] = {"room": link.room, "pages": pages, "aux": self.free_aux.pop(),
                            "num_tokens": num_tokens, "prefix": prefix,
                            "routed": False}  # fmt: skip
        self._snapshot_sends(rid, link)
        if not self.hold(rid):
            self.route(rid)
        return link

    def next_event_time(self) -> float | None:
        return self.backend.next_event_time()

    def release(self, rid: str) -> None:
        self.backend.release(rid)

    # the router -------------------------------------------------------------------------------
    def route(self, rid: str) -> dict[str, Any]:
        """Hand ``rid`` to SGLang's decode: receiver, ``init(0)``, ``send_metadata``."""
        r = self.routes[rid]
        r["routed"] = True
        return self.node.call("add", room=r["room"], addr=self.backend.bootstrap_addr,
                              pages=r["pages"], aux=r["aux"], prefix=r["prefix"])  # fmt: skip

    def forget(self, rid: str, clear_node: bool = True) -> None:
        """SGLang's decode is done with ``rid``: clear its receiver and row, free its pages."""
        r = self.routes.pop(rid)
        if clear_node and r["routed"]:
            self.node.call("clear", room=r["room"])
            self.node.call("clear_aux", aux=r["aux"])
        self.free_pages.extend(r["pages"])
        self.free_aux.append(r["aux"])
        self.sent.pop(rid, None)

    def _snapshot_sends(self, rid: str, link: Any) -> None:
        """Record the prefill pool's rows of every token a send hands to the transport, at the
        moment it hands them over (the bytes SGLang's decode must end up holding)."""
        inner = link.send
        pool = self.pool
        rows = self.sent.setdefault(rid, {})

        def send(attempt: int, start: int, end: int, src_slots: Any, last: bool,
                 metadata: Any = None) -> bool:  # fmt: skip
            snap = [buf[src_slots.to(buf.device)].contiguous() for buf in _buffers(pool)]
            ok = inner(attempt, start, end, src_slots, last, metadata=metadata)
            if ok:
                for i in range(end - start):
                    rows[start + i] = [t[i].view(-1).view(_u8()).numpy().tobytes() for t in snap]
            return ok

        link.send = send


def _u8() -> Any:
    import torch

    return torch.uint8


def _buffers(pool: Any) -> list[Any]:
    if hasattr(pool, "k_buffer"):
        return [*pool.k_buffer, *pool.v_buffer]
    return list(pool.kv_buffer)


def compare_request(router: SGLangDecodeRouter, rid: str) -> tuple[bool, int, str]:
    """Every token row the prefill sent for ``rid`` (tokens ``[decode_prefix_len, n)``) against
    SGLang's decode pool rows of the same token (decode page order = token order); returns
    (equal, bytes compared, detail)."""
    r = router.routes[rid]
    n, dpl = r["num_tokens"], r["prefix"]
    sent = router.sent.get(rid, {})
    if sorted(sent) != list(range(dpl, n)):
        return False, 0, f"sent tokens {sorted(sent)[:1]}.. ({len(sent)}), want [{dpl}, {n})"
    got = [base64.b64decode(b) for b in router.node.call("pages", pages=r["pages"])["buffers"]]
    nbuf = len(got)
    if nbuf != len(sent[dpl]):
        return False, 0, f"decode has {nbuf} buffers, prefill {len(sent[dpl])}"
    total = 0
    for b in range(nbuf):
        row = len(sent[dpl][b])
        for t in range(dpl, n):  # decode page i holds tokens dpl + i*ps ...
            want = sent[t][b]
            have = got[b][(t - dpl) * row : (t - dpl + 1) * row]
            total += row
            if have != want:
                return False, total, f"buffer {b} token {t} differs"
    return True, total, ""


def expected_aux(res: Any, room: int) -> dict[str, Any]:
    """The aux row SGLang's prefill would send for this request (``MetadataBuffers.set_buf``):
    cached tokens as ``[total, device, host, storage]``, the tiers disjoint as SGLang's
    ``split_cached_prefix_by_tier`` makes them (this project counts L3 tokens inside host)."""
    dev, host, storage = (res.cached_device_tokens, res.cached_host_tokens,
                          getattr(res, "cached_storage_tokens", 0))  # fmt: skip
    return {"output_id": res.first_token, "cached_tokens": [dev + host, dev, host - storage,
            storage], "bootstrap_room": room}  # fmt: skip


class Scene:
    """One prefill executor (the product's) and one SGLang decode node, with the leak checks."""

    def __init__(self, site: str, page_size: int, seed: int, **args_over: Any) -> None:
        from hicache_prefill.prefill.clock import WallClock
        from hicache_prefill.prefill.disagg.backends import make_decode_backend
        from hicache_prefill.prefill.executor import OptimisticPrefillExecutor
        from hicache_prefill.prefill.model.factory import build_model
        from hicache_prefill.prefill.scheduler.admission import (
            DEFAULT_MAX_RUNNING_REQUESTS,
            metadata_buffer_count,
        )
        from hicache_prefill.server_args import ServerArgs
        from tests.sglang_check import pd_interop
        from tests.support.harness import build_cache

        base = dict(page_size=page_size, max_total_tokens=8192, chunked_prefill_size=64,
                    device="cpu", dtype="float32", disaggregation_mode="prefill",
                    disaggregation_transfer_backend="mooncake",
                    disaggregation_bootstrap_port=0)  # fmt: skip
        self.args = ServerArgs(**{**base, **args_over})  # type: ignore[arg-type]
        self.site, self.seed = site, seed
        self.cache = build_cache(self.args)
        pool = self.cache.device_pool
        self.pool = pool
        clock = WallClock()
        mrr = getattr(self.args, "max_running_requests", None) or DEFAULT_MAX_RUNNING_REQUESTS
        self.backend = make_decode_backend(self.args, pool, clock, metadata_buffer_count(mrr),
                                           1 << 16, keep_received=True)  # fmt: skip
        self.node: SGLangNodeProcess | None = None
        try:
            self.node = self.start_node()
            self.router = SGLangDecodeRouter(self.backend, self.node, pool,
                                             self.decode_tokens // page_size,
                                             pd_interop.GEOMETRY["aux_rows"], seed)  # fmt: skip
            self.ex = OptimisticPrefillExecutor(self.args, cache=self.cache,
                                                model=build_model(self.args), clock=clock,
                                                decode=self.router)  # fmt: skip
        except BaseException:
            self.close()
            raise

    decode_tokens = 16384

    def node_config(self) -> dict[str, Any]:
        from tests.sglang_check import pd_interop

        pool = self.pool
        if hasattr(pool, "k_buffer"):
            geo = {"kind": "MHA", "heads": pool.head_num, "head_dim": pool.head_dim}
        else:
            geo = {"kind": "MLA", "kv_lora_rank": pool.kv_lora_rank,
                   "qk_rope_head_dim": pool.qk_rope_head_dim}  # fmt: skip
        dtype = str(pool.dtype).removeprefix("torch.")
        return {**pd_interop.GEOMETRY, **geo, "layers": pool.layer_num, "dtype": dtype,
                "page_size": pool.page_size, "tokens": self.decode_tokens}  # fmt: skip

    def start_node(self) -> SGLangNodeProcess:
        node = SGLangNodeProcess(self.site, "decode", self.node_config())
        node.call("fill_const", value=POISON)
        return node

    def replace_node(self) -> None:
        """A fresh SGLang decode in place of the current one (after a kill or a freeze); the
        router's free lists start over with it."""
        if self.node is not None:
            self.node.stop()
        self.node = self.start_node()
        r = self.router
        r.node = self.node
        r.routes.clear()
        r.sent.clear()
        r.free_pages = list(range(1, self.decode_tokens // self.pool.page_size))
        r.rng.shuffle(r.free_pages)
        r.free_aux = list(range(_aux_rows()))
        r.rng.shuffle(r.free_aux)

    def drive(self, until: Any, timeout_s: float) -> bool:
        deadline = time.monotonic() + timeout_s
        while not until():
            if time.monotonic() > deadline:
                return False
            if not self.ex.step():
                time.sleep(0.001)
            self.ex.check_integrity()
        return True

    def leaks(self) -> list[str]:
        """What the prefill side still holds with no request live (empty: back to baseline)."""
        ex = self.ex
        bad = []
        ex.check_integrity()
        if ex.request_owned_slots():
            bad.append(f"request-owned slots {ex.request_owned_slots()}")
        if ex.draining_queue:
            bad.append(f"draining {[r.rid for r in ex.draining_queue]}")
        stats = self.backend.transport.stats()
        if stats.get("outstanding"):
            bad.append(f"outstanding transfers {stats['outstanding']}")
        if stats.get("rooms"):
            bad.append(f"rooms {stats['rooms']}")
        live = [rid for rid, link in self.backend.peers.items() if link.live]
        if live:
            bad.append(f"live links {live}")
        return bad

    def close(self) -> None:
        if self.node is not None:
            self.node.stop()
        self.backend.close()


def _aux_rows() -> int:
    from tests.sglang_check import pd_interop

    return int(pd_interop.GEOMETRY["aux_rows"])


def _prompt(rng: random.Random, n: int, prefix: list[int] | None = None) -> list[int]:
    body = [rng.randrange(0, 500) for _ in range(n)]
    return (prefix + body)[:n] if prefix else body


MLA_ARGS = dict(use_mla=True, kv_lora_rank=32, qk_rope_head_dim=8)


def run_many(site: str, page_size: int, n: int, seed: int, **args_over: Any) -> dict[str, Any]:
    """``n`` requests (mixed lengths, shared prefixes, chunked prefill) byte-exact."""
    kind = "MLA/" if args_over.get("use_mla") else ""
    row: dict[str, Any] = {"case": f"pd/project->sglang/{kind}p{page_size}", "ok": False,
                           "requests": 0, "bytes_compared": 0, "fault_cases": 0,
                           "fault_cases_passed": 0}  # fmt: skip
    t0 = time.monotonic()
    scene = None
    try:
        scene = Scene(site, page_size, seed, chunked_prefill_size=64 if page_size > 1 else 16,
                      **args_over)  # fmt: skip
        rng = random.Random(seed)
        shared = _prompt(rng, 96)
        # Every fourth request: SGLang's decode claims a page-aligned prefix (its radix hit),
        # so META carries decode_prefix_len and the pages of [prefix, n) only.
        ps = page_size
        scene.router.prefix = lambda rid, n: (
            ps * (1 + int(rid[1:]) % max(1, (n - 1) // ps)) if int(rid[1:]) % 4 == 1 and n > ps
            else 0
        )  # fmt: skip
        lengths = [1, page_size, page_size + 1, 3 * page_size, 100, 200, 333]
        done = 0
        bad_aux: list[str] = []
        for w in range(0, n, 8):
            rids = []
            for i in range(w, min(n, w + 8)):
                length = lengths[i] if i < len(lengths) else rng.randint(1, 300)
                prefix = shared if i % 3 == 0 else None
                rid = f"r{i}"
                scene.ex.submit(rid, _prompt(rng, length, prefix))
                rids.append(rid)
            scene.ex.run_until_idle(check=True)
            results = {r.rid: r for r in scene.ex.pop_results()}
            for rid in rids:
                res = results[rid]
                if res.outcome.name != "SUCCESS":
                    raise AssertionError(f"{rid}: {res.outcome.name} ({res.error})")
                route = scene.router.routes[rid]
                st = scene.node.wait_status("poll", route["room"], {SUCCESS}, 30)
                if st["status"] != SUCCESS:
                    raise AssertionError(f"{rid}: SGLang's decode ended {st}")
                same, nbytes, why = compare_request(scene.router, rid)
                if not same:
                    raise AssertionError(f"{rid}: received KV differs: {why}")
                aux = scene.node.call("aux", aux=route["aux"])
                want = expected_aux(res, route["room"])
                have = {k: aux[k] for k in want}
                if have != want or aux["logprob_fields_nonzero"]:
                    bad_aux.append(f"{rid}: {have} (logprob fields nonzero: "
                                   f"{aux['logprob_fields_nonzero']}), want {want}")  # fmt: skip
                row.setdefault("cached_tokens_rows", []).append(aux["cached_tokens"])
                row["bytes_compared"] += nbytes
                row["requests"] += 1
                done += 1
                scene.router.forget(rid)
                scene.router.release(rid)
        leaks = scene.leaks()
        if leaks:
            raise AssertionError(f"prefill side not back to baseline: {leaks}")
        health = scene.node.call("health")
        addr = scene.backend.bootstrap_addr
        if addr not in health["known"] or health["failures"].get(addr, 0):
            raise AssertionError(f"SGLang's heartbeat to {addr}/health failed: {health}")
        row["decode_prefix_requests"] = sum(1 for i in range(n) if i % 4 == 1)
        row["listeners"], off = pd_interop.listeners([os.getpid(), scene.node.pid])
        if off:
            raise AssertionError(f"listeners off loopback: {off}")
        if bad_aux:
            raise AssertionError(f"KV byte-exact for all {done}, but the aux row as SGLang's "
                                 f"decode reads it differs for {len(bad_aux)}: "
                                 + "; ".join(bad_aux[:3]))  # fmt: skip
        row["ok"] = done == n
    except (NodeError, AssertionError) as e:
        row["error"] = str(e)[-3000:]
    except Exception as e:
        row["error"] = f"{type(e).__name__}: {e}"
        row["traceback"] = traceback.format_exc()
    finally:
        if scene is not None:
            row["stubs"] = scene.node.stubs if scene.node is not None else {}
            scene.close()
    rows = row.pop("cached_tokens_rows", [])
    row["cached_tokens_seen"] = sorted({tuple(r) for r in rows})[:8]
    row["seconds"] = round(time.monotonic() - t0, 1)
    return row


def _served_after(scene: Scene, rid: str, seed: int, tries: int = 2) -> str | None:
    """A new request to the current SGLang decode succeeds byte-exact (None) or why not."""
    why = None
    for t in range(tries):
        name = f"{rid}.{t}"
        scene.ex.submit(name, _prompt(random.Random(seed + t), 150))
        if not scene.drive(lambda n=name: n in scene.ex.results, 60):
            return f"{name}: no result in 60 s"
        res = {r.rid: r for r in scene.ex.pop_results()}[name]
        route = scene.router.routes[name]
        if res.outcome.name == "SUCCESS":
            st = scene.node.wait_status("poll", route["room"], {SUCCESS}, 30)
            same, _, detail = compare_request(scene.router, name)
            ok = st["status"] == SUCCESS and same
            scene.router.forget(name)
            scene.router.release(name)
            return None if ok else f"{name}: SGLang {st}, bytes {detail or 'equal'}"
        why = f"{name}: {res.outcome.name} ({res.error})"
        scene.router.forget(name, clear_node=False)
        scene.router.release(name)
        time.sleep(1.0)  # a failed session is probed back by the prefill side
    return why


def _end_of(scene: Scene, rid: str, timeout_s: float) -> Any:
    if not scene.drive(lambda: rid in scene.ex.results, timeout_s):
        raise AssertionError(f"{rid}: no result within {timeout_s} s ({scene.ex.describe()})")
    return {r.rid: r for r in scene.ex.pop_results()}[rid]


def _settled(scene: Scene, timeout_s: float = 30) -> list[str]:
    """Drive until the prefill side is back to its baseline (or the time is up): its leaks."""
    scene.drive(lambda: not scene.leaks(), timeout_s)
    return scene.leaks()


def _hook(scene: Scene, victim: str, chunk: int, action: Any) -> bool:
    """Run ``action`` on the prefill's transfer thread before ``victim``'s chunk ``chunk``;
    False when the backend has no transfer hook."""
    set_hook = getattr(scene.backend, "set_hook", None)
    if set_hook is None:
        return False
    fired = []

    def hook(rid: str, c: int, last: bool, phase: str) -> None:
        if rid == victim and c == chunk and not fired:
            fired.append(1)
            action()

    set_hook(hook)
    return True


def fault_kill_mid_transfer(scene: Scene) -> str:
    """SGLang's receiver SIGKILLed by pid before chunk 1 of a 5-chunk request."""
    node = scene.node
    if not _hook(scene, "V1", 1, node.kill):
        raise AssertionError("the prefill backend has no transfer hook (set_hook)")
    scene.ex.submit("V1", _prompt(random.Random(71), 300))
    res = _end_of(scene, "V1", 60)
    scene.backend.set_hook(None)
    if res.outcome.name != "ABORTED" or node.alive():
        raise AssertionError(f"V1 {res.outcome.name} ({res.error}); node alive {node.alive()}")
    scene.router.forget("V1", clear_node=False)
    scene.router.release("V1")
    leaks = _settled(scene)
    if leaks:
        raise AssertionError(f"after the kill: {leaks}")
    scene.replace_node()
    bad = _served_after(scene, "N1", 81)
    if bad:
        raise AssertionError(f"a new SGLang decode after the kill: {bad}")
    return f"V1 aborted ({res.error}); new decode served"


def fault_frozen_bootstrapping(scene: Scene) -> str:
    """SGLang's receiver REGISTERs, then is SIGSTOPped before its META, past the prefill's
    bootstrap timeout; resumed, its late META must not revive the room."""
    r = scene.router
    r.hold = lambda rid: rid == "V2"
    scene.ex.submit("V2", _prompt(random.Random(72), 200))
    route = r.routes["V2"]
    route["routed"] = True
    if not scene.node.call("prepare", room=route["room"], addr=scene.backend.bootstrap_addr)[
        "registered"
    ]:
        raise AssertionError("SGLang's decode could not read the prefill's /route")
    scene.node.freeze()
    try:
        res = _end_of(scene, "V2", 60)
    finally:
        scene.node.thaw()
    r.hold = lambda rid: False
    if res.outcome.name != "ABORTED" or "Bootstrapping" not in str(res.error):
        raise AssertionError(f"V2 {res.outcome.name} ({res.error})")
    scene.node.call("send_meta", room=route["room"], pages=route["pages"], aux=route["aux"])
    time.sleep(0.5)
    link = scene.backend.peers.get("V2")
    if link is not None and link.live:
        raise AssertionError("a late META revived V2's room on the prefill side")
    late = scene.node.wait_status("poll", route["room"], {SUCCESS}, 30)
    if late["status"] != FAILED:
        raise AssertionError(f"SGLang's decode after its late META: {late}")
    scene.node.call("abort", room=route["room"])
    r.forget("V2")
    r.release("V2")
    leaks = _settled(scene)
    if leaks:
        raise AssertionError(f"after the freeze: {leaks}")
    bad = _served_after(scene, "N2", 82)
    if bad:
        raise AssertionError(f"the resumed SGLang decode: {bad}")
    return (
        f"V2 aborted ({res.error}); late META revived nothing, SGLang's decode ended "
        f"Failed ({late.get('reason')}); resumed decode served"
    )


def fault_frozen_mid_transfer(scene: Scene) -> str:
    """SGLang's receiver SIGSTOPped before chunk 1: the write times out (Mooncake's progress
    timeout), the request aborts and drains; resumed, the decode serves again."""
    node = scene.node
    if not _hook(scene, "V3", 1, node.freeze):
        raise AssertionError("the prefill backend has no transfer hook (set_hook)")
    try:
        scene.ex.submit("V3", _prompt(random.Random(73), 300))
        res = _end_of(scene, "V3", 60)
        leaks = _settled(scene)
    finally:
        scene.backend.set_hook(None)
        node.thaw()
    if res.outcome.name != "ABORTED":
        raise AssertionError(f"V3 {res.outcome.name} ({res.error})")
    if leaks:
        raise AssertionError(f"after the frozen transfer: {leaks}")
    route = scene.router.routes["V3"]
    scene.node.call("abort", room=route["room"])
    scene.router.forget("V3")
    scene.router.release("V3")
    bad = _served_after(scene, "N3", 83, tries=4)
    if bad:
        raise AssertionError(f"the resumed SGLang decode: {bad}")
    return f"V3 aborted ({res.error}); resumed decode served"


def fault_abort_first(scene: Scene) -> str:
    """SGLang's receiver aborts right after its META (ABORT to the prefill): the request ends
    at once, and SGLang's deferred release sees the prefill's ABORT_ACK."""
    r = scene.router
    r.hold = lambda rid: rid == "V4"
    scene.ex.submit("V4", _prompt(random.Random(74), 300))
    r.hold = lambda rid: False
    route = r.routes["V4"]
    r.route("V4")
    scene.node.call("abort", room=route["room"])
    t0 = time.monotonic()
    res = _end_of(scene, "V4", 60)
    took = time.monotonic() - t0
    if res.outcome.name != "ABORTED":
        raise AssertionError(f"V4 {res.outcome.name} ({res.error})")
    leaks = _settled(scene)
    if leaks:
        raise AssertionError(f"after SGLang's abort: {leaks}")
    deadline = time.monotonic() + 10
    acked = scene.node.call("release_safe", room=route["room"])
    while not acked["safe"] and time.monotonic() < deadline:
        time.sleep(0.05)
        acked = scene.node.call("release_safe", room=route["room"])
    if not acked["safe"]:
        raise AssertionError(f"SGLang's decode saw no ABORT_ACK for V4 ({acked})")
    r.forget("V4")
    r.release("V4")
    return f"V4 aborted in {took:.1f}s ({res.error}); ABORT_ACK seen by SGLang"


def fault_geometry_mismatch(scene: Scene) -> str:
    """An SGLang decode whose pool has twice the KV heads (other per-page item lengths): the
    prefill side refuses its REGISTER, the request ends without a byte written into SGLang's
    pool, and SGLang's decode learns it failed."""
    cfg = scene.node_config()
    if cfg["kind"] != "MHA":
        raise AssertionError("the geometry case runs on an MHA prefill")
    other = SGLangNodeProcess(scene.site, "decode", {**cfg, "heads": 2 * cfg["heads"]})
    keep = scene.router.node
    try:
        other.call("fill_const", value=POISON)
        scene.router.node = other
        scene.ex.submit("V5", _prompt(random.Random(75), 200))
        route = scene.router.routes["V5"]
        res = _end_of(scene, "V5", 60)
        if res.outcome.name != "ABORTED":
            raise AssertionError(f"V5 {res.outcome.name} ({res.error})")
        st = other.wait_status("poll", route["room"], {SUCCESS}, 30)
        seen = other.call("untouched", value=POISON, exclude=[])["pages"]
        if st["status"] != FAILED or seen["dirty"]:
            raise AssertionError(f"SGLang's decode ended {st}; pages written {seen}")
        scene.router.forget("V5")
        scene.router.release("V5")
        leaks = _settled(scene)
        if leaks:
            raise AssertionError(f"after the refused REGISTER: {leaks}")
    finally:
        scene.router.node = keep
        other.stop()
    return f"V5 aborted ({res.error}); SGLang's decode: {st.get('reason') or st}"


def run_faults(site: str, seed: int) -> dict[str, Any]:
    cases = [("kill-mid-transfer", fault_kill_mid_transfer),
             ("frozen-past-bootstrap-timeout", fault_frozen_bootstrapping),
             ("frozen-mid-transfer", fault_frozen_mid_transfer),
             ("abort-first", fault_abort_first),
             ("geometry-mismatch", fault_geometry_mismatch)]  # fmt: skip
    row: dict[str, Any] = {"case": "pd/project->sglang/faults", "ok": False, "requests": 0,
                           "bytes_compared": 0, "fault_cases": len(cases),
                           "fault_cases_passed": 0, "details": {}}  # fmt: skip
    t0 = time.monotonic()
    scene = None
    try:
        scene = Scene(site, 16, seed)
        for name, fn in cases:
            try:
                row["details"][name] = "ok: " + fn(scene)
                row["fault_cases_passed"] += 1
            except (NodeError, AssertionError) as e:
                row["details"][name] = f"FAILED: {str(e)[-1500:]}"
                if scene.node is None or not scene.node.alive():
                    scene.replace_node()
        row["ok"] = row["fault_cases_passed"] == len(cases)
        if not row["ok"]:
            row["error"] = "; ".join(f"{k}: {v}" for k, v in row["details"].items()
                                     if v.startswith("FAILED"))  # fmt: skip
    except Exception as e:
        row["error"] = f"{type(e).__name__}: {e}"
        row["traceback"] = traceback.format_exc()
    finally:
        if scene is not None:
            scene.close()
    row["seconds"] = round(time.monotonic() - t0, 1)
    return row


def run_optimistic(site: str, seed: int) -> dict[str, Any]:
    """Optimistic attempts (forced not ready, 2 attempts): the ones never finalized write
    nothing SGLang's decode pool can see; the finalized ones arrive byte-exact."""
    row: dict[str, Any] = {"case": "pd/project->sglang/optimistic", "ok": False, "requests": 0,
                           "bytes_compared": 0, "fault_cases": 1,
                           "fault_cases_passed": 0}  # fmt: skip
    t0 = time.monotonic()
    scene = None
    try:
        scene = Scene(site, 16, seed, optimistic_prefill_attempts=2,
                      disaggregation_force_not_ready_prob=1.0)  # fmt: skip
        r = scene.router
        r.hold = lambda rid: rid in ("p0", "p1")
        rng = random.Random(seed)
        for i in range(4):
            scene.ex.submit(f"p{i}", _prompt(rng, 120))
        parked = lambda: {q.rid for q in scene.ex.inflight_queue if q.parked} >= {"p0", "p1"}  # noqa: E731
        if not scene.drive(parked, 60):
            raise AssertionError(f"p0, p1 never parked ({scene.ex.describe()})")
        early = [s for s in scene.backend.send_log if s.rid in ("p0", "p1")]
        exposed = [p for rid in ("p2", "p3") for p in r.routes[rid]["pages"]]
        seen = scene.node.call("untouched", value=POISON, exclude=exposed)["pages"]
        if early or seen["dirty"]:
            raise AssertionError(f"before finalize: sends {early}, written pages {seen}")
        for rid in ("p0", "p1"):
            r.route(rid)
        scene.ex.run_until_idle(check=True)
        results = {q.rid: q for q in scene.ex.pop_results()}
        for rid, res in sorted(results.items()):
            if res.outcome.name != "SUCCESS":
                raise AssertionError(f"{rid}: {res.outcome.name} ({res.error})")
            st = scene.node.wait_status("poll", r.routes[rid]["room"], {SUCCESS}, 30)
            same, nbytes, why = compare_request(r, rid)
            if st["status"] != SUCCESS or not same:
                raise AssertionError(f"{rid}: SGLang {st}, bytes {why or 'equal'}")
            row["bytes_compared"] += nbytes
            row["requests"] += 1
        finalized = {rid: res.passes for rid, res in results.items()}
        wrong = [s for s in scene.backend.send_log if s.attempt != finalized[s.rid]]
        all_pages = [p for q in r.routes.values() for p in q["pages"]]
        after = scene.node.call("untouched", value=POISON, exclude=all_pages)["pages"]
        if wrong or after["dirty"]:
            raise AssertionError(f"sends of attempts never finalized {wrong}; stray pages {after}")
        row["attempts"] = {rid: (res.passes, res.yields) for rid, res in results.items()}
        for rid in list(r.routes):
            r.forget(rid)
            r.release(rid)
        leaks = _settled(scene)
        if leaks:
            raise AssertionError(f"not back to baseline: {leaks}")
        row["fault_cases_passed"] = 1
        row["ok"] = row["requests"] == 4
    except (NodeError, AssertionError) as e:
        row["error"] = str(e)[-3000:]
    except Exception as e:
        row["error"] = f"{type(e).__name__}: {e}"
        row["traceback"] = traceback.format_exc()
    finally:
        if scene is not None:
            scene.close()
    row["seconds"] = round(time.monotonic() - t0, 1)
    return row


def run(site: str, requests: int) -> list[dict[str, Any]]:
    why = wire_pending()
    if why is not None:
        return [{"case": "pd/project->sglang", "ok": False, "pending": True, "error": why}]
    rows = [run_many(site, ps, requests, seed=3 + ps) for ps in (16, 1)]
    rows.append(run_many(site, 16, max(8, requests // 4), seed=31, **MLA_ARGS))
    rows.append(run_faults(site, seed=41))
    rows.append(run_optimistic(site, seed=42))
    from tests.sglang_check import pd_reverse

    rows.append(pd_reverse.run_sglang_to_project(site, 16, requests, seed=43))
    rows.append(pd_reverse.run_sglang_to_project(site, 1, max(8, requests // 4), seed=44))
    rows.append(pd_reverse.run_faults(site, seed=45))
    return rows
