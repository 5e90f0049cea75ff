"""`PackingReport`: per-pack token, sequence and padding counts of a set of packs, for logs and plots."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass

from rlbench.packing.pack import Pack

__all__ = ["PackingReport"]


@dataclass
class PackingReport:
    """Summary of the packs of one step (or of any list of packs)."""

    tokens: list[int]  # real tokens per pack
    sequences: list[int]  # sequences per pack
    padding: list[int]  # pad tokens per pack (alignment + trailing)
    max_tokens: int | None = None  # the budget the packs were built under, if any
    num_truncated: int = 0  # sequences cut to fit the budget

    @classmethod
    def from_packs(cls, packs: Sequence[Pack], max_tokens: int | None = None) -> PackingReport:
        return cls(
            tokens=[p.num_real_tokens for p in packs],
            sequences=[p.num_sequences for p in packs],
            padding=[p.num_padding for p in packs],
            max_tokens=max_tokens,
            num_truncated=sum(len(p.truncated_ids) for p in packs),
        )

    @property
    def num_packs(self) -> int:
        return len(self.tokens)

    @property
    def imbalance(self) -> float:
        """max / mean of real tokens per pack (1.0 = perfectly balanced)."""
        mean = sum(self.tokens) / max(1, len(self.tokens))
        return max(self.tokens) / mean if mean > 0 else 1.0

    @property
    def padding_fraction(self) -> float:
        """Pad tokens / all tokens processed."""
        total = sum(self.tokens) + sum(self.padding)
        return sum(self.padding) / total if total else 0.0

    def to_dict(self) -> dict:
        """Plain lists and numbers (per-pack lists plus the scalar summaries), ready for plotting."""
        return asdict(self) | {
            "num_packs": self.num_packs,
            "imbalance": self.imbalance,
            "padding_fraction": self.padding_fraction,
            "max_pack_tokens": max(t + p for t, p in zip(self.tokens, self.padding)) if self.tokens else 0,
        }
