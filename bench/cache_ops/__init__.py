"""``python -m bench.cache_ops``: the radix tree's bookkeeping per op on a multi-turn trace,
against SGLang's own trees with ``--against-sglang``."""
