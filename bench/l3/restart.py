"""``python -m bench.l3.restart --args ARGS.json --prompts PROMPTS.json --out OUT.json``: a fresh
process over an L3 directory (``file_storage_path`` in the args' extra config) submits each
prompt once, one at a time, on wall time, and writes per-request TTFT and the tokens each took
from the device, the host and storage. The benchmark runs it twice: over the directory the
multi-turn run's L2+L3 row filled (warm restart), and over an empty one (cold)."""

from __future__ import annotations

import argparse
import json
import sys

from bench.e2e.setup import release_executor
from prefill.disagg.sim_config import PeerConfig
from prefill.testing.harness import make_executor
from server_args import ServerArgs


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.l3.restart", description=__doc__)
    p.add_argument("--args", required=True)
    p.add_argument("--prompts", required=True)
    p.add_argument("--out", required=True)
    opts = p.parse_args(argv)
    with open(opts.args, encoding="utf-8") as f:
        args = ServerArgs(**json.load(f))
    with open(opts.prompts, encoding="utf-8") as f:
        prompts = json.load(f)
    from prefill.clock import WallClock

    ex = make_executor(args, peer_config=PeerConfig(), clock=WallClock(), keep_received=False)
    rows = []
    for i, prompt in enumerate(prompts):
        ex.submit(f"p{i}", prompt)
        ex.run_until_idle()
        r = ex.pop_results()[0]
        rows.append({"ttft_s": r.ttft, "tokens": r.num_tokens, "device": r.cached_device_tokens,
                     "host": r.cached_host_tokens, "storage": r.cached_storage_tokens,
                     "ok": r.outcome.value == "success"})  # fmt: skip
    ex.drain_cache_events()
    stats = ex.cache.storage.stats.as_dict()
    release_executor(ex)
    with open(opts.out, "w", encoding="utf-8") as f:
        json.dump({"requests": rows, "storage": stats}, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
