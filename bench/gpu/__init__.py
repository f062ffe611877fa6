"""GPU readiness: the probe (``python -m bench.gpu.probe``), its kernels, and the CUDA-path smoke
checks (``python -m bench.gpu.smoke``); ``bench/gpu_check.sh`` runs them first."""
