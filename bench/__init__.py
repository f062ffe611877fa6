"""Benchmarks: ``python -m bench`` runs the suite (the README's ``make bench``)."""
