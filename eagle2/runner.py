"""Where the target runs: in this process (`LocalRunner`) or sharded across tensor-parallel
ranks (`services` drives the same interface over Ray actors). The engine only talks to this.

Verification runs where the logits are (docs/draft-tree.md "Verification"): `verify_step` and
`prefill_step` return token ids, node indices and features only, never logits [B, N, V].
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch

from eagle2.backend import WHOLE_TREE, StepPart, TargetOutput
from eagle2.config import SamplingParams
from eagle2.target import TargetModel
from eagle2.tree import DraftTree, to_device
from eagle2.verify import (
    TokenLogprobs,
    Verified,
    first_logprobs,
    first_tokens,
    verify_batch,
    verify_greedy_lazily,
    verify_greedy_tokens,
    with_logprobs,
)

BLOCK_SIZE = 32  # entries per block of a paged cache: the CPU exact attention's key chunk


class TargetRunner(Protocol):
    vocab_size: int
    device: torch.device

    @property
    def lengths(self) -> torch.Tensor:  # [slots] committed length per cache slot
        ...

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor, tree_mask: torch.Tensor,
                slots: torch.Tensor, logit_index: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """-> (features [B, N, H], fp32 logits [B, N, V], or [B, V] at logit_index [B])."""
        ...

    def verify_step(self, tree: DraftTree, positions: torch.Tensor, slots: torch.Tensor,
                    params: list[SamplingParams], generators: list[torch.Generator | None],
                    logits: bool = False) -> tuple[Verified, torch.Tensor]:
        """One forward over the trees + acceptance. -> (Verified, accepted features [B, A, H],
        row b valid up to len(nodes[b])). Sampled rows advance their generator. logits: take
        the logits even where greedy rows could do without them (what the cost grid times)."""
        ...

    def prefill_step(self, tokens: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor,
                     slots: torch.Tensor, last_idx: torch.Tensor, params: list[SamplingParams],
                     generators: list[torch.Generator | None]
                     ) -> tuple[torch.Tensor, list[int], list[TokenLogprobs | None] | None]:
        """Prompt forward. -> (features [B, S, H], the first new token of each request, its
        TokenLogprobs where the request asks (None: none asks))."""
        ...

    # Optional: `mixed_step(tree, positions, slots, params, generators, prompts:
    # list[PromptBatch])`, `verify_step` with prompt batches read in the same forward (-> its
    # Verified, accepted features and each batch's `prefill_step` result), and
    # `prefill_parts(prompts)`, several prompt batches in one forward; the engine reads prompts
    # right-padded in forwards of their own where a runner has none.

    def commit(self, slots: torch.Tensor, node_idx: torch.Tensor, kept: torch.Tensor) -> None: ...

    def copy_slot(self, src: int, dst: int) -> None: ...

    def set_lengths(self, slots: torch.Tensor, values: torch.Tensor) -> None: ...


class LocalRunner:
    """The whole target (or one tensor-parallel rank's shard of it) and its KV cache in this
    process."""

    # whether this runner keeps a paged cache where num_blocks or kv_cache_memory is given
    # (every backend's attention reads one; tests turn it off for the slotted layout)
    can_page = True

    def __init__(self, target: TargetModel, num_slots: int, max_len: int,
                 num_blocks: int | None = None, block_size: int = BLOCK_SIZE,
                 kv_cache_memory: int | float | None = None):
        """num_slots sequences (cache slots) of at most max_len entries each. Paged
        (docs/kv-cache.md "Paged cache") where num_blocks or kv_cache_memory (bytes, or on
        CUDA a fraction of the free memory, which `num_blocks_for` turns into blocks) is
        given: the slots share num_blocks blocks of block_size entries, which the engine
        hands out (`Engine`, `eagle2.blocks`); else each slot holds max_len entries of its
        own, and with kv_cache_memory only as many slots as fit it (`cache_layout`;
        `capacity`)."""
        self.target = target.fuse()  # the backend's layers (`Backend.prepare`)
        self.vocab_size = target.vocab_size
        self.device = target.device
        layout = cache_layout(self.target, num_slots, max_len, kv_cache_memory, num_blocks,
                              block_size, pages=self.can_page)
        if layout.num_blocks is not None:
            self.cache = target.allocate_paged_cache(layout.num_slots, layout.num_blocks,
                                                     block_size, max_len)
        else:
            self.cache = target.allocate_cache(layout.num_slots, max_len)
        # a tensor-parallel rank other than 0 (`load`): rank 0 reads every step's results, so
        # this one's verifications run the forward and the collectives only (`verified`)
        self.follower = False

    @classmethod
    def load(cls, spec: str | None, dtype: torch.dtype, device: torch.device, num_slots: int,
             max_len: int, feature_layers: tuple[int, ...] | None = None, tp_size: int = 1,
             rank: int = 0, num_blocks: int | None = None, block_size: int = BLOCK_SIZE,
             kv_cache_memory: int | float | None = None) -> LocalRunner:
        """Rank `rank` of `tp_size` of the target given as for `TargetModel.load`, read
        straight to `device` (`eagle2.tp.load_rank`; tp_size 1: the whole model), with a cache
        of num_slots x max_len (paged, or fewer slots: num_blocks or kv_cache_memory, as
        `__init__`).
        tp_size > 1 needs `eagle2.tp.init_tp` first.
        feature_layers: the layer inputs an EAGLE-3 head reads (None: the final hidden state)."""
        from eagle2.tp import load_rank

        target = load_rank(spec, tp_size, rank, dtype, str(device))
        target.set_feature_layers(feature_layers)
        runner = cls(target, num_slots, max_len, num_blocks=num_blocks,
                     block_size=block_size, kv_cache_memory=kv_cache_memory)
        runner.follower = rank != 0
        return runner

    @property
    def info(self) -> dict:
        """What a service reports about the target held here: vocab_size, device, dtype,
        local_kv_heads (this shard's), and the backend's kernels (`Backend.info`: backend,
        attention, fused layers or the modules, native CPU operations)."""
        t = self.target
        return {"vocab_size": t.vocab_size, "device": str(t.device), "dtype": str(t.dtype),
                "local_kv_heads": t.local_kv_heads(), **t.backend.info(t)}

    @property
    def capacity(self) -> dict:
        """What the cache holds (docs/kv-cache.md "In the service"): num_slots (the most
        requests a step may run), kv_blocks and block_size (None where slotted),
        kv_cache_bytes (this shard's, the CPU's kept key blocks included)."""
        paged = self.paged
        return {"num_slots": int(self.lengths.shape[0]),
                "kv_blocks": paged[0] if paged else None,
                "block_size": paged[1] if paged else None,
                "kv_cache_bytes": cache_bytes(self.cache)}

    @property
    def lengths(self) -> torch.Tensor:
        return self.cache.lengths

    @property
    def paged(self) -> tuple[int, int] | None:
        """(num_blocks, block_size) of a paged cache (the null block left out), else None."""
        c = self.cache
        return (c.null_block, c.block_size) if c.paged else None

    def set_blocks(self, slot: int, blocks: list[int]) -> None:
        """A paged cache's slot reads and writes these blocks (position order)."""
        self.cache.set_blocks(slot, blocks)

    def target_forward(self, tokens, positions, tree_mask, slots) -> TargetOutput:
        """The target's forward over this runner's cache (what every step here calls;
        `eagle2.cuda_graphs.GraphedRunner` pads it to buckets and replays CUDA graphs)."""
        return self.target.forward(tokens, positions, tree_mask, self.cache, slots)

    def forward(self, tokens, positions, tree_mask, slots, logit_index=None):
        out = self.target_forward(tokens, positions, tree_mask, slots)
        if logit_index is not None:
            rows = torch.arange(out.hidden.shape[0], device=out.hidden.device)
            return out.features, self.target.logits(out.hidden[rows, logit_index])
        return out.features, self.target.logits(out.hidden)

    @property
    def greedy_argmax(self) -> bool:
        """Whether greedy steps take the target's argmax without its logits (the cost model
        prices them so: `CostModel.greedy`): the backend's (`GreedyArgmax`), or a
        tensor-parallel shard's vocabulary-parallel lm_head, whose ranks then gather one
        (max, index) pair a row instead of their [rows, V / tp] logits."""
        return self.target.backend.greedy_head is not None or self.target.vocab_parallel

    @property
    def greedy_first_rows(self) -> int:
        """Rows the first round of a greedy verification's argmax takes (`GreedyArgmax.
        first_rows`, `verify.verify_greedy_lazily`; the cost model prices them so). On a
        shard every node in one round: each round is a collective of all the ranks."""
        if self.target.vocab_parallel:
            return WHOLE_TREE
        return getattr(self.target.backend.greedy_head, "first_rows", 0)

    def _greedy_only(self, params) -> bool:
        """Whether this step needs only argmaxes, which the target can find without logits
        (`TargetModel.greedy_tokens`): every request greedy, none asking log-probabilities."""
        return self.greedy_argmax and all(p.greedy and p.logprobs is None for p in params)

    def greedy_verification(self, params, logits: bool = False) -> bool:
        """Whether a verification of these requests takes the argmaxes alone (`verified`; on a
        vocabulary-parallel shard it decides which gather every rank makes, so a follower is
        told this rank 0's answer): greedy-only requests and no logits asked."""
        return not logits and self._greedy_only(params)

    @torch.inference_mode()
    def head_seconds(self, rows: tuple[int, ...], passes: int = 4, argmax: bool = False,
                     before: Callable[[], object] | None = None
                     ) -> tuple[list[float], list[float] | None]:
        """Best seconds over `passes` sweeps of the lm_head over each of `rows` rows: the
        logits (and their argmax if `argmax`), and the argmax without them (None without a
        greedy head), on the final hidden states of a forward over text (`timing_tokens`)
        written past the shortest slot's committed entries (scratch, as a tree step's: safe
        between engine steps). before: called untimed ahead of every timed call (e.g. a read
        that flushes the caches, as a verification's forward does)."""
        t = self.target
        slot = int(self.cache.lengths.argmin())
        start = int(self.cache.lengths[slot])
        num = max(min(max(rows), self.cache.max_len - start), 1)
        dev = t.device
        tokens = timing_tokens(t, num).to(dev)
        mask = torch.ones(num, num, dtype=torch.bool, device=dev).tril()[None]
        positions = start + torch.arange(num, device=dev)[None]
        hidden = t.forward(tokens, positions, mask, self.cache,
                           torch.tensor([slot], device=dev)).hidden[0]
        sync = (lambda: torch.cuda.synchronize(dev)) if dev.type == "cuda" else (lambda: None)
        logits = (lambda h: t.logits(h).argmax(-1)) if argmax else t.logits
        fns = [logits] + ([t.greedy_tokens] if self.greedy_argmax else [])
        best = [[float("inf")] * len(rows) for _ in fns]
        for _ in range(max(passes, 1)):
            for i, r in enumerate(rows):
                h = hidden[torch.arange(r, device=dev) % num]
                for f, fn in enumerate(fns):
                    if before is not None:
                        before()
                    sync()
                    t0 = time.perf_counter()
                    fn(h)
                    sync()
                    best[f][i] = min(best[f][i], time.perf_counter() - t0)
        return best[0], (best[1] if len(best) > 1 else None)

    def verify_step(self, tree, positions, slots, params, generators, logits: bool = False):
        """logits: take the logits even where the target finds greedy argmaxes without them
        (the cost grid times steps so: `budget.time_grid`)."""
        dev = self.device
        # the forward's inputs to the device; the tree stays where the engine keeps it (HOST),
        # where greedy acceptance reads it (`verified` moves it for sampled acceptance)
        out = self.target_forward(tree.tokens.to(dev), positions.to(dev),
                                  tree.tree_mask.to(dev), slots.to(dev))
        return self.verified(tree, out, params, generators, logits)

    def prefill_step(self, tokens, positions, mask, slots, last_idx, params, generators):
        out = self.target_forward(tokens, positions, mask, slots)
        return self._firsts([out], [PromptBatch(tokens, positions, mask, slots, last_idx,
                                                params, generators)])[0]

    def mixed_step(self, tree, positions, slots, params, generators,
                   prompts: list[PromptBatch]):
        """`verify_step` and a `prefill_step` for each prompt batch in one forward
        (`TargetModel.forward_parts`: the projections and MLP over every group's tokens at
        once, attention per group), run unpadded. -> (Verified, accepted features, each
        batch's `prefill_step` result)."""
        dev = self.device
        tree = to_device(tree, dev)
        trees, *read = self.target.forward_parts(
            [StepPart(tree.tokens, positions.to(dev), tree.tree_mask, slots.to(dev))]
            + [StepPart(p.tokens, p.positions, p.mask, p.slots) for p in prompts], self.cache)
        verified, feats = self.verified(tree, trees, params, generators)
        return verified, feats, self._firsts(read, prompts)

    def prefill_parts(self, prompts: list[PromptBatch]):
        """`prefill_step` for each prompt batch, all in one forward (`TargetModel.
        forward_parts`: e.g. one batch a prompt, so no padding runs through the layers).
        -> each batch's `prefill_step` result."""
        read = self.target.forward_parts(
            [StepPart(p.tokens, p.positions, p.mask, p.slots) for p in prompts], self.cache)
        return self._firsts(read, prompts)

    def verified(self, tree: DraftTree, out: TargetOutput, params, generators,
                 logits: bool = False) -> tuple[Verified, torch.Tensor]:
        """Acceptance of the trees from their forward's output (where the logits are): what
        every verification here goes through (`eagle2.bench.calibrate` observes it).
        -> (Verified, accepted features [B, A, H]); (None, None) on a follower, which only
        takes part in the collective."""
        greedy = self.greedy_verification(params, logits)
        if not greedy:  # sampled acceptance reads the trees beside the logits
            tree = to_device(tree, out.hidden.device)
        if self.target.vocab_parallel or (greedy and self.greedy_first_rows >= WHOLE_TREE):
            # every node at once (on a shard: one collective of all the ranks)
            got = self.gathered(out.hidden, tree.num_nodes, greedy)
            if self.follower:
                return None, None
            verified = (verify_greedy_tokens(tree, got) if greedy else
                        with_logprobs(verify_batch(tree, got, params, generators), got, params))
        elif greedy:
            hidden = out.hidden
            verified = verify_greedy_lazily(
                tree, lambda rows, nodes: self.target.greedy_tokens(hidden[rows, nodes]),
                self.greedy_first_rows)
        else:
            logits = self.target.logits(out.hidden)  # [B, N, V]
            verified = with_logprobs(verify_batch(tree, logits, params, generators), logits,
                                     params)
        return verified, accepted_features(out.features, verified.nodes)

    def gathered(self, hidden: torch.Tensor, num_nodes: torch.Tensor, greedy: bool
                 ) -> torch.Tensor:
        """What a verification on a vocabulary-parallel shard gathers over the ranks (every
        rank the same: `follow_verify`), or a greedy head takes in one round: greedy, the
        argmax at every tree's nodes, [B, N] (-1 at padding); else the whole logits [B, N, V]."""
        if not greedy:
            return self.target.logits(hidden)
        num_b, num_n = hidden.shape[:2]
        # every_row: padding rows too, then masked (no node count read back from the device)
        every_row = getattr(self.target.backend.greedy_head, "every_row", False)
        counts = None if every_row else num_nodes.tolist()
        if counts is None or all(c == num_n for c in counts):
            pred = self.target.greedy_tokens(hidden.reshape(num_b * num_n, -1)).view(num_b,
                                                                                     num_n)
            if every_row:
                pad = torch.arange(num_n, device=hidden.device) >= \
                    num_nodes.to(hidden.device)[:, None]
                pred = pred.masked_fill(pad, -1)
            return pred
        rows = [b for b, c in enumerate(counts) for _ in range(c)]
        nodes = [n for c in counts for n in range(c)]
        pred = torch.full((num_b, num_n), -1, dtype=torch.long, device=hidden.device)
        pred[rows, nodes] = self.target.greedy_tokens(hidden[rows, nodes])
        return pred

    def follow_verify(self, tokens, positions, tree_mask, slots, num_nodes, greedy: bool
                      ) -> None:
        """A follower's share of a verification whose tree rank 0 holds: the forward over
        the trees' tokens [B, N] (`tree_mask` [B, N, N], `num_nodes` [B]) and the collective
        that ends it (`gathered`; greedy: rank 0's `greedy_verification`)."""
        out = self.target_forward(tokens, positions, tree_mask, slots)
        self.gathered(out.hidden, num_nodes, greedy)

    def _firsts(self, outs: list[TargetOutput], prompts: list[PromptBatch]) -> list[tuple]:
        """Prompt forwards' first tokens (each batch's rows at its last_idx), the lm_head (or
        the greedy argmax) run once over all the batches' rows. -> each batch's
        `prefill_step` result: (features, first tokens, TokenLogprobs or None)."""
        lasts = torch.cat([o.hidden[torch.arange(o.hidden.shape[0], device=o.hidden.device),
                                    p.last_idx] for o, p in zip(outs, prompts, strict=True)])
        params = [x for p in prompts for x in p.params]
        if self._greedy_only(params):
            first, logprobs = self.target.greedy_tokens(lasts).tolist(), None
        else:
            last_logits = self.target.logits(lasts)  # [rows, V]
            if self.follower:  # took part in the gather: rank 0 draws the first tokens
                return [(o.features, None, None) for o in outs]
            first = first_tokens(last_logits, params, [g for p in prompts for g in p.generators])
            logprobs = first_logprobs(last_logits, first, params)
        out, start = [], 0
        for o, p in zip(outs, prompts, strict=True):
            end = start + len(p.params)
            out.append((o.features, first[start:end],
                        logprobs[start:end] if logprobs is not None else None))
            start = end
        return out

    def commit(self, slots, node_idx, kept) -> None:
        self.cache.commit(slots, node_idx, kept)

    def copy_slot(self, src: int, dst: int) -> None:
        self.cache.copy_slot(src, dst)

    def set_lengths(self, slots, values) -> None:
        dev = self.cache.lengths.device
        self.cache.lengths[slots.to(dev)] = values.to(dev)


@dataclass
class PromptBatch:
    """Prompts (newcomers' right-padded, or a long one's chunk) read after their rows'
    committed entries, as `prefill_step` takes them: in a forward of their own, or in a
    verification step's (`LocalRunner.mixed_step`)."""

    tokens: torch.Tensor  # [B, W]
    positions: torch.Tensor  # [B, W]
    mask: torch.Tensor  # [B, W, W] causal
    slots: torch.Tensor  # [B]
    last_idx: torch.Tensor  # [B]: each prompt's last token
    params: list[SamplingParams]
    generators: list  # [torch.Generator | None] (a tensor-parallel rank's: their states)


@dataclass(frozen=True)
class CacheLayout:
    """A target cache's shape for a memory budget (`cache_layout`)."""

    num_slots: int  # cache slots: the most requests a step runs
    num_blocks: int | None  # paged: blocks of block_size entries the slots share; None: slotted
    block_size: int


def cache_layout(target: TargetModel, num_slots: int, max_len: int,
                 kv_cache_memory: int | float | None = None, num_blocks: int | None = None,
                 block_size: int = BLOCK_SIZE, pages: bool = True) -> CacheLayout:
    """What a K/V budget buys (docs/kv-cache.md "In the service"). Paged: num_slots slots
    over num_blocks blocks, or over what kv_cache_memory holds (`num_blocks_for`); slotted
    (pages False): as many slots of max_len entries as kv_cache_memory holds (the cache's
    real bytes, the CPU's kept key blocks included), at most num_slots and at least one. No
    budget: num_slots slotted, or num_blocks paged. E.g. 512 bytes a token, max_len 258,
    1 MiB: 7 slots."""
    if num_blocks is None and kv_cache_memory is not None and pages:
        num_blocks = num_blocks_for(target, kv_cache_memory, block_size)
    if num_blocks is not None and pages:
        return CacheLayout(num_slots, num_blocks, block_size)
    if kv_cache_memory is not None:
        budget = kv_budget_bytes(target, kv_cache_memory)  # before the one-slot cache below
        per_slot = cache_bytes(target.allocate_cache(1, max_len))
        num_slots = max(1, min(num_slots, int(budget // per_slot)))
    return CacheLayout(num_slots, None, block_size)


def kv_budget_bytes(target: TargetModel, kv_cache_memory: int | float) -> float:
    """kv_cache_memory in bytes: bytes as given, or, given as a fraction in (0, 1] on a CUDA
    target, that fraction of the device's free memory now."""
    budget = float(kv_cache_memory)
    if budget <= 0:
        raise ValueError(f"kv_cache_memory must be > 0, got {kv_cache_memory}")
    if budget <= 1:
        if target.device.type != "cuda":
            raise ValueError("kv_cache_memory as a fraction of free memory needs a CUDA "
                             "target; give bytes")
        budget *= torch.cuda.mem_get_info(target.device)[0]
    return budget


def num_blocks_for(target: TargetModel, kv_cache_memory: int | float, block_size: int) -> int:
    """Blocks of block_size entries that fit a K/V budget (`kv_budget_bytes`), the null block
    left out."""
    per_block = target.kv_bytes_per_token() * block_size
    blocks = int(kv_budget_bytes(target, kv_cache_memory) // per_block) - 1  # the null block
    if blocks < 1:
        raise ValueError(f"kv_cache_memory {kv_cache_memory} holds no block of {per_block} "
                         "bytes; give more")
    return blocks


def cache_bytes(cache) -> int:
    """Bytes a cache's tensors take (K, V, the CPU's kept key blocks, tables, lengths)."""
    return sum(t.numel() * t.element_size() for t in vars(cache).values()
               if isinstance(t, torch.Tensor))


def accepted_features(features: torch.Tensor, nodes: list[list[int]]) -> torch.Tensor:
    """features [B, N, H] -> [B, A, H] of the accepted nodes, A = the longest path, 0-padded.
    E.g. nodes [[0, 2], [0]] -> rows [f[0, 0], f[0, 2]] and [f[1, 0], 0]."""
    width = max(len(n) for n in nodes)
    if width == 1:  # every path the root alone (plain decoding): a copy of the first column
        return features[:, :1].clone()
    idx = torch.tensor([n + [0] * (width - len(n)) for n in nodes], device=features.device)
    rows = torch.arange(features.shape[0], device=features.device)[:, None]
    return features[rows, idx]  # [B, A, H]


# What the lm_head's greedy argmax is timed on: its cost grows with the outputs whose bound
# reaches the best one, many for the near-uniform predictions after random tokens and few
# after text (two threads, caches flushed, 16 / 32 rows: 2.85 / 4.37 ms after random tokens,
# 2.10 / 2.83 after a benchmark prompt), so the budget priced a greedy step's big trees
# (and batches) above what they cost.
TIMING_TEXT = (
    "Write a short story about a lighthouse keeper who finds a message in a bottle. The keeper "
    "had lived alone on the island for twenty years, and every morning he climbed the stairs "
    "to clean the lamp. def count_words(text: str) -> dict:\n    counts = {}\n    for word in "
    "text.split():\n        counts[word] = counts.get(word, 0) + 1\n    return counts\n")


def timing_tokens(target, num: int) -> torch.Tensor:
    """[1, num] tokens to time the lm_head after: TIMING_TEXT repeated where the target has a
    tokenizer, else random ones (seeded)."""
    tok = getattr(target, "tokenizer", None)
    if tok is not None:
        ids = list(tok(TIMING_TEXT)["input_ids"])
        if ids:
            # host: [1, num] ids, which the caller moves to the target's device
            return torch.tensor((ids * (num // len(ids) + 1))[:num])[None]
    gen = torch.Generator().manual_seed(0)
    return torch.randint(0, target.vocab_size, (1, num), generator=gen)
