"""How requests start in the engine (docs/kv-cache.md "Paged cache", "Chunked prefill beside
decoding"): admission by free rows and, where the cache pages, free blocks (prefix caching
first); preemption of the newest request when blocks run out; the per-step prompt-token
budget that newcomers and a long prompt's chunks share while requests run; the prefill of an
idle engine. `Admission` is part of `eagle2.engine.Engine` (a mixin over its state).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from eagle2.attention import causal_mask
from eagle2.config import SamplingParams
from eagle2.runner import PromptBatch
from eagle2.sequence import Event, Request, SeqState, request_generator
from eagle2.tree import HOST, DraftTree, to_device
from eagle2.verify import TokenLogprobs


@dataclass
class Chunked:
    """A long prompt (or a preempted request's tokens) prefilled one chunk per step while the
    running requests keep decoding (`Engine._prefill_chunk`), in the cache's top row."""

    req: Request
    resumed: SeqState | None
    tokens: list[int]
    start: int  # its cached prefix (prefix caching): entries [0, start) were there
    done: int  # entries written so far
    row: int
    generator: torch.Generator | None
    feats: list[torch.Tensor] = field(default_factory=list)  # [chunk, H] each
    piece: int = 0  # tokens this step reads of it (`Engine._next_chunk`)

    @property
    def left(self) -> int:
        return len(self.tokens) - self.done


class Admission:
    """The engine's admission, preemption, chunked prefill and prefill (`Engine`'s state:
    its rows `seqs`, queues `waiting` and `preempted`, `chunking`, `paging`, `runner`)."""

    def _candidates(self) -> list[SeqState | Request]:
        """Who starts next, in order: preempted requests (oldest admitted first), then the
        waiting ones."""
        return [*self.preempted, *self.waiting]

    @staticmethod
    def _uses_prefix_cache(r: Request) -> bool:
        """Whether a request may take cached prefix blocks: greedy or vanilla ones, whose
        output cannot depend on it. (A seeded sampled request's trees, so its sample, depend
        on the head's input, which a prefix hit shortens: it always computes its prompt.)"""
        return r.params.greedy or r.tree.mode == "vanilla"

    def _admissible(self) -> bool:
        """Whether the first candidate can start now (`_fits`)."""
        return self.paging is None or self._fits(self._candidates()[0], len(self.seqs))

    def _fits(self, c: SeqState | Request, rows: int) -> bool:
        """Whether a candidate's blocks are free beside `rows` running requests, keeping one
        block per running request free for its growth (a request admitted only to be
        preempted at the next step would be recomputed again and again), the chunked prompt
        counted as one (it joins them when read)."""
        req = c.req if isinstance(c, SeqState) else c
        return self.paging.can_admit(self._prefill_tokens(c), self._uses_prefix_cache(req),
                                     spare=rows + (self.chunking is not None))

    @staticmethod
    def _prefill_tokens(c: SeqState | Request) -> list[int]:
        """What a candidate's prefill computes: a prompt, or a resumed request's committed
        entries (all its tokens but the newest)."""
        return c.tokens()[:-1] if isinstance(c, SeqState) else list(c.prompt_ids)

    def _reserve(self, tree: DraftTree) -> DraftTree:
        """Blocks for this step's trees (N entries past each committed prefix); where they run
        out, the newest request is preempted until they fit: a running one (`_preempt`) or
        the chunked prompt (`_unchunk`; a new request is newer than every running one, a
        resumed one keeps its order). -> the trees of the requests still running, in their
        rows' order."""
        before = list(self.seqs)
        num_n = tree.tokens.shape[1]
        lengths = self.runner.lengths[: len(before)].tolist()
        for s, length in sorted(zip(before, lengths, strict=True), key=lambda p: p[0].order):
            while self._row(s) is not None and not self.paging.ensure(
                    s.req.seq_id, self._row(s), length + num_n):
                newest = max(self.seqs, key=lambda x: x.order)
                ch = self.chunking
                if ch is not None and (ch.resumed is None or ch.resumed.order > newest.order):
                    self._unchunk()
                else:
                    self._preempt(newest)
        if len(self.seqs) == len(before):
            return tree
        rows = [next(i for i, b in enumerate(before) if b is s) for s in self.seqs]
        self._ngram_rows = [rows.index(b) for b in self._ngram_rows if b in rows]
        return tree.select(torch.tensor(rows, dtype=torch.long, device=HOST))  # (may be none)

    def _row(self, s: SeqState) -> int | None:
        return next((i for i, x in enumerate(self.seqs) if x is s), None)

    def _unchunk(self) -> None:
        """Stop the chunked prefill: its blocks are freed (the full ones read so far stay in
        the prefix cache) and its request goes back to the head of its queue, to be read
        again when blocks are free."""
        ch = self.chunking
        self._drop_chunk()
        if ch.resumed is not None:
            self.preempted.append(ch.resumed)
            self.preempted.sort(key=lambda x: x.order)
        else:
            self.waiting.insert(0, ch.req)
        self.stats.preemptions += 1

    def _drop_chunk(self) -> None:
        """The chunked prompt's row cleared and its blocks freed (cancelled, or `_unchunk`)."""
        ch, self.chunking = self.chunking, None
        self._clear_row(ch.row)
        if self.paging is not None:
            self.paging.free(ch.req.seq_id, ch.row, ch.row)

    def _preempt(self, s: SeqState) -> None:
        """Free a running request's blocks (and its draft state); it resumes later from its
        prompt and output, recomputed (`_prefill`), with the output it would have had."""
        self._remove(self._row(s))
        s.backlog.clear()
        self.preempted.append(s)
        self.preempted.sort(key=lambda x: x.order)
        self.stats.preemptions += 1

    def _admit(self) -> list[tuple[Request, SeqState | None, list[int], int]]:
        """The candidates that start now (rows free, and blocks where paged), taken off their
        queues: (request, the preempted SeqState or None, tokens to prefill, how many of them
        are cached)."""
        out, widest, total, varlen = [], 0, 0, self._varlen()
        for c in self._candidates():
            rows = len(self.seqs) + len(out)
            tokens = self._prefill_tokens(c)
            widest, total = max(widest, len(tokens)), total + len(tokens)
            cost = total if varlen else widest * (len(out) + 1)  # tokens through the layers
            if rows >= self._rows() or (out and cost > self.prefill_budget) \
                    or (out and self._long(c)):  # a long one is chunked on its own
                break
            if self.paging is not None and not self._fits(c, rows):
                break
            out.append(self._take(c, rows))
        return out

    def _take(self, c: SeqState | Request, row: int
              ) -> tuple[Request, SeqState | None, list[int], int]:
        """A candidate off its queue, its blocks taken for `row` where paged (its prompt's
        cached prefix first). -> (request, the preempted SeqState or None, tokens to prefill, how
        many of them are cached)."""
        resumed = c if isinstance(c, SeqState) else None
        req = c.req if resumed is not None else c
        tokens, cached = self._prefill_tokens(c), 0
        if self.paging is not None:
            cached = self.paging.admit(req.seq_id, row, tokens, self._uses_prefix_cache(req))
            self.stats.prefix_query_tokens += len(tokens)
            self.stats.prefix_hit_tokens += cached
        self.preempted = [s for s in self.preempted if s is not c]
        self.waiting = [r for r in self.waiting if r is not c]
        return req, resumed, tokens, cached

    def _admit_within(self) -> tuple[Chunked | None, list, Chunked | None]:
        """What a mixed step reads beside the trees, within its prompt-token budget
        (`prefill_chunk`), first come first served, as the serving engines' schedulers do:
        the chunked prompt's next piece (`old`), then candidates whole (their tokens past
        the cached prefix) while they fit what is left, then where the one in progress
        finishes (at most one prompt stays chunked) the next candidate's first piece (`new`,
        in the row under the top one while `old` holds it; moved up after the step:
        `_chunk_on`). Rows: newcomers after the running ones, as `_admit`; a new chunk
        needs one more (the old one joins the running ones in the row after the newcomers,
        which must not be the new one's). -> (old, newcomers as `_admit` gives them, new)."""
        old, budget = self.chunking, self.prefill_chunk
        if old is not None:
            old.piece = min(budget, old.left)
            budget -= old.piece
        shared = self.newcomers_in_budget
        whole = budget if shared else self.prefill_budget  # tokens newcomers may take
        held = int(old is not None)  # the top row, until `old` joins the running ones
        may_chunk = old is None or (shared and old.piece == old.left)
        out, new = [], None
        for c in self._candidates():
            rows = len(self.seqs) + len(out)
            if rows + 1 + held > self.max_batch or (shared and budget <= 0) \
                    or (self.paging is not None and not self._fits(c, rows)):
                break
            req = c.req if isinstance(c, SeqState) else c
            tokens = self._prefill_tokens(c)
            need = len(tokens) - (self.paging.cached_prefix(tokens, self._uses_prefix_cache(req))
                                  if self.paging is not None else 0)
            if need <= (whole if shared else min(whole, self.prefill_chunk)):
                out.append(self._take(c, rows))
                whole -= need
                budget -= need if shared else 0
                continue
            if may_chunk and 0 < budget < need and rows + 1 + 2 * held <= self.max_batch:
                new = self._chunk(c, self.max_batch - 1 - held)
                new.piece = min(budget, new.left)
            break
        return old, out, new

    # ----- chunked prefill beside decoding ---------------------------------------------------
    def _rows(self) -> int:
        """Rows running requests may take (the top one is a chunked prefill's)."""
        return self.max_batch - (self.chunking is not None)

    def _long(self, c: SeqState | Request) -> bool:
        """Whether a candidate's prefill is chunked: requests are running and its tokens are
        more than a chunk."""
        return (bool(self.seqs) and self.max_batch > 1
                and len(self._prefill_tokens(c)) > self.prefill_chunk)

    def _admission(self) -> str:
        """How the first candidate starts: "prefill" (with the others that fit, this step),
        "chunk" (a chunk per step from now on) or "wait" (it is long and another prompt is
        being chunked: one at a time)."""
        if not self._long(self._candidates()[0]):
            return "prefill"
        return "chunk" if self.chunking is None else "wait"

    def _start_chunking(self) -> None:
        """The first candidate chunked in the top row; its chunks run from the next call of
        `_prefill_chunk` on."""
        self.chunking = self._chunk(self._candidates()[0], self.max_batch - 1)

    def _chunk(self, c: SeqState | Request, row: int) -> Chunked:
        """A candidate off its queue to be prefilled in chunks in `row` (blocks for all its
        tokens where paged)."""
        req, resumed, tokens, cached = self._take(c, row)
        dev = self.runner.device
        self.runner.set_lengths(torch.tensor([row], device=dev),
                                torch.tensor([cached], device=dev))
        gen = request_generator(req.params) if resumed is None else None
        return Chunked(req, resumed, tokens, cached, cached, row, gen)

    def _chunk_on(self, ch: Chunked) -> None:
        """A prompt whose first piece a mixed step read stays chunked, in the top row."""
        self.chunking, top = ch, self.max_batch - 1
        if ch.row != top:  # (the old chunk held the top row in that step)
            self.runner.copy_slot(ch.row, top)
            self._clear_row(ch.row)
            ch.row = top

    def _prefill_chunk(self) -> list[Event]:
        """The next chunk of the chunked prefill in a forward of its own (`_next_chunk`,
        `_chunk_done`)."""
        t0 = time.perf_counter()
        ch = self.chunking
        ch.piece = min(self.prefill_chunk, ch.left)
        events = self._chunk_done(ch, *self._read(self._next_chunk(ch)))
        self._drop_finished(events)
        self.stats.prefill_s += time.perf_counter() - t0
        return events

    def _read(self, prompts: PromptBatch):
        """A prompt batch's forward of its own (`TargetRunner.prefill_step`)."""
        return self.runner.prefill_step(prompts.tokens, prompts.positions, prompts.mask,
                                        prompts.slots, prompts.last_idx, prompts.params,
                                        prompts.generators)

    def _mixing(self) -> bool:
        """Whether prompts (newcomers, a chunk) ride in the running requests' verification
        forward (`mix_prompts` and a runner with `mixed_step`) rather than in a forward of
        their own."""
        return self.mix_prompts and getattr(self.runner, "mixed_step", None) is not None

    def _can_admit(self) -> bool:
        """Whether a candidate waits, a row is free for it and it fits (`_admissible`)."""
        return bool(self.waiting or self.preempted) and len(self.seqs) < self._rows() \
            and self._admissible()

    def _next_chunk(self, ch: Chunked) -> PromptBatch:
        """A chunked prompt's next piece (`Chunked.piece` tokens): a causal [1, C, C] mask
        after the entries written so far, in its row."""
        dev, num = self.runner.device, ch.piece
        final = ch.done + num == len(ch.tokens) and ch.resumed is None  # a new request's
        # last chunk samples its first token; the others' take greedy parameters
        return PromptBatch(
            torch.tensor([ch.tokens[ch.done:ch.done + num]], device=dev),
            ch.done + torch.arange(num, device=dev)[None],
            causal_mask(torch.tensor([num], device=dev), num), torch.tensor([ch.row], device=dev),
            torch.tensor([num - 1], device=dev), [ch.req.params if final else SamplingParams()],
            [ch.generator if final else None])

    def _chunk_done(self, ch: Chunked, features: torch.Tensor, first: list[int],
                    first_lp: list[TokenLogprobs | None] | None) -> list[Event]:
        """A chunk's entries are written (its `prefill_step` result): the length advances;
        with the last chunk its request joins the running ones (the row after theirs) and
        gets its first token (the caller drops it if that ends it)."""
        dev, num = self.runner.device, ch.piece
        last = num == ch.left
        slots = torch.tensor([ch.row], device=dev)
        ch.feats.append(to_device(features, dev)[0, :num])
        ch.done += num
        self.runner.set_lengths(slots, torch.tensor([ch.done], device=dev))
        self.stats.prefill_tokens += num
        if self.paging is not None:
            self.paging.commit(ch.req.seq_id, ch.done, lambda: ch.tokens)
        events = []
        if last:
            if self.chunking is ch:
                self.chunking = None
            row = len(self.seqs)
            if ch.row != row:  # paged: the block table moves; slotted: the entries
                self.runner.copy_slot(ch.row, row)
                self._clear_row(ch.row)
            event = self._start(ch.req, ch.resumed, ch.tokens, ch.start, torch.cat(ch.feats),
                                first[0], ch.generator, first_lp[0] if first_lp else None)
            events = [event] if event is not None else []
            self._rate, self._depths_used, self._sizes_used = 0.0, [], []
        return events

    def _clear_row(self, row: int) -> None:
        """A row no request holds: length 0, and no blocks where paged."""
        dev = self.runner.device
        self.runner.set_lengths(torch.tensor([row], device=dev), torch.tensor([0], device=dev))
        if self.paging is not None:
            self.runner.set_blocks(row, [])

    def _start(self, r: Request, resumed: SeqState | None, toks: list[int], cached: int,
               feats: torch.Tensor, tok: int, gen: torch.Generator | None,
               logprobs: TokenLogprobs | None = None) -> Event | None:
        """A prefilled request joins the running ones (the next row): its pending pairs are
        (feature of position t, token t + 1) over the computed positions feats [n, H], the
        last one's token the next root (the first new token, or a resumed request's newest
        token). -> a new request's first-token event; None for a resumed one."""
        root = resumed.output[-1] if resumed is not None else tok
        following = torch.tensor(toks[cached + 1:] + [root], device=HOST)  # (`SeqState`)
        self._admitted += 1
        if resumed is not None:
            resumed.pending_feats, resumed.pending_tokens = feats, following
            resumed.probe = True
            self.seqs.append(resumed)
            return None
        s = SeqState(r, gen, feats, following, order=self._admitted)
        self.seqs.append(s)
        return self._emit(s, [tok], [logprobs] if logprobs is not None else None)

    # ----- prefill ----------------------------------------------------------------------------
    def _prefill(self) -> list[Event]:
        """Admitted requests' tokens past their cached prefixes in a step of its own
        (`_prefill_inputs`); new requests get their first token, resumed ones continue."""
        t0 = time.perf_counter()
        idle = not self.seqs
        batch = self._admit()
        prompts = self._prefill_inputs(batch)
        reads = (self.runner.prefill_parts(prompts) if self._varlen()
                 else [self._read(p) for p in prompts])
        events = self._prefill_done(batch, prompts, reads)
        self._drop_finished(events)
        # the gates go with the batch they learnt at when the engine was idle and a newcomer
        # samples, so a seeded request that runs alone samples the same whatever ran before it
        # (its trees, so its sample, depend on them). Greedy newcomers keep them: a gate that
        # learnt speculation does not pay at a batch size would otherwise probe every new
        # batch of requests (at batch 2 on an AVX2 CPU ~1-2% of their decoding)
        if idle and not all(r.params.greedy for r, _, _, _ in batch):
            self.gates.clear()
            self._last_gate = None
        self.stats.prefill_s += time.perf_counter() - t0
        return events

    def _varlen(self) -> bool:
        """Whether admitted prompts are read one group each in one forward (`_mixing` and a
        runner with `prefill_parts`: no padding through the layers), else right-padded into
        one batch."""
        return self._mixing() and getattr(self.runner, "prefill_parts", None) is not None

    def _prefill_inputs(self, batch: list[tuple[Request, SeqState | None, list[int], int]]
                        ) -> list[PromptBatch]:
        """The admitted requests' (`_admit`) tokens past their cached prefixes, causal, in the
        rows after the running ones (their lengths set to the cached prefixes): one
        `PromptBatch` each (`_varlen`), else right-padded into one."""
        dev = self.runner.device
        first = len(self.seqs)
        cached = torch.tensor([c for _, _, _, c in batch], device=dev)
        slots = torch.arange(first, first + len(batch), device=dev)
        self.runner.set_lengths(slots, cached)
        # a resumed request's next token is known: greedy params take no sample from its
        # generator (its output continues as it would have)
        params = [SamplingParams() if s is not None else r.params for r, s, _, _ in batch]
        gens = [None if s is not None else request_generator(r.params) for r, s, _, _ in batch]
        groups = [list(range(len(batch)))]
        if self._varlen():
            groups = [[b] for b in range(len(batch))]
        out = []
        for rows in groups:
            lengths = torch.tensor([len(batch[b][2]) - batch[b][3] for b in rows], device=dev)
            width = int(lengths.max())
            tokens = torch.zeros(len(rows), width, dtype=torch.long, device=dev)
            for i, b in enumerate(rows):
                _, _, toks, c = batch[b]
                tokens[i, : len(toks) - c] = torch.tensor(toks[c:], device=dev)
            out.append(PromptBatch(
                tokens, cached[rows, None] + torch.arange(width, device=dev),
                causal_mask(lengths, width), slots[rows], lengths - 1,
                [params[b] for b in rows], [gens[b] for b in rows]))
        return out

    def _prefill_done(self, batch: list[tuple[Request, SeqState | None, list[int], int]],
                      prompts: list[PromptBatch], reads: list) -> list[Event]:
        """The admitted requests' prompts are written (`reads`: each prompt batch's
        `prefill_step` result, the batches holding the requests in order): they join the
        running ones (the caller drops those it ends); new ones get their first token."""
        dev, rows = self.runner.device, []
        for p, (features, first, first_lp) in zip(prompts, reads, strict=True):
            lengths = p.last_idx + 1
            self.runner.set_lengths(p.slots, p.positions[:, 0] + lengths)
            self.stats.prefill_tokens += int(lengths.sum())
            features = to_device(features, dev)
            rows += [(features[i], first[i], p.generators[i], first_lp[i] if first_lp else None)
                     for i in range(len(first))]
        if self.paging is not None:  # the prompts' full blocks are shareable from now on
            for r, _, toks, _ in batch:
                self.paging.commit(r.seq_id, len(toks), lambda toks=toks: toks)
        events = []
        for (r, resumed, toks, c), (feats, tok, gen, lp) in zip(batch, rows, strict=True):
            event = self._start(r, resumed, toks, c, feats[:len(toks) - c], tok, gen, lp)
            if event is not None:
                events.append(event)
        # what earlier steps learnt goes with the batch they ran: the rate, depths and sizes
        self._rate, self._depths_used, self._sizes_used = 0.0, [], []
        return events
