"""What the ``v4compile`` commands share: the console, the model the arguments name, a spinner, and argument
types."""

from __future__ import annotations

import argparse
import sys

from rich.console import Console
from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn


def _console() -> Console:
    """The CLI's console: piped output gets lines wide enough that no table folds or cuts an identifier (so
    ``v4compile passes | grep compressor_fusion`` finds it); a terminal keeps its width."""
    return Console() if sys.stdout.isatty() else Console(width=200)


console = _console()


def model_from_args(args: argparse.Namespace):
    import v4compile

    if getattr(args, "model", None):
        return _model_from_factory(args.model).eval()
    if getattr(args, "checkpoint", None):
        return v4compile.load(args.checkpoint).eval()
    return v4compile.DeepSeekV4(v4compile.V4Config.preset(args.preset), seed=0).eval()


def _model_from_factory(spec: str):
    """The model ``module:factory`` builds (``factory()``, a module-level callable), e.g. a transformers V4."""
    import importlib

    import torch

    module_name, _, attr = spec.partition(":")
    if not module_name or not attr:
        raise ValueError(f"--model expects module:factory (a module-level function building the model), got {spec!r}")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ValueError(f"--model {spec}: cannot import {module_name!r} ({exc})") from None
    factory = getattr(module, attr, None)
    if not callable(factory):
        raise ValueError(f"--model {spec}: module {module_name!r} has no callable {attr!r}")
    model = factory()
    if not isinstance(model, torch.nn.Module):
        raise ValueError(f"--model {spec}: {attr}() returned {type(model).__name__}, not a torch.nn.Module")
    return model


def spinner(message: str) -> Progress:
    progress = Progress(SpinnerColumn(), TextColumn("[progress.description]{task.description}"), TimeElapsedColumn(),
                        console=console, transient=True)
    progress.add_task(message, total=None)
    return progress


def add_model_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_mutually_exclusive_group()
    group.add_argument("--preset", default="tiny", help="model preset with seeded random weights (default tiny)")
    group.add_argument("--checkpoint", help="checkpoint directory (config.json + *.safetensors)")
    group.add_argument("--model", help="module:factory building any model (e.g. a transformers V4); its forward "
                                       "is explained on random ids below config.vocab_size")
    parser.add_argument("--backend", default="auto", help="kernel backend: auto, triton, tilelang, reference")
    parser.add_argument("--entry", choices=["all", "forward", "prefill", "decode"], default="all",
                        help="which entry points to compile (default all)")


def entries(args: argparse.Namespace) -> tuple[str, ...]:
    return ("forward", "prefill", "decode") if args.entry == "all" else (args.entry,)


def positive_int(text: str) -> int:
    """An argparse type: an integer of at least 1."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value
