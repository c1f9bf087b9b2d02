"""``V4COMPILE_LOGS``: which parts of v4compile say what they are doing, like ``TORCH_LOGS``.

Topics: ``compile`` (the first call's progress: capture, passes, Inductor, kernel builds; on by default),
``passes`` (every rewrite and near-miss with its location), ``graphs`` (node counts per graph, and with ``+``
the rewritten graph's code), ``kernels`` (each kernel built, with its source file and first launch
configuration) and ``engine`` (each request admitted, served from the prefix cache and finished). The value is a
comma list: ``passes,kernels`` turns topics on (INFO), ``+passes`` at DEBUG, ``-compile`` off, ``all`` every
topic. Lines go to the ``v4compile.<topic>`` loggers, printed on stderr unless the application configured
logging itself.
"""

from __future__ import annotations

import logging
import os
import sys

TOPICS = ("compile", "passes", "graphs", "kernels", "engine")


def logger(topic: str) -> logging.Logger:
    """The logger of one topic (``v4compile.<topic>``)."""
    if topic not in TOPICS:
        raise ValueError(f"unknown v4compile log topic {topic!r}; topics: {', '.join(TOPICS)}")
    return logging.getLogger(f"v4compile.{topic}")


def ensure_output(log: logging.Logger) -> None:
    """Prints ``log``'s lines on stderr unless the application set up logging (then its handlers decide)."""
    if log.handlers or logging.getLogger().handlers:
        return
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("v4compile | %(message)s"))
    log.addHandler(handler)
    log.propagate = False


def parse(spec: str) -> dict[str, int]:
    """The level of each topic a ``V4COMPILE_LOGS`` value names (``ValueError`` naming an unknown topic)."""
    levels: dict[str, int] = {}
    for token in (t.strip() for t in spec.split(",")):
        if not token:
            continue
        level = logging.DEBUG if token[0] == "+" else logging.WARNING if token[0] == "-" else logging.INFO
        name = token.lstrip("+-")
        for topic in TOPICS if name == "all" else (name,):
            if topic not in TOPICS:
                raise ValueError(f"V4COMPILE_LOGS: unknown topic {name!r} in {spec!r}; topics: all, "
                                 f"{', '.join(TOPICS)} (prefix + for debug, - for off)")
            levels[topic] = level
    return levels


def configure(spec: str | None = None) -> dict[str, int]:
    """Sets the topics' levels from ``spec`` (default: the ``V4COMPILE_LOGS`` environment variable); topics it
    does not name keep their level (``compile`` INFO, the others silent). Returns the levels it set."""
    levels = parse(os.environ.get("V4COMPILE_LOGS", "") if spec is None else spec)
    for topic, level in levels.items():
        log = logger(topic)
        log.setLevel(level)
        if level < logging.WARNING:
            ensure_output(log)
    return levels
