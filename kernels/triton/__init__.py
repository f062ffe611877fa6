"""The one Triton gather/scatter kernel (``copy_kernel``) and how a copy is launched: word, tile,
grid, stream (``launch``)."""
