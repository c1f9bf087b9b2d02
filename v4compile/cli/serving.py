"""The serving commands: ``generate`` (prompts through the engine), ``serve`` (an OpenAI-compatible server) and
``serve-bench`` (the multi-turn workload, or clients against a running server)."""

from __future__ import annotations

import argparse
import json
import signal
from dataclasses import asdict
from pathlib import Path

from rich.table import Table

from .common import add_model_arguments, console, model_from_args, positive_int, spinner


def add_commands(sub: argparse._SubParsersAction) -> None:
    """Registers the serving commands."""
    gen = sub.add_parser("generate", help="generate from text or token-id prompts with the engine (prefix cache on)")
    add_model_arguments(gen)
    gen.add_argument("--text", nargs="*", help="text prompts, one argument each (the checkpoint's tokenizer.json; "
                                               "a built-in byte-level tokenizer for a preset)")
    gen.add_argument("--ids", nargs="*", help="prompts: one argument each, ids separated by spaces or commas")
    gen.add_argument("--file", help="a text file with one prompt of token ids per line")
    gen.add_argument("--max-new-tokens", type=positive_int, default=16)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--max-batch", type=positive_int, default=4)
    gen.add_argument("--repeat", type=positive_int, default=1,
                     help="serve the prompts this many times (shows cache hits)")
    gen.add_argument("--no-prefix-cache", action="store_true")
    gen.add_argument("--mtp", action="store_true", help="speculative decoding with the MTP block (greedy)")
    gen.add_argument("--json", action="store_true", help="print outputs, log-probs and cache stats as JSON")
    gen.set_defaults(func=_generate)

    srv = sub.add_parser("serve", help="an OpenAI-compatible HTTP server: /v1/completions and /v1/chat/completions, "
                                       "streaming or not")
    add_model_arguments(srv)
    srv.add_argument("--host", default="127.0.0.1")
    srv.add_argument("--port", type=int, default=8000)
    srv.add_argument("--name", help="the model name clients send (default: the folder's name, or v4compile-PRESET)")
    srv.add_argument("--max-batch", type=positive_int, default=8)
    srv.add_argument("--optimize", action="store_true", help="serve v4compile.optimize(model) (compiles on first use)")
    srv.set_defaults(func=_serve)

    sb = sub.add_parser("serve-bench", help="the multi-turn agentic workload: prefix-cache hit rate and bytes; or, "
                                            "with --server, concurrent clients against a running server")
    add_model_arguments(sb)
    sb.add_argument("--conversations", type=int, default=4)
    sb.add_argument("--turns", type=int, default=4)
    sb.add_argument("--json", action="store_true", help="print the serving report as JSON")
    sb.add_argument("--server", help="drive a running `v4compile serve` at this URL (http://HOST:PORT/v1) with "
                                     "concurrent streaming clients: time to first token, chunk gaps, tokens/s")
    sb.add_argument("--name", help="with --server: the served model name (default v4compile-PRESET)")
    sb.add_argument("--clients", type=positive_int, default=4)
    sb.add_argument("--requests", type=positive_int, default=16)
    sb.add_argument("--max-tokens", type=positive_int, default=64)
    sb.add_argument("--prompt", default="Explain compressed sparse attention in one paragraph.")
    sb.set_defaults(func=_serve_bench)


def _read_prompts(args: argparse.Namespace) -> list[list[int]] | list[str]:
    """Prompts from ``--text`` (one text prompt per argument), ``--ids`` (one prompt per argument, ids separated by
    spaces or commas) or ``--file`` (one prompt of ids per line)."""
    if args.text:
        if args.ids or args.file:
            raise ValueError("give prompts as --text or as --ids / --file, not both")
        return list(args.text)
    lines = list(args.ids or [])
    if args.file:
        lines += [line for line in Path(args.file).read_text().splitlines() if line.strip()]
    if not lines:
        raise ValueError("give prompts with --text, --ids or --file")
    prompts = []
    for n, line in enumerate(lines, start=1):
        try:
            prompts.append([int(t) for t in line.replace(",", " ").split()])
        except ValueError as exc:
            raise ValueError(f"prompt {n}: token ids must be integers ({exc})") from None
    return prompts


def _generate(args: argparse.Namespace) -> int:
    from ..runtime.engine import Engine

    model = model_from_args(args)
    prompts = _read_prompts(args)
    tokenizer = None
    if args.text:
        from ..runtime.text import Tokenizer

        tokenizer = Tokenizer.from_folder(args.checkpoint) if args.checkpoint else Tokenizer.builtin()
    engine = Engine(model, max_batch=args.max_batch, prefix_cache=not args.no_prefix_cache, tokenizer=tokenizer)
    results = []
    for _ in range(args.repeat):
        results = engine.generate(prompts, args.max_new_tokens, temperature=args.temperature, top_p=args.top_p,
                                  seed=args.seed, mtp=args.mtp)
    if args.json:
        print(json.dumps([{"tokens": r.tokens, "text": r.text, "logprobs": r.logprobs, "finish_reason": r.finish_reason,
                           "error": r.error, "cache": vars(r.cache), "mtp_drafted": r.mtp_drafted,
                           "mtp_accepted": r.mtp_accepted} for r in results], indent=1))
        return _generate_status(results)
    table = Table(title="v4compile generate")
    for col in ("#", "prompt", "output text" if tokenizer else "output ids", "cached", "recomputed", "prefilled",
                "status"):
        table.add_column(col, overflow="fold")
    for r, prompt in zip(results, prompts, strict=True):
        shown = repr(r.text) if tokenizer else " ".join(map(str, r.tokens))
        table.add_row(str(r.index), repr(prompt) if tokenizer else f"{len(prompt)} ids", shown,
                      str(r.cache.cached_tokens), str(r.cache.recomputed_tokens), str(r.cache.prefill_tokens),
                      r.error or r.finish_reason)
    console.print(table)
    if engine.store is not None:
        console.print(f"prefix cache: {engine.stats()['tree']}")
    if args.mtp:
        drafted = sum(r.mtp_drafted for r in results)
        console.print(f"MTP drafts accepted: {sum(r.mtp_accepted for r in results)} of {drafted}")
    return _generate_status(results)


def _generate_status(results: list) -> int:
    """The exit status of ``generate``: 1 when every request failed (each one's error is in the output)."""
    if results and all(r.error for r in results):
        console.print(f"[red]error:[/red] every request failed, the first with: {results[0].error}", soft_wrap=True)
        return 1
    return 0


def _serve_bench(args: argparse.Namespace) -> int:
    from ..runtime.engine import Engine
    from ..runtime.workload import Workload, run_workload

    if args.server:
        return _client_bench(args)
    engine = Engine(model_from_args(args), max_batch=args.conversations + 2)
    with spinner("serving the multi-turn workload"):
        report = run_workload(engine, Workload(conversations=args.conversations, turns=args.turns))
    if args.json:
        print(json.dumps({**asdict(report), "hit_rate": report.hit_rate,
                          "baseline_hit_rate": report.baseline_hit_rate}, indent=1))
        return 0
    table = Table(title=f"{report.requests} requests, {report.prompt_tokens} prompt tokens")
    for col in ("cache", "hit rate", "prefill tokens saved", "recomputed (max per hit)", "bytes per cached token"):
        table.add_column(col)
    table.add_row("ShadowRadix", f"{report.hit_rate:.3f}", str(report.cached_tokens),
                  f"{report.recomputed_tokens} ({report.max_recompute_per_hit})",
                  f"{report.bytes_per_token['all']:.0f}")
    table.add_row("baseline (full window KV)", f"{report.baseline_hit_rate:.3f}", str(report.baseline_cached_tokens),
                  "0 (0)", f"{report.baseline_bytes_per_token:.0f}")
    console.print(table)
    console.print("bytes per cached token by pool: "
                  + ", ".join(f"{k} {v:.1f}" for k, v in report.bytes_per_token.items()))
    return 0


def _client_bench(args: argparse.Namespace) -> int:
    from ..runtime.client_bench import drive

    model = args.name or f"v4compile-{args.preset}"
    with spinner(f"{args.requests} streamed requests from {args.clients} clients"):
        report = drive(args.server, model, args.clients, args.requests, args.max_tokens, args.prompt)
    summary = report.summary()
    if args.json:
        print(json.dumps({**summary, "errors": report.errors}, indent=1))
    else:
        table = Table(title=f"{args.server}: {args.clients} clients, {args.requests} requests of {args.max_tokens} "
                            "tokens")
        for key in summary:
            table.add_column(key)
        table.add_row(*(f"{v:.1f}" if isinstance(v, float) else str(v) for v in summary.values()))
        console.print(table)
        for error in report.errors[:3]:
            console.print(f"[red]error:[/red] {error}", soft_wrap=True)
    return 1 if report.failed == report.requests else 0


def _serve(args: argparse.Namespace) -> int:
    import v4compile

    from ..runtime.engine import Engine
    from ..runtime.server import Server
    from ..runtime.text import Tokenizer

    model = model_from_args(args)
    tokenizer = Tokenizer.from_folder(args.checkpoint) if args.checkpoint else Tokenizer.builtin()
    if args.optimize:
        with spinner("optimizing the model"):
            model = v4compile.optimize(model, backend=args.backend)
    name = args.name or (Path(args.checkpoint).name if args.checkpoint else f"v4compile-{args.preset}")
    engine = Engine(model, max_batch=args.max_batch, tokenizer=tokenizer)
    server = Server(engine, name, args.host, args.port)
    _stop_on_signals()
    console.print(f"serving {name!r} at {server.url} (completions, chat completions; Ctrl-C stops)")
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.close()
    return 0


def _stop_on_signals() -> None:
    """Ctrl-C (SIGINT) and SIGTERM stop the server cleanly, also when it was started with SIGINT ignored (a script's
    background job, a test runner's worker): such a process inherits the ignoring, and Python then installs no
    Ctrl-C handler of its own."""
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, signal.default_int_handler)
