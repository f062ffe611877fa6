"""``python -m bench.trace``: a Mooncake-format trace through the project's tree and tiers."""
