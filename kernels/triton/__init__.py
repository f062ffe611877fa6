"""The one Triton gather/scatter kernel (``copy_kernel``), how a copy is launched
(``launch``) and the device-side record of bad indices (``index_record``).
"""
