"""The service's one typed configuration, filled from the Serve config YAML's `args`.

Validated with pydantic at the boundary; the core's frozen dataclasses are built from it.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from eagle2.config import MAX_LOOKUP, TreeConfig


class TreeSettings(BaseModel):
    """Draft-tree budget, as `eagle2.config.TreeConfig`: with budget "auto" (the default) the
    sizes are maxima and the engine cuts each step's trees to what pays on this hardware at
    the current batch (from the forward costs it measures at start-up, cached per machine)."""

    model_config = ConfigDict(extra="forbid")
    mode: Literal["eagle2", "static", "chain", "vanilla"] = "eagle2"
    total_tokens: int = Field(32, ge=2, le=128)
    depth: int = Field(6, ge=1, le=16)
    top_k: int = Field(8, ge=1, le=32)
    draft_window: int = Field(2048, ge=16)
    budget: Literal["auto", "fixed"] = "auto"
    # Longest prompt-lookup chain in the tree (mode "eagle2"; 0: off), docs/draft-tree.md
    # "Prompt lookup".
    lookup: int = Field(TreeConfig.lookup, ge=0, le=MAX_LOOKUP)
    # The head's catch-up per draft call (0: no limit, else >= 16), TreeConfig.catch_up.
    catch_up: int = Field(TreeConfig.catch_up, ge=0)

    def to_core(self, mode: str | None = None) -> TreeConfig:
        return TreeConfig(mode or self.mode, self.total_tokens, self.depth, self.top_k,
                          self.draft_window, self.budget, self.lookup, self.catch_up)


class ServiceConfig(BaseModel):
    """Everything a deployment needs. Paths may be local directories or mounted volumes."""

    model_config = ConfigDict(extra="forbid")
    # Target: a HF model directory or .gguf file; None = the embedded SmolLM2-135M-Instruct.
    target: str | None = None
    # Draft head directory, "untrained", or None for the head shipped for the target.
    draft: str | None = None
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    # Tensor-parallel ranks for the target (one Ray actor each, in one placement group).
    tp_size: int = Field(1, ge=1, le=64)
    # Where the target runs: "ranks" = on the tp_size rank actors (driven over a step channel);
    # "engine" = in the engine replica: the whole target at tp_size 1 (as vLLM's uniprocess
    # executor), rank 0 of it at tp_size > 1 with ranks 1.. on actors (CPU ranks only, as
    # vLLM's driver worker; docs/tensor-parallel.md "Rank 0 in the engine"); "auto" =
    # "engine", except "ranks" for GPU ranks at tp_size > 1.
    target_placement: Literal["auto", "ranks", "engine"] = "auto"
    # GPUs: each TP rank (or the engine replica holding the target) and the draft worker ask
    # for one when true.
    use_gpu: bool = False
    # Engine replicas (each with its own tp_size ranks and draft worker); `eagle2 plan
    # --layouts` ranks replicas x tp for a node, e.g. 2 x tp4 on 8 GPUs.
    num_replicas: int = Field(1, ge=1, le=64)
    # The draft worker's GPU share: 1.0 = a GPU of its own; below 1 it shares a GPU with a TP
    # rank, and every rank then asks for 1 - draft_gpu_fraction (Ray packs the fractions; at
    # tp_size > 1 it must be below 0.5, so that no two ranks fit on one GPU).
    draft_gpu_fraction: float = Field(1.0, gt=0, le=1)
    # CPUs reserved per TP rank (its placement-group bundle, or the engine replica when it
    # holds the target); also a rank actor's torch threads.
    cpus_per_rank: float = Field(1.0, gt=0)
    # torch threads of a target the engine replica holds on the CPU: "auto" = EAGLE2_THREADS
    # if set, else the count that decodes fastest on this machine when quiet (measured at
    # start and cached, as `Eagle2.load` does), fewer while other processes keep cores busy
    # (`eagle2.threads.LoadFollower`); None = cpus_per_rank (before this setting existed);
    # N = that many. On a 2-core VM, where the router, the gRPC proxy and the draft worker
    # share the cores with the step, "auto" (two threads) served 80.4-83.8 tokens/s against
    # 73.4-75.4 with one (8 requests x 128, greedy, one at a time).
    engine_threads: int | Literal["auto"] | None = "auto"
    # "worker": the head runs in its own deployment, reached over gRPC; "inprocess": in the
    # engine replica (single-GPU deployments), otherwise the same code path.
    draft_placement: Literal["worker", "inprocess"] = "worker"
    tree: TreeSettings = TreeSettings()
    # The target's cache (docs/kv-cache.md "In the service"). max_running: the most requests
    # a step runs (the runner's cache slots); the rest wait, max_queued_requests counting them.
    # The target keeps its K/V in blocks of block_size entries shared by the running
    # requests (every backend's attention reads them: SDPA, FlexAttention, the CPU's exact
    # and native bf16 attention; the CUDA-graph runner; tensor-parallel ranks): a request
    # starts when blocks for its prompt are free, the newest is preempted (and recomputed
    # later) when they run out, and with prefix_caching a prompt reuses the blocks of its
    # longest cached prefix.
    max_running: int = Field(64, ge=1, le=1024)
    # Deprecated: the older name of max_running (existing configs); it sets max_running where
    # max_running is not given.
    max_batch_size: int | None = Field(None, ge=1, le=1024)
    # Bytes of the target's K/V cache, all tensor-parallel ranks together (each rank takes
    # kv_cache_memory / tp_size for its share of the KV heads), or with use_gpu a fraction in
    # (0, 1] of each rank's free GPU memory once its weights are loaded. None: 1 GiB on CPUs
    # (the embedded SmolLM2 in bf16: 964 blocks of 32, 30,848 entries with the native
    # attention's kept keys; the old 8 slots of 2,048 took 0.6 GiB); with use_gpu, 0.9 of
    # the rank's GPU share (`gpu_per_rank`: 0.9 of the free memory on a GPU of its own, 0.81
    # beside a draft worker at draft_gpu_fraction 0.1), the rest for activations, logits and
    # CUDA graphs.
    kv_cache_memory: float | None = Field(None, gt=0)
    # Entries per block: a multiple of 16 (the CPU exact attention reads keys in chunks of 16
    # and 32; FlashInfer and FlashAttention's paged kernels take multiples of 16).
    block_size: int = Field(32, ge=16, le=1024, multiple_of=16)
    prefix_caching: bool = True
    # While requests run, the prompt tokens a step reads beside their trees: a long prompt's
    # next chunk and newcomers' prompts together (docs/kv-cache.md "Chunked prefill beside
    # decoding"): smaller keeps their inter-token latency steadier, larger admits prompts in
    # fewer steps. None: 32 on CPUs, 2,048 on GPUs (vLLM's OpenAI server's token budget on
    # GPUs under 70 GB, not measured here on a GPU). On 2 CPU cores a prompt token costs
    # ~1.2 ms of a step (compute-bound: a step of 8 streams ~18 ms, with 64 prompt tokens
    # ~90-140 ms): bf16 (the default), 8 streams decoding, a 2,346-token prompt arriving, read
    # in the running step's forward (benchmarks/service_cache.py --only-long, one run each):
    # 64 -> the streams' p99 inter-token latency 4.5-5.3x their median, its first token after
    # 4.9-5.0 s; 48 -> 2.8x, 4.5 s; 32 -> 2.1x, 6.4 s; 16 -> 2.0x, 8.6 s. (In fp32, whose
    # steps are ~7x slower, 64 gave 2.42x.)
    prefill_chunk: int | None = Field(None, ge=16, le=8192)
    max_context: int = Field(2048, ge=64)
    default_max_tokens: int = Field(256, ge=1)
    max_tokens_limit: int = Field(1024, ge=1)
    # Requests admitted (running + waiting) before RESOURCE_EXHAUSTED.
    max_queued_requests: int = Field(64, ge=1)
    grpc_port: int = Field(9000, ge=1, le=65535)
    # Port of the draft worker's gRPC server; 0 = any free port (announced through Serve).
    draft_grpc_port: int = Field(0, ge=0, le=65535)
    app_name: str = "eagle2"
    # Per-request limits, checked on the raw request before anything is tokenized.
    max_prompt_bytes: int = Field(256 << 10, ge=1)  # text, or all chat contents together
    max_chat_messages: int = Field(256, ge=1)
    max_stop_sequences: int = Field(16, ge=0)
    max_stop_bytes: int = Field(256, ge=1)  # each stop string
    # API keys (services/auth.py): a file with one key per line and/or an environment
    # variable with comma-separated keys, read by the router. None set = no authentication.
    api_keys_file: str | None = None
    api_keys_env: str | None = "EAGLE2_API_KEYS"
    # Draft worker: its gRPC server binds here. 127.0.0.1 = engine and worker on one node;
    # "node" = the node's IP in the Ray cluster, for multi-node clusters on a private network.
    draft_bind_host: str = "127.0.0.1"
    # A Draft call slower than this counts as a stalled worker: plain decoding takes over.
    draft_timeout_s: float = Field(10.0, gt=0)
    # Engine health: NOT_SERVING when requests are waiting and no step finished for this long.
    stall_timeout_s: float = Field(120.0, gt=0)

    @model_validator(mode="after")
    def _engine_threads(self) -> ServiceConfig:
        if isinstance(self.engine_threads, int) and self.engine_threads < 1:
            raise ValueError(f"engine_threads must be >= 1, \"auto\" or null, got "
                             f"{self.engine_threads}")
        return self

    @model_validator(mode="after")
    def _cache(self) -> ServiceConfig:
        if self.max_batch_size is not None:
            if "max_running" not in self.model_fields_set:
                self.max_running = self.max_batch_size
            elif self.max_running != self.max_batch_size:
                raise ValueError(f"max_batch_size is the older name of max_running: set one "
                                 f"(got max_running {self.max_running}, max_batch_size "
                                 f"{self.max_batch_size})")
        if self.kv_cache_memory is not None and self.kv_cache_memory <= 1 and not self.use_gpu:
            raise ValueError(f"kv_cache_memory {self.kv_cache_memory} is a fraction of free GPU "
                             f"memory, which needs use_gpu; on CPUs give bytes, e.g. "
                             f"{1 << 30} for 1 GiB")
        return self

    @model_validator(mode="after")
    def _check(self) -> ServiceConfig:
        if self.default_max_tokens > self.max_tokens_limit:
            raise ValueError("default_max_tokens must not exceed max_tokens_limit")
        if self.max_tokens_limit >= self.max_context:
            raise ValueError("max_tokens_limit must be below max_context")
        if self.target_placement == "engine" and self.tp_size > 1 and self.use_gpu:
            raise ValueError(f"target_placement 'engine' at tp_size {self.tp_size} runs rank 0 "
                             f"in the engine replica, which only CPU ranks can do (a failed "
                             f"rank cannot interrupt NCCL's collectives there); use "
                             f"target_placement 'ranks' or 'auto' with use_gpu")
        if self.use_gpu and self.tp_size > 1 and 0.5 <= self.draft_gpu_fraction < 1.0:
            # ranks asking for 1 - f <= 0.5 of a GPU each: Ray may pack two on one GPU, where
            # NCCL refuses the group ("Duplicate GPU detected") and both size their KV cache
            # from the same free memory
            raise ValueError(f"draft_gpu_fraction {self.draft_gpu_fraction} at tp_size "
                             f"{self.tp_size} leaves each rank {1 - self.draft_gpu_fraction:g} "
                             f"of a GPU, so two ranks could share one; use a fraction below "
                             f"0.5 (the draft worker beside one rank) or 1.0 (its own GPU)")
        return self

    def resolved_target_placement(self) -> Literal["ranks", "engine"]:
        """Where the target runs: target_placement with "auto" decided by tp_size."""
        if self.target_placement == "auto":
            return "ranks" if self.tp_size > 1 and self.use_gpu else "engine"
        return self.target_placement

    def target_in_engine(self) -> bool:
        """The whole target in the engine replica (tp_size 1, placement "engine")."""
        return self.resolved_target_placement() == "engine" and self.tp_size == 1

    def rank0_in_engine(self) -> bool:
        """Rank 0 of a tensor-parallel target in the engine replica, ranks 1.. on actors."""
        return self.resolved_target_placement() == "engine" and self.tp_size > 1

    def resolved_prefill_chunk(self) -> int:
        """prefill_chunk, None decided by the device (see the field)."""
        if self.prefill_chunk is not None:
            return self.prefill_chunk
        return 2048 if self.use_gpu else 32

    def device(self) -> str:
        return "cuda" if self.use_gpu else "cpu"

    def kv_cache_budget(self) -> float:
        """kv_cache_memory, or its default where None: 1 GiB on CPUs, 0.9 of the rank's GPU
        share (`gpu_per_rank`) as a fraction of its free memory with use_gpu."""
        if self.kv_cache_memory is not None:
            return self.kv_cache_memory
        return round(0.9 * self.gpu_per_rank(), 4) if self.use_gpu else float(1 << 30)

    def rank_kv_cache_memory(self) -> float:
        """One tensor-parallel rank's budget: its 1/tp_size of the bytes (it holds that share
        of the KV heads, so every rank gets the same blocks), or the same fraction of its own
        GPU's free memory."""
        budget = self.kv_cache_budget()
        return budget if budget <= 1 else budget / self.tp_size

    def gpu_per_rank(self) -> float:
        """Ray GPU share of one TP rank: 1, or what the draft worker leaves when it shares."""
        if not self.use_gpu:
            return 0.0
        return 1.0 if self.draft_gpu_fraction >= 1.0 else round(1.0 - self.draft_gpu_fraction, 4)
