"""``SGLangDecodeRouter``: SGLang's router role in front of SGLang's decode receiver, as the
executor's decode side (``DecodeBackend``), and the byte comparison of what it received.

``create_peer`` opens the room on this project's prefill side (``MooncakeBackend``), picks decode
pages and an aux row from the SGLang node's free lists (as ``DecodePreallocQueue`` would), and
hands room, bootstrap address, page ids and aux row to SGLang's ``MooncakeKVReceiver`` in the
child (:mod:`tests.sglang_check.pd_sglang_node`). Each send the executor makes is snapshotted
from the prefill pool as it is handed over (:func:`compare_request` checks SGLang's pool
against it, token row by token row).
"""

from __future__ import annotations

import base64
import random
from typing import Any

from tests.sglang_check.pd_node_process import SGLangNodeProcess
from tests.support.mooncake_decode import PrefillBackendFront


class SGLangDecodeRouter(PrefillBackendFront):
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
