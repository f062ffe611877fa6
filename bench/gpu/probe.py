"""The GPU check's prerequisites (``python -m bench.gpu.probe --out FILE [--cpu]``): Python.h, CUDA
torch, triton, a C compiler, libcuda, Triton reading registered host memory, a timed 4 GB
``cudaHostRegister``, host RAM. The first missing one prints ONE line ``gpu_check: STOP: <cause>``
(exit 3). ``--cpu`` (the dry run): the CUDA checks recorded as skipped."""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import sysconfig
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

PAGE, REGISTER_BYTES, BLOCK = 4096, 4 * 10**9, 256
CUDA_ONLY = ("libcuda", "launch on the device", "is_pinned", "4 GB register")
tl: Any = None  # triton.language, once the probe found triton (after TRITON_INTERPRET is set)


class Stop(Exception):
    """A missing prerequisite; the message is the line the run stops with."""


def probe(out: Path, cpu: bool) -> None:
    """Each prerequisite in turn, recorded in ``out`` as found; ``Stop`` at the first missing."""
    global tl
    doc: dict[str, Any] = {"mode": "cpu" if cpu else "cuda", "skipped_cpu": []}

    def ok(key: str, value: Any, line: str) -> None:
        doc[key] = value
        out.write_text(json.dumps(doc, indent=2))
        print(f"[probe] ok: {line}", flush=True)

    py, inc = sys.version.split()[0], sysconfig.get_paths()["include"]
    if sys.version_info < (3, 10) or not (Path(inc) / "Python.h").exists():
        raise Stop(f"Python >= 3.10 with Python.h is needed (Python {py}, include {inc})")
    ok("python", py, f"Python {py}, Python.h")
    try:
        import torch
    except Exception as exc:
        raise Stop(f"torch does not import with {sys.executable}: {exc}") from exc
    cuda = torch.version.cuda
    build = f"torch {torch.__version__}, {f'CUDA {cuda}' if cuda else 'a CPU-only'} build"
    if not cpu and not torch.cuda.is_available():
        why = "see nvidia-smi, CUDA_VISIBLE_DEVICES" if cuda else "set PYTHON= to a CUDA one"
        raise Stop(f"no CUDA device: torch.cuda.is_available() is False ({build}; {why})")
    name = "cpu" if cpu else torch.cuda.get_device_name()
    ok("torch", {"version": torch.__version__, "device": name}, f"{build}, {name}")
    if cpu:
        os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported
    try:
        import triton
        import triton.language as tl
    except Exception as exc:
        raise Stop(f"triton does not import: {exc}") from exc
    ok("triton", triton.__version__, f"triton {triton.__version__}")
    if not (cc := os.environ.get("CC") or shutil.which("gcc") or shutil.which("clang")):
        raise Stop("no C compiler ($CC, gcc or clang): Triton builds its launchers with one")
    ok("cc", cc, f"C compiler {cc}")
    mods = {m: importlib.util.find_spec(m) is not None for m in ("pytest", "xdist", "numpy")}
    ok("modules", mods, ", ".join(f"{m} {'yes' if v else 'NO'}" for m, v in mods.items()))
    if cpu:
        doc["skipped_cpu"] = list(CUDA_ONLY)
        print(f"[probe] skipped (they need CUDA): {', '.join(CUDA_ONLY)}", flush=True)
    else:
        check_driver()
        ok("libcuda", True, "libcuda.so.1, where Triton finds it")
    kernel, dev = triton.jit(_add_one), torch.device("cpu" if cpu else "cuda")
    src = torch.arange(1000, dtype=torch.int32, device=dev)
    dst = torch.zeros_like(src)
    check_kernel(kernel, src, dst, "tensor", "a trivial launch")
    ok("launch", True, f"trivial Triton launch on {dev}")
    with registered(torch, 4000, cpu) as raw:
        host = raw[:4000].view(torch.int32)
        host.copy_(torch.arange(1000, dtype=torch.int32))
        if not cpu and not host.is_pinned():
            raise Stop("registered host memory does not report is_pinned()")
        for how in ("tensor", "int64 table", "uint64 table"):
            check_kernel(kernel, host, dst, how, f"reading registered host memory ({how})")
    line = "kernels read registered host memory (tensor, int64 and uint64 tables)"
    ok("registered_reads", True, line + ("" if cpu else "; is_pinned() True"))
    if not cpu and (avail := _meminfo("MemAvailable")) < REGISTER_BYTES + 4 * 10**9:
        doc["register_4gb_s"] = f"skipped: MemAvailable {avail / 1e9:.1f} GB"
        print(f"[probe] 4 GB registration {doc['register_4gb_s']}", flush=True)
    elif not cpu:
        t0 = time.perf_counter()
        with registered(torch, REGISTER_BYTES, False):
            took = time.perf_counter() - t0
        ok("register_4gb_s", round(took, 2), f"4 GB malloc + cudaHostRegister in {took:.2f} s")
    mem = {k: round(_meminfo(k) / 1e9, 1) for k in ("MemTotal", "MemAvailable")}
    ok("meminfo_gb", mem, ", ".join(f"{k} {v} GB" for k, v in mem.items()))


def _add_one(src, dst, n, TABLE: tl.constexpr, BLOCK: tl.constexpr):
    """``dst = src + 1`` (int32), ``src`` read through a pointer table if ``TABLE``; jitted once
    the probe imported triton as ``tl``."""
    if TABLE:
        src = tl.load(src).to(tl.pointer_type(tl.int32))
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    tl.store(dst + offs, tl.load(src + offs, mask=mask) + 1, mask=mask)


def check_driver() -> None:
    """libcuda loads and is where Triton looks: $TRITON_LIBCUDA_PATH, ldconfig, $LD_LIBRARY_PATH."""
    try:
        ctypes.CDLL("libcuda.so.1")
    except OSError as exc:
        raise Stop(f"libcuda.so.1 does not load: {exc}") from exc
    try:
        listed = subprocess.run(["/sbin/ldconfig", "-p"], capture_output=True, text=True).stdout
    except OSError:
        listed = ""
    dirs = [d for d in os.environ.get("LD_LIBRARY_PATH", "").split(":") if d]
    found = "libcuda.so.1" in listed or any(Path(d, "libcuda.so.1").exists() for d in dirs)
    if not (found or os.environ.get("TRITON_LIBCUDA_PATH")):
        fix = "run ldconfig or export TRITON_LIBCUDA_PATH=<its folder>"
        raise Stop(f"libcuda.so.1 loads but Triton would not find it: {fix}")


def check_kernel(kernel: Any, src: Any, dst: Any, how: str, what: str) -> None:
    """``dst = src + 1`` by ``kernel``, ``src`` passed as ``how``: ``tensor``, ``int64 table``
    (SGLang's older pools) or ``uint64 table`` (``kernels.data_ptr_table``, this project's)."""
    import torch

    dst.zero_()
    try:
        ptr = src
        if how == "uint64 table":
            from hicache_prefill import kernels

            ptr = kernels.data_ptr_table([src], dst.device)
        elif how == "int64 table":
            ptr = torch.tensor([src.data_ptr()], dtype=torch.int64, device=dst.device)
        n = dst.numel()
        kernel[(-(-n // BLOCK),)](ptr, dst, n, TABLE=how != "tensor", BLOCK=BLOCK)
        if dst.is_cuda:
            torch.cuda.synchronize()
    except Exception as exc:
        first = (str(exc).splitlines() or [""])[0]
        raise Stop(f"Triton kernel failed, {what}: {type(exc).__name__}: {first}") from exc
    if not torch.equal(dst.cpu(), (src + 1).cpu()):
        raise Stop(f"Triton kernel computed wrong data, {what}")


@contextlib.contextmanager
def registered(torch: Any, nbytes: int, cpu: bool) -> Iterator[Any]:
    """``nbytes`` (whole pages) of page-aligned host memory with a page of slack each side,
    registered with ``cudaHostRegister`` (flags 0, as the host pool) for the block."""
    size = -(-nbytes // PAGE) * PAGE
    owner = torch.empty(size + 2 * PAGE, dtype=torch.uint8)
    view = owner[-owner.data_ptr() % PAGE :][:size]
    rc = 0 if cpu else int(torch.cuda.cudart().cudaHostRegister(view.data_ptr(), size, 0))
    if rc != 0:
        raise Stop(f"cudaHostRegister of {size} bytes failed (cudaError {rc})")
    try:
        yield view
    finally:
        if not cpu:
            torch.cuda.synchronize()
            torch.cuda.cudart().cudaHostUnregister(view.data_ptr())


def _meminfo(field: str) -> int:
    lines = Path("/proc/meminfo").read_text().splitlines()
    return next((int(ln.split()[1]) * 1024 for ln in lines if ln.startswith(field + ":")), 0)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.gpu.probe", description=__doc__)
    p.add_argument("--out", type=Path, default=Path("probe.json"))
    p.add_argument("--cpu", action="store_true", help="Dry run: CUDA checks recorded as skipped.")
    args = p.parse_args(argv)
    try:
        probe(args.out, args.cpu)
    except Stop as stop:
        print(f"gpu_check: STOP: {stop}", flush=True)
        return 3
    print("[probe] all prerequisites present", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
