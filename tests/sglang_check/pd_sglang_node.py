"""One SGLang 0.5.23 PD node in a child process: its own Mooncake connector, driven by JSON lines.

``python -m tests.sglang_check.pd_sglang_node --site DIR --role decode|prefill --config JSON``

The node is SGLang's code: ``MooncakeKVManager`` in ``DisaggregationMode.DECODE`` with
``MooncakeKVReceiver`` (decode), or in ``PREFILL`` with ``MooncakeKVSender`` behind SGLang's own
bootstrap server (``start_disagg_service``: ``MooncakeKVBootstrapServer``) (prefill); its KV pool
is SGLang's ``MHATokenToKVPool`` / ``MLATokenToKVPool`` on the CPU, its auxiliary rows SGLang's
``MetadataBuffers``, its engine SGLang's ``MooncakeTransferEngine`` over TCP on 127.0.0.1.
What stands in for SGLang's scheduler is in :data:`STUBS` (each with its reason). Commands arrive
one JSON object a line on stdin; each gets one JSON reply line on the original stdout (SGLang's
own prints go to stderr). The parent stops this process by the pid it recorded.
"""

from __future__ import annotations

import argparse
import base64
import json
import os
import sys
import time
import traceback
from typing import Any

STUBS: dict[str, str] = {
    "scheduler": "SGLang's Scheduler / DecodePreallocQueue / PrefillBootstrapQueue need a model "
    "runner and a GPU; this node makes the calls they make on the connector in their order "
    "(try_ensure_parallel_info, receiver.init(0), send_metadata(page ids, aux row), poll "
    "through SGLang's _apply_metadata_gate; sender poll, init(num_pages, aux), send(chunk))",
    "server_args": "SGLang's ServerArgs built by RuntimeContext.override_server_args (its own "
    "test seam: disaggregation mode, backend mooncake, bootstrap port, host 127.0.0.1, page "
    "size) and published with runtime_context.publish(ranks=SpawnRanks(world_rank=0)) as a "
    "launcher does for rank 0",
    "torchvision": "SGLang's import chain reaches torchvision through VLM configs; PyPI's wheel "
    "is the CUDA build, so the names are stubbed as in the real-stack mode (never called)",
    "tp_group": "TP/DP/PP/CP of 1: SGLang's published defaults, no torch.distributed group; the "
    "all-reduce of polls over one rank is the identity",
    "pp_group": "no torch.distributed groups are built; the prefill manager stores "
    "get_parallel().pp_group and uses it only with PP > 1 (PPConsensusStore): set to None",
    "aux_row": "the prefill node writes output id, cached tokens and bootstrap room into its "
    "MetadataBuffers row as MetadataBuffers.set_buf does for a finished Req (no Req object)",
}


def _emit(out: Any, obj: dict[str, Any]) -> None:
    out.write(json.dumps(obj) + "\n")
    out.flush()


class Node:
    """SGLang's connector for one role, plus the pool and metadata rows it transfers."""

    def __init__(self, site: str, role: str, cfg: dict[str, Any]) -> None:
        sys.path.insert(0, site)
        from tests.sglang_check import real_stack

        real_stack._setup(site)
        import torch
        from sglang.srt.disaggregation.base.conn import KVArgs
        from sglang.srt.disaggregation.utils import (
            DisaggregationMode,
            MetadataBuffers,
            get_kv_transfer_buf_infos,
            setup_state_kv_args,
        )
        from sglang.srt.distributed.device_communicators import mooncake_transfer_engine as mte
        from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, MLATokenToKVPool
        from sglang.srt.runtime_context import SpawnRanks, get_context, publish

        self.role, self.cfg = role, cfg
        self.page_size = int(cfg["page_size"])
        fields = dict(
            disaggregation_mode=role,
            disaggregation_transfer_backend="mooncake",
            disaggregation_bootstrap_port=int(cfg.get("bootstrap_port", 8998)),
            host="127.0.0.1",
            page_size=self.page_size,
        )
        self._override = get_context().override_server_args(**fields)
        server_args = self._override.install()
        publish(server_args, role="test", ranks=SpawnRanks(world_rank=0, gpu_id=0))
        self.server_args = server_args
        # SGLang's prefill manager keeps the PP group handle; it reads it only with PP > 1.
        get_context().parallel.override_permanently(pp_group=None)
        common = dict(size=int(cfg["tokens"]), page_size=self.page_size,
                      dtype=getattr(torch, cfg.get("dtype", "bfloat16")),
                      layer_num=int(cfg["layers"]), device="cpu",
                      enable_memory_saver=False)  # fmt: skip
        self.is_mla = cfg["kind"] == "MLA"
        if self.is_mla:
            self.pool = MLATokenToKVPool(kv_lora_rank=int(cfg["kv_lora_rank"]),
                                         qk_rope_head_dim=int(cfg["qk_rope_head_dim"]),
                                         **common)  # fmt: skip
        else:
            self.pool = MHATokenToKVPool(
                head_num=int(cfg["heads"]), head_dim=int(cfg["head_dim"]), **common
            )
        self.meta = MetadataBuffers(int(cfg["aux_rows"]), hidden_size=int(cfg["hidden_size"]),
                                    hidden_states_dtype=torch.float32,
                                    max_sampling_mask_tokens=16)  # fmt: skip
        self.engine = mte.init_mooncake_transfer_engine(hostname="127.0.0.1", gpu_id=0)
        args = KVArgs()
        args.engine_rank = 0
        args.pp_rank = 0
        args.system_dp_rank = 0
        # What a server started with the default --kv-cache-dtype auto reports (an unquantized
        # pool); the decode side refuses a prefill whose string differs.
        args.kv_cache_dtype_str = cfg.get("kv_cache_dtype", "auto")
        args.kv_layout = None
        args.kv_data_ptrs, args.kv_data_lens, args.kv_item_lens = get_kv_transfer_buf_infos(
            self.pool
        )
        args.num_draft_entries = 0
        args.kv_layer_ids = []
        args.page_size = self.page_size
        args.aux_data_ptrs, args.aux_data_lens, args.aux_item_lens = self.meta.get_buf_infos()
        setup_state_kv_args(args, self.pool, None, total_kv_layers=int(cfg["layers"]))
        if role == "prefill":  # as the prefill scheduler's _init_kv_manager sets them
            args.rust_http_port = None
            args.prefill_start_layer = self.pool.start_layer
            args.prefill_end_layer = getattr(self.pool, "end_layer", None)
            if not self.is_mla:
                args.kv_head_num = self.pool.head_num
                args.total_kv_head_num = self.pool.head_num
        args.ib_device = None
        args.gpu_id = 0
        self.kv_args = args
        mode = DisaggregationMode.DECODE if role == "decode" else DisaggregationMode.PREFILL
        self.bootstrap_server = None
        if role == "prefill":
            from sglang.srt.managers.disagg_service import start_disagg_service

            self.bootstrap_server = start_disagg_service()
            self._wait_bootstrap_listening(int(fields["disaggregation_bootstrap_port"]))
        from sglang.srt.disaggregation.mooncake.conn import (
            MooncakeKVManager,
            MooncakeKVReceiver,
            MooncakeKVSender,
        )

        self.receiver_cls, self.sender_cls = MooncakeKVReceiver, MooncakeKVSender
        self.mgr = MooncakeKVManager(args, mode, server_args, self.is_mla)
        self.peers: dict[int, dict[str, Any]] = {}

    @staticmethod
    def _wait_bootstrap_listening(port: int) -> None:
        import socket

        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            with socket.socket() as s:
                if s.connect_ex(("127.0.0.1", port)) == 0:
                    return
            time.sleep(0.05)
        raise RuntimeError(f"SGLang's bootstrap server did not listen on 127.0.0.1:{port}")

    # --- the pool, as bytes per page -------------------------------------------------------

    def _buffers(self) -> list[Any]:
        if self.is_mla:
            return list(self.pool.kv_buffer)
        return [*self.pool.k_buffer, *self.pool.v_buffer]

    def page_bytes(self, pages: list[int]) -> list[str]:
        """Base64 of each buffer's rows for ``pages`` (K layers then V layers; MLA: one per
        layer), rows of a page contiguous, pages in the given order."""
        import torch

        ps = self.page_size
        idx = torch.tensor([p * ps + i for p in pages for i in range(ps)], dtype=torch.int64)
        out = []
        for buf in self._buffers():
            rows = buf.index_select(0, idx).contiguous()
            out.append(base64.b64encode(rows.view(torch.uint8).numpy().tobytes()).decode())
        return out

    def fill(self, seed: int) -> None:
        """Every pool buffer filled with seeded random bytes (page 0 included)."""
        import torch

        g = torch.Generator().manual_seed(seed)
        for buf in self._buffers():
            flat = buf.view(torch.uint8).view(-1)
            flat.copy_(torch.randint(0, 256, flat.shape, dtype=torch.uint8, generator=g))

    def fill_const(self, value: int) -> None:
        import torch

        for buf in self._buffers():
            buf.view(torch.uint8).fill_(value)

    def untouched(self, value: int, exclude: list[int]) -> dict[str, int]:
        """Pages (page 0 and ``exclude`` left out) whose every byte in every buffer still is
        ``value``, and those where some byte is not."""
        import torch

        ps = self.page_size
        pages = int(self.cfg["tokens"]) // ps
        skip = set(exclude) | {0}
        clean = dirty = 0
        bufs = [b.view(torch.uint8).view(b.shape[0], -1) for b in self._buffers()]
        for p in range(pages):
            if p in skip:
                continue
            if all(bool((b[p * ps : (p + 1) * ps] == value).all()) for b in bufs):
                clean += 1
            else:
                dirty += 1
        return {"clean": clean, "dirty": dirty}

    def zero(self) -> None:
        for buf in self._buffers():
            buf.zero_()

    # --- the aux row --------------------------------------------------------------------------

    def aux_row(self, idx: int) -> dict[str, Any]:
        m = self.meta
        row = m.get_buf(idx)
        nonzero_logprob = any(bool(t.count_nonzero()) for t in row[2:6] if t is not None)
        return {
            "output_id": int(row[0][0]),
            "cached_tokens": [int(x) for x in row[1][:4]],
            "bootstrap_room": int(row[-1][0]),
            "logprob_fields_nonzero": nonzero_logprob,
            "hidden_nonzero": bool(row[11].count_nonzero()),
        }

    def set_aux(self, idx: int, output_id: int, cached: list[int], room: int) -> None:
        m = self.meta
        m.output_ids[idx][0] = output_id
        for i, c in enumerate(cached[:4]):
            m.cached_tokens[idx][i] = c
        m.bootstrap_room[idx, 0] = room

    # --- decode ---------------------------------------------------------------------------------

    def prepare(self, room: int, addr: str) -> dict:
        """DecodePreallocQueue's first steps: the prefill's parallel info (GET /route), a
        receiver, ``init(0)`` (REGISTER once per prefill rank)."""
        if not self.mgr.try_ensure_parallel_info(addr):
            return {"registered": False, "status": 0}
        rcv = self.receiver_cls(self.mgr, addr, room)
        rcv.init(0)
        self.peers[room] = {"receiver": rcv, "aux": None, "pages": None}
        return {"registered": True, "status": int(rcv.poll())}

    def send_meta(self, room: int, pages: list[int], aux: int, prefix: int) -> dict:
        """``_send_kv_metadata``: the decode page ids (int32) and the aux row (META)."""
        import numpy as np

        peer = self.peers[room]
        peer["aux"], peer["pages"] = aux, pages
        peer["receiver"].send_metadata(np.asarray(pages, dtype=np.int32), aux, None, prefix)
        return {"status": int(peer["receiver"].poll())}

    def add(self, room: int, addr: str, pages: list[int], aux: int, prefix: int) -> dict:
        out = self.prepare(room, addr)
        if out["registered"]:
            out["status"] = self.send_meta(room, pages, aux, prefix)["status"]
        return out

    def poll(self, room: int) -> dict:
        from types import SimpleNamespace

        from sglang.srt.disaggregation.utils import _apply_metadata_gate

        p = self.peers[room]
        rcv = p["receiver"]
        polls = [int(rcv.poll())]
        dr = SimpleNamespace(
            req=SimpleNamespace(bootstrap_host="127.0.0.1", bootstrap_room=room),
            metadata_buffer_index=p["aux"],
        )
        _apply_metadata_gate(polls, [dr], self.meta)
        out: dict[str, Any] = {"status": polls[0]}
        if polls[0] == 0:
            out["reason"] = self.mgr.failure_records.get(room, "")
        return out

    # --- prefill --------------------------------------------------------------------------------

    def open_sender(self, room: int) -> dict:
        addr = f"127.0.0.1:{self.cfg.get('bootstrap_port', 8998)}"
        snd = self.sender_cls(self.mgr, addr, room)
        self.peers[room] = {"sender": snd}
        return {"status": int(snd.poll())}

    def sender_poll(self, room: int) -> dict:
        snd = self.peers[room]["sender"]
        st = int(snd.poll())
        out: dict[str, Any] = {"status": st}
        if st == 0:
            out["reason"] = self.mgr.failure_records.get(room, "")
        return out

    def send(self, room: int, pages: list[int], chunks: list[int], aux: int,
             output_id: int, cached: list[int]) -> dict:  # fmt: skip
        import numpy as np

        snd = self.peers[room]["sender"]
        prefix = snd.pop_decode_prefix_len()
        snd.init(len(pages), aux)
        self.set_aux(aux, output_id, cached, room)
        start = 0
        for n in chunks:
            snd.send(np.asarray(pages[start : start + n], dtype=np.int32))
            start += n
        return {"decode_prefix_len": prefix, "status": int(snd.poll())}

    def handle(self, cmd: dict[str, Any]) -> dict[str, Any]:
        op = cmd["op"]
        room = cmd.get("room")
        if op == "info":
            return {"pid": os.getpid(), "session": self.engine.get_session_id(),
                    "rank_port": self.mgr.rank_port, "item_lens": self.kv_args.kv_item_lens,
                    "aux_item_lens": self.kv_args.aux_item_lens}  # fmt: skip
        if op == "fill":
            self.fill(int(cmd["seed"]))
            return {}
        if op == "zero":
            self.zero()
            return {}
        if op == "fill_const":
            self.fill_const(int(cmd["value"]))
            return {}
        if op == "untouched":
            return {"pages": self.untouched(int(cmd["value"]), cmd["exclude"])}
        if op == "pages":
            return {"buffers": self.page_bytes(cmd["pages"])}
        if op == "aux":
            return self.aux_row(int(cmd["aux"]))
        if op == "clear_aux":
            self.meta.clear_slot(int(cmd["aux"]))
            return {}
        if op == "add":
            return self.add(room, cmd["addr"], cmd["pages"], int(cmd["aux"]),
                            int(cmd.get("prefix", 0)))  # fmt: skip
        if op == "prepare":
            return self.prepare(room, cmd["addr"])
        if op == "send_meta":
            return self.send_meta(room, cmd["pages"], int(cmd["aux"]), int(cmd.get("prefix", 0)))
        if op == "release_safe":
            return {"safe": bool(self.mgr.is_abort_release_safe(room, 1)),
                    "armed": room in self.mgr._deferred_abort_ack_tracker}  # fmt: skip
        if op == "poll":
            return self.poll(room)
        if op == "abort":
            self.peers[room]["receiver" if self.role == "decode" else "sender"].abort()
            return {}
        if op == "clear":
            peer = self.peers.pop(room)
            peer["receiver" if self.role == "decode" else "sender"].clear()
            return {}
        if op == "open":
            return self.open_sender(room)
        if op == "sender_poll":
            return self.sender_poll(room)
        if op == "send":
            return self.send(room, cmd["pages"], cmd["chunks"], int(cmd["aux"]),
                             int(cmd["output_id"]), cmd["cached"])  # fmt: skip
        if op == "health":  # the decode's heartbeat view of each prefill it knows
            return {"known": sorted(self.mgr.prefill_info_table),
                    "failures": dict(self.mgr.heartbeat_failures)}  # fmt: skip
        if op == "status_table":
            return {"rooms": {str(k): int(v) for k, v in self.mgr.request_status.items()}}
        raise ValueError(f"op: unknown command {op!r}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--site", required=True)
    parser.add_argument("--role", choices=("decode", "prefill"), required=True)
    parser.add_argument("--config", required=True)
    args = parser.parse_args(argv)
    reply = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)  # SGLang's own prints never reach the reply stream
    sys.stdout = sys.stderr
    try:
        node = Node(args.site, args.role, json.loads(args.config))
    except Exception as e:
        _emit(reply, {"ok": False, "error": f"{type(e).__name__}: {e}",
                      "traceback": traceback.format_exc()})  # fmt: skip
        return 1
    _emit(reply, {"ok": True, "pid": os.getpid(), "stubs": STUBS})
    for line in sys.stdin:
        if not line.strip():
            continue
        cmd = json.loads(line)
        if cmd.get("op") == "quit":
            _emit(reply, {"ok": True})
            break
        try:
            _emit(reply, {"ok": True, **node.handle(cmd)})
        except Exception as e:
            _emit(reply, {"ok": False, "error": f"{type(e).__name__}: {e}",
                          "traceback": traceback.format_exc()})  # fmt: skip
    reply.flush()
    os._exit(0)  # SGLang's daemon threads and the engine need no orderly exit


if __name__ == "__main__":
    sys.exit(main())
