"""MTP speculative decoding (greedy): each step verifies every row's current token and one draft from the
model's first MTP block, so a step emits two tokens where the draft was right.

After a prefill the MTP block drafts from the prompt's last ``window`` streams (its window ring needs them);
after a verification step a row whose draft the main model confirmed keeps both tokens plus the token after,
the others roll their compressor state back, and the MTP block drafts again from the new streams.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ..model.cache import V4Cache
from .model_runner import ModelRunner
from .sequence import Sequence

PickDraft = Callable[[Sequence, torch.Tensor], int]
"""The draft for the token after a sequence's current one, from the MTP block's logits [vocab] for it."""


class Speculator:
    """Drives MTP drafting and verification through ``runner``; ``window`` is the model's window size and
    ``pick_draft`` chooses each draft (the engine's greedy choice)."""

    def __init__(self, runner: ModelRunner, window: int, pick_draft: PickDraft) -> None:
        self.runner, self.window, self.pick_draft = runner, window, pick_draft

    def keep_streams(self, seq: Sequence, hidden: torch.Tensor) -> None:
        """Keeps the last ``window`` positions' streams of ``seq``'s prefill so far, with piece ``hidden`` added."""
        kept = hidden if seq.hidden is None else torch.cat((seq.hidden, hidden), dim=1)
        seq.hidden = kept[:, -self.window :]

    def first_draft(self, seq: Sequence, staging: V4Cache) -> None:
        """Drafts ``seq``'s second token once its prompt is prefilled (its first token emitted), filling the MTP
        block's window ring in ``staging``; drops the kept streams."""
        assert seq.hidden is not None
        first = len(seq.prompt) - seq.hidden.shape[1]
        next_ids = self.runner.tokens([seq.prompt[first + 1 :] + [seq.token]])
        draft_logits = self.runner.draft(seq.hidden, next_ids, staging, start=first)
        seq.draft, seq.hidden = self.pick_draft(seq, draft_logits[0, -1]), None

    def step(self, seqs: list[Sequence], bucket: int, cache: V4Cache, record: bool) -> None:
        """One verification step of ``seqs`` over ``cache`` (the ``bucket`` decode rows): emits one or two
        tokens per sequence, rolls rejected drafts out of the compressor state and drafts again."""
        ids, positions = self.runner.decode_inputs(seqs, bucket, speculative=True)
        checkpoint = cache.draft_checkpoint()
        logits, hidden, routing = self.runner.verify(ids, positions, cache, record)
        next_ids = ids.clone()
        rejected, accepted = [], []
        for seq in seqs:
            seq.out.mtp_drafted += 1
            confirmed = int(logits[seq.row, 0].argmax()) == seq.draft
            seq.emit(logits[seq.row, 0])
            kept = 2 if confirmed and not seq.stopped and len(seq.out.tokens) < seq.max_new else 1
            seq.record(routing, seq.row, kept)
            if kept == 2:
                seq.out.mtp_accepted += 1
                seq.emit(logits[seq.row, 1])
                next_ids[seq.row] = torch.tensor([seq.draft, seq.token])
                accepted.append(seq)
            else:
                next_ids[seq.row, 0] = seq.token
                rejected.append(seq)
        if rejected:  # the draft's position must not stay in the compressor state
            rows = torch.tensor([s.row for s in rejected], device=self.runner.device)
            cache.rollback_draft(checkpoint, rows, positions[rows] + 1)
        drafts = self.runner.draft(hidden, next_ids, cache, positions=positions)
        for seq in accepted:
            seq.draft = self.pick_draft(seq, drafts[seq.row, 1])
        for seq in rejected:
            seq.draft = self.pick_draft(seq, drafts[seq.row, 0])
