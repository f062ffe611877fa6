"""The fault cases of this project's prefill side against SGLang 0.5.23's decode receiver:
SGLang's receiver SIGKILLed before a chunk, SIGSTOPped while bootstrapping past the prefill's
bootstrap timeout (then its late META), SIGSTOPped mid-transfer, aborting first, and of another
KV geometry. Each ends its request aborted in bounded time, leaves the prefill side at its
baseline (``Scene.leaks``), and a new or resumed SGLang decode is served afterwards.
"""

from __future__ import annotations

import random
import time
from typing import Any

from tests.sglang_check import pd_interop
from tests.sglang_check.pd_node_process import NodeError, SGLangNodeProcess, recorded_row
from tests.sglang_check.pd_project import FAILED, POISON, SUCCESS, Scene, _prompt, _settled
from tests.sglang_check.pd_router import compare_request


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
    with recorded_row(row) as stops:
        scene = Scene(site, 16, seed)
        stops.append(scene.close)
        for name, fn in cases:
            try:
                row["details"][name] = "ok: " + fn(scene)
            except (NodeError, AssertionError) as e:
                row["details"][name] = f"FAILED: {str(e)[-1500:]}"
                if scene.node is None or not scene.node.alive():
                    scene.replace_node()
        pd_interop.conclude_faults(row)
    return row
