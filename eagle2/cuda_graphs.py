"""CUDA graphs of the serving engine's steps (docs/architecture.md "On GPUs"): the target's
verification and prefill forwards (`GraphedRunner`) and the draft head's tree levels
(`GraphedLevels`), captured per bucket of padded shapes (`eagle2.buckets`); eager elsewhere.

A verification step launches hundreds of small kernels (~55 a decoder layer); at small batches
on a GPU the launch time can exceed the kernels' own. A CUDA graph replays a whole step as one
launch, but only for fixed shapes and with no host synchronisation inside. So:

- a step is padded to a bucket (batch Bb, new entries Nb) and attends over a key-length bucket
  S (`buckets.Buckets`, `buckets.pad_step`): padded rows write only into a reserved scratch
  slot (one cache slot past the real ones); a real row's padded entries write past its real
  tree, in its uncommitted scratch, and see only themselves;
- `padded_step_inputs` builds what `attention.step_inputs` builds (write positions, the
  dense [Bb, 1, Nb, S] mask, RoPE's cos and sin) on the device alone: the committed lengths
  are read on the device, RoPE from a table made beforehand, and every shape is the
  bucket's; the host reads the slots and lengths once before the step to pick S (outside any
  captured region). Over a paged cache (docs/kv-cache.md "CUDA graphs over the paged cache")
  writes and reads go through the block tables, which stay on the device and are updated in
  place between steps, and the scratch slot's table is all the null block.
  The layers are `attention.decoder_layer` as in the torch backend, with
  SDPA over that mask (also where the eager steps attend through FlexAttention); the
  lm_head and the verification run after the replay, eagerly;
- `GraphCache` captures one graph per bucket lazily (on a side stream after warm-up calls
  whose writes go to the scratch slot only), with static input buffers the next step's
  padded inputs are copied into, and replays it; outputs are copied out (`buckets.unpad`).

On CUDA `GraphedRunner` replays; on other devices it runs the same padded step eagerly (what
the CPU tests check, padded against unpadded); steps past the largest bucket (long prefills,
big batches) run the target's own forward. `GraphedLevels` does the same for the draft
head's tree levels (`Drafter(cuda_graphs=)`), with the level's draft log-probs and top-k
inside the graph. Both serve the torch backends (`Backend`,
`eagle2.flex.FlexBackend`); the CPU backend keeps its own kernels (exact bf16 attention:
padded shapes would not keep its bitwise equality with plain decoding), so it is refused
there. `make_runner` (and `runner_class`) picks the runner: its argument or
EAGLE2_CUDA_GRAPHS, "auto" = graphs on CUDA models of the torch backends (a capture that
fails turns them off, logged; "on": raised), "on" elsewhere = the padded steps, eagerly.

`static_forward` and `GraphedForward` are the older fixed-bucket forward for slots 0..B-1
that `eagle2.gpu_check` times per (batch, tokens).
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections import Counter
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from eagle2.attention import KVCache, StepInputs, decoder_layer, dense_step_mask
from eagle2.backend import Backend, TargetOutput, module_layers
from eagle2.buckets import Buckets, PaddedStep, pad_nodes, pad_step, unpad
from eagle2.runner import BLOCK_SIZE, LocalRunner
from eagle2.target import TargetModel

if TYPE_CHECKING:
    from eagle2.drafter import Drafter

log = logging.getLogger(__name__)

# whether the serving engine's steps run through CUDA graphs: "auto" (on for CUDA models of the
# torch backends), "on" (also on other devices, padded and eager: for tests) or "off"
CUDA_GRAPHS_ENV = "EAGLE2_CUDA_GRAPHS"
CHOICES = ("auto", "on", "off")
MAX_GRAPHS = 256  # graphs kept per runner or drafter; new buckets past them run eagerly


def graphs_choice(cuda_graphs: bool | str | None = None) -> str:
    """"auto", "on" or "off" from the argument (True / False / a choice), else
    $EAGLE2_CUDA_GRAPHS, else "auto"."""
    if isinstance(cuda_graphs, bool):
        return "on" if cuda_graphs else "off"
    choice = cuda_graphs or os.environ.get(CUDA_GRAPHS_ENV) or "auto"
    if choice not in CHOICES:
        where = "the argument" if cuda_graphs else CUDA_GRAPHS_ENV
        raise ValueError(f"unknown cuda_graphs {choice!r} (from {where}); use one of {CHOICES}")
    return choice


def padded_wanted(cuda_graphs: bool | str | None, device: torch.device,
                  backend: Backend) -> bool:
    """Whether a model on `device` with `backend` runs its steps padded (through graphs on
    CUDA). The CPU backend keeps its kernels: "auto" leaves it alone, "on" is refused."""
    choice = graphs_choice(cuda_graphs)
    if choice == "off":
        return False
    if backend.name == "cpu":
        if choice == "on":
            raise ValueError(
                "padded (CUDA-graph) steps serve the torch backends; the CPU backend keeps its "
                "own kernels (exact bf16 attention): use cuda_graphs off or auto on a CPU, or "
                "EAGLE2_ATTENTION=flex for the torch path")
        return False
    return choice == "on" or device.type == "cuda"


def padded_step_inputs(cache: KVCache, step: PaddedStep, rope: tuple[torch.Tensor, torch.Tensor],
                       keys: int, contiguous: bool, window: int | None = None,
                       flex: bool | None = None) -> StepInputs:
    """`attention.step_inputs` for a padded step (`buckets.pad_step`), graph-safe: no host
    synchronisation and every shape fixed by the bucket. keys: S, the cache entries attended
    over (>= every row's committed length + the step's scratch region); contiguous: the real
    slots are 0..B-1 (the layers read the first Bb slots as a view, padded rows reading a
    slot they never write; else they gather the step's slots, the scratch slot included);
    rope: cos, sin [>= max position + 1, Dh] (`RopeTable.table`); window: also hide prefix
    entries older than this. The mask is [Bb, 1, Nb, S]. flex (a paged cache laid out
    heads-outer): no mask; the layers attend through FlexAttention over the blocks in place
    (`eagle2.flex.PagedFlexWindow`; True: compiled, False: eager), the padded rows (all
    the null block) seeing nothing."""
    slots, tree_mask = step.slots, step.tree_mask  # [Bb], [Bb, Nb, T]
    num_n = step.positions.shape[1]
    num_t = tree_mask.shape[2]
    dev = slots.device
    base = cache.lengths[slots]  # [Bb] (the scratch slot's: 0)
    scratch = base[:, None] + torch.arange(num_t, device=dev)  # [Bb, T]
    in_place = flex is not None and cache.paged
    mask = None if in_place else dense_step_mask(base, scratch, tree_mask, keys, window)
    cos, sin = rope[0][step.positions], rope[1][step.positions]  # [Bb, Nb, Dh]
    # a paged cache: the layers write through the block tables (the scratch slot's are all
    # the null block) and read each row's first S entries gathered through them, or (flex)
    # the blocks in place
    write_pos = scratch[:, num_t - num_n:]
    inp = StepInputs(slots, write_pos, mask, cos, sin, contiguous, None, None, base,
                     tree_mask, gather_len=keys if cache.paged else 0)
    if cache.paged:  # (as `attention.step_inputs`: once a forward, not once a layer)
        inp.write_entries = cache.entries(slots, write_pos)
        inp.read_blocks = cache.table_rows(slots, keys)
    if in_place:
        from eagle2.flex import PagedFlexWindow, paged_block_mask

        inp.window = PagedFlexWindow(
            paged_block_mask(base, tree_mask, inp.read_blocks, cache.k.shape[1],
                             cache.block_size, window), cache.block_size, flex)
    return inp


def padded_forward(target: TargetModel, cache: KVCache, step: PaddedStep,
                   rope: tuple[torch.Tensor, torch.Tensor], keys: int,
                   contiguous: bool, flex: bool | None = None) -> TargetOutput:
    """The torch backend's `TargetModel.forward` over a padded step (graph-safe): hidden and
    features [Bb, Nb, ...] (`buckets.unpad` takes the real ones). flex: `padded_step_inputs`'s."""
    x = target.embed(step.tokens)  # [Bb, Nb, H]
    inp = padded_step_inputs(cache, step, rope, keys, contiguous, flex=flex)
    return module_layers(target, x, cache, inp)


# the attention of the target's padded steps (inside the CUDA graphs): "sdpa" (over the
# dense mask, the paged cache's entries gathered) or "flex" (FlexAttention over the blocks in
# place: a FlexBackend that reads them so, `eagle2.flex`)
GRAPH_ATTENTION_ENV = "EAGLE2_GRAPH_ATTENTION"
GRAPH_ATTENTIONS = ("sdpa", "flex")


def _host_plan(cache: KVCache, slots: torch.Tensor, needed_past_base: int, buckets: Buckets
               ) -> tuple[int, bool] | None:
    """(S, contiguous) of a step over `slots` whose scratch region has needed_past_base
    entries, or None where it does not fit the cache. The one host read of a padded step
    (slots and committed lengths), before anything is launched for it."""
    num_b = slots.shape[0]
    values = torch.cat([slots, cache.lengths[slots]]).tolist()
    keys = buckets.keys_for(max(values[num_b:]) + needed_past_base, cache.max_len)
    if keys is None:
        return None
    return keys, values[:num_b] == list(range(num_b))


def _current(device: torch.device | None):
    """A context in which `device` (a CUDA device; None: leave it) is the current one."""
    return torch.cuda.device(device) if device is not None else contextlib.nullcontext()


class GraphCache:
    """CUDA graphs of one padded step function, captured lazily per key and replayed.

    `run(key, make, fill, fn)`: the first time a key is met, `make()` builds the step's
    static input buffers (all padding), `fn(buffers)` runs `warmup` times on a side stream
    (warming kernels and allocators up; a padded step writes only the scratch slot then) and
    once under capture, its outputs kept as the graph's output buffers; each call then
    `fill(buffers)` (copies the real inputs in), replays the graph and returns the outputs
    (overwritten by the next replay of that key). All graphs share one memory pool (they
    replay one at a time, on one stream). None for a new key once max_graphs are kept, and
    for every key once a capture failed with `strict` off (logged; `failed` says why): the
    caller then runs its own eager step. Captures and replays run with `device` current
    (streams, capture and replay follow the current device: a model on cuda:1 in a process
    whose current device is cuda:0 would otherwise capture an empty graph, with a warning
    only, and every replay would do nothing)."""

    def __init__(self, max_graphs: int = MAX_GRAPHS, warmup: int = 2, strict: bool = False,
                 device: torch.device | None = None):
        self.max_graphs, self.warmup, self.strict = max_graphs, warmup, strict
        self.device = device
        self.graphs: dict[tuple, tuple] = {}
        self.pool = None
        self.failed: str | None = None
        self.counts: Counter = Counter()  # "captured", "replayed", "full" (eager: no room)

    def run(self, key: tuple, make: Callable[[], object], fill: Callable[[object], None],
            fn: Callable[[object], object]):
        entry = self.graphs.get(key)
        if entry is None:
            if self.failed is not None:
                return None
            if len(self.graphs) >= self.max_graphs:
                if not self.counts["full"]:  # said once: from now on new buckets run eagerly
                    log.warning("%d CUDA graphs kept: a new bucket (%s) and those after it run "
                                "eagerly", self.max_graphs, key)
                self.counts["full"] += 1
                return None
            entry = self._capture(key, make, fn)
            if entry is None:
                return None
        buffers, graph, out = entry
        fill(buffers)
        with _current(self.device):
            graph.replay()
        self.counts["replayed"] += 1
        return out

    def _capture(self, key: tuple, make: Callable[[], object], fn: Callable[[object], object]):
        with _current(self.device):
            return self._capture_here(key, make, fn)

    def _capture_here(self, key: tuple, make: Callable[[], object],
                      fn: Callable[[object], object]):
        try:
            buffers = make()
            current = torch.cuda.current_stream()
            stream = torch.cuda.Stream()
            stream.wait_stream(current)
            with torch.cuda.stream(stream):
                for _ in range(self.warmup):
                    fn(buffers)
            current.wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool, capture_error_mode="thread_local"):
                out = fn(buffers)
        except Exception as e:  # any failure: eager from now on, said once
            if self.strict:
                raise
            self.failed = f"{type(e).__name__}: {e}"
            log.warning("CUDA graph capture of %s failed (%s); eager from now on", key,
                        self.failed)
            return None
        self.pool = graph.pool()
        self.graphs[key] = entry = (buffers, graph, out)
        self.counts["captured"] += 1
        return entry


class GraphedRunner(LocalRunner):
    """`LocalRunner` whose target forwards run padded to buckets (`eagle2.buckets`): replayed
    from one CUDA graph per bucket on CUDA, eagerly on other devices (the same padded step);
    a step past the largest bucket, or whose padded tree would run past the cache, or a new
    bucket once MAX_GRAPHS are kept, runs the target's own forward. The cache has one more
    slot than num_slots, the scratch slot padded rows write into (`lengths` shows the real
    ones).

    graphs: capture CUDA graphs (None: on CUDA); strict: a failed capture raises (else it is
    logged and the runner runs the target's own forward from then on; None: strict where
    $EAGLE2_CUDA_GRAPHS is "on"). `counts` says how steps ran: "graph" (replayed), "padded"
    (eagerly, padded), "eager" (the target's own).

    The cache is paged as `LocalRunner`'s (num_blocks or kv_cache_memory, docs/kv-cache.md
    "Paged cache"): the block tables live on the device, where `set_blocks` writes them in
    place before a step, so a captured graph reads each replay's tables; the scratch slot's
    table is all the null block, so padded rows write nowhere a real row reads."""

    def __init__(self, target: TargetModel, num_slots: int, max_len: int,
                 num_blocks: int | None = None, block_size: int = BLOCK_SIZE,
                 kv_cache_memory: int | float | None = None, *, buckets: Buckets | None = None,
                 graphs: bool | None = None, strict: bool | None = None,
                 attention: str | None = None):
        if target.backend.name == "cpu":
            padded_wanted("on", target.device, target.backend)  # raises: the CPU backend
        super().__init__(target, num_slots + 1, max_len, num_blocks=num_blocks,
                         block_size=block_size, kv_cache_memory=kv_cache_memory)
        # attention: of the padded steps (None: $EAGLE2_GRAPH_ATTENTION, else "sdpa")
        self.attention = attention or os.environ.get(GRAPH_ATTENTION_ENV) or "sdpa"
        if self.attention not in GRAPH_ATTENTIONS:
            raise ValueError(f"unknown graph attention {self.attention!r}; use one of "
                             f"{GRAPH_ATTENTIONS}")
        backend = target.backend
        if self.attention == "flex" and not (self.paged and backend.reads_blocks(self.device)):
            raise ValueError("graph attention 'flex' reads a paged cache's blocks in place: it "
                             "needs a paged cache and a FlexBackend that reads blocks "
                             "(compiled, as on CUDA)")
        # flex: compiled or eager (`padded_step_inputs`); None: SDPA over the dense mask
        self.flex = backend.compiles(self.device) if self.attention == "flex" else None
        self.num_slots = num_slots
        self.scratch_slot = num_slots  # padded rows' slot: committed length 0 for good
        self.buckets = buckets or Buckets()
        cuda = self.device.type == "cuda"
        if graphs and not cuda:
            raise ValueError(f"CUDA graphs need a CUDA target, not {self.device}")
        if strict is None:
            strict = graphs_choice() == "on"
        self.graphs = GraphCache(strict=strict, device=self.device) \
            if (cuda if graphs is None else graphs) else None
        # cos, sin of every cache position, kept here: a graph reads them where they are
        self.rope = target.rope.table(target.embed.weight, max_len)
        self.counts: Counter = Counter()

    @property
    def lengths(self) -> torch.Tensor:
        return self.cache.lengths[: self.num_slots]

    @property
    def info(self) -> dict:
        return {**super().info, "cuda_graphs": self.graphs is not None
                and self.graphs.failed is None, "padded_steps": True,
                "graph_attention": self.attention}

    def target_forward(self, tokens: torch.Tensor, positions: torch.Tensor,
                       tree_mask: torch.Tensor, slots: torch.Tensor) -> TargetOutput:
        with torch.inference_mode():
            out = self._padded(tokens, positions, tree_mask, slots)
            if out is None:
                self.counts["eager"] += 1
                return super().target_forward(tokens, positions, tree_mask, slots)
            return out

    def _padded(self, tokens, positions, tree_mask, slots) -> TargetOutput | None:
        """The padded forward (replayed or eager), unpadded; None: the step fits no bucket."""
        if self.graphs is not None and self.graphs.failed is not None:
            return None
        num_b, num_n = tokens.shape
        bucket_b = self.buckets.batch_for(num_b, self.num_slots)
        bucket_n = self.buckets.nodes_for(num_n)
        if bucket_b is None or bucket_n is None or tree_mask.shape[2] != num_n:
            return None
        plan = _host_plan(self.cache, slots, bucket_n, self.buckets)
        if plan is None:
            return None
        keys, contiguous = plan
        fn = lambda step: padded_forward(self.target, self.cache, step, self.rope, keys,  # noqa: E731
                                         contiguous, self.flex)
        if self.graphs is not None:
            out = self.graphs.run(
                (bucket_b, bucket_n, keys, contiguous),
                lambda: PaddedStep.empty(bucket_b, bucket_n, bucket_n, self.scratch_slot,
                                         self.device),
                lambda bufs: pad_step(tokens, positions, tree_mask, slots, bucket_b, bucket_n,
                                      self.scratch_slot, out=bufs), fn)
            if out is None:  # no more graphs (or none at all): the target's own forward
                return None
            self.counts["graph"] += 1
            return _unpad_output(out, num_b, num_n, copy=True)
        self.counts["padded"] += 1
        step = pad_step(tokens, positions, tree_mask, slots, bucket_b, bucket_n,
                        self.scratch_slot)
        return _unpad_output(fn(step), num_b, num_n, copy=False)


def _unpad_output(out: TargetOutput, num_b: int, num_n: int, copy: bool) -> TargetOutput:
    hidden = unpad(out.hidden, num_b, num_n, copy)
    same = out.features is out.hidden
    return TargetOutput(hidden, hidden if same else unpad(out.features, num_b, num_n, copy))


def runner_class(device: torch.device, cuda_graphs: bool | str | None = None
                 ) -> type[LocalRunner]:
    """The runner class for a target to be loaded on `device` (`LocalRunner.load`):
    `GraphedRunner` where cuda_graphs (None: $EAGLE2_CUDA_GRAPHS, else "auto") is "on", or
    "auto" on CUDA (whose targets run the torch backends; "on" for a target of the CPU backend
    is refused when it is made), else `LocalRunner`."""
    choice = graphs_choice(cuda_graphs)
    on = choice == "on" or (choice == "auto" and device.type == "cuda")
    return GraphedRunner if on else LocalRunner


def make_runner(target: TargetModel, num_slots: int, max_len: int,
                cuda_graphs: bool | str | None = None, num_blocks: int | None = None,
                block_size: int = BLOCK_SIZE, graph_attention: str | None = None
                ) -> LocalRunner:
    """The serving engine's runner for a target in this process: `GraphedRunner` where
    `padded_wanted` says so (cuda_graphs None: $EAGLE2_CUDA_GRAPHS, else "auto": CUDA
    targets of the torch backends; graph_attention: its `attention`), else `LocalRunner`;
    paged over num_blocks blocks where given (and the target pages), else slotted."""
    if padded_wanted(cuda_graphs, target.device, target.backend):
        return GraphedRunner(target, num_slots, max_len, num_blocks, block_size,
                             strict=graphs_choice(cuda_graphs) == "on",
                             attention=graph_attention)
    return LocalRunner(target, num_slots, max_len, num_blocks, block_size)


class GraphedLevels:
    """The draft head's tree levels (`Drafter._feed`: one head call over a level's M nodes per
    request and their top-k draft log-probs) padded to (batch, width) buckets: replayed from
    one CUDA graph per bucket on CUDA (the level's embedding, head layer, draft lm_head,
    log-softmax and top-k in one launch), eagerly elsewhere. The drafter's cache has one slot
    past its real ones for padded rows; a level past the largest bucket, or whose padded
    scratch would run past the cache, returns None (the drafter's own call runs it).

    drafter: its head, embedding, cache and `_log_probs`, on a torch backend
    (`padded_wanted`). graphs, strict, counts: as `GraphedRunner`'s."""

    def __init__(self, drafter: Drafter, buckets: Buckets | None = None,
                 graphs: bool | None = None, strict: bool = False):
        self.drafter = drafter
        self.scratch_slot = drafter.cache.k.shape[1] - 1
        self.buckets = buckets or Buckets()
        cuda = drafter.device.type == "cuda"
        if graphs and not cuda:
            raise ValueError(f"CUDA graphs need a CUDA head, not {drafter.device}")
        self.graphs = GraphCache(strict=strict, device=drafter.device) \
            if (cuda if graphs is None else graphs) else None
        self.rope = drafter._rope_table()  # cos, sin of every cache position (kept here)
        self.counts: Counter = Counter()

    def run(self, slots: torch.Tensor, tokens: torch.Tensor, features: torch.Tensor,
            positions: torch.Tensor, anc: torch.Tensor, window: int | None, k: int):
        """One level: tokens, positions [B, M], features [B, M, H] (each node's parent's
        predicted feature), anc [B, M, T0] (each node's ancestors among the earlier levels'
        entries). -> (outputs [B, M, H], the mask [B, M, T0 + M], log-probs and draft tokens
        [B, M, k]) as `Drafter._call_head(..., append_eye=True)`, or None."""
        if self.graphs is not None and self.graphs.failed is not None:
            return None
        d = self.drafter
        num_b, num_m = tokens.shape
        eye = torch.eye(num_m, dtype=torch.bool, device=d.device)
        mask = torch.cat([anc, eye.expand(num_b, num_m, num_m)], dim=2)  # [B, M, T]
        bucket_b = self.buckets.batch_for(num_b, self.scratch_slot)
        bucket_m = self.buckets.nodes_for(num_m)
        if bucket_b is None or bucket_m is None:
            return None
        num_t = mask.shape[2] - num_m + bucket_m  # the padded scratch region
        plan = _host_plan(d.cache, slots, num_t, self.buckets)
        if plan is None:
            return None
        keys, contiguous = plan
        width = features.shape[-1]

        def fn(bufs):
            return self._level(bufs[0], bufs[1], keys, contiguous, window, k)

        def fill(bufs):
            pad_step(tokens, positions, mask, slots, bucket_b, bucket_m, self.scratch_slot,
                     out=bufs[0])
            pad_nodes(features, bucket_b, bucket_m, 0, out=bufs[1])

        def make():
            return (PaddedStep.empty(bucket_b, bucket_m, num_t, self.scratch_slot, d.device),
                    features.new_zeros(bucket_b, bucket_m, width))

        if self.graphs is not None:
            got = self.graphs.run((bucket_b, bucket_m, num_t, keys, contiguous, window, k,
                                   width, features.dtype), make, fill, fn)
            if got is None:  # no more graphs (or none at all): the drafter's own call
                return None
            self.counts["graph"] += 1
        else:
            bufs = (pad_step(tokens, positions, mask, slots, bucket_b, bucket_m,
                             self.scratch_slot), pad_nodes(features, bucket_b, bucket_m))
            got = fn(bufs)
            self.counts["padded"] += 1
        copy = self.graphs is not None  # a graph's outputs are overwritten by its next replay
        out, logp, toks = (unpad(t, num_b, num_m, copy) for t in got)
        return out, mask, logp, toks

    def _level(self, step: PaddedStep, features: torch.Tensor, keys: int, contiguous: bool,
               window: int | None, k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The padded level (graph-safe): outputs [Bb, Mb, H], log-probs, tokens [Bb, Mb, k]."""
        d = self.drafter
        embeds = d.embed(step.tokens).to(d.dtype)  # [Bb, Mb, H]
        inp = padded_step_inputs(d.cache, step, self.rope, keys, contiguous, window)
        out = d.head.step(embeds, features, d.cache, inp)
        return (out, *d._log_probs(out, k))


def static_step_inputs(cache: KVCache, tree_mask: torch.Tensor, positions: torch.Tensor,
                       rotary: torch.nn.Module, like: torch.Tensor) -> StepInputs:
    """StepInputs for slots 0..B-1 over the whole cache, with no host synchronisation.
    tree_mask [B, N, N], positions [B, N]; the mask is [B, 1, N, S_max]."""
    num_b, num_n = positions.shape
    dev = positions.device
    base = cache.lengths[:num_b]  # [B]
    write_pos = base[:, None] + torch.arange(num_n, device=dev)  # [B, N]
    cols = torch.arange(cache.max_len, device=dev)  # [S]
    mask = (cols[None, None, :] < base[:, None, None]).expand(num_b, num_n, cache.max_len)
    mask = mask.clone()
    mask.scatter_(2, write_pos[:, None, :].expand(num_b, num_n, num_n), tree_mask)
    cos, sin = rotary(like, positions)
    slots = torch.arange(num_b, device=dev)
    return StepInputs(slots, write_pos, mask[:, None], cos, sin, True)


def static_forward(target: TargetModel, cache: KVCache, tokens: torch.Tensor,
                   positions: torch.Tensor, tree_mask: torch.Tensor) -> torch.Tensor:
    """`TargetModel.forward` for slots 0..B-1, graph-safe. -> features [B, N, H]."""
    x = target.embed(tokens)  # [B, N, H]
    inp = static_step_inputs(cache, tree_mask, positions, target.rotary, x)
    for i, layer in enumerate(target.layers):
        x = decoder_layer(layer, i, x, cache, inp, target.head_dim)
    return target.norm(x)


class GraphedForward:
    """The target forward with one CUDA graph per (batch, tokens) bucket."""

    def __init__(self, target: TargetModel, cache: KVCache, buckets: list[tuple[int, int]],
                 warmup: int = 2):
        self.target, self.cache = target, cache
        self.graphs: dict[tuple[int, int], tuple] = {}
        self.enabled = target.device.type == "cuda"
        if self.enabled:
            for num_b, num_n in buckets:
                self.graphs[(num_b, num_n)] = self._capture(num_b, num_n, warmup)

    @torch.inference_mode()
    def _capture(self, num_b: int, num_n: int, warmup: int) -> tuple:
        dev = self.target.device
        tokens = torch.zeros(num_b, num_n, dtype=torch.long, device=dev)
        positions = torch.arange(num_n, device=dev).expand(num_b, num_n).contiguous()
        tree_mask = torch.ones(num_n, num_n, dtype=torch.bool, device=dev).tril()
        tree_mask = tree_mask.expand(num_b, num_n, num_n).contiguous()
        with _current(dev):  # (as GraphCache: the model's device current)
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                for _ in range(warmup):
                    static_forward(self.target, self.cache, tokens, positions, tree_mask)
            torch.cuda.current_stream().wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                out = static_forward(self.target, self.cache, tokens, positions, tree_mask)
        return graph, tokens, positions, tree_mask, out

    @torch.inference_mode()
    def __call__(self, tokens: torch.Tensor, positions: torch.Tensor,
                 tree_mask: torch.Tensor) -> torch.Tensor:
        """features [B, N, H] for slots 0..B-1 (the graph's output buffer when replayed:
        copy it before the next call)."""
        entry = self.graphs.get(tuple(tokens.shape)) if self.enabled else None
        if entry is None:
            return static_forward(self.target, self.cache, tokens, positions, tree_mask)
        graph, s_tokens, s_positions, s_mask, out = entry
        s_tokens.copy_(tokens)
        s_positions.copy_(positions)
        s_mask.copy_(tree_mask)
        with _current(self.target.device):
            graph.replay()
        return out
