"""What a GPU run needs, checked in seconds before any GPU time is spent on tests or benchmarks:
``python -m bench.gpu.probe`` (the first step of ``bench/gpu_check.sh``).

Checks, in order (each prints one ``[probe] ok`` line; the first failure prints ONE line
``gpu_check: STOP: ...`` saying what is missing and how to fix it, and exits 3):

1. torch imports, is a CUDA build, and sees a device (without one nothing else can run);
2. triton imports (and, when kernels would run interpreted, numpy is older than 2.4: numpy 2.4
   breaks Triton 3.6's CPU interpreter);
3. a C compiler (``$CC``, gcc or clang): Triton builds its launcher with it;
4. ``Python.h`` of this interpreter: the launcher includes it;
5. ``libcuda.so.1``: loadable, and where Triton looks for it (``$TRITON_LIBCUDA_PATH``,
   ``ldconfig -p``, ``$LD_LIBRARY_PATH``);
6. the device attributes the kernels rely on, read through the driver API: unified addressing
   and ``CU_DEVICE_ATTRIBUTE_CAN_USE_HOST_POINTER_FOR_REGISTERED_MEM`` (the kernels read and write
   ``cudaHostRegister``-ed host memory through its host pointer);
7. one trivial Triton launch on device memory, then the ways the kvcacheio kernels reach
   registered host memory: a host tensor passed as a kernel argument, and a host address loaded
   from a device pointer table and cast to a pointer, the table int64 and uint64 (the pools'
   tables are ``kernels.data_ptr_table``'s uint64 ones).
"""

from __future__ import annotations

import ctypes
import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path
from typing import Any

CU_DEVICE_ATTRIBUTE_UNIFIED_ADDRESSING = 41
CU_DEVICE_ATTRIBUTE_CAN_USE_HOST_POINTER_FOR_REGISTERED_MEM = 91


class Stop(Exception):
    """A missing prerequisite; the message is the one line the run stops with."""


def ok(what: str) -> None:
    print(f"[probe] ok: {what}", flush=True)


def check_torch() -> Any:
    try:
        import torch
    except Exception as exc:  # ImportError, or a broken install
        raise Stop(f"torch does not import with {sys.executable} ({exc}); install a CUDA build "
                   "of torch, or set PYTHON= to an interpreter that has one") from exc  # fmt: skip
    if torch.version.cuda is None:
        raise Stop(f"torch {torch.__version__} at {sys.executable} is not a CUDA build; "
                   "install a CUDA build of torch (or set PYTHON= to an interpreter that has "
                   "one)")  # fmt: skip
    if not torch.cuda.is_available():
        raise Stop(f"torch {torch.__version__} (CUDA {torch.version.cuda}) sees no CUDA device; "
                   "check the driver (nvidia-smi) and CUDA_VISIBLE_DEVICES")  # fmt: skip
    ok(f"torch {torch.__version__}, CUDA {torch.version.cuda}, "
       f"{torch.cuda.get_device_name()} ({torch.cuda.device_count()} device(s))")  # fmt: skip
    return torch


def check_triton() -> Any:
    try:
        import triton
    except Exception as exc:
        raise Stop(f"triton does not import ({exc}); pip install triton (the version torch "
                   "pins)") from exc  # fmt: skip
    from kernels._env import version_tuple  # after triton imported: ``kernels`` imports it

    interpret = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
    try:
        import numpy

        np_version = numpy.__version__
    except ImportError:
        np_version = None
    if (interpret and np_version and version_tuple(triton.__version__) == (3, 6)
            and version_tuple(np_version) >= (2, 4)):  # fmt: skip
        raise Stop(f"TRITON_INTERPRET=1 with triton {triton.__version__} and numpy {np_version}: "
                   "numpy 2.4 breaks Triton 3.6's interpreter; pip install 'numpy<2.4' or unset "
                   "TRITON_INTERPRET")  # fmt: skip
    ok(f"triton {triton.__version__} (interpreter {'on' if interpret else 'off'}), "
       f"numpy {np_version}")  # fmt: skip
    return triton


def check_compiler() -> None:
    cc = os.environ.get("CC") or shutil.which("gcc") or shutil.which("clang")
    if not cc or not (Path(cc).exists() or shutil.which(cc)):
        raise Stop("no C compiler ($CC, gcc or clang): Triton builds its launcher with one; "
                   "apt-get install gcc")  # fmt: skip
    ok(f"C compiler {cc}")


def check_python_h() -> None:
    include = sysconfig.get_paths()["include"]
    if not (Path(include) / "Python.h").exists():
        minor = f"{sys.version_info.major}.{sys.version_info.minor}"
        raise Stop(f"Python.h not in {include}: Triton's launcher includes it; apt-get install "
                   f"python{minor}-dev (or the -dev package of this interpreter)")  # fmt: skip
    ok(f"Python.h in {include}")


def _libcuda_dirs() -> list[str]:
    if os.environ.get("TRITON_LIBCUDA_PATH"):
        return [os.environ["TRITON_LIBCUDA_PATH"]]
    dirs: list[str] = []
    try:
        out = subprocess.run(["/sbin/ldconfig", "-p"], capture_output=True, text=True,
                             timeout=20).stdout  # fmt: skip
        dirs = [str(Path(ln.split()[-1]).parent) for ln in out.splitlines() if "libcuda.so.1" in ln]
    except (OSError, subprocess.SubprocessError):
        pass
    if not dirs:
        dirs = [d for d in os.environ.get("LD_LIBRARY_PATH", "").split(":")
                if d and (Path(d) / "libcuda.so.1").exists()]  # fmt: skip
    return dirs


def check_libcuda() -> ctypes.CDLL:
    try:
        lib = ctypes.CDLL("libcuda.so.1")
    except OSError as exc:
        raise Stop(f"libcuda.so.1 does not load ({exc}): the NVIDIA driver's user-space library "
                   "is missing from this container") from exc  # fmt: skip
    dirs = _libcuda_dirs()
    if not dirs:
        raise Stop("libcuda.so.1 loads but Triton cannot find it (not in `ldconfig -p` nor "
                   "$LD_LIBRARY_PATH): run ldconfig, or export TRITON_LIBCUDA_PATH=<its "
                   "folder>")  # fmt: skip
    ok(f"libcuda.so.1 in {dirs[0]}")
    return lib


def check_device_attributes(lib: ctypes.CDLL, device_index: int) -> None:
    def call(name: str, *args: Any) -> None:
        rc = getattr(lib, name)(*args)
        if rc != 0:
            raise Stop(f"driver call {name} failed with CUresult {rc}")

    call("cuInit", 0)
    dev = ctypes.c_int()
    call("cuDeviceGet", ctypes.byref(dev), device_index)
    values = {}
    for name, attr in (("unified addressing", CU_DEVICE_ATTRIBUTE_UNIFIED_ADDRESSING),
                       ("host pointer for registered memory",
                        CU_DEVICE_ATTRIBUTE_CAN_USE_HOST_POINTER_FOR_REGISTERED_MEM)):  # fmt: skip
        value = ctypes.c_int()
        call("cuDeviceGetAttribute", ctypes.byref(value), attr, dev)
        values[name] = value.value
    missing = [k for k, v in values.items() if v != 1]
    if missing:
        raise Stop(f"device {device_index} lacks {', '.join(missing)} (attributes {values}): the "
                   "kvcacheio kernels address registered host memory through host pointers, "
                   "which this device cannot do")  # fmt: skip
    ok(f"device {device_index}: unified addressing, can use host pointers for registered memory")


def check_triton_launches(torch: Any) -> None:
    from bench.gpu import probe_kernels as k

    dev = torch.device("cuda")
    n = 1000
    src = torch.arange(n, dtype=torch.int32, device=dev)
    dst = torch.zeros_like(src)
    try:
        k.launch_add_one(src, dst)
        torch.cuda.synchronize()
    except Exception as exc:
        raise Stop(f"a trivial Triton kernel does not compile or launch: {type(exc).__name__}: "
                   f"{str(exc).splitlines()[0] if str(exc) else ''}") from exc  # fmt: skip
    if not torch.equal(dst.cpu(), torch.arange(1, n + 1, dtype=torch.int32)):
        raise Stop("a trivial Triton kernel launched but computed the wrong result")
    ok("trivial Triton launch on device memory")

    host = torch.arange(n, dtype=torch.int32)
    cudart = torch.cuda.cudart()
    rc = int(cudart.cudaHostRegister(host.data_ptr(), host.numel() * host.element_size(), 0))
    if rc != 0:
        raise Stop(f"cudaHostRegister of 4 KB failed with cudaError {rc}: the host pool pins "
                   "its buffers this way")  # fmt: skip
    try:
        for how in ("tensor", "int64 table", "uint64 table"):
            dst.zero_()
            try:
                k.launch_read_host(host, dst, how)
                torch.cuda.synchronize()
            except Exception as exc:
                raise Stop(f"a Triton kernel cannot read registered host memory passed as a "
                           f"{how}: {type(exc).__name__}: "
                           f"{str(exc).splitlines()[0] if str(exc) else ''}") from exc  # fmt: skip
            if not torch.equal(dst.cpu(), host + 1):
                raise Stop(f"a Triton kernel read registered host memory ({how}) but got wrong "
                           "data")  # fmt: skip
    finally:
        torch.cuda.synchronize()
        cudart.cudaHostUnregister(host.data_ptr())
    ok("Triton kernels read registered host memory (host tensor argument, int64 and uint64 "
       "pointer tables)")


def main() -> int:
    try:
        torch = check_torch()
        check_triton()
        check_compiler()
        check_python_h()
        lib = check_libcuda()
        check_device_attributes(lib, torch.cuda.current_device())
        check_triton_launches(torch)
    except Stop as stop:
        print(f"gpu_check: STOP: {stop}", flush=True)
        return 3
    print("[probe] all prerequisites present", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
