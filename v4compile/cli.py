"""The ``v4compile`` command."""

from __future__ import annotations

import argparse
import sys

from rich.console import Console


def _demo(args: argparse.Namespace) -> int:
    from .demo import run_demo

    return 0 if run_demo(Console(), prompt_len=args.prompt_len, steps=args.steps) else 1


def build_parser() -> argparse.ArgumentParser:
    """The argument parser with every subcommand."""
    parser = argparse.ArgumentParser(prog="v4compile", description="Compiler and runtime for DeepSeek-V4-class models.")
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="run the tiny preset end to end (prefill + cached decode) and summarize")
    demo.add_argument("--prompt-len", type=int, default=48)
    demo.add_argument("--steps", type=int, default=8)
    demo.set_defaults(func=_demo)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``v4compile`` command."""
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
