"""Prepare in parallel, time alone: each job compiles in a process of its own while the others compile, then
the jobs time one after another so no compiler competes with a measurement for the host or the GPU."""

from __future__ import annotations

import json
import multiprocessing
import queue
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

Job = dict[str, Any]
"""A job's labels (e.g. variant and phase); they head its rows and its error row."""


def run_prepared(target: Callable[..., None], args: Any, jobs: list[Job], prepare_s: float,
                 on_row: Callable[[list[dict[str, Any]]], None] | None = None) -> list[dict[str, Any]]:
    """Runs ``target(args, job, ready, go, results)`` in a spawned process per job. ``target`` prepares,
    sets ``ready``, waits for ``go``, puts its rows on ``results`` and finally ``{"done": True}``. A job not
    ready within ``prepare_s`` of the start, or silent for ``prepare_s`` while timing, gets an error row.
    ``on_row`` sees the rows so far after each new one (to save partial results)."""
    ctx = multiprocessing.get_context("spawn")
    results = ctx.Queue()
    procs = []
    for job in jobs:
        ready, go = ctx.Event(), ctx.Event()
        proc = ctx.Process(target=target, args=(args, job, ready, go, results), daemon=True)
        proc.start()
        procs.append((job, proc, ready, go))
    deadline = time.monotonic() + prepare_s
    rows: list[dict[str, Any]] = []
    for job, proc, ready, go in procs:
        if not ready.wait(max(0.0, deadline - time.monotonic())):
            proc.kill()
            rows.append({**job, "error": f"not prepared within {prepare_s:.0f} s"})
            continue
        go.set()
        while True:
            try:
                row = results.get(timeout=prepare_s)
            except queue.Empty:
                rows.append({**job, "error": "no result within the time allowed"})
                proc.kill()
                break
            if row.get("done"):
                break
            rows.append(row)
            print(json.dumps(row), flush=True)
            if on_row is not None:
                on_row(rows)
        proc.join()
    return rows


def save_rows(args: Any, rows: list[dict[str, Any]]) -> None:
    """Writes the rows so far, with the device and the arguments, to ``args.out`` when given (called after every
    row, so the rows of jobs that finished are kept when a later one runs out of time)."""
    if args.out:
        device = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
        Path(args.out).write_text(json.dumps({"device": device, "args": vars(args), "rows": rows}, indent=1))
