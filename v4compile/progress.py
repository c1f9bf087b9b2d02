"""Compile progress: what the first call of an optimized entry point is doing (Dynamo capture, each pass,
Inductor, kernel builds), with elapsed time, so a long first call is never a silent wait.

Lines go to the ``v4compile.compile`` logger at INFO. When the application has configured no logging, they are
printed on stderr; silence them with ``V4COMPILE_LOGS=-compile`` or
``logging.getLogger("v4compile").setLevel(logging.WARNING)`` (``logs`` lists the other topics).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

from . import logs

LOGGER = logs.logger("compile")
_state = threading.local()


def _ensure_output() -> None:
    """Prints on stderr unless the application set up logging; INFO unless a level was chosen."""
    logs.ensure_output(LOGGER)
    if LOGGER.level == logging.NOTSET and logging.getLogger("v4compile").level == logging.NOTSET:
        LOGGER.setLevel(logging.INFO)


def elapsed() -> float:
    """Seconds since the current optimized call began (0 outside one)."""
    start = getattr(_state, "start", None)
    return 0.0 if start is None else time.perf_counter() - start


def current_entry() -> str | None:
    """The optimized entry point whose call is running (``forward``, ``hidden_states``, ``decode_step``...), if any."""
    return getattr(_state, "entry", None)


def current_region() -> str | None:
    """The compiled region (``layers.1,3``, ``head``, ``mtp.0``) whose call is running inside an entry point, if any."""
    return getattr(_state, "region", None)


def region_scope() -> str | None:
    """The module path that the running region's graph locations are relative to (a block's ``layers.1,3``;
    None for a region traced from the model itself, whose paths are the model's already)."""
    return getattr(_state, "scope", None)


@contextmanager
def region(name: str, scoped: bool = False) -> Iterator[None]:
    """Marks a call of one compiled region: graphs compiled inside it are named by it and, ``scoped``, their
    locations are prefixed with it."""
    outer = getattr(_state, "region", None), getattr(_state, "scope", None)
    _state.region, _state.scope = name, name if scoped else None
    try:
        yield
    finally:
        _state.region, _state.scope = outer


def log(message: str) -> None:
    """One progress line, prefixed with the entry point being compiled and the seconds since its call began."""
    _ensure_output()
    entry, part = getattr(_state, "entry", None), getattr(_state, "region", None)
    where = f"{entry}{'.' + part if part else ''} " if entry else ""
    LOGGER.info("%s[%6.1f s] %s", where, elapsed(), message)


@contextmanager
def call(entry: str) -> Iterator[None]:
    """Marks one call of the optimized ``entry``: progress lines logged inside it are timed from its start."""
    outer = getattr(_state, "entry", None), getattr(_state, "start", None)
    _state.entry, _state.start = entry, time.perf_counter()
    try:
        yield
    finally:
        _state.entry, _state.start = outer


@contextmanager
def step(what: str) -> Iterator[None]:
    """Logs ``what`` when it starts and, with its duration, when it ends."""
    log(f"{what} ...")
    start = time.perf_counter()
    yield
    log(f"{what}: done in {time.perf_counter() - start:.1f} s")
