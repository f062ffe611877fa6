"""SGLang's ``kvcacheio`` ops: their signatures (``kernel_backend``), the Triton-backed binding
(``kvcacheio``) with argument checks (``checks``) and dispatch (``dispatch``), the torch reference
(``reference``) and the direct backend (``direct``)."""
