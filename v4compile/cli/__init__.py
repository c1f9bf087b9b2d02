"""The ``v4compile`` command: the demo, the pass-debugging tools, generation and the serving benchmark. Each family
of commands registers its arguments next to its code: :mod:`.compiler` (passes, explain, schedule, dump, kernels,
bisect), :mod:`.serving` (generate, serve, serve-bench), :mod:`.numerics` (check, diverge); :mod:`.common` holds
the console and the model arguments they share."""

from __future__ import annotations

import argparse

from . import compiler, numerics, serving
from .common import console


def _demo(args: argparse.Namespace) -> int:
    from ..demo import run_demo

    return 0 if run_demo(console, prompt_len=args.prompt_len, steps=args.steps, optimized=not args.no_optimize) else 1


def build_parser() -> argparse.ArgumentParser:
    """The argument parser with every subcommand."""
    parser = argparse.ArgumentParser(prog="v4compile", description="Compiler and runtime for DeepSeek-V4-class models.")
    sub = parser.add_subparsers(dest="command", required=True)

    demo = sub.add_parser("demo", help="the tiny preset end to end: prefill, cached decode, optimization report")
    demo.add_argument("--prompt-len", type=int, default=48)
    demo.add_argument("--steps", type=int, default=8)
    demo.add_argument("--no-optimize", action="store_true", help="skip the compiler part")
    demo.set_defaults(func=_demo)

    compiler.add_commands(sub)
    serving.add_commands(sub)
    numerics.add_commands(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``v4compile`` command; bad arguments print a clear error."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command == "check" and not (args.golden or args.checkpoint):
        parser.error("check needs a golden folder")
    try:
        return args.func(args)
    except (ValueError, FileNotFoundError) as exc:
        console.print(f"[red]error:[/red] {exc}")
        return 2
