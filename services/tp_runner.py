"""The tensor-parallel target on Ray: one `TPRank` actor per rank.

See docs/tensor-parallel.md "Tensor parallelism".

`ShardedRunner` is the engine's `TargetRunner` on the driver side:
  1. reserve a placement group of tp_size bundles on one node (STRICT_PACK), one per rank
     ({"GPU": 1, "CPU": c} on a GPU cluster, {"CPU": c} on CPUs);
  2. start one `TPRank` per bundle; rank 0 names the rendezvous (its node IP + a free port);
  3. every rank joins the process group, reads only its own slices of the checkpoint
     (`eagle2.tp.load_rank`) and allocates its own KV cache (its share of the KV heads);
  4. one Ray call per rank starts its step loop (`TPRank.serve`), which connects to the
     driver's step channel (`eagle2.tp_channel`) and reads messages until it is closed; from
     then on a step makes no Ray call: every runner call is one message, written to all ranks
     (lockstep: the all-reduces inside the model need every rank), and only rank 0 replies.
     Cache updates (commit, copy_slot, set_lengths) return nothing: they ride with the next
     message, one message per step instead of two.
Ray still places, starts, health-checks and kills the ranks; a rank that dies closes its
connection, one whose step raises reports the error, and either fails the call at once
(`RankFailure`).
Every rank takes part in a verification's gather (the vocabulary-parallel lm_head: greedy
tokens as one (max, index) pair a row and rank, whole logits only for sampled rows); rank 0
verifies, and its `verify_step` and `prefill_step` return token ids, node indices and accepted
features only, while the other ranks follow (`LocalRunner.follower`: the forward and the
gather, nothing after it). A sampled request's generator state goes to the ranks with the
step and comes back advanced from rank 0, so results equal in-process verification.
Committed lengths are mirrored on the driver so that the engine reads them without a call;
`traffic` counts the messages and bytes sent to and received from the ranks.

With `local_rank0` (CPU ranks; docs/tensor-parallel.md "Rank 0 in the engine") the driver
runs rank 0 itself, on the thread that calls it, and only ranks 1.. are actors: a step is one
message to them and no reply (a verification's carries only the followers' inputs:
`TPRank.follow_verify`), and rank 0's collectives also watch their connections, so that a
rank that fails ends rank 0's wait at once.
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from dataclasses import replace
from pathlib import Path

import ray
import torch
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from eagle2.cuda_graphs import graphs_choice, runner_class
from eagle2.devices import pick_device, pick_dtype
from eagle2.runner import BLOCK_SIZE, LocalRunner
from eagle2.target import embedded_model_dir
from eagle2.threads import TorchThread
from eagle2.tp import check_tp_size, init_tp, socket_group
from eagle2.tp_channel import (
    DriverChannel,
    RankChannel,
    RankError,
    RankLost,
    dumps,
    free_port,
    loads,
)
from eagle2.tree import HOST, to_device


class TPRank:
    """One tensor-parallel rank: a target shard and its KV cache (a Ray actor's body)."""

    def __init__(self, rank: int, tp_size: int, target: str | None, dtype: str | None,
                 num_slots: int, max_len: int, num_threads: int = 1,
                 feature_layers: tuple[int, ...] | None = None, block_size: int = BLOCK_SIZE,
                 kv_cache_memory: int | float | None = None, own_thread: bool = True):
        """own_thread: load and step on a `TorchThread` of its own (an actor, whichever of its
        threads Ray calls on); False: on the caller's thread (rank 0 in the driver, whose
        step loop already is one)."""
        torch.set_num_threads(num_threads)  # the rank's share of the node's cores (its bundle)
        use_tensor_wire()  # the results it sends
        self.rank, self.tp_size = rank, tp_size
        self.target_spec, self.dtype = target, dtype
        self.num_slots, self.max_len = num_slots, max_len
        # this rank's K/V budget (its share: `ShardedRunner`) and block size
        self.block_size, self.kv_cache_memory = block_size, kv_cache_memory
        self.feature_layers = feature_layers  # EAGLE-3 head: TargetModel.set_feature_layers
        self.runner: LocalRunner | None = None
        self.device = pick_device()  # cuda:0 when Ray gave this actor a GPU
        self.busy_s = 0.0  # seconds inside the calls (deferred cache updates included)
        self.calls: Counter = Counter()  # the methods `run` ran, by name
        self.fault_in = 0  # fault tests: `run` calls until this rank raises (0: never)
        # loading (`start`) and the step loop (`serve`) on one thread, whichever of the
        # actor's threads Ray calls them on (`TorchThread`)
        self.torch = TorchThread(f"rank-{rank}") if own_thread else None

    def address(self) -> tuple[str, int]:
        """This node's IP and a free port: the rendezvous of the process group (rank 0)."""
        return ray.util.get_node_ip_address(), free_port()

    def start(self, master_addr: str, master_port: int, timeout_s: float | None = None
              ) -> dict:
        """Join the group, read this rank's shard of the target straight to the device."""
        return self.torch.call(self._start, master_addr, master_port, timeout_s)

    def _start(self, master_addr: str, master_port: int, timeout_s: float | None = None
               ) -> dict:
        dtype = pick_dtype(self.dtype, self.device)
        _check_target(self.target_spec, self.tp_size)  # every rank fails alike, before joining
        init_tp(self.rank, self.tp_size, master_addr, master_port, timeout_s=timeout_s)
        # CUDA graphs with the NCCL collectives captured inside them only where asked for
        # (EAGLE2_CUDA_GRAPHS=on; auto: none at tp > 1 until a GPU run has shown that
        # capture works there: a capture failing on one rank mid-collective could hang the
        # group); the padded steps themselves are tested over tp 2 shards on the CPU
        graphs = "on" if graphs_choice() == "on" else "off"
        self.runner = runner_class(self.device, graphs).load(
            self.target_spec, dtype, self.device, self.num_slots, self.max_len,
            self.feature_layers, self.tp_size, self.rank, block_size=self.block_size,
            kv_cache_memory=self.kv_cache_memory)
        return self.runner.info

    # Tensors arrive from the driver on HOST and go back there: `to_device` both ways.
    # Every rank runs the same runner call, verification included: the vocabulary-parallel
    # lm_head (`eagle2.tp.VocabParallelLMHead`) gathers over all of them, and given the same
    # inputs and generator states each rank reaches the same tokens. Only rank 0 answers.
    def forward(self, tokens, positions, tree_mask, slots, logit_index=None):
        """Rank 0 returns (features, logits) on CPU; the others return None (same values)."""
        features, logits = self.runner.forward(
            *to_device((tokens, positions, tree_mask, slots, logit_index), self.runner.device))
        return to_device((features, logits), HOST) if self.rank == 0 else None

    def verify_step(self, tree, positions, slots, params, gen_states, logits=False):
        """Every rank runs the forward and the verification; rank 0 returns (Verified,
        accepted features [B, A, H] on CPU, advanced generator states), the others None.
        logits: the logits even for greedy rows (`LocalRunner.verify_step`)."""
        gens = _generators(gen_states)  # (the runner moves what its forward reads)
        verified, feats = self.runner.verify_step(tree, positions, slots, params, gens, logits)
        if self.rank != 0:
            return None
        return verified, to_device(feats, HOST), _states(gens)

    def follow_verify(self, tokens, positions, tree_mask, slots, num_nodes, greedy):
        """A rank other than 0 in a `verify_step` whose tree and results rank 0 holds (rank 0
        in the driver): the forward and the gather that ends the verification
        (`LocalRunner.follow_verify`); its message carries only their inputs."""
        self.runner.follow_verify(*to_device((tokens, positions, tree_mask, slots, num_nodes),
                                             self.runner.device), greedy)

    def prefill_step(self, tokens, positions, mask, slots, last_idx, params, gen_states):
        """Rank 0: (features [B, S, H] on CPU, first tokens, their TokenLogprobs where asked,
        generator states); others None."""
        args = to_device((tokens, positions, mask, slots), self.runner.device)
        gens = _generators(gen_states)
        feats, first, logprobs = self.runner.prefill_step(
            *args, to_device(last_idx, self.runner.device), params, gens)
        if self.rank != 0:
            return None
        return to_device(feats, HOST), first, logprobs, _states(gens)

    def mixed_step(self, tree, positions, slots, params, gen_states, prompts):
        """`verify_step` with prompt batches in its forward (`LocalRunner.mixed_step`; their
        generators as states). Rank 0: (Verified, accepted features, generator states, and
        per batch its features, first tokens, TokenLogprobs and generator states)."""
        tree, positions, slots = to_device((tree, positions, slots), self.runner.device)
        gens = _generators(gen_states)
        prompts = self._prompts_here(prompts)
        verified, feats, read = self.runner.mixed_step(tree, positions, slots, params, gens,
                                                       prompts)
        if self.rank != 0:
            return None
        return verified, to_device(feats, HOST), _states(gens), self._read_back(read, prompts)

    def prefill_parts(self, prompts):
        """`LocalRunner.prefill_parts` (generators as states). Rank 0: per batch its features,
        first tokens, TokenLogprobs and generator states."""
        prompts = self._prompts_here(prompts)
        read = self.runner.prefill_parts(prompts)
        return None if self.rank != 0 else self._read_back(read, prompts)

    def _prompts_here(self, prompts: list) -> list:
        """Prompt batches from the driver: tensors on this rank's device, generators rebuilt
        from their states."""
        dev = self.runner.device
        return [replace(p, generators=_generators(p.generators),
                        **{f: to_device(getattr(p, f), dev) for f in PROMPT_TENSORS})
                for p in prompts]

    @staticmethod
    def _read_back(read: list, prompts: list) -> list:
        """Each batch's prefill result for the driver: features on HOST, generator states."""
        return [(to_device(f, HOST), first, logprobs, _states(p.generators))
                for (f, first, logprobs), p in zip(read, prompts, strict=True)]

    def commit(self, slots, node_idx, kept) -> None:
        self.runner.commit(slots, node_idx, kept)  # (the cache moves what it needs)

    def copy_slot(self, src: int, dst: int) -> None:
        self.runner.copy_slot(src, dst)

    def set_lengths(self, slots, values) -> None:
        self.runner.set_lengths(*to_device((slots, values), self.runner.device))

    def set_blocks(self, slot: int, blocks: list[int]) -> None:
        self.runner.set_blocks(slot, blocks)

    def capacity(self) -> dict:
        return self.runner.capacity

    def lengths(self) -> torch.Tensor:
        return to_device(self.runner.lengths, HOST)

    def close(self) -> None:
        """Leave the group (rank 0 in the driver: before a rebuild joins a new one there)."""
        if self.runner is not None:
            group = socket_group(self.runner.target.hf)
            if group is not None:
                group.close()
            self.runner = None
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()

    def inject_fault(self, after_calls: int) -> None:
        """Fault tests: this rank's `after_calls`-th `run` from now (1: the next) raises
        torch.OutOfMemoryError before it starts its method, as a rank that runs out of memory
        would, while its peers go on into the call's collectives and wait there for it."""
        self.fault_in = after_calls

    def run(self, deferred: list[tuple[str, tuple]], method: str, *args):
        """The cache updates sent since the last call, in order, then `method`; rank 0's
        result comes back with this rank's busy seconds so far."""
        if self.fault_in:
            self.fault_in -= 1
            if not self.fault_in:
                raise torch.OutOfMemoryError(f"rank {self.rank}: injected fault in {method}")
        t0 = time.perf_counter()
        for name, update_args in deferred:
            getattr(self, name)(*update_args)
        out = getattr(self, method)(*args)
        self.calls[method] += 1
        self.busy_s += time.perf_counter() - t0
        return out, self.busy_s

    def serve(self, host: str, port: int) -> str:
        """The step loop (one Ray call for the rank's life): connect to the driver's channel,
        then run each message (deferred updates, method, args, every_rank) with `run` and
        reply (rank 0, or every rank when every_rank), until the driver closes the channel.
        A step that raises is reported to the driver and ends the loop: the group is failed
        (its peers may wait in a collective) and the driver kills it."""
        return self.torch.call(self._serve, host, port)

    def _serve(self, host: str, port: int) -> str:
        channel = RankChannel(host, port, self.rank)
        try:
            while True:
                try:
                    deferred, method, args, every_rank = channel.receive()
                except ConnectionError:
                    return "closed"  # the driver shut the group down (or is gone)
                try:
                    out = self.run(deferred, method, *args)
                except Exception as e:
                    channel.report(e)
                    raise
                if self.rank == 0 or every_rank:
                    channel.reply(out)
        finally:
            channel.close()


class RankFailure(RuntimeError):
    """A lockstep call failed on some rank: its task raised (e.g. out of memory), its process
    died, or the call ran past the timeout. The group cannot go on (its peers wait in the
    call's collectives for a rank that left them, and the ranks' caches may now disagree):
    the runner has killed every rank and refuses further calls; the caller rebuilds it, as
    after a dead rank (`services.engine.TargetEngine._step_failed`: UNAVAILABLE)."""


class ShardedRunner:
    """The target split over tp_size `TPRank` actors, driven in lockstep (a TargetRunner)."""

    def __init__(self, tp_size: int, num_slots: int, max_len: int, target: str | None = None,
                 dtype: str | None = None, use_gpu: bool = False, cpus_per_rank: float = 1.0,
                 placement: PlacementGroup | None = None, first_bundle: int = 0,
                 timeout_s: float = 600.0, gpu_per_rank: float = 1.0,
                 feature_layers: tuple[int, ...] | None = None, block_size: int = BLOCK_SIZE,
                 kv_cache_memory: int | float | None = None, local_rank0: bool = False):
        """target: a model directory, a .gguf file or None (the embedded SmolLM2); dtype: None
        = fp32 on CPU, bf16 on GPU. num_slots, max_len: each rank's KV cache, as LocalRunner.
        placement: use these bundles (first_bundle ..) of an existing placement group, e.g. a
        Serve replica's, instead of reserving one (then it is not removed on shutdown).
        timeout_s: how long one lockstep call (or the start) may take before TimeoutError.
        gpu_per_rank: each rank's Ray GPU share when use_gpu (below 1 when a draft worker
        shares the GPUs; a rank still gets one device of its own).
        feature_layers: the layer inputs an EAGLE-3 head reads (None: the final hidden state).
        block_size, kv_cache_memory: each rank's cache as `LocalRunner`'s (its bytes, or a
        fraction of its GPU's free memory: paged in blocks, or fewer slots where it cannot
        page); the group runs what every rank holds (`capacity`, `_group_capacity`).
        local_rank0: run rank 0 in this process (on the calling thread, which must be the one
        that steps: `TorchThread`) and ranks 1.. on actors on this node; CPU ranks only
        (their socket collectives watch the other ranks' connections; NCCL's cannot be
        interrupted by a rank that fails before its collectives). The caller reserves rank
        0's CPUs; the placement group holds tp_size - 1 bundles.
        """
        _check_target(target, tp_size)
        if local_rank0 and (use_gpu or tp_size < 2):
            raise ValueError("local_rank0 runs rank 0 of a CPU group in this process: it needs "
                             f"tp_size >= 2 (got {tp_size}) and use_gpu False (got {use_gpu})")
        use_tensor_wire()  # the arguments this process sends to the ranks
        self.tp_size, self.timeout_s = tp_size, timeout_s
        self.device = torch.device("cpu")  # where the engine's tensors live (the driver)
        self._lengths = torch.zeros(num_slots, dtype=torch.long)  # [slots] mirror of the ranks'
        self._own_placement = placement is None
        # the ranks on actors (`actors[i]` is rank `remote[i]`): all, or 1.. with local_rank0
        self.remote = list(range(1 if local_rank0 else 0, tp_size))
        if placement is None:
            bundle = {"CPU": cpus_per_rank, **({"GPU": gpu_per_rank} if use_gpu else {})}
            if local_rank0:  # on this node: rank 0 reaches them over loopback
                bundle[f"node:{ray.util.get_node_ip_address()}"] = 0.001
            placement = placement_group([dict(bundle) for _ in self.remote],
                                        strategy="STRICT_PACK")
        self.placement = placement
        self.local: TPRank | None = None  # rank 0 in this process (local_rank0)
        self.actors: list = []
        self.loops: list = []  # each rank's step loop (`TPRank.serve`): ends when it fails
        self._channel: DriverChannel | None = None
        self._stepping = threading.Lock()  # held while a message is out (`check_health`)
        self._deferred: list = []  # cache updates for the next call: [(method, args)]
        self.failed: str | None = None  # what failed the group (`_fail`); then no more calls
        self.failed_rank: int | None = None  # the rank whose task failed the last call
        self._rank_busy_s = 0.0
        try:
            self._gather([placement.ready()])
            # threaded: Ray calls beside the step loop (inject_fault, a pid) still run
            actor_cls = ray.remote(max_concurrency=4)(TPRank)
            rank_args = (tp_size, target, dtype, num_slots, max_len, max(1, int(cpus_per_rank)),
                         feature_layers, block_size, kv_cache_memory)
            self.actors = [actor_cls.options(
                num_cpus=cpus_per_rank, num_gpus=gpu_per_rank if use_gpu else 0,
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    placement, placement_group_bundle_index=first_bundle + i),
            ).remote(rank, *rank_args) for i, rank in enumerate(self.remote)]
            if local_rank0:
                self.local = TPRank(0, *rank_args, own_thread=False)
                master_addr, master_port = self.local.address()
            else:
                master_addr, master_port = self._gather([self.actors[0].address.remote()],
                                                        self.remote[:1])[0]
            starts = [a.start.remote(master_addr, master_port, timeout_s) for a in self.actors]
            # rank 0 here joins beside them (the join waits for every rank), then loads
            infos = [self.local._start(master_addr, master_port, timeout_s)] if self.local \
                else []
            infos += self._gather(starts, self.remote)
            # the cache every rank holds (`LocalRunner.capacity`)
            self.capacity = _group_capacity(
                ([self.local.capacity()] if self.local else [])
                + self._gather([a.capacity.remote() for a in self.actors], self.remote))
            self._channel = DriverChannel(ray.util.get_node_ip_address(), self.remote)
            self.loops = [a.serve.remote(*self._channel.address) for a in self.actors]
            self._channel.accept(timeout_s, alive=self._loops_alive)
            if self.local is not None:  # a wait in rank 0's collectives ends when one fails
                socket_group(self.local.runner.target.hf).watch(self._channel.sockets,
                                                                timeout_s)
        except BaseException:
            self.shutdown()
            raise
        self.info = infos[0]  # vocab_size, device, dtype, local_kv_heads, fused of rank 0
        self._lengths = torch.zeros(self.capacity["num_slots"], dtype=torch.long)
        self.vocab_size = infos[0]["vocab_size"]
        # calls: runner calls (deferred updates included); steps: messages sent; ray_calls: Ray
        # calls to the ranks since the loops started (none per step); bytes_out / bytes_in,
        # frames_out / frames_in: what crossed the channel (a message is one frame a rank);
        # wait_s: seconds the driver waited for the ranks' replies
        self.traffic: Counter = Counter()

    # ----- TargetRunner -----------------------------------------------------------------------
    @property
    def lengths(self) -> torch.Tensor:
        return self._lengths

    @property
    def paged(self) -> tuple[int, int] | None:
        """(num_blocks, block_size) every rank's paged cache holds, else None (slotted)."""
        blocks = self.capacity["kv_blocks"]
        return (blocks, self.capacity["block_size"]) if blocks else None

    def forward(self, tokens, positions, tree_mask, slots, logit_index=None):
        """(features, logits) from rank 0: logits cross the process boundary, so the engine
        uses verify_step / prefill_step; this stays for tests and tools."""
        return self._all("forward", tokens, positions, tree_mask, slots, logit_index)[0]

    def verify_step(self, tree, positions, slots, params, generators, logits=False):
        call = ("verify_step", (tree, positions, slots, params,
                                _states(_sampled(params, generators)), logits))
        if self.local is None:
            reply = self._all(call[0], *call[1])
        else:  # ranks 1.. follow rank 0 here: the forward's inputs, the gather's kind
            greedy = self.local.runner.greedy_verification(params, logits)
            reply = self._all("follow_verify", tree.tokens, positions, tree.tree_mask, slots,
                              tree.num_nodes, greedy, local=call)
        verified, feats, states = reply[0]
        _restore(generators, states)
        return verified, feats

    def prefill_step(self, tokens, positions, mask, slots, last_idx, params, generators):
        feats, first, logprobs, states = self._all("prefill_step", tokens, positions, mask,
                                                   slots, last_idx, params,
                                                   _states(_sampled(params, generators)))[0]
        _restore(generators, states)
        return feats, first, logprobs

    def mixed_step(self, tree, positions, slots, params, generators, prompts):
        """`LocalRunner.mixed_step` on every rank: the prompt batches in the verification's
        forward (one message, one pass over each rank's weights)."""
        verified, feats, states, read = self._all(
            "mixed_step", tree, positions, slots, params,
            _states(_sampled(params, generators)), _wire(prompts))[0]
        _restore(generators, states)
        return verified, feats, _restored(prompts, read)

    def prefill_parts(self, prompts):
        """`LocalRunner.prefill_parts` on every rank (one message)."""
        return _restored(prompts, self._all("prefill_parts", _wire(prompts))[0])

    # Cache updates return nothing, so they wait for the next call (the next forward) and run
    # first in it, in the order made; that call raises their errors.
    def commit(self, slots, node_idx, kept) -> None:
        self._all("commit", slots, node_idx, kept, wait=False)
        self._lengths.index_add_(0, slots.cpu(), kept.cpu())

    def copy_slot(self, src: int, dst: int) -> None:
        self._all("copy_slot", src, dst, wait=False)
        self._lengths[dst] = self._lengths[src]

    def set_lengths(self, slots, values) -> None:
        self._all("set_lengths", slots, values, wait=False)
        self._lengths[slots.cpu()] = values.cpu()

    def set_blocks(self, slot: int, blocks: list[int]) -> None:
        self._all("set_blocks", slot, list(blocks), wait=False)

    # ----- lifecycle and checks ---------------------------------------------------------------
    def rank_lengths(self) -> list[torch.Tensor]:
        """Each rank's committed lengths (they must all equal `lengths`)."""
        return self._all("lengths", every_rank=True)

    def inject_fault(self, rank: int, after_calls: int = 1) -> None:
        """Fault tests: rank `rank` raises at its `after_calls`-th call from now
        (`TPRank.inject_fault`); a rebuilt group has no fault."""
        if self.local is not None and rank == 0:
            self.local.inject_fault(after_calls)
            return
        self.traffic["ray_calls"] += 1
        self._gather([self.actors[self.remote.index(rank)].inject_fault.remote(after_calls)],
                     [rank])

    def check_health(self) -> None:
        """RankFailure if a rank died or its loop ended since the last call (no step needed:
        a dead rank's connection has ended; Ray says whether a loop is still running). Safe
        from another thread: while a step is in flight it returns at once (the step watches
        the connections itself)."""
        self._check_usable()
        if not self._stepping.acquire(blocking=False):
            return
        try:
            self._channel.poll()
            self._loops_alive()
        except (RankError, RankLost, RuntimeError, ray.exceptions.RayError) as e:
            raise self._fail("check_health", e) from e
        finally:
            self._stepping.release()

    def shutdown(self) -> None:
        """Close the channel (the loops end), kill the rank actors, leave the group (rank 0
        here) and release the placement group (if this runner reserved it)."""
        if self._channel is not None:
            self._channel.close()
            self._channel = None
        self._kill_ranks()
        self._close_local()
        self.actors, self.loops, self._deferred = [], [], []
        if self._own_placement and self.placement is not None:
            remove_placement_group(self.placement)
        self.placement = None

    def _kill_ranks(self, wait_s: float = 30.0) -> None:
        """Kill every rank actor and wait (up to `wait_s`) until each is gone: a rank stuck in
        a collective (waiting for a peer whose task failed) leaves it only so; gloo and NCCL
        would wait out their own timeouts. ray.kill only sends the request, and a rank whose
        loop has ended would still answer calls until it arrives; waiting makes "the group
        failed" mean "no rank runs", and frees the ranks' CPUs and memory for a rebuild."""
        for actor in self.actors:
            ray.kill(actor, no_restart=True)
        deadline = time.monotonic() + wait_s
        for actor in self.actors:
            while time.monotonic() < deadline:
                left = max(deadline - time.monotonic(), 0.01)
                try:
                    ray.get(actor.__ray_ready__.remote(), timeout=left)
                except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
                    break
                time.sleep(0.05)

    def _close_local(self) -> None:
        """Rank 0 in this process leaves the group (a rebuild joins a new one)."""
        if self.local is not None:
            self.local.close()
            self.local = None

    def _loops_alive(self) -> None:
        """Raise the error of a rank's step loop that has ended (it never ends by itself)."""
        if not self.loops:
            return
        done, _ = ray.wait(self.loops, num_returns=1, timeout=0)
        if done:
            self.failed_rank = self.remote[self.loops.index(done[0])]
            ray.get(done[0])  # its error (a task that raised, an actor that died)
            raise RuntimeError(f"rank {self.failed_rank}'s step loop ended")

    def _check_usable(self) -> None:
        if self.failed is not None:
            raise RankFailure(f"the tensor-parallel ranks failed earlier ({self.failed}); "
                              "rebuild the runner")
        if self._channel is None:
            raise RuntimeError("this ShardedRunner is shut down")

    def _all(self, method: str, *args, wait: bool = True, every_rank: bool = False,
             local: tuple[str, tuple] | None = None) -> list:
        """Run `method` on every rank with the same arguments: one message on the channel.
        -> [rank 0's result], or every rank's in rank order when every_rank; wait=False: none,
        the call goes with the next message. local: (method, args) rank 0 runs instead, when
        it runs here. Any rank's failure fails the group at once: the ranks are killed and
        RankFailure raised (`_fail`)."""
        self._check_usable()
        self.traffic["calls"] += 1
        if not wait:  # a snapshot, as a sent call would be
            self._deferred.append((method, tuple(a.clone() if isinstance(a, torch.Tensor) else a
                                                 for a in args)))
            return []
        deferred, self._deferred = self._deferred, []
        ranks = tuple(range(self.tp_size)) if every_rank else (0,)
        t0 = time.perf_counter()
        try:
            with self._stepping:
                self._channel.broadcast((deferred, method, args, every_rank))
                if self.local is None:
                    replies = self._receive(ranks)
                else:
                    replies = [self._run_local(deferred, *(local or (method, args))),
                               *self._receive(ranks[1:])]
                results, busy = zip(*replies, strict=True)
        except (RankError, RankLost, TimeoutError) as e:
            raise self._fail(local[0] if local else method, e) from e  # the runner call's name
        self.traffic["wait_s"] += time.perf_counter() - t0
        self.traffic["steps"] += 1
        for key in ("bytes_out", "bytes_in", "frames_out", "frames_in"):
            self.traffic[key] = self._channel.counts[key]
        self._rank_busy_s = busy[0]
        return list(results)

    def _receive(self, ranks: tuple[int, ...]) -> list:
        """The (result, busy seconds) replies of `ranks` to the message just sent."""
        return self._channel.receive(ranks, self.timeout_s) if ranks else []

    def _run_local(self, deferred: list, method: str, args: tuple) -> tuple:
        """Rank 0's share of a call, in this process: (result, busy seconds). Its collectives
        end early when another rank fails (`SocketGroup.watch`: PeerAlert, or the peer's
        connection ends); that rank's error is raised (RankError / RankLost), else rank 0's
        own as a rank's would be (RankError naming rank 0). A peer silent for timeout_s is a
        timeout, as a reply that does not come."""
        try:
            return self.local.run(deferred, method, *args)
        except TimeoutError:
            self._channel.poll()
            raise
        except Exception as e:
            # the rank that failed first has written its error or closed its connection
            self._channel.poll(timeout_s=5.0 if isinstance(e, ConnectionError) else 0.0)
            raise RankError(0, type(e).__name__, str(e)[:500]) from e

    def rank_busy_s(self) -> float:
        """Seconds rank 0 spent inside the calls so far (as of the last one)."""
        return self._rank_busy_s

    def _fail(self, method: str, error: BaseException) -> RankFailure:
        """The group failed in call `method` (a rank's step raised, its process died or the
        call timed out): kill every rank at once, so that none waits on in a collective, and
        say which rank failed first and how."""
        if self._channel is not None:
            self._channel.close()
        self._kill_ranks()
        self._close_local()
        self._deferred = []
        if isinstance(error, RankError):
            self.failed_rank, kind = error.rank, error.kind
        elif isinstance(error, RankLost):
            self.failed_rank, kind = error.rank, "process gone"
        elif isinstance(error, ray.exceptions.RayTaskError):  # a loop's own exception
            kind = type(error.cause).__name__
        else:  # a timeout, or a loop that ended (`_loops_alive` names its rank)
            self.failed_rank = None if isinstance(error, TimeoutError) else self.failed_rank
            kind = type(error).__name__
        rank = "no rank answered" if self.failed_rank is None else f"rank {self.failed_rank}"
        self.failed = f"{rank}: {kind} in {method}"
        return RankFailure(f"tensor-parallel call failed ({self.failed}): {str(error)[:200]}")

    def _gather(self, refs: list, ranks: list[int] | None = None) -> list:
        """ray.get, but a failed rank raises at once (its peers would wait in an all-reduce);
        `failed_rank` says which one it was (ranks: each ref's rank; None where the refs are
        not ranks' calls, or the call timed out). For the start and Ray calls beside the step
        loops."""
        late = f"tensor-parallel call still running after {self.timeout_s} s"
        self.failed_rank = None
        if len(refs) == 1:  # one rank: nobody waits for it
            try:
                return [ray.get(refs[0], timeout=self.timeout_s)]
            except ray.exceptions.GetTimeoutError:
                raise TimeoutError(late) from None
            except ray.exceptions.RayError:
                self.failed_rank = ranks[0] if ranks else None
                raise
        pending = list(refs)
        while pending:
            done, pending = ray.wait(pending, num_returns=1, timeout=self.timeout_s)
            if not done:
                raise TimeoutError(late)
            try:
                ray.get(done)
            except ray.exceptions.RayError:
                self.failed_rank = ranks[refs.index(done[0])] if ranks else None
                raise
        return ray.get(refs)


def _group_capacity(ranks: list[dict]) -> dict:
    """The group's `LocalRunner.capacity`: rank 0's, with the slots and blocks every rank
    holds (budgets given as a fraction of free memory may give ranks different counts; the
    blocks past the smallest count stay unused)."""
    out = dict(ranks[0])
    out["num_slots"] = min(r["num_slots"] for r in ranks)
    if out["kv_blocks"]:
        out["kv_blocks"] = min(r["kv_blocks"] for r in ranks)
    return out


def use_tensor_wire() -> None:
    """Send tensors to and from the ranks through Ray (the calls beside the step channel:
    start-up, capacity, lengths) as the step channel frames them (`eagle2.tp_channel.dumps`:
    raw bytes, dtype and shape, moved to the CPU; torch's own pickling costs ~100 us per
    tensor each way). Ray's serializer for this process; the receiving side only needs this
    module."""
    ray.util.register_serializer(torch.Tensor, serializer=dumps, deserializer=loads)


PROMPT_TENSORS = ("tokens", "positions", "mask", "slots", "last_idx")  # a PromptBatch's


def _wire(prompts: list) -> list:
    """Prompt batches for the ranks: their sampled rows' generators as states."""
    return [replace(p, generators=_states(_sampled(p.params, p.generators))) for p in prompts]


def _restored(prompts: list, read: list) -> list:
    """Rank 0's per-batch prefill results: the batches' generators advanced as rank 0's,
    -> (features, first tokens, TokenLogprobs) each."""
    for p, (*_, states) in zip(prompts, read, strict=True):
        _restore(p.generators, states)
    return [r[:3] for r in read]


def _sampled(params: list, generators: list) -> list:
    """The generators of the sampled rows (None for greedy ones: nothing to carry)."""
    return [None if p.greedy else g for p, g in zip(params, generators, strict=True)]


def _states(generators: list) -> list:
    """Generator states (5 KB each) of the sampled requests; None for greedy ones."""
    return [None if g is None else g.get_state() for g in generators]


def _generators(states: list) -> list:
    out = []
    for state in states:
        gen = None
        if state is not None:
            gen = torch.Generator()
            gen.set_state(state)
        out.append(gen)
    return out


def _restore(generators: list, states: list) -> None:
    for gen, state in zip(generators, states, strict=True):
        if state is not None:
            gen.set_state(state)


def _check_target(target: str | None, tp_size: int) -> None:
    """Fail on the driver, before reserving anything, when the model cannot be split."""
    if tp_size < 1:
        raise ValueError(f"tp_size must be >= 1, got {tp_size}")
    path = embedded_model_dir() if target is None else Path(target)
    if path.is_dir():  # a .gguf file is checked by the ranks
        from transformers import AutoConfig

        check_tp_size(AutoConfig.from_pretrained(path), tp_size)
