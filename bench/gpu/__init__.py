"""The GPU check's modules: its plan and headline, the probe, the device tests beside the kernel
precompile, and the measured profile; ``bench/gpu_check.sh`` runs them."""
