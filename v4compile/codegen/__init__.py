"""Kernel emitters (Triton, TileLang), the kernel registry and the custom-op bindings."""
