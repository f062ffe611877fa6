"""This project's prefill side serving SGLang 0.5.23's own decode connector, on loopback.

The prefill side is the product's: ``OptimisticPrefillExecutor`` over ``build_kv_cache`` with
``--disaggregation-transfer-backend mooncake`` (``make_decode_backend``: its bootstrap server,
its ZMQ listener, its Mooncake engine in this process, under the loopback shim). Its ``decode``
is :class:`SGLangDecodeRouter`: SGLang's router role, handing each request's room and the
prefill's bootstrap address to SGLang's ``MooncakeKVReceiver`` in a child
(:mod:`tests.sglang_check.pd_sglang_node`), which picks decode pages and an aux row as
``DecodePreallocQueue`` does and polls through SGLang's metadata gate.

Rows (:func:`run`): many requests byte-exact (every token row the prefill sent, read from SGLang's
decode pool, against the prefill's KV snapshotted at send time, :mod:`.pd_router`; the aux row as
SGLang's decode reads it); the fault cases (:mod:`.pd_faults`); optimistic attempts that are
never finalized write nothing SGLang's decode pool can see; then SGLang's sender against this
project's decode worker (:mod:`.pd_reverse`).
"""

from __future__ import annotations

import os
import random
import time
from typing import Any

from tests.sglang_check import pd_interop
from tests.sglang_check.pd_node_process import SGLangNodeProcess, recorded_row
from tests.sglang_check.pd_router import SGLangDecodeRouter, compare_request

SUCCESS, FAILED, WAITING = 4, 0, 2
POISON = 0xA5


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


def _settled(scene: Scene, timeout_s: float = 30) -> list[str]:
    """Drive until the prefill side is back to its baseline (or the time is up): its leaks."""
    scene.drive(lambda: not scene.leaks(), timeout_s)
    return scene.leaks()


MLA_ARGS = dict(use_mla=True, kv_lora_rank=32, qk_rope_head_dim=8)


def run_many(site: str, page_size: int, n: int, seed: int, **args_over: Any) -> dict[str, Any]:
    """``n`` requests (mixed lengths, shared prefixes, chunked prefill) byte-exact."""
    kind = "MLA/" if args_over.get("use_mla") else ""
    row: dict[str, Any] = {"case": f"pd/project->sglang/{kind}p{page_size}", "ok": False,
                           "requests": 0, "bytes_compared": 0, "fault_cases": 0,
                           "fault_cases_passed": 0}  # fmt: skip
    with recorded_row(row) as stops:
        scene = Scene(site, page_size, seed, chunked_prefill_size=64 if page_size > 1 else 16,
                      **args_over)  # fmt: skip
        stops.append(scene.close)
        stops.append(lambda: row.update(stubs=scene.node.stubs if scene.node is not None else {}))
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
    rows = row.pop("cached_tokens_rows", [])
    row["cached_tokens_seen"] = sorted({tuple(r) for r in rows})[:8]
    return row


def run_optimistic(site: str, seed: int) -> dict[str, Any]:
    """Optimistic attempts (forced not ready, 2 attempts): the ones never finalized write
    nothing SGLang's decode pool can see; the finalized ones arrive byte-exact."""
    row: dict[str, Any] = {"case": "pd/project->sglang/optimistic", "ok": False, "requests": 0,
                           "bytes_compared": 0, "fault_cases": 1,
                           "fault_cases_passed": 0}  # fmt: skip
    with recorded_row(row) as stops:
        scene = Scene(site, 16, seed, optimistic_prefill_attempts=2,
                      disaggregation_force_not_ready_prob=1.0)  # fmt: skip
        stops.append(scene.close)
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
    return row


def run(site: str, requests: int) -> list[dict[str, Any]]:
    rows = [run_many(site, ps, requests, seed=3 + ps) for ps in (16, 1)]
    rows.append(run_many(site, 16, max(8, requests // 4), seed=31, **MLA_ARGS))
    from tests.sglang_check import pd_faults

    rows.append(pd_faults.run_faults(site, seed=41))
    rows.append(run_optimistic(site, seed=42))
    from tests.sglang_check import pd_reverse

    rows.append(pd_reverse.run_sglang_to_project(site, 16, requests, seed=43))
    rows.append(pd_reverse.run_sglang_to_project(site, 1, max(8, requests // 4), seed=44))
    rows.append(pd_reverse.run_faults(site, seed=45))
    return rows
