"""Drafting with the EAGLE head (docs/draft-tree.md): head update, root step, expansion.

One call per decoding step and batch: the head first runs over the newly accepted positions,
fed the target's *true* features (pair t = (feature[t], token[t+1]) at position t), which
refreshes its KV cache; the last output is the root step. Then `depth` expansions, each one
batched head call over the current level whose mask lets a node see the prefix and its own
ancestors only. The head's cache never keeps tree entries: they are scratch past the
committed length, overwritten by the next call. In mode "eagle2" a prompt-lookup chain
(`eagle2.lookup`, docs/draft-tree.md "Prompt lookup") joins the candidates before the rerank; the
drafter keeps each sequence's tokens for it, as it keeps its cache entries.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
from torch import nn

from eagle2.attention import RopeTable, causal_mask, step_inputs, vocab_projection
from eagle2.config import TreeConfig
from eagle2.cuda_graphs import GraphedLevels, graphs_choice, padded_wanted
from eagle2.devices import backend_for
from eagle2.eagle3 import Eagle3Head
from eagle2.head import DraftHead
from eagle2.lookup import Candidates, LookupTable, TokenHistory, add_chains, propose_branches
from eagle2.ngram import NgramStore
from eagle2.tree import HOST, DraftTree, build_tree, root_only, static_shape


@dataclass
class _Level:
    """The nodes fed to the head at one expansion step (M of them per request)."""

    tokens: torch.Tensor  # [B, M]
    scores: torch.Tensor  # [B, M] path value (sum of log-probs)
    cand_idx: torch.Tensor  # [B, M] index into the candidate list
    features: torch.Tensor  # [B, M, H] the parent's predicted feature
    anc: torch.Tensor  # [B, M, T] which earlier scratch entries are ancestors


def _widest(total_tokens: int) -> int:
    """The most children a node of the static tree of this size has (its top k)."""
    return max(rank for lvl in static_shape(total_tokens) for _, rank in lvl) + 1


class Drafter:
    """The head, its per-sequence KV cache and the tree builder. Sequences are keyed by id."""

    def __init__(self, head: DraftHead | Eagle3Head, embed: nn.Embedding, lm_head: nn.Module | None,
                 max_slots: int, max_len: int, tree_margin: int = 256,
                 keep_candidates: bool = False, calibrated: bool = True,
                 cuda_graphs: bool | str | None = None):
        """keep_candidates: keep every expansion's full candidate list (before the rerank)
        in `last_candidates`, for tools that replay acceptance (the bench's tuner).
        calibrated: tree values through the head's calibration when it has one (False: raw
        path values, what `eagle2 calibrate` fits on).
        cuda_graphs: run the tree levels padded to buckets, through CUDA graphs on CUDA
        (`eagle2.cuda_graphs.GraphedLevels`): True / "on", False / "off", "auto" (CUDA heads
        of the torch backends), None: $EAGLE2_CUDA_GRAPHS, else "auto"."""
        self.head = head
        self.calibration = head.calibration if calibrated else None
        table = head.calibration.lookup if head.calibration is not None else None
        self.lookup_table = table or LookupTable()  # a conservative default without one
        # the target's answers' n-gram continuations, where the head ships them: they compete
        # with prompt lookup's chain (`lookup.propose_chain`); None: prompt lookup alone
        self.ngram: NgramStore | None = getattr(head, "ngram", None)
        if self.ngram is not None:
            self.ngram.check_vocab(embed.num_embeddings)
        self.keep_candidates = keep_candidates
        # the head's candidates of the last expansion, before lookup joins them
        self.last_candidates: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]] = []
        # when a list: every lookup proposal is appended to it as (seq_id, history length,
        # match length, tokens, whether each token was new to the candidates), for calibration
        self.lookup_log: list[tuple[str, int, int, list[int], list[bool]]] | None = None
        self.last_fresh: list[torch.Tensor] = []  # [B, D] of the last merges, per chain rank
        self.embed = embed
        param = head.fc.weight
        self.device, self.dtype = param.device, param.dtype
        # [Vd, H]: the target's lm_head rows of the draft vocabulary (EAGLE-1/2) or the
        # head's own lm_head (EAGLE-3)
        self.draft_lm_head = head.output_weight(lm_head).to(device=self.device, dtype=self.dtype)
        self._rope = RopeTable(head.rotary)  # cos, sin of every cache position
        self._rope_like = torch.zeros(1, dtype=self.dtype, device=self.device)  # (its dtype)
        self.d2t = head.d2t.to(self.device) if head.d2t.numel() else None
        backend = backend_for(self.device, self.dtype)
        # padded tree levels (`eagle2.cuda_graphs`): one more cache slot, padded rows' scratch
        padded = padded_wanted(cuda_graphs, self.device, backend)
        self.cache = head.allocate_cache(max_slots + int(padded), max_len + tree_margin)
        # the backend's faster calls of the head (a bf16 CPU: packed linears, native layer;
        # `eagle2.cpu.head.HeadKernels`), None: the torch module path below
        self.kernels = backend.head_kernels(
            head, self.draft_lm_head, self.embed.weight, self.d2t, self.cache, self._rope_table)
        self.levels = GraphedLevels(self, strict=graphs_choice(cuda_graphs) == "on") \
            if padded else None
        self.max_len = max_len
        self.tree_margin = tree_margin
        self.slot_of: dict[str, int] = {}
        self.free = list(range(max_slots))[::-1]
        # seq id -> the token after each position it was given (prompt lookup reads them)
        self.histories: dict[str, TokenHistory] = {}
        # seq id -> positions given but not in the head's cache (skipped by a restart,
        # `TreeConfig.catch_up`): history length - cache length
        self.skipped: dict[str, int] = {}
        if self.kernels is not None and self.kernels.native is not None:
            self.warm_up()

    def warm_up(self) -> None:
        """One throwaway draft, so that the kernels pack their weights and the RoPE table is
        built now rather than in the first request's step (~55 ms on a 2-core CPU, which the
        budget would also take for what a draft call costs)."""
        sid = "__warm_up__"
        fc_in = self.head.fc.in_features  # EAGLE-3: fused target features; else [embed; feature]
        width = fc_in if isinstance(self.head, Eagle3Head) else fc_in // 2
        feats = torch.zeros(1, 2, width, dtype=self.dtype, device=self.device)
        tokens = torch.zeros(1, 2, dtype=torch.long, device=self.device)
        try:
            self.draft([sid], feats, tokens, torch.tensor([2]),
                       TreeConfig(total_tokens=4, depth=2, top_k=2, budget="fixed", lookup=0))
        finally:
            self.release(sid)

    # ----- sequence bookkeeping -------------------------------------------------------------
    def _slots(self, seq_ids: list[str]) -> torch.Tensor:
        for sid in seq_ids:
            if sid not in self.slot_of:
                if not self.free:
                    raise ValueError(f"draft cache is full ({len(self.slot_of)} sequences)")
                slot = self.free.pop()
                self.slot_of[sid] = slot
                self.cache.lengths[slot] = 0
                self.histories[sid] = TokenHistory()
        return torch.tensor([self.slot_of[s] for s in seq_ids], device=self.device)

    def release(self, seq_id: str) -> None:
        slot = self.slot_of.pop(seq_id, None)
        self.histories.pop(seq_id, None)
        self.skipped.pop(seq_id, None)
        if slot is not None:
            self.free.append(slot)

    def length(self, seq_id: str) -> int:
        """Entries in the head's cache for the sequence."""
        return int(self.cache.lengths[self.slot_of[seq_id]])

    def rewind(self, seq_id: str, length: int) -> None:
        """Forget the head's entries of a sequence past `length` (e.g. to draft a step again)."""
        if not 0 <= length <= self.length(seq_id):
            raise ValueError(f"cannot rewind {seq_id!r} to {length}: it holds "
                             f"{self.length(seq_id)} entries")
        self.cache.lengths[self.slot_of[seq_id]] = length
        self.histories[seq_id].truncate(length + self.skipped.get(seq_id, 0))

    def _restart(self, seq_ids: list[str], slots: torch.Tensor, features: torch.Tensor,
                 tokens: torch.Tensor, counts: torch.Tensor, keep: int):
        """Rows with more than `keep` new pairs forget their cache entries and keep only their
        last `keep` pairs, which the head then runs over from position 0 (RoPE depends on
        distances only, so this is a sliding window of `keep` positions at this call).
        -> features, tokens, counts of what the head runs over."""
        skip = (counts - keep).clamp(min=0)
        for b in skip.nonzero().flatten().tolist():
            sid = seq_ids[b]
            self.skipped[sid] = len(self.histories[sid]) + int(skip[b])
            self.cache.lengths[slots[b]] = 0
        idx = (skip[:, None] + torch.arange(keep, device=self.device)).clamp(
            max=tokens.shape[1] - 1)
        return (features.gather(1, idx[:, :, None].expand(-1, -1, features.shape[-1])),
                tokens.gather(1, idx), counts - skip)

    # ----- drafting -------------------------------------------------------------------------
    def _log_probs(self, features: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Top-k draft (log-prob, token) for [..., H] features."""
        x = self.head.pre_logits(features.to(self.dtype))
        if self.kernels is not None:
            values, indices = self.kernels.top_log_probs(x, k)
        else:
            logits = vocab_projection(x, self.draft_lm_head).float()
            values, indices = torch.log_softmax(logits, dim=-1).topk(k, dim=-1)
        return values, indices if self.d2t is None else self.d2t[indices]

    def _run(self, slots: torch.Tensor, tokens: torch.Tensor, features: torch.Tensor,
             positions: torch.Tensor, tree_mask: torch.Tensor, window: int) -> torch.Tensor:
        embeds = self.embed(tokens).to(self.dtype)
        if self.kernels is not None:
            out = self.kernels.run(slots, embeds, features, positions, tree_mask, window)
            if out is not None:
                return out
        inp = step_inputs(self.cache, slots, tree_mask, positions, self.head.rotary, embeds,
                          window)
        return self.head.step(embeds, features, self.cache, inp)

    def _rope_table(self) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [>= S, Dh] of every cache position (built once)."""
        return self._rope.table(self._rope_like, self.cache.max_len)

    def _call_head(self, slots: torch.Tensor, tokens: torch.Tensor, features: torch.Tensor,
                   positions: torch.Tensor, mask: torch.Tensor, window: int, k: int = 0,
                   append_eye: bool = False, logit_rows: torch.Tensor | None = None):
        """One head call over [B, N] new entries (`_run`) and, with k > 0, its top-k draft
        log-probs (`_log_probs`): through the backend's one-operator call where it applies
        (`eagle2.cpu.head.HeadStep`).
        append_eye: mask [B, N, T0] holds the nodes' ancestors and each also sees itself;
        logit_rows [B]: the log-probs of that output of each request only ([B, k]).
        -> outputs [B, N, H], the mask [B, N, T], log-probs and tokens (or Nones)."""
        step = self.kernels.step if self.kernels is not None else None
        if step is not None:
            got = step(slots, self.cache.lengths[slots], tokens, features, positions,
                             mask, append_eye, k, logit_rows)
            if got is not None:
                return got
        if append_eye:
            num_b, num_m = tokens.shape
            eye = torch.eye(num_m, dtype=torch.bool, device=self.device)
            mask = torch.cat([mask, eye.expand(num_b, num_m, num_m)], dim=2)
        out = self._run(slots, tokens, features, positions, mask, window)
        if not k:
            return out, mask, None, None
        picked = out if logit_rows is None else \
            out[torch.arange(out.shape[0], device=self.device), logit_rows]
        return out, mask, *self._log_probs(picked, k)

    @torch.inference_mode()
    def draft(self, seq_ids: list[str], features: torch.Tensor, tokens: torch.Tensor,
              counts: torch.Tensor, config: TreeConfig, min_gain: float = 0.0) -> DraftTree:
        """Append the new pairs and draft one tree per sequence.

        features: [B, A, F] target features of the newly committed positions (F = H, or 3H
        for an EAGLE-3 head: `TargetModel.set_feature_layers`); tokens: [B, A]
        the token after each of them (the last one is the root); counts: [B] valid entries.
        min_gain: the dynamic tree stops expanding once the best frontier values (summed over
        the batch, calibrated) fall below it: deeper nodes could not pay for the expansion.
        -> the trees on the host, where the engine (budget, acceptance) and the draft worker's
        reply read them: the candidates cross from the head's device in one read
        (`build_tree`), and no tree goes back up only to be read down again.
        """
        num_b, num_a = tokens.shape
        assert features.shape[:2] == (num_b, num_a), "features and tokens disagree"
        count_list = counts.tolist()  # (read here, on the host: not back from the device)
        new_tokens = [t[:n] for t, n in zip(tokens.tolist(), count_list, strict=True)]
        features, tokens, counts = (t.to(self.device) for t in (features, tokens, counts))
        if config.depth * config.top_k > self.tree_margin:
            raise ValueError(f"depth x top_k = {config.depth * config.top_k} exceeds the draft "
                             f"cache's tree margin ({self.tree_margin})")
        slots = self._slots(seq_ids)
        if config.catch_up and max(count_list) > config.catch_up:
            features, tokens, counts = self._restart(seq_ids, slots, features, tokens, counts,
                                                     config.catch_up)
            num_a = config.catch_up
        base = self.cache.lengths[slots]
        if int((base + counts).max()) > self.max_len:
            raise ValueError(f"sequence longer than the draft context ({self.max_len})")
        rows = torch.arange(num_b, device=self.device)
        positions = base[:, None] + torch.arange(num_a, device=self.device)
        if self.kernels is not None:
            self.kernels.prepare_step(base + counts, config.draft_window)
        # the root step's top k (the first level) with the update: one call where it applies
        first_k = {"vanilla": 0, "chain": 1, "static": _widest(config.total_tokens)}.get(
            config.mode, config.top_k)
        out, _, *first = self._call_head(slots, tokens, features, positions,
                                         causal_mask(counts, num_a), config.draft_window,
                                         first_k, logit_rows=counts - 1)
        self.cache.lengths[slots] += counts
        for sid, toks in zip(seq_ids, new_tokens, strict=True):
            self.histories[sid].extend(toks)
        root = tokens[rows, counts - 1]
        if config.mode == "vanilla":
            return root_only(root.to(HOST))
        last = out[rows, counts - 1]  # [B, H] predicted feature at the root's position
        if config.mode == "static":
            return self._expand_static(slots, root, last, first, config)
        if config.mode == "chain":  # one child per level: a chain of depth + 1 drafts
            return self._expand_dynamic(slots, root, last, first, replace(config, top_k=1),
                                        min_gain)
        branches = propose_branches([self.histories[s] for s in seq_ids],
                                    [config.lookup] * len(seq_ids), self.lookup_table,
                                    self.ngram) if config.lookup else None
        tree = self._expand_dynamic(slots, root, last, first, config, min_gain, branches)
        if self.lookup_log is not None and branches:
            self._log_chains(seq_ids, branches)
        return tree

    def values(self, raw: torch.Tensor) -> torch.Tensor:
        """Raw path values -> acceptance estimates (the head's calibration, if any)."""
        return raw if self.calibration is None else self.calibration(raw)

    def _first_level(self, last: torch.Tensor, first: list[torch.Tensor]) -> _Level:
        """last: [B, H] the root step's output; first: its top-k log-probs and tokens [B, K]."""
        scores, tokens = first
        num_b, k = tokens.shape
        cand = torch.arange(k, device=self.device).expand(num_b, k)
        feats = last[:, None, :].expand(num_b, k, last.shape[-1])
        return _Level(tokens, scores, cand, feats, last.new_zeros(num_b, k, 0, dtype=torch.bool))

    def _feed(self, slots: torch.Tensor, level: _Level, depth: int, window: int, k: int):
        """Run the head over one level (depth `depth`): -> its outputs [B, M, H], mask rows
        [B, M, T + M], the top-k log-probs of each output and their tokens [B, M, k]."""
        num_b, num_m = level.tokens.shape
        positions = (self.cache.lengths[slots] + depth - 1)[:, None].expand(num_b, num_m)
        if self.levels is not None:  # padded to a bucket (a CUDA graph's replay on CUDA)
            got = self.levels.run(slots, level.tokens, level.features, positions, level.anc,
                                  window, k)
            if got is not None:
                return got
        return self._call_head(slots, level.tokens, level.features, positions, level.anc,
                               window, k, append_eye=True)

    def _expand_dynamic(self, slots, root, last, first, config: TreeConfig,
                        min_gain: float = 0.0,
                        branches: list[list[tuple[list[int], list[float], int]]] | None = None
                        ) -> DraftTree:
        k = config.top_k
        level = self._first_level(last, first)
        cands = [(level.tokens, level.scores, torch.full_like(level.tokens, -1), 1)]
        num_cands = k
        for depth in range(1, config.depth + 1):
            best_next = self.values(level.scores.max(dim=1).values.exp())  # [B] bound
            if min_gain > 0 and float(best_next.sum()) < min_gain:
                break
            out, mask, logp, toks = self._feed(slots, level, depth, config.draft_window, k)
            num_b, num_m = level.tokens.shape
            scores = (level.scores[:, :, None] + logp).reshape(num_b, num_m * k)
            toks = toks.reshape(num_b, num_m * k)
            parents = level.cand_idx[:, :, None].expand(num_b, num_m, k).reshape(num_b, -1)
            cands.append((toks, scores, parents, depth + 1))
            if depth == config.depth:
                break
            best = scores.topk(min(k, num_m * k), dim=1).indices  # next frontier [B, K]
            par = best // k
            level = _Level(
                tokens=toks.gather(1, best), scores=scores.gather(1, best),
                cand_idx=num_cands + best,
                features=out.gather(1, par[:, :, None].expand(-1, -1, out.shape[-1])),
                anc=mask.gather(1, par[:, :, None].expand(-1, -1, mask.shape[2])),
            )
            num_cands += num_m * k
        return self._build(root, cands, config.num_nodes, branches)

    def _expand_static(self, slots, root, last, first, config: TreeConfig) -> DraftTree:
        shape = static_shape(config.total_tokens)
        widest = _widest(config.total_tokens)
        scores, toks = first  # [B, W]
        ranks = torch.tensor([r for _, r in shape[0]], device=self.device)
        num_b = root.shape[0]
        level = _Level(toks[:, ranks], scores[:, ranks],
                       torch.arange(len(ranks), device=self.device).expand(num_b, -1),
                       last[:, None, :].expand(num_b, len(ranks), last.shape[-1]),
                       last.new_zeros(num_b, len(ranks), 0, dtype=torch.bool))
        cands = [(level.tokens, level.scores, torch.full_like(level.tokens, -1), 1)]
        num_cands = len(ranks)
        for depth, spec in enumerate(shape[1:], start=1):
            out, mask, logp, ctoks = self._feed(slots, level, depth, config.draft_window,
                                                widest)  # [B, M, W]
            par = torch.tensor([p for p, _ in spec], device=self.device)
            rank = torch.tensor([r for _, r in spec], device=self.device)
            parent_cand = level.cand_idx[:, par]
            level = _Level(
                tokens=ctoks[:, par, rank], scores=level.scores[:, par] + logp[:, par, rank],
                cand_idx=num_cands + torch.arange(len(spec), device=self.device).expand(num_b, -1),
                features=out[:, par], anc=mask[:, par],
            )
            cands.append((level.tokens, level.scores, parent_cand, depth + 1))
            num_cands += len(spec)
        return self._build(root, cands, num_cands + 1)

    def _build(self, root, cands, num_nodes: int,
               branches: list[list[tuple[list[int], list[float], int]]] | None = None
               ) -> DraftTree:
        """cands: per level (tokens [B, C], scores [B, C], parent candidate [B, C], level);
        branches: per row the lookup chains (tokens, their values, match length:
        `lookup.propose_branches`, the one worth more first) to merge in before the rerank,
        one `add_chains` per rank, so a token the first chain shares with the second is
        one candidate."""
        if self.keep_candidates:
            self.last_candidates = cands
        tokens = torch.cat([c[0] for c in cands], 1)
        scores = torch.cat([c[1] for c in cands], 1)
        raw = scores.float().exp()
        merged = Candidates(
            tokens, torch.cat([c[2] for c in cands], 1), scores,
            torch.cat([torch.full_like(c[0], c[3]) for c in cands], 1),
            torch.where(raw > 0, self.values(raw), 0.0), torch.zeros_like(tokens, dtype=torch.bool))
        self.last_fresh = []
        for rank in range(max(map(len, branches or []), default=0)):
            chains = [row[rank] if len(row) > rank else ([], [], 0) for row in branches]
            merged, fresh = add_chains(merged, *self._chain_tensors(chains))
            self.last_fresh.append(fresh)
        return build_tree(root, merged.tokens, merged.parents, merged.scores, merged.depths,
                          num_nodes, merged.values, merged.lookup, device=HOST)

    def _chain_tensors(self, chains: list[tuple[list[int], list[float], int]]):
        """Lookup chains -> tokens [B, D], lengths [B], rerank scores [B, D] (log of the raw
        value their rate calibrates from) and values [B, D] (their rates)."""
        width = max(len(toks) for toks, _, _ in chains)
        tokens = torch.zeros(len(chains), width, dtype=torch.long)
        rates = torch.zeros(len(chains), width)
        for b, (toks, values, _) in enumerate(chains):
            tokens[b, : len(toks)] = torch.tensor(toks, dtype=torch.long)
            rates[b, : len(toks)] = torch.tensor(values)
        raw = rates if self.calibration is None else self.calibration.raw_for(rates)
        lengths = torch.tensor([len(toks) for toks, _, _ in chains])
        return (tokens.to(self.device), lengths.to(self.device),
                raw.log().to(self.device), rates.to(self.device))

    def _log_chains(self, seq_ids: list[str], branches) -> None:
        """Record each prompt-lookup proposal and which of its tokens neither the head nor a
        chain merged before it had proposed (whether or not the rerank kept them); the n-gram
        store's are not (match 0)."""
        for rank, fresh in enumerate(self.last_fresh):
            flags = fresh.tolist()
            for b, (sid, row) in enumerate(zip(seq_ids, branches, strict=True)):
                toks, _, match = row[rank] if len(row) > rank else ([], [], 0)
                if toks and match:
                    self.lookup_log.append((sid, len(self.histories[sid]), match, toks,
                                            flags[b][: len(toks)]))
