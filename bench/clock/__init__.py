"""The deterministic (virtual-clock) mode: calibration of forward and copy costs, and what is
charged to the virtual clock."""
