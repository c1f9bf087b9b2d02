"""Shared pages of compressed KV entries: the pools a serving engine's caches and its prefix cache all address.

A page holds ``PAGE_TOKENS`` tokens' worth of compressed entries in every compressing layer at once (32 C4
entries and 32 indexer keys in a C4 layer, one entry in a C128 layer), so one page id, one allocation and one
page-table slot serve the whole model. A request's row maps its pages through its table; a cached prefix is a
list of page ids another row's table can name, so a prefix hit copies no entries. Page 0 is the null page: a
table slot not yet assigned names it, and nothing meaningful is ever stored there.
"""

from __future__ import annotations

import torch

from .cache import PAGE_TOKENS
from .config import V4Config

KINDS = ("compressor", "indexer")
"""The compressed entries of a layer: the main compressor's and (C4 layers) the indexer's keys."""


def pooled_kinds(config: V4Config, c4_main: bool = True) -> list[tuple[int, str, int, int]]:
    """(layer, kind, entries per page, width) of every pool: each compressing layer's main entries (C4 layers'
    only with ``c4_main``) and each C4 layer's indexer keys."""
    out = []
    for layer, ratio in enumerate(config.layer_ratios):
        if ratio and (ratio != 4 or c4_main):
            out.append((layer, "compressor", PAGE_TOKENS // ratio, config.head_dim))
        if ratio == 4:
            out.append((layer, "indexer", PAGE_TOKENS // ratio, config.index_head_dim))
    return out


def page_bytes(config: V4Config, c4_main: bool = True) -> int:
    """Bytes of one page (bf16 entries) across every pool."""
    return sum(per_page * width * 2 for _, _, per_page, width in pooled_kinds(config, c4_main))


class EntryPages:
    """``n_pages`` pages (page 0 the null page) of every pool ``pooled_kinds`` lists, on ``device``. ``c4_main``
    False leaves the C4 layers' main entries out (HiSparse keeps them in its host tier)."""

    def __init__(self, config: V4Config, n_pages: int, device: torch.device | str | None,
                 c4_main: bool = True) -> None:
        if n_pages < 2:
            raise ValueError(f"entry pages need the null page and at least one more, got {n_pages} pages")
        self.n_pages, self.c4_main = n_pages, c4_main
        self.page_bytes = page_bytes(config, c4_main)
        self.pools: dict[tuple[int, str], torch.Tensor] = {
            (layer, kind): torch.zeros(n_pages, per_page, width, dtype=torch.bfloat16, device=device)
            for layer, kind, per_page, width in pooled_kinds(config, c4_main)}

    def zero(self, pages: list[int]) -> None:
        """Clears ``pages`` in every pool (freshly allocated pages hold no earlier sequence's entries)."""
        if pages and self.pools:
            index = torch.tensor(pages, dtype=torch.long, device=next(iter(self.pools.values())).device)
            for pool in self.pools.values():
                pool.index_fill_(0, index, 0)

    def nbytes(self) -> int:
        """Bytes of every pool."""
        return sum(pool.nbytes for pool in self.pools.values())
