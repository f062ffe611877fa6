"""The CUDA paths end to end: the checks of ``bench/gpu/smoke.py`` under pytest.

On CUDA (marked ``gpu``): kernels reading and writing pinned and ``cudaHostRegister``-ed host
memory, the controller on real streams (and without a host synchronization in ``write`` /
``start_loading``), the model's attention restricted to SDPA's fused kernels, and the executor
with the write-back L2 cache. On CPU the same checks run where they apply, so the checks
themselves stay tested on a machine without a GPU.
"""

from __future__ import annotations

import pytest
import torch

from bench.gpu import smoke as gpu_smoke

CUDA = pytest.param("cuda", marks=pytest.mark.gpu)
DEVICES = ["cpu", CUDA]

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.mark.parametrize("device", DEVICES)
def test_kernels_with_pinned_host(device: str) -> None:
    gpu_smoke.check_kernels_pinned(torch.device(device), registered=False)


@pytest.mark.gpu
def test_kernels_with_registered_host() -> None:
    gpu_smoke.check_kernels_pinned(torch.device("cuda"), registered=True)


@pytest.mark.parametrize("device", DEVICES)
def test_controller_round_trip(device: str) -> None:
    gpu_smoke.check_controller_round_trip(torch.device(device))


@pytest.mark.parametrize("device", DEVICES)
def test_controller_write_and_load_never_synchronize(device: str) -> None:
    gpu_smoke.check_controller_never_syncs(torch.device(device))


@pytest.mark.parametrize("device", DEVICES)
def test_model_attention_runs_on_fused_kernels(device: str) -> None:
    gpu_smoke.check_model_fused_attention(torch.device(device))


@pytest.mark.parametrize("device", DEVICES)
def test_executor_with_write_back_l2(device: str) -> None:
    gpu_smoke.check_executor_l2(torch.device(device))
