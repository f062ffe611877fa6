"""How the copy ops address memory: the layouts as plain data (``addressing``) and the per-layer
pointer tables with their verified alignment (``ptr_tables``). Imports nothing else of ours."""
