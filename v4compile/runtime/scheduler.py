"""What runs next: admission into staging rows, chunked prefill pieces, decode rows and their static buckets.

The scheduler holds no tensors: it decides which sequence goes to which staging slot and decode row, where each
prefill piece ends, which bucket a decode step runs, and which decode rows move when others finish; the engine
runs those decisions through the model runner and the cache manager.

Why the pieces and buckets are what they are: every prompt is prefilled in pieces whose boundaries are fixed
multiples of ``piece`` tokens counted from position 0, and every decode step runs a static bucket of rows, so the
computation that produces a token's KV does not depend on what else is running (see ``engine.py``).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from .requests import RequestOutput
from .sequence import Mode, Sequence


@dataclass
class DecodeBatch:
    """One decode step: the static ``bucket`` of rows it runs, the sequences in rows ``0..len(seqs)-1`` (the
    rest is padding) and the mode they share."""

    bucket: int
    seqs: list[Sequence]
    mode: Mode


class Scheduler:
    """Continuous batching over ``max_prefills`` staging slots and ``max_batch`` decode rows: waiting requests
    are admitted first come, first served while a staging slot and a row are free and their mode matches the
    running requests'; prefill runs in pieces of ``piece`` tokens; decode steps run the smallest of ``buckets``
    that holds every decode row."""

    def __init__(self, max_prefills: int, max_batch: int, buckets: tuple[int, ...], piece: int) -> None:
        self.max_prefills, self.max_batch, self.buckets, self.piece = max_prefills, max_batch, buckets, piece
        self.waiting: deque[Sequence] = deque()
        self.prefilling: list[Sequence] = []
        self.decoding: list[Sequence] = []
        self.retired: list[Sequence] = []
        self._by_output: dict[int, Sequence] = {}

    def add(self, seq: Sequence) -> None:
        """Queues ``seq`` for admission."""
        self._by_output[id(seq.out)] = seq
        self.waiting.append(seq)

    def cancel(self, out: RequestOutput) -> None:
        """Marks the sequence behind ``out`` cancelled (``drop_cancelled`` removes it); a finished one is gone."""
        seq = self._by_output.get(id(out))
        if seq is not None:
            seq.cancelled = True

    @property
    def busy(self) -> bool:
        """Whether any sequence is waiting, prefilling or decoding."""
        return bool(self.waiting or self.prefilling or self.decoding)

    def drop_cancelled(self) -> list[tuple[int, int]]:
        """Removes cancelled sequences everywhere; returns the decode row moves (destination, source) that keep
        the remaining rows dense."""
        for queue in (self.waiting, self.prefilling):
            for seq in [s for s in queue if s.cancelled]:
                queue.remove(seq)
                self._retire(seq)
        return self.compact() if any(s.cancelled for s in self.decoding) else []

    def admit(self, begin: Callable[[Sequence], bool]) -> list[Sequence]:
        """Moves waiting sequences into free staging slots (each given its ``slot``), first come first served, while
        a staging slot and a decode row are free, the next one's mode matches the running sequences' and ``begin``
        (which takes its cache pages) accepts it; returns those admitted."""
        admitted = []
        while self.waiting and len(self.prefilling) < self.max_prefills and \
                len(self.prefilling) + len(self.decoding) < self.max_batch and self._fits_mode(self.waiting[0]):
            seq = self.waiting[0]
            used = {s.slot for s in self.prefilling}
            seq.slot = next(slot for slot in range(self.max_prefills) if slot not in used)
            if not begin(seq):
                seq.slot = -1
                break
            self.waiting.popleft()
            self.prefilling.append(seq)
            admitted.append(seq)
        return admitted

    def _fits_mode(self, seq: Sequence) -> bool:
        running = self.prefilling or self.decoding
        return not running or running[0].mode == seq.mode

    def piece_end(self, seq: Sequence) -> int:
        """Where ``seq``'s next prefill piece ends: the next multiple of ``piece``, or the prompt's end."""
        return min(len(seq.prompt), (seq.done // self.piece + 1) * self.piece)

    def prefilled(self, seq: Sequence) -> int | None:
        """Takes ``seq``, whose prompt is done, out of prefill: the decode row it moves to, or None when it is
        already finished."""
        self.prefilling.remove(seq)
        if self._retire(seq):
            return None
        seq.row = len(self.decoding)
        self.decoding.append(seq)
        return seq.row

    def decode_batch(self) -> DecodeBatch | None:
        """The next decode step: every decode row in the smallest bucket holding them (None when none decode)."""
        if not self.decoding:
            return None
        bucket = next(b for b in self.buckets if b >= len(self.decoding))
        return DecodeBatch(bucket, self.decoding, self.decoding[0].mode)

    def compact(self) -> list[tuple[int, int]]:
        """Retires finished decode sequences; the rest move down over them (rows stay dense). Returns the row
        moves (destination, source), to be applied in order."""
        keep = [s for s in self.decoding if not self._retire(s)]
        moves = []
        for row, seq in enumerate(keep):
            if seq.row != row:
                moves.append((row, seq.row))
                seq.row = row
        self.decoding[:] = keep
        return moves

    def take_retired(self) -> list[Sequence]:
        """The sequences retired since the last call (their pages go back)."""
        out, self.retired = self.retired, []
        return out

    def _retire(self, seq: Sequence) -> bool:
        if not seq.finish_if_done():
            return False
        self._by_output.pop(id(seq.out), None)
        self.retired.append(seq)
        return True


def prefill_piece(chunk: int, max_batch_tokens: int) -> int:
    """The prefill piece: the largest divisor of the prefix-cache ``chunk`` up to ``max_batch_tokens``, so pieces
    end on every chunk boundary."""
    return max(d for d in range(1, chunk + 1) if chunk % d == 0 and d <= max_batch_tokens)


def bucket_sizes(requested: tuple[int, ...] | None, max_batch: int) -> tuple[int, ...]:
    """The static decode batch sizes: ``requested`` (default: powers of two below ``max_batch``), sorted, ending
    with ``max_batch`` at least."""
    buckets = tuple(sorted(requested)) if requested else _powers_of_two(max_batch)
    return buckets if buckets[-1] >= max_batch else (*buckets, max_batch)


def _powers_of_two(limit: int) -> tuple[int, ...]:
    sizes, b = [], 1
    while b < limit:
        sizes.append(b)
        b *= 2
    return (*sizes, limit)
