"""v4compile: a compiler and runtime for DeepSeek-V4-class models."""

from .model import ConfigError, DeepSeekV4, InputError, V4Cache, V4Config
from .model.checkpoint import CheckpointError, load

__all__ = ["CheckpointError", "ConfigError", "DeepSeekV4", "InputError", "V4Cache", "V4Config", "load"]
