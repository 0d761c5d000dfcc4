"""Evaluation: metrics, benchmarks and plots of a retrofitted model."""
