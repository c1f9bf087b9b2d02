"""Running a test's ranks as spawned CPU processes on gloo."""

from __future__ import annotations

import contextlib
import os
import socket
from collections.abc import Callable, Iterator
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def run_ranks(worker: Callable[..., None], size: int, *args: object) -> None:
    """Spawns ``size`` processes running ``worker(rank, port, *args)`` on a free local port and waits."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(worker, args=(port, *args), nprocs=size, join=True)


@contextlib.contextmanager
def process_group(rank: int, port: int, size: int) -> Iterator[None]:
    """This process as ``rank`` of a gloo group of ``size`` on ``port``, one thread per process (two threads
    per rank make small eager runs many times slower on a busy 2-core machine); destroyed on exit."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=size, timeout=timedelta(seconds=600))
    try:
        yield
    finally:
        dist.destroy_process_group()
