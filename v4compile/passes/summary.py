"""The per-pass summary of a compiled model: plain rows a script can read, a table a person can."""

from __future__ import annotations

import io
import json
from typing import Any

from rich.console import Console
from rich.table import Table


class PassSummary(list):
    """Rows of per-pass totals (``pass``, ``enabled``, ``matches``, ``near_misses``, ``seconds``, ``kernels`` as a
    sorted list, ``worst_rel_error``, ``tolerance``): a list of JSON-ready dicts that prints as the report table."""

    def table(self, title: str = "pass report") -> Table:
        """The rows as the rich table the demo and the CLI print (kernel names never folded)."""
        table = Table(title=title)
        longest = max((len(k) for row in self for k in row["kernels"]), default=7)
        table.add_column("pass", no_wrap=True)
        table.add_column("rewrites", justify="right")
        table.add_column("near-misses", justify="right")
        table.add_column("kernels", no_wrap=True, min_width=longest)
        table.add_column("worst region rel. error", overflow="fold")
        table.add_column("pass time", justify="right")
        for row in self:
            worst = "-" if row["worst_rel_error"] is None else f"{row['worst_rel_error']:.2e}"
            table.add_row(row["pass"], str(row["matches"]), str(row["near_misses"]), "\n".join(row["kernels"]) or "-",
                          worst, f"{row['seconds'] * 1e3:.1f} ms")
        return table

    def to_json(self) -> str:
        """The rows as JSON text."""
        return json.dumps(list(self), indent=1)

    def __str__(self) -> str:
        console = Console(width=200, file=io.StringIO())
        console.print(self.table())
        return console.file.getvalue()

    def __rich__(self) -> Table:
        return self.table()


def summary_rows(rows: list[dict[str, Any]]) -> PassSummary:
    """Wraps summarize's rows, kernel sets made sorted lists so the rows are plain JSON."""
    return PassSummary({**row, "kernels": sorted(row["kernels"])} for row in rows)
