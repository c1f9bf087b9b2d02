"""Triton kernels, generated as source specialised to their shapes; on CPU they run in the interpreter."""
