"""How the copy ops address memory: the layouts as plain data, and the pointer tables."""
