"""SGLang 0.5.23's own prefill-side sender serving this project's decode worker, on loopback.

SGLang's side is :mod:`tests.sglang_check.pd_sglang_node` in ``prefill`` role (its bootstrap
server, ``MooncakeKVManager`` in ``PREFILL`` mode, ``MooncakeKVSender``); the project's side is
its decode worker process (``tests.support.mooncake_decode.DecodeWorker``, the test and
benchmark peer). SGLang's router role is played here: both get the same room and SGLang's
bootstrap address. Every token row the worker received must equal SGLang's prefill pool row, and
the first token the worker read from its metadata row SGLang's output id.
"""

from __future__ import annotations

import time
from typing import Any

from tests.sglang_check import pd_interop
from tests.sglang_check.pd_node_process import SGLangNodeProcess, recorded_row

SUCCESS, WAITING = 4, 2


def _worker(page_size: int) -> Any:
    from hicache_prefill.prefill.disagg.mooncake.layout import KVGeometry
    from tests.sglang_check.pd_node_process import SHORT_TIMEOUTS
    from tests.support.mooncake_decode import DecodeWorker

    g = pd_interop.GEOMETRY
    geometry = KVGeometry("mha", g["layers"], page_size, g["dtype"], head_num=g["heads"],
                          head_dim=g["head_dim"], v_head_dim=g["head_dim"])  # fmt: skip
    return DecodeWorker(geometry, pool_tokens=pd_interop.POOL_TOKENS,
                        env=SHORT_TIMEOUTS).wait_ready()  # fmt: skip


def run_sglang_to_project(site: str, page_size: int, n: int, seed: int) -> dict[str, Any]:
    """SGLang prefill node -> this project's decode worker, ``n`` requests."""
    import base64

    import torch

    from tests.support.loopback import free_port
    from tests.support.mooncake_decode import _tensors

    row: dict[str, Any] = {"case": f"pd/sglang->project/p{page_size}", "ok": False,
                           "requests": 0, "bytes_compared": 0, "fault_cases": 0,
                           "fault_cases_passed": 0}  # fmt: skip
    port = free_port()
    with recorded_row(row) as stops:
        prefill = SGLangNodeProcess(site, "prefill", pd_interop.node_config(page_size, port))
        stops.append(prefill.stop)
        worker = _worker(page_size)
        stops.append(worker.stop)
        prefill.call("fill", seed=seed)
        addr = f"127.0.0.1:{port}"
        layers = pd_interop.GEOMETRY["layers"]
        for r in pd_interop.plan_requests(n, page_size, seed):
            rid = f"s{r['room']}"
            prefill.call("open", room=r["room"])
            worker.call("add", rid=rid, room=r["room"], bootstrap_addr=addr,
                        num_tokens=r["tokens"], decode_prefix_len=0, keep=True, hold=False,
                        delay_s=0.0)  # fmt: skip
            st = prefill.wait_status("sender_poll", r["room"], {WAITING}, 20)
            if st["status"] != WAITING:
                raise AssertionError(f"room {r['room']}: SGLang's sender ended {st}")
            prefill.call("send", room=r["room"], pages=r["src"], chunks=r["chunks"],
                         aux=r["aux_p"], output_id=r["output_id"], cached=r["cached"])  # fmt: skip
            st = prefill.wait_status("sender_poll", r["room"], {SUCCESS}, 30)
            if st["status"] != SUCCESS:
                raise AssertionError(f"room {r['room']}: SGLang's sender ended {st}")
            deadline = time.monotonic() + 30
            while worker.call("state", rid=rid)[0]["state"] not in ("Success", "Failed"):
                if time.monotonic() > deadline:
                    raise AssertionError(f"{rid}: the decode worker never concluded")
                time.sleep(0.01)
            head, payload = worker.call("received_kv", rid=rid)
            got = _tensors(head, payload)  # k, v: [L, n, H, D]
            src = [base64.b64decode(b) for b in prefill.call("pages", pages=r["src"])["buffers"]]
            tokens = r["tokens"]
            for b, buf in enumerate(src):
                kind, layer = divmod(b, layers)
                mine = got[kind][layer].contiguous().view(torch.uint8).numpy().tobytes()
                row_bytes = len(buf) // (len(r["src"]) * page_size)
                if mine != buf[: tokens * row_bytes]:
                    raise AssertionError(f"{rid}: buffer {b} differs from SGLang's prefill pool")
                row["bytes_compared"] += len(mine)
            if head.get("first_token") != r["output_id"]:
                raise AssertionError(f"{rid}: first token {head.get('first_token')} from the "
                                     f"metadata row, SGLang sent {r['output_id']}")  # fmt: skip
            row["requests"] += 1
            worker.call("release", rid=rid)
            prefill.call("clear", room=r["room"])
        row["ok"] = row["requests"] >= n
        if not row["ok"]:
            row["error"] = f"{row['requests']} of {n} requests"
    return row


def run_faults(site: str, seed: int) -> dict[str, Any]:
    """SGLang's sender against this project's decode worker under faults: the worker aborts
    first (SGLang's prefill fails the room and acks the drained abort, which the worker counts
    as an acked release), the worker is SIGKILLed before the transfer (SGLang's sender fails)."""
    from tests.support.loopback import free_port

    row: dict[str, Any] = {"case": "pd/sglang->project/faults", "ok": False, "requests": 0,
                           "bytes_compared": 0, "fault_cases": 2, "fault_cases_passed": 0,
                           "details": {}}  # fmt: skip
    port = free_port()
    with recorded_row(row) as stops:
        prefill = SGLangNodeProcess(site, "prefill", pd_interop.node_config(16, port))
        stops.append(prefill.stop)
        worker = _worker(16)
        stops.append(worker.stop)
        addr = f"127.0.0.1:{port}"
        a, b = pd_interop.plan_requests(2, 16, seed)
        for r in (a, b):
            prefill.call("open", room=r["room"])
            worker.call("add", rid=f"f{r['room']}", room=r["room"], bootstrap_addr=addr,
                        num_tokens=r["tokens"], decode_prefix_len=0, keep=True, hold=False,
                        delay_s=0.0)  # fmt: skip
            prefill.wait_status("sender_poll", r["room"], {WAITING}, 20)

        worker.call("abort", rid=f"f{a['room']}")
        st = prefill.wait_status("sender_poll", a["room"], {SUCCESS}, 20)
        deadline = time.monotonic() + 15
        acked = worker.call("stats")[0].get("acked_releases", 0)
        while acked < 1 and time.monotonic() < deadline:
            time.sleep(0.05)
            acked = worker.call("stats")[0].get("acked_releases", 0)
        ok = st["status"] == 0 and acked >= 1
        row["details"]["decode-aborts-first"] = (
            "ok: " if ok else "FAILED: "
        ) + f"SGLang's sender {st}, acked releases {acked}"

        worker.kill()
        prefill.call("send", room=b["room"], pages=b["src"], chunks=b["chunks"],
                     aux=b["aux_p"], output_id=b["output_id"], cached=b["cached"])  # fmt: skip
        st = prefill.wait_status("sender_poll", b["room"], {SUCCESS}, 30)
        row["details"]["decode-killed-before-transfer"] = (
            "ok: " if st["status"] == 0 else "FAILED: "
        ) + str(st)
        pd_interop.conclude_faults(row)
    return row
