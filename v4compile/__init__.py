"""v4compile: a compiler and runtime for DeepSeek-V4-class models."""

import os
import sys

import torch

# Without a GPU, generated Triton kernels run in Triton's interpreter, which must be chosen before
# triton is first imported.
if "triton" not in sys.modules and not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import warnings

from . import logs
from .backend import last_report
from .model import ConfigError, DeepSeekV4, InputError, V4Cache, V4Config
from .model.checkpoint import CheckpointError, load, save
from .optimize import OptimizedModel, optimize

try:
    logs.configure()
except ValueError as _bad:
    warnings.warn(str(_bad), stacklevel=2)

__all__ = ["CheckpointError", "ConfigError", "DeepSeekV4", "InputError", "OptimizedModel", "V4Cache", "V4Config",
           "last_report", "load", "optimize", "save"]
