"""Calibrated node values (docs/draft-tree.md, "Choosing the tree size each step").

A draft node's raw value is the product of the head's probabilities along its path. It ranks
nodes well but is not itself the probability that verification accepts the node: a small
head is over- or under-confident by depth and context. `Calibration` maps raw values to
measured acceptance rates: bins of log(raw value), the rate of accepted nodes in each bin, made
non-decreasing by pool-adjacent-violators (so the map keeps the ranking and a child
never outranks its parent). It is fitted by `eagle2 calibrate` on prompts the head was not
trained on and shipped beside the head as `calibration.json`.

Prompt-lookup nodes (`eagle2.lookup`) have no path value: their acceptance rates by match
length and depth are measured by `eagle2 calibrate` as well and stored in the same file
(optional field "lookup"; files without it load with no table). `raw_for` maps such a rate to
the raw scale the tree's rerank sorts by (docs/draft-tree.md "Prompt lookup").
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from eagle2.lookup import LookupTable

FILE_NAME = "calibration.json"


@dataclass(frozen=True)
class Calibration:
    edges: tuple[float, ...]  # ascending log-value bin edges (len K - 1)
    rates: tuple[float, ...]  # acceptance rate per bin, non-decreasing (len K)
    num_samples: int = 0
    lookup: LookupTable | None = None  # prompt-lookup acceptance, when it was measured

    def __post_init__(self) -> None:
        if len(self.rates) != len(self.edges) + 1:
            raise ValueError(f"calibration needs len(rates) == len(edges) + 1, got "
                             f"{len(self.rates)} and {len(self.edges)}")
        if any(b < a for a, b in zip(self.rates, self.rates[1:], strict=False)):
            raise ValueError("calibration rates must be non-decreasing")

    def _tensors(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """(edges, rates) as fp32 tensors on `device`, made once per device (a draft call
        calibrates ~10 times; making them each time was ~5% of its Python)."""
        made = self.__dict__.setdefault("_made", {})
        if device not in made:
            made[device] = (torch.tensor(self.edges, device=device),
                            torch.tensor(self.rates, device=device))
        return made[device]

    def __call__(self, raw: torch.Tensor) -> torch.Tensor:
        """Raw path values (probabilities) [...] -> calibrated acceptance estimates [...]."""
        logv = raw.float().clamp(min=1e-30).log()
        edges, rates = self._tensors(raw.device)
        return torch.where(raw > 0, rates[torch.bucketize(logv, edges)], 0.0)

    def raw_for(self, rate: torch.Tensor) -> torch.Tensor:
        """Acceptance estimates [...] -> raw values that rank among the head's nodes of the first
        bin whose rate reaches them (the middle of that bin in log value; the top bin when none
        does). E.g. rates [.1, .5, .9] over log-value edges [-3, -1]: .3 -> exp(-2)."""
        if not self.edges:
            return rate
        edges, rates = self._tensors(rate.device)
        lower = torch.cat([edges[:1] - 1.0, edges])  # log-value bounds of each bin
        upper = torch.cat([edges, edges.new_zeros(1).clamp(min=float(edges[-1]))])
        k = torch.searchsorted(rates, rate.to(rates.dtype)).clamp(max=len(self.rates) - 1)
        return torch.where(rate > 0, ((lower[k] + upper[k]) / 2).exp(), 0.0).to(rate.dtype)

    @classmethod
    def fit(cls, raw: torch.Tensor, accepted: torch.Tensor, num_bins: int = 20,
            min_count: int = 20) -> Calibration:
        """raw [M] path values, accepted [M] bool -> monotone rates per bin.

        Edges: quantiles of all values (num_bins / 2 bins) and of the accepted ones (num_bins
        bins), so that resolution goes where acceptance happens (most nodes are hopeless);
        bins with fewer than min_count samples merge into the next one."""
        if raw.numel() < 2 * min_count:
            raise ValueError(f"need at least {2 * min_count} samples to calibrate, "
                             f"got {raw.numel()}")
        logv = raw.float().clamp(min=1e-30).log()
        acc = accepted.bool()
        cuts = [torch.quantile(logv, torch.linspace(0, 1, max(num_bins // 2, 2) + 1)[1:-1])]
        if int(acc.sum()) >= min_count:
            cuts.append(torch.quantile(logv[acc], torch.linspace(0, 1, num_bins + 1)[1:-1]))
        edges = torch.unique(torch.cat(cuts))  # sorted
        while True:
            bins = torch.bucketize(logv, edges)
            counts = torch.bincount(bins, minlength=len(edges) + 1)
            small = (counts < min_count).nonzero().flatten()
            if len(small) == 0 or len(edges) == 0:
                break
            i = int(small[0])  # merge bin i with its right neighbour (or left for the last)
            edges = torch.cat([edges[: min(i, len(edges) - 1)], edges[min(i, len(edges) - 1) + 1:]])
        sums = torch.bincount(bins, weights=acc.float(), minlength=len(edges) + 1)
        rates = _pool_adjacent_violators(sums.tolist(), counts.tolist())
        return cls(tuple(edges.tolist()), tuple(rates), int(raw.numel()))

    def save(self, path: Path) -> None:
        data = {"edges": self.edges, "rates": self.rates, "num_samples": self.num_samples}
        if self.lookup is not None:
            data["lookup"] = self.lookup.to_json()
        path.write_text(json.dumps(data, indent=1) + "\n")

    @classmethod
    def of_head(cls, head_dir: str | Path | None) -> Calibration | None:
        """The calibration shipped in a head's directory (`FILE_NAME`), None without one (or
        without a directory: an untrained head)."""
        if head_dir is None:
            return None
        path = Path(head_dir) / FILE_NAME
        return cls.load(path) if path.exists() else None

    @classmethod
    def load(cls, path: Path) -> Calibration:
        data = json.loads(path.read_text())
        lookup = LookupTable.from_json(data["lookup"]) if "lookup" in data else None
        return cls(tuple(data["edges"]), tuple(data["rates"]), data.get("num_samples", 0),
                   lookup)


def _pool_adjacent_violators(sums: list[float], counts: list[int]) -> list[float]:
    """Non-decreasing rates per bin: merge neighbouring bins whose rates fall (weighted mean)."""
    blocks: list[list[float]] = []  # [sum, count, number of bins]
    for s, c in zip(sums, counts, strict=True):
        blocks.append([s, c, 1])
        while len(blocks) > 1 and blocks[-2][0] / blocks[-2][1] > blocks[-1][0] / blocks[-1][1]:
            s2, c2, n2 = blocks.pop()
            blocks[-1][0] += s2
            blocks[-1][1] += c2
            blocks[-1][2] += n2
    return [b[0] / b[1] for b in blocks for _ in range(int(b[2]))]


def accepted_nodes(tokens: torch.Tensor, parents: torch.Tensor, tree_mask: torch.Tensor,
                   num_nodes: torch.Tensor, target_argmax: torch.Tensor) -> torch.Tensor:
    """[B, N] bool: the node lies on the target's greedy path (its token and every
    ancestor's equal the target's argmax at their parents). target_argmax: [B, N]."""
    num_n = tokens.shape[1]
    parent_pred = torch.gather(target_argmax, 1, parents.clamp(min=0))
    match = (tokens == parent_pred) | (parents < 0)  # the root always "matches"
    valid = torch.arange(num_n, device=tokens.device)[None, :] < num_nodes[:, None]
    bad_ancestor = (tree_mask & ~match[:, None, :]).any(-1)  # [B, N]
    return valid & ~bad_ancestor & (parents >= 0)
