"""The receiving end of ``bench.pd.engine_rate``: ``python -m bench.pd.receiver BYTES``.

One Mooncake engine (host 127.0.0.1; start it under the loopback shim) with one registered,
zero-filled buffer of ``BYTES``. Prints ``{"session", "ptr", "size", "pid"}`` as its first
stdout line, then answers JSON lines on stdin: ``{"op": "digest", "items": [[offset, length],
...]}`` gives the sha256 of those ranges of the buffer, concatenated (``{"digest": hex}``);
``{"op": "quit"}`` (or the end of stdin) ends it.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys

import numpy as np

from hicache.mooncake.loopback import require_loopback_engines
from prefill.disagg.mooncake.engine import KVTransferEngine


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    size = int(argv[0])
    require_loopback_engines("127.0.0.1")
    engine = KVTransferEngine("127.0.0.1")
    buf = np.zeros(size, dtype=np.uint8)  # zero-filled: every page is touched before timing
    engine.register([(buf.ctypes.data, buf.nbytes)])
    out = {"session": engine.session_id, "ptr": buf.ctypes.data, "size": size, "pid": os.getpid()}
    print(json.dumps(out), flush=True)
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd.get("op") == "digest":
            h = hashlib.sha256()
            for off, n in cmd["items"]:
                h.update(buf[off : off + n].tobytes())
            print(json.dumps({"digest": h.hexdigest()}), flush=True)
        else:
            break
    engine.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
