"""SGLang's ``kvcacheio`` ops: op table, Triton-backed ops, checks, plans, reference, direct."""
