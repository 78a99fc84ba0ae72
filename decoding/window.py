"""Verify windows sized by what a row costs: draft a token only where its expected gain pays for its verify row.

Leviathan et al. 2023 (arXiv 2211.17192, §3.4) choose γ from the acceptance rate α and the cost ratio c of a draft
step, assuming a verify of γ+1 rows costs one forward. On a CPU it does not: llama.cpp's kernels are compute-bound
past a few rows, and a verify of n rows costs ``c(n)`` one-row forwards (measured: about 1.7 for 2 rows and 5 for 8
on a 2-core AMD EPYC, 2.3–2.9 for 8 on an Intel Xeon; ``python -m bench.rowcost``). So the window is grown one
token at a time, and the next token is drafted only when the window's expected tokens per unit of verify cost can
grow with it and the run it may start (a measured curve is not convex: on the EPYC 3 rows cost what 4 do):

    E(k) = 1 + Σ_{i ≤ k} P_i        (the bonus token, plus each draft accepted with all before it)
    draft token k+1  iff  max_{m ≥ 1} (E(k) + Σ_{j < m} P_{k+1} · a^j) / c(k + 1 + m)  >=  E(k) / c(k + 1)

where ``P_{k+1} = P_k · a`` with ``a = 1`` for a schema-forced token (the mask allows only it) and, for a drafter
token, the sequence's running acceptance at that drafter position (``DecodeStats.accepted_by_position`` /
``drafted_by_position``, starting from a prior). The decision uses only what is known before the token is drawn
(the history and whether the mask forces it), never the drawn token, so a shorter window changes neither the greedy
output nor the sampled distribution (a draft included or not by its own value would bias speculative sampling).
Long schema-forced runs keep their rows (each is accepted with the window so far); drafter tokens whose acceptance
does not pay for a row are not sent.
"""
from __future__ import annotations

import bisect
from dataclasses import dataclass

from .stats import DecodeStats


@dataclass(frozen=True)
class RowCost:
    """The measured cost of a verify of n rows, in one-row forwards.

    Attributes:
        rows: increasing row counts, starting at 1.
        cost: ``cost[i]`` = time of a verify of ``rows[i]`` rows / time of one row (``cost[0] == 1``).
        ms_1_row: the one-row forward time (ms) it was measured with.
    """

    rows: tuple[int, ...]
    cost: tuple[float, ...]
    ms_1_row: float = 0.0

    def __post_init__(self):
        if not self.rows or self.rows[0] != 1 or len(self.rows) != len(self.cost) or \
                any(b <= a for a, b in zip(self.rows, self.rows[1:])):
            raise ValueError(f"a row-cost curve needs increasing rows from 1 and one cost each, got {self.rows}, "
                             f"{self.cost}")

    def __call__(self, n: int) -> float:
        """``c(n)``: linear between measured points, extended past the last with the last segment's slope, and
        never decreasing (a measured dip is noise: more rows never cost less)."""
        if n <= 1:
            return 1.0
        if len(self.rows) == 1:
            return float(n)
        i = bisect.bisect_left(self.rows, n)
        if i < len(self.rows) and self.rows[i] == n:
            return max(self.cost[:i + 1])
        if i == len(self.rows):
            i -= 1
        a, b = i - 1, i
        slope = (self.cost[b] - self.cost[a]) / (self.rows[b] - self.rows[a])
        return max(max(self.cost[:b]), self.cost[a] + slope * (n - self.rows[a]))

    def to_dict(self) -> dict:
        return {"rows": list(self.rows), "cost": list(self.cost), "ms_1_row": self.ms_1_row}

    @classmethod
    def from_dict(cls, d: dict) -> "RowCost":
        return cls(tuple(int(r) for r in d["rows"]), tuple(float(c) for c in d["cost"]), float(d.get("ms_1_row", 0)))


class WindowPolicy:
    """One sequence's window rule (module docstring): :meth:`start` before each window, :meth:`admit` before each
    token of it.

    Args:
        cost: the backend's :class:`RowCost`.
        stats: the sequence's :class:`DecodeStats` (its by-position acceptance counts are read, not written).
        prior: pseudo-counts ``(accepted, drafted)`` added at every drafter position: the acceptance assumed before
            the sequence has any (2 of 3: optimistic enough that a drafter is tried).
    """

    def __init__(self, cost: RowCost, stats: DecodeStats, prior: tuple[float, float] = (2.0, 3.0)):
        self.cost, self.stats, self.prior = cost, stats, prior
        self.start()

    def start(self) -> None:
        """A new window: only ``cur``'s row so far (its bonus token is certain)."""
        self.expected, self.p_all, self.rows = 1.0, 1.0, 1

    def acceptance(self, position: int) -> float:
        """The running acceptance of drafter tokens at drafter position ``position`` of a window (given the ones
        before it were accepted), with the prior."""
        a, d = self.prior
        s = self.stats
        if position < len(s.drafted_by_position):
            a, d = a + s.accepted_by_position[position], d + s.drafted_by_position[position]
        return a / d

    def admit(self, forced: bool, position: int, max_rows: int = 33) -> bool:
        """Whether the next token (schema-``forced``, else the drafter's token at drafter ``position``) is worth a
        verify row; if so it is counted in the window.

        A measured curve is not convex (on the EPYC 3 rows cost what 4 do), so the token is judged with the run it
        may start: it is admitted when some m >= 1 more rows, each accepted with the same factor as this one
        (1 for a forced run, else the drafter's acceptance), give the window a better expected rate than stopping
        here — ``max_m (E + Σ_{j<m} P·a^j) / c(rows + m) >= E / c(rows)`` — up to ``max_rows`` rows."""
        a = 1.0 if forced else self.acceptance(position)
        p = self.p_all * a
        stop_rate = self.expected / self.cost(self.rows)
        gain, q = 0.0, p
        for m in range(1, max(1, max_rows - self.rows) + 1):
            gain += q
            if (self.expected + gain) / self.cost(self.rows + m) >= stop_rate:
                self.expected, self.p_all, self.rows = self.expected + p, p, self.rows + 1
                return True
            q *= a
            if q < 1e-3:
                break
        return False
