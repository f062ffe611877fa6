"""The decode worker refuses bad flags before it reports ready: a size that is not positive, a
``--device`` this machine does not have. It exits non-zero and its one message names the flag;
the check runs before Mooncake is imported, so it needs neither Mooncake nor the loopback shim."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from hicache_prefill.prefill.disagg.mooncake.wire import read_stream

REPO = Path(__file__).resolve().parents[3]


def _run_worker(*flags: str) -> tuple[int, list[dict], str]:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.run(
        [sys.executable, "-m", "hicache_prefill.prefill.disagg.mooncake.decode_worker", *flags],
        cwd=REPO,
        env=env,
        stdin=subprocess.DEVNULL,
        capture_output=True,
        timeout=120,
    )
    messages, out = [], io.BytesIO(proc.stdout)
    while out.tell() < len(proc.stdout):
        messages.append(json.loads(read_stream(out)[0]))
    return proc.returncode, messages, proc.stderr.decode(errors="replace")


BAD_FLAGS = [
    (("--max-total-tokens", "-5"), "--max-total-tokens"),
    (("--max-total-tokens", "0"), "--max-total-tokens"),
    (("--max-running-requests", "0"), "--max-running-requests"),
    (("--max-running-requests", "-3"), "--max-running-requests"),
    (("--device", "bogus"), "--device"),
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
