"""SGLang's ``kvcacheio`` ops: the op table (``kernel_backend``), the Triton-backed ops
(``kvcacheio``) with their checks (``checks``), dispatch (``dispatch``) and plan cache
(``plans``), the torch reference (``reference``) and the direct backend (``direct``).
"""
