"""PD over SGLang 0.5.23's own Mooncake wire, on a CPU, on loopback: who serves whom, byte-exact.

``python -m tests.sglang_check.run_pin --site DIR --mode pd-interop --out FILE.json``

Each SGLang side is SGLang's own connector in a child process
(:mod:`tests.sglang_check.pd_sglang_node`: ``MooncakeKVManager`` + ``MooncakeKVReceiver`` /
``MooncakeKVSender``, SGLang's bootstrap server, its ``MetadataBuffers``, its CPU KV pool, the
real Mooncake transfer engine over TCP on 127.0.0.1). Rows (:func:`run`):

- ``pd/sglang->sglang/p{16,1}``: SGLang's prefill sender to SGLang's decode receiver; proves the
  harness (many requests, mixed lengths, chunked sends, shuffled pages; every received page and
  aux row compared with the sender's);
- ``pd/project->sglang/...``: this project's prefill side (``--disaggregation-transfer-backend
  mooncake``) to SGLang's decode receiver, same comparison, plus the fault cases
  (:mod:`tests.sglang_check.pd_project`);
- ``pd/sglang->project/...``: SGLang's prefill sender to this project's decode worker.

A row whose side cannot run here says why (``skipped``); Mooncake or the loopback shim missing
skips every row, as the L3 rows on a real master do.
"""

from __future__ import annotations

import base64
import logging
import random
import time
import traceback
from typing import Any

from tests.sglang_check.pd_node_process import SGLangNodeProcess, recorded_row

logger = logging.getLogger(__name__)

SUCCESS, FAILED, WAITING = 4, 0, 2
GEOMETRY = {"kind": "MHA", "layers": 3, "heads": 2, "head_dim": 8, "dtype": "bfloat16",
            "aux_rows": 64, "hidden_size": 16}  # fmt: skip
POOL_TOKENS = 8192  # per pool; page 0 never used (SGLang's padding slot lives there)
MAX_TOKENS = 192  # longest prompt of a planned request


def node_config(page_size: int, bootstrap_port: int = 8998, **over: Any) -> dict[str, Any]:
    return {**GEOMETRY, "page_size": page_size, "tokens": POOL_TOKENS,
            "bootstrap_port": bootstrap_port, **over}  # fmt: skip


def plan_requests(n: int, page_size: int, seed: int) -> list[dict[str, Any]]:
    """``n`` requests with mixed prompt lengths (1 token up to ``MAX_TOKENS``), each with its own
    shuffled prefill pages and decode pages (disjoint per side), chunks (non-last chunks whole
    pages), aux rows and first-token metadata."""
    rng = random.Random(seed)
    pages = POOL_TOKENS // page_size
    free_p = list(range(1, pages))
    free_d = list(range(1, pages))
    rng.shuffle(free_p)
    rng.shuffle(free_d)
    rooms = rng.sample(range(1, 1 << 62), n)
    aux_p = rng.sample(range(GEOMETRY["aux_rows"]), n)
    aux_d = rng.sample(range(GEOMETRY["aux_rows"]), n)
    out = []
    for i in range(n):
        tokens = rng.choice([1, page_size, 3 * page_size + 1, rng.randint(1, MAX_TOKENS)])
        npages = -(-tokens // page_size)
        if npages > len(free_p) or npages > len(free_d):
            break
        src = [free_p.pop() for _ in range(npages)]
        dst = [free_d.pop() for _ in range(npages)]
        if rng.random() < 0.4:  # contiguous runs on both sides: SGLang merges them
            src.sort()
            dst.sort()
        cuts = sorted(rng.sample(range(1, npages), min(npages - 1, rng.randint(0, 3))))
        chunks = [b - a for a, b in zip([0, *cuts], [*cuts, npages], strict=True)]
        out.append({"room": rooms[i], "tokens": tokens, "src": src, "dst": dst,
                    "chunks": chunks, "aux_p": aux_p[i], "aux_d": aux_d[i],
                    "output_id": rng.randint(1, 150_000),
                    "cached": [rng.randint(0, tokens), 0, 0, 0]})  # fmt: skip
    return out


def compare_pages(src: list[str], dst: list[str]) -> tuple[bool, int]:
    """Byte-exact per buffer; returns (equal, bytes compared)."""
    total = 0
    equal = len(src) == len(dst)
    for a, b in zip(src, dst, strict=False):
        ra, rb = base64.b64decode(a), base64.b64decode(b)
        total += len(ra)
        equal = equal and ra == rb
    return equal, total


def check_aux(row: dict[str, Any], req: dict[str, Any]) -> str | None:
    """What SGLang's decode reads from the aux row (``_commit_transfer_to_req``): the room
    gate, the first output id, the cached token counts; None when all match."""
    want = {"bootstrap_room": req["room"], "output_id": req["output_id"],
            "cached_tokens": req["cached"]}  # fmt: skip
    bad = {k: (row[k], v) for k, v in want.items() if row[k] != v}
    if row.get("logprob_fields_nonzero"):
        bad["logprob_fields"] = ("nonzero", "zero (no logprobs asked)")
    return f"aux row differs: {bad}" if bad else None


def conclude_faults(row: dict[str, Any]) -> None:
    """A fault row's verdict from its ``details`` (each ``"ok: ..."`` or ``"FAILED: ..."``)."""
    row["fault_cases_passed"] = sum(v.startswith("ok") for v in row["details"].values())
    row["ok"] = row["fault_cases_passed"] == row["fault_cases"]
    if not row["ok"]:
        failed = [f"{k}: {v}" for k, v in row["details"].items() if not v.startswith("ok")]
        row["error"] = "; ".join(failed)


def listeners(pids: list[int]) -> tuple[int, list[tuple[str, int]]]:
    """(TCP listeners of ``pids``, those not on loopback)."""
    from tests.support import loopback

    found = loopback.tcp_listeners(pids)
    return len(found), loopback.non_loopback(found)


def run_sglang_pair(site: str, page_size: int, n: int, seed: int) -> dict[str, Any]:
    """SGLang prefill node -> SGLang decode node, ``n`` requests in waves of 8."""
    from tests.support.loopback import free_port

    name = f"pd/sglang->sglang/p{page_size}"
    row: dict[str, Any] = {"case": name, "ok": False, "requests": 0, "bytes_compared": 0,
                           "fault_cases": 0, "fault_cases_passed": 0}  # fmt: skip
    port = free_port()
    with recorded_row(row) as stops:
        prefill = SGLangNodeProcess(site, "prefill", node_config(page_size, port))
        stops.append(prefill.stop)
        decode = SGLangNodeProcess(site, "decode", node_config(page_size, port))
        stops.append(decode.stop)
        row["stubs"] = {**prefill.stubs}
        prefill.call("fill", seed=seed)
        decode.call("zero")
        addr = f"127.0.0.1:{port}"
        reqs = plan_requests(n, page_size, seed)
        for w in range(0, len(reqs), 8):
            wave = reqs[w : w + 8]
            for r in wave:
                prefill.call("open", room=r["room"])
                got = decode.call("add", room=r["room"], addr=addr, pages=r["dst"],
                                  aux=r["aux_d"])  # fmt: skip
                if not got["registered"]:
                    raise AssertionError(f"decode could not read {addr}'s parallel info")
            for r in wave:
                st = prefill.wait_status("sender_poll", r["room"], {WAITING}, 20)
                if st["status"] != WAITING:
                    raise AssertionError(f"room {r['room']}: sender never WaitingForInput: {st}")
                prefill.call("send", room=r["room"], pages=r["src"], chunks=r["chunks"],
                             aux=r["aux_p"], output_id=r["output_id"],
                             cached=r["cached"])  # fmt: skip
            for r in wave:
                st = decode.wait_status("poll", r["room"], {SUCCESS}, 30)
                if st["status"] != SUCCESS:
                    raise AssertionError(f"room {r['room']}: decode ended {st}")
                ps = prefill.wait_status("sender_poll", r["room"], {SUCCESS}, 10)
                if ps["status"] != SUCCESS:
                    raise AssertionError(f"room {r['room']}: sender ended {ps}")
                same, nbytes = compare_pages(
                    prefill.call("pages", pages=r["src"])["buffers"],
                    decode.call("pages", pages=r["dst"])["buffers"],
                )
                if not same:
                    raise AssertionError(f"room {r['room']}: received pages differ")
                bad = check_aux(decode.call("aux", aux=r["aux_d"]), r)
                if bad:
                    raise AssertionError(f"room {r['room']}: {bad}")
                row["bytes_compared"] += nbytes
                row["requests"] += 1
                decode.call("clear", room=r["room"])
                decode.call("clear_aux", aux=r["aux_d"])
                prefill.call("clear", room=r["room"])
        row["listeners"], off = listeners([prefill.pid, decode.pid])
        row["ok"] = row["requests"] == len(reqs) and row["requests"] >= n and not off
        if not row["ok"]:
            row["error"] = (f"{row['requests']} of {n} requests planned and passed; listeners "
                            f"off loopback: {off}")  # fmt: skip
    return row


def run_sglang_faults(site: str, seed: int) -> dict[str, Any]:
    """SGLang against SGLang under the faults the project side is put through (the reference
    behaviour, and proof that the harness's faults reach SGLang's code): the sender's bootstrap
    timeout with no decode, decode aborting first (the sender fails, SGLang's ABORT_ACK
    arrives), decode SIGKILLed before the transfer (the sender fails)."""
    from tests.support.loopback import free_port

    row: dict[str, Any] = {"case": "pd/sglang->sglang/faults", "ok": False, "requests": 0,
                           "bytes_compared": 0, "fault_cases": 3, "fault_cases_passed": 0,
                           "details": {}}  # fmt: skip
    port = free_port()
    with recorded_row(row) as stops:
        prefill = SGLangNodeProcess(site, "prefill", node_config(16, port))
        stops.append(prefill.stop)
        decode = SGLangNodeProcess(site, "decode", node_config(16, port))
        stops.append(decode.stop)
        addr = f"127.0.0.1:{port}"
        a, b, c = plan_requests(3, 16, seed)

        prefill.call("open", room=a["room"])  # no decode ever comes
        st = prefill.wait_status("sender_poll", a["room"], {SUCCESS}, 30)
        if st["status"] == FAILED and "Bootstrapping" in st.get("reason", ""):
            row["details"]["bootstrap-timeout"] = f"ok: {st['reason']}"
        else:
            row["details"]["bootstrap-timeout"] = f"FAILED: {st}"

        prefill.call("open", room=b["room"])
        decode.call("add", room=b["room"], addr=addr, pages=b["dst"], aux=b["aux_d"])
        prefill.wait_status("sender_poll", b["room"], {WAITING}, 20)
        decode.call("abort", room=b["room"])
        st = prefill.wait_status("sender_poll", b["room"], {SUCCESS}, 20)
        safe = decode.call("release_safe", room=b["room"])
        deadline = time.monotonic() + 10
        while not safe["safe"] and time.monotonic() < deadline:
            time.sleep(0.05)
            safe = decode.call("release_safe", room=b["room"])
        ok = st["status"] == FAILED and safe["safe"]
        row["details"]["abort-first"] = ("ok: " if ok else "FAILED: ") + f"{st}, ack {safe}"

        prefill.call("open", room=c["room"])
        decode.call("add", room=c["room"], addr=addr, pages=c["dst"], aux=c["aux_d"])
        prefill.wait_status("sender_poll", c["room"], {WAITING}, 20)
        decode.kill()
        prefill.call("send", room=c["room"], pages=c["src"], chunks=c["chunks"],
                     aux=c["aux_p"], output_id=c["output_id"], cached=c["cached"])  # fmt: skip
        st = prefill.wait_status("sender_poll", c["room"], {SUCCESS}, 30)
        ok = st["status"] == FAILED
        row["details"]["kill-before-transfer"] = ("ok: " if ok else "FAILED: ") + str(st)
        conclude_faults(row)
    return row


def skip_reason() -> str | None:
    """Why no row can run here (Mooncake's engine or the loopback shim), or None."""
    from tests.support import loopback

    return loopback.skip_reason("engine")


def run(site: str, requests: int = 40) -> list[dict[str, Any]]:
    """Every PD row of this check (see the module docstring)."""
    from tests.sglang_check import pd_project

    why = skip_reason()
    if why is not None:
        names = [f"pd/sglang->sglang/p{ps}" for ps in (16, 1)] + ["pd/project<->sglang"]
        return [{"case": n, "ok": True, "skipped": why} for n in names]
    rows = [run_sglang_pair(site, ps, requests, seed=11 + ps) for ps in (16, 1)]
    rows.append(run_sglang_faults(site, seed=19))
    return rows + pd_project.run(site, requests)


def main(site: str, out_path: str) -> int:
    """The ``pd-interop`` mode of ``run_pin``: one JSON object with the rows."""
    import json
    import os

    from hicache_prefill.hicache.storage.mooncake import availability
    from tests.sglang_check.pd_node_process import SHORT_TIMEOUTS
    from tests.support import loopback

    if availability.installed():  # this process hosts the project's prefill engine
        loopback.reexec_under_shim()
        loopback.forget_preload()
    # The project's prefill side reads SGLang's variables too: the same short timeouts.
    os.environ.update({**SHORT_TIMEOUTS, "SGLANG_FAILED_SESSION_PROBE_INTERVAL_S": "0.5"})
    os.environ.setdefault("GLOG_minloglevel", "2")
    logging.basicConfig(level=os.environ.get("SGLANG_CHECK_LOG", "WARNING"))
    out: dict[str, Any] = {"mode": "pd-interop"}
    t0 = time.monotonic()
    try:
        out["sglang_version"] = _site_version(site)
        out["pd"] = run(site)
        out["stubs"] = _stub_entries(out["pd"])
    except Exception as e:
        out["fatal"] = f"{type(e).__name__}: {e}"
        out["traceback"] = traceback.format_exc()
    out["seconds"] = round(time.monotonic() - t0, 1)
    with open(out_path, "w", encoding="utf-8") as f:
        json.dump(out, f, indent=1, default=str)
    return 0


def _site_version(site: str) -> str:
    import os

    return os.path.basename(os.path.normpath(site)).removeprefix("sglang-")


def _stub_entries(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The stand-ins of the SGLang node children, in the check's stub-list format."""
    seen: dict[str, str] = {}
    for r in rows:
        seen.update(r.get("stubs", {}))
    return [{"module": f"pd node: {k}", "kind": "stand-in", "reason": v}
            for k, v in sorted(seen.items())]  # fmt: skip
