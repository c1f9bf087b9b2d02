"""The DeepSeek-V4 reference model: plain PyTorch, the single source of truth for the math."""

from .cache import V4Cache
from .config import ConfigError, V4Config
from .routing import ReplayError, Routing
from .transformer import DeepSeekV4, InputError

__all__ = ["ConfigError", "DeepSeekV4", "InputError", "ReplayError", "Routing", "V4Cache", "V4Config"]
