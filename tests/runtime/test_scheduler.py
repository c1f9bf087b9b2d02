"""The scheduler's decisions without a model: admission within slots, rows and one mode, piece ends on the
chunk grid, the smallest bucket, and dense decode rows after finished ones leave."""

from __future__ import annotations

from v4compile.runtime.requests import RequestOutput
from v4compile.runtime.scheduler import Scheduler, bucket_sizes, prefill_piece
from v4compile.runtime.sequence import Mode, Sequence


def _seq(index: int, mode: Mode | None = None) -> Sequence:
    return Sequence(index, list(range(10)), 3, None, RequestOutput(index=index), mode or Mode())


def _accept(seq: Sequence) -> bool:
    return True


def _decode(scheduler: Scheduler, seq: Sequence) -> None:
    seq.out.tokens.append(1)
    assert scheduler.prefilled(seq) is not None


def test_admission_fills_free_slots_and_rows_of_one_mode() -> None:
    scheduler = Scheduler(max_prefills=2, max_batch=4, buckets=(1, 2, 4), piece=4)
    seqs = [_seq(0), _seq(1), _seq(2), _seq(3, mode=Mode(mtp=True))]
    for seq in seqs:
        scheduler.add(seq)
    assert scheduler.admit(_accept) == seqs[:2] and [s.slot for s in seqs[:2]] == [0, 1]
    _decode(scheduler, seqs[0])
    assert scheduler.admit(_accept) == [seqs[2]] and seqs[2].slot == 0  # the freed slot
    for seq in seqs[1:3]:
        _decode(scheduler, seq)
    assert scheduler.admit(_accept) == [] and scheduler.waiting[0] is seqs[3]  # another mode waits for the running ones
    batch = scheduler.decode_batch()
    assert batch is not None and batch.bucket == 4 and len(batch.seqs) == 3 and batch.mode == Mode()


def test_pieces_end_on_the_grid_and_rows_stay_dense() -> None:
    assert prefill_piece(256, 100) == 64 and bucket_sizes(None, 5) == (1, 2, 4, 5) and bucket_sizes((8,), 4) == (8,)
    scheduler = Scheduler(max_prefills=3, max_batch=3, buckets=(3,), piece=4)
    seqs = [_seq(i) for i in range(3)]
    for seq in seqs:
        scheduler.add(seq)
    scheduler.admit(_accept)
    seqs[0].done = 5
    assert scheduler.piece_end(seqs[0]) == 8 and scheduler.piece_end(seqs[1]) == 4
    for seq in seqs:
        _decode(scheduler, seq)
    seqs[0].out.tokens += [1, 1]  # at max_new
    scheduler.cancel(seqs[1].out)
    assert scheduler.drop_cancelled() == [(0, 2)]
    assert [s.out.finish_reason for s in seqs] == ["length", "abort", ""] and seqs[2].row == 0
    assert scheduler.busy and scheduler.compact() == [] and scheduler.decoding == [seqs[2]]
    assert scheduler.take_retired() == seqs[:2] and scheduler.take_retired() == []  # their pages go back


def test_admission_stops_in_order_when_the_pages_run_out() -> None:
    scheduler = Scheduler(max_prefills=3, max_batch=3, buckets=(3,), piece=4)
    seqs = [_seq(i) for i in range(3)]
    for seq in seqs:
        scheduler.add(seq)
    budget = [1]

    def begin(seq: Sequence) -> bool:
        budget[0] -= 1
        return budget[0] >= 0

    assert scheduler.admit(begin) == seqs[:1]
    assert list(scheduler.waiting) == seqs[1:] and seqs[1].slot == -1  # first come, first served: none skips
    budget[0] = 2
    assert scheduler.admit(begin) == seqs[1:] and [s.slot for s in seqs] == [0, 1, 2]
