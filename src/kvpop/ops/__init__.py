"""Kernels, each beside a pure-PyTorch reference with the same signature."""
