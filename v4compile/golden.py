"""The official golden vectors (``shared/golden``), scored the way they were made.

Each golden row is the last-position logits of its own official prefill ending at that row (batched over the
case's rows), so a row is scored by a prefill of exactly that length; the decode rows come from a prefill of
the case's first length followed by one-token decode steps; the MTP row from the block's last position. The
band is the golden README's: how far the official model moves when only the batch composition changes.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F

from .model import DeepSeekV4

BAND = {"median_cos": 0.99, "mean_cos": 0.97, "argmax_agreement": 0.80}
MTP_BAND = 0.95


@dataclass
class GoldenCase:
    """One case of a golden folder: ids [B, L+n-1], the first prefill length L, the official logits of the n
    rows by prefill and by decode [B, n, V], and the official model's own decode-vs-prefill minimum cosine."""

    name: str
    ids: torch.Tensor
    prefill_len: int
    prefill_logits: torch.Tensor
    decode_logits: torch.Tensor
    official_drift: float


@dataclass
class GoldenFolder:
    """A golden folder's cases and its MTP vectors (streams [B, 24, n, D], ids [B, 24], logits [B, V])."""

    path: Path
    cases: list[GoldenCase]
    mtp_hidden: torch.Tensor
    mtp_ids: torch.Tensor
    mtp_logits: torch.Tensor

    @classmethod
    def read(cls, path: str | Path) -> GoldenFolder:
        """Reads ``cases.safetensors`` of a golden folder; a missing file is a FileNotFoundError naming it."""
        from safetensors.torch import load_file

        path = Path(path)
        file = path / "cases.safetensors"
        if not file.is_file():
            raise FileNotFoundError(f"no cases.safetensors in golden folder {path}")
        data = load_file(str(file))
        names = sorted({k.split(".")[0] for k in data if k.startswith("case")}, key=lambda n: int(n[4:]))
        cases = [GoldenCase(n, data[f"{n}.ids"], int(data[f"{n}.prefill_len"]), data[f"{n}.prefill_logits"],
                            data[f"{n}.decode_logits"], float(data[f"{n}.official_decode_vs_prefill_min_cos"]))
                 for n in names]
        return cls(path, cases, data["mtp.hidden"], data["mtp.ids"], data["mtp.logits"])


@dataclass
class Agreement:
    """How close two sets of logit rows are: the golden README's measures, plus the share of rows that are
    bitwise equal."""

    median_cos: float
    mean_cos: float
    min_cos: float
    argmax_agreement: float
    bitwise: float = 0.0

    @classmethod
    def of(cls, got: torch.Tensor, want: torch.Tensor) -> Agreement:
        """The measures of two [..., vocab] logit tensors, row by row."""
        got, want = got.flatten(0, -2).float(), want.flatten(0, -2).float()
        cos = F.cosine_similarity(got, want, dim=-1)
        agree = (got.argmax(-1) == want.argmax(-1)).float().mean().item()
        same = (got == want).all(-1).float().mean().item()
        return cls(cos.median().item(), cos.mean().item(), cos.min().item(), agree, same)

    def in_band(self) -> bool:
        """Whether the median and mean cosine and the argmax agreement reach the golden band."""
        return all(getattr(self, key) >= bar for key, bar in BAND.items())

    def line(self) -> str:
        """One readable line of the measures."""
        return (f"median {self.median_cos:.4f} mean {self.mean_cos:.4f} min {self.min_cos:.4f} "
                f"argmax {self.argmax_agreement:.3f} bitwise {self.bitwise:.3f}")


@dataclass
class GoldenScore:
    """A model against one golden folder: prefill rows, decode rows (against the official decode and against
    the model's own prefill rows, with the official model's drift between its two paths), MTP cosines."""

    folder: str
    prefill: Agreement
    decode: Agreement
    decode_vs_own_prefill: Agreement
    official_drift: Agreement
    decode_min_cos_by_case: list[tuple[float, float]] = field(default_factory=list)
    mtp_cos: list[float] = field(default_factory=list)

    def in_band(self) -> bool:
        """Prefill rows, decode rows (against the official decode and against the model's own prefill rows) in the
        band, and every MTP cosine at least ``MTP_BAND``. The per-case minimum cosines beside the official drift
        are reported, not judged: a single knife-edge row decides them."""
        return (self.prefill.in_band() and self.decode.in_band() and self.decode_vs_own_prefill.in_band()
                and all(c >= MTP_BAND for c in self.mtp_cos))

    def lines(self) -> list[str]:
        """The score as readable lines."""
        return [f"{self.folder}: {'in band' if self.in_band() else 'OUT OF BAND'}",
                f"  prefill rows          {self.prefill.line()}",
                f"  decode rows           {self.decode.line()}",
                f"  decode vs own prefill {self.decode_vs_own_prefill.line()}",
                f"  official drift        {self.official_drift.line()}",
                "  decode min cos (ours, official drift) per case "
                + ", ".join(f"({a:.4f}, {b:.4f})" for a, b in self.decode_min_cos_by_case),
                "  mtp cos " + ", ".join(f"{c:.4f}" for c in self.mtp_cos)]


def prefill_rows(model: DeepSeekV4, case: GoldenCase) -> torch.Tensor:
    """[B, n, V]: row i from a prefill of the first ``prefill_len + i`` tokens (all of the case's sequences in one
    batch, as the official model ran them), its last position's logits."""
    n, ids = case.prefill_logits.shape[1], case.ids.to(model.embed.weight.device)
    with torch.no_grad():
        rows = [model.logits(model.hidden_states(ids[:, : case.prefill_len + i]), last=True) for i in range(n)]
    return torch.stack(rows, dim=1).cpu()


def decode_rows(model: DeepSeekV4, case: GoldenCase) -> torch.Tensor:
    """[B, n, V]: a prefill of ``prefill_len`` tokens (its last logits), then one-token decode steps on the case's
    ids, as the official incremental path reached the same positions."""
    ids, length = case.ids.to(model.embed.weight.device), case.prefill_len
    cache = model.new_cache(ids.shape[0])
    with torch.no_grad():
        rows = [model.logits(model.hidden_states(ids[:, :length], cache=cache), last=True)]
        for i in range(case.decode_logits.shape[1] - 1):
            positions = torch.full((ids.shape[0],), length + i, device=ids.device)
            rows.append(model.decode_step(ids[:, length + i : length + i + 1], positions, cache)[:, 0])
    return torch.stack(rows, dim=1).cpu()


def score(model: DeepSeekV4, folder: str | Path | GoldenFolder) -> GoldenScore:
    """``model`` against every case of a golden folder (prefill rows, decode rows, MTP)."""
    golden = folder if isinstance(folder, GoldenFolder) else GoldenFolder.read(folder)
    prefill, decode, official_p, official_d, by_case = [], [], [], [], []
    for case in golden.cases:
        p, d = prefill_rows(model, case), decode_rows(model, case)
        prefill.append(p.flatten(0, 1))
        decode.append(d.flatten(0, 1))
        official_p.append(case.prefill_logits.flatten(0, 1))
        official_d.append(case.decode_logits.flatten(0, 1))
        by_case.append((Agreement.of(d, case.decode_logits).min_cos, case.official_drift))
    p, d, op, od = (torch.cat(t) for t in (prefill, decode, official_p, official_d))
    mtp_cos: list[float] = []
    if len(model.mtp):
        device = model.embed.weight.device
        with torch.no_grad():
            mtp = model.mtp_logits(golden.mtp_hidden.to(device), golden.mtp_ids.to(device), last=True).cpu()
        mtp_cos = F.cosine_similarity(mtp, golden.mtp_logits, dim=-1).tolist()
    return GoldenScore(golden.path.name, Agreement.of(p, op), Agreement.of(d, od), Agreement.of(d, p),
                       Agreement.of(od, op), by_case, mtp_cos)
