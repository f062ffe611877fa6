"""``python -m bench.cache_ops``: the radix tree's bookkeeping per op, and SGLang's trees."""
