"""The one Triton copy kernel, its launch and the device-side record of bad indices."""
