"""The GPU check's prerequisites, checked before any step spends time (``python -m
bench.gpu.probe --out FILE [--cpu]``): Python.h, CUDA torch and a device, triton, a C compiler,
libcuda where Triton finds it, Triton launches reading registered host memory, ``is_pinned()``,
a timed 4 GB ``cudaHostRegister``, host RAM. The first missing one prints ONE line ``gpu_check:
STOP: <cause>`` (exit 3). ``--cpu`` (the dry run): the CUDA checks recorded as skipped."""

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

PAGE = 4096
REGISTER_BYTES = 4 * 10**9
CUDA_ONLY = ("libcuda", "launch on the device", "is_pinned", "4 GB register")


class Stop(Exception):
    """A missing prerequisite; the message is the line the run stops with."""


class Probe:
    def __init__(self, out: Path, cpu: bool) -> None:
        self.out, self.cpu = out, cpu
        self.doc: dict[str, Any] = {"mode": "cpu" if cpu else "cuda", "skipped_cpu": []}

    def ok(self, key: str, value: Any, line: str) -> None:
        self.doc[key] = value
        self.out.write_text(json.dumps(self.doc, indent=2))
        print(f"[probe] ok: {line}", flush=True)

    def run(self) -> None:
        py, inc = sys.version.split()[0], sysconfig.get_paths()["include"]
        if sys.version_info < (3, 10) or not (Path(inc) / "Python.h").exists():
            raise Stop(f"Python >= 3.10 with Python.h is needed (Python {py}, include {inc})")
        self.ok("python", py, f"Python {py}, Python.h")
        torch = self.check_torch()
        if self.cpu:
            os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported
        try:
            import triton
        except Exception as exc:
            raise Stop(f"triton does not import: {exc}") from exc
        self.ok("triton", triton.__version__, f"triton {triton.__version__}")
        cc = os.environ.get("CC") or shutil.which("gcc") or shutil.which("clang")
        if not cc:
            raise Stop("no C compiler ($CC, gcc or clang): Triton builds its launchers with one")
        self.ok("cc", cc, f"C compiler {cc}")
        mods = {m: importlib.util.find_spec(m) is not None for m in ("pytest", "xdist", "numpy")}
        self.ok("modules", mods, ", ".join(f"{m} {'yes' if v else 'NO'}" for m, v in mods.items()))
        if self.cpu:
            self.doc["skipped_cpu"] = list(CUDA_ONLY)
            print(f"[probe] skipped (they need CUDA): {', '.join(CUDA_ONLY)}", flush=True)
        else:
            self.check_driver()
        self.check_kernels(torch)
        if not self.cpu:
            self.time_registration(torch)
        mem = {k: round(_meminfo(k) / 1e9, 1) for k in ("MemTotal", "MemAvailable")}
        self.ok("meminfo_gb", mem, ", ".join(f"{k} {v} GB" for k, v in mem.items()))

    def check_torch(self) -> Any:
        try:
            import torch
        except Exception as exc:
            raise Stop(f"torch does not import with {sys.executable}: {exc}") from exc
        cuda = torch.version.cuda
        build = f"torch {torch.__version__}, {f'CUDA {cuda}' if cuda else 'a CPU-only'} build"
        if not self.cpu and not torch.cuda.is_available():
            why = "see nvidia-smi, CUDA_VISIBLE_DEVICES" if cuda else "set PYTHON= to a CUDA one"
            raise Stop(f"no CUDA device: torch.cuda.is_available() is False ({build}; {why})")
        name = "cpu" if self.cpu else torch.cuda.get_device_name()
        self.ok("torch", {"version": torch.__version__, "device": name}, f"{build}, {name}")
        return torch

    def check_driver(self) -> None:
        try:
            ctypes.CDLL("libcuda.so.1")
        except OSError as exc:
            raise Stop(f"libcuda.so.1 does not load: {exc}") from exc
        try:  # where Triton looks: $TRITON_LIBCUDA_PATH, `/sbin/ldconfig -p`, $LD_LIBRARY_PATH
            listed = subprocess.run(["/sbin/ldconfig", "-p"], capture_output=True, text=True).stdout
        except OSError:
            listed = ""
        dirs = [d for d in os.environ.get("LD_LIBRARY_PATH", "").split(":") if d]
        if not (
            os.environ.get("TRITON_LIBCUDA_PATH")
            or "libcuda.so.1" in listed
            or any(Path(d, "libcuda.so.1").exists() for d in dirs)
        ):
            fix = "run ldconfig or export TRITON_LIBCUDA_PATH=<its folder>"
            raise Stop(f"libcuda.so.1 loads but Triton would not find it: {fix}")
        self.ok("libcuda", True, "libcuda.so.1, where Triton finds it")

    def check_kernels(self, torch: Any) -> None:
        from bench.gpu import probe_kernels as k

        dev = torch.device("cpu" if self.cpu else "cuda")
        src = torch.arange(1000, dtype=torch.int32, device=dev)
        dst = torch.zeros_like(src)
        _kernel("a trivial launch", lambda: k.launch_add_one(src, dst), dst, src + 1, torch)
        self.ok("launch", True, f"trivial Triton launch on {dev}")
        with registered(torch, 4000, self.cpu) as raw:
            host = raw[:4000].view(torch.int32)
            host.copy_(torch.arange(1000, dtype=torch.int32))
            if not self.cpu and not host.is_pinned():
                raise Stop("registered host memory does not report is_pinned()")
            for how in ("tensor", "int64 table", "uint64 table"):
                run = lambda how=how: k.launch_read_host(host, dst, how)
                _kernel(f"reading registered host memory ({how})", run, dst, host + 1, torch)
        line = "kernels read registered host memory (tensor, int64 and uint64 tables)"
        self.ok("registered_reads", True, line + ("" if self.cpu else "; is_pinned() True"))

    def time_registration(self, torch: Any) -> None:
        avail = _meminfo("MemAvailable")
        if avail < REGISTER_BYTES + 4 * 10**9:
            self.doc["register_4gb_s"] = f"skipped: MemAvailable {avail / 1e9:.1f} GB"
            return print(f"[probe] 4 GB registration {self.doc['register_4gb_s']}", flush=True)
        t0 = time.perf_counter()
        with registered(torch, REGISTER_BYTES, False):
            took = time.perf_counter() - t0
        line = f"4 GB malloc + cudaHostRegister in {took:.2f} s"
        self.ok("register_4gb_s", round(took, 2), line)


def _kernel(what: str, launch: Any, got: Any, want: Any, torch: Any) -> None:
    got.zero_()
    try:
        launch()
        if got.is_cuda:
            torch.cuda.synchronize()
    except Exception as exc:
        first = (str(exc).splitlines() or [""])[0]
        raise Stop(f"Triton kernel failed, {what}: {type(exc).__name__}: {first}") from exc
    if not torch.equal(got.cpu(), want.cpu()):
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
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m bench.gpu.probe", description=__doc__.split("\n")[0]
    )
    p.add_argument("--out", type=Path, default=Path("probe.json"))
    p.add_argument("--cpu", action="store_true", help="Dry run: CUDA checks recorded as skipped.")
    args = p.parse_args(argv)
    try:
        Probe(args.out, args.cpu).run()
    except Stop as stop:
        print(f"gpu_check: STOP: {stop}", flush=True)
        return 3
    print("[probe] all prerequisites present", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
