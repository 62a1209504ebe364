"""Metrics: quality (ROUGE, GSM8K, pass@k), speed (tok/s, speedups, MAT, acceptance, HM), code sandbox."""
