"""The decode worker refuses bad flags before it reports ready: a size that is not positive, a
``--device`` this machine does not have. It exits non-zero and its one message names the flag;
the check runs before Mooncake is imported, so it needs neither Mooncake nor the loopback shim."""

from __future__ import annotations

import os
import subprocess
import sys
from multiprocessing.connection import Connection
from pathlib import Path

import pytest
import torch

from hicache_prefill.prefill.disagg.mooncake.decode_worker import recv_message
from hicache_prefill.prefill.disagg.mooncake.layout import KVGeometry

REPO = Path(__file__).resolve().parents[3]
GEOMETRY = KVGeometry("mha", 2, 16, "float32", 2, 16, 16).to_json()


def _run_worker(*flags: str) -> tuple[int, list[dict], str]:
    path = [str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(path)}
    if "--kv-geometry" not in flags:
        flags = ("--kv-geometry", GEOMETRY, *flags)
    proc = subprocess.Popen(
        [sys.executable, "-m", "hicache_prefill.prefill.disagg.mooncake.decode_worker", *flags],
        cwd=REPO,
        env=env,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    assert proc.stdout is not None
    conn = Connection(os.dup(proc.stdout.fileno()), writable=False)
    messages = []
    try:
        while True:
            messages.append(recv_message(conn)[0])
    except EOFError:
        pass
    finally:
        conn.close()
    _, stderr = proc.communicate(timeout=120)
    return proc.returncode, messages, stderr.decode(errors="replace")


BAD_FLAGS = [
    (("--max-total-tokens", "-5"), "--max-total-tokens"),
    (("--max-total-tokens", "0"), "--max-total-tokens"),
    (("--max-running-requests", "0"), "--max-running-requests"),
    (("--max-running-requests", "-3"), "--max-running-requests"),
    (("--device", "bogus"), "--device"),
    (("--kv-geometry", '{"kind": "mha"}'), "--kv-geometry"),
    (("--kv-geometry", "not json"), "--kv-geometry"),
]
if not torch.cuda.is_available():
    BAD_FLAGS.append((("--device", "cuda"), "--device"))


@pytest.mark.parametrize(("flags", "named"), BAD_FLAGS)
def test_bad_flags_exit_non_zero_naming_the_flag_and_never_ready(flags, named) -> None:
    rc, messages, stderr = _run_worker(*flags)
    assert rc != 0
    assert not any(m.get("ready") for m in messages)
    assert len(messages) == 1 and named in messages[0]["error"]
    assert named in stderr
