"""The paged model: one rank (``paged``), tensor parallel (``tp``), and ``factory.build_model``."""
