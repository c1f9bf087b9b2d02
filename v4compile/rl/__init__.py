"""RL training hooks: log-prob mismatch between rollout engine and trainer, off-policy importance weights,
and a per-tensor precision report between two configurations."""

from .importance import importance_weights
from .mismatch import MismatchReport, logprob_mismatch
from .precision import TensorAgreement, precision_report

__all__ = ["MismatchReport", "TensorAgreement", "importance_weights", "logprob_mismatch", "precision_report"]
