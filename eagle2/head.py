"""The EAGLE-1/2 draft head (docs/draft-tree.md "Draft head") and its published checkpoint layout.

Input at position t: concat(embed(token[t+1]), feature[t]) (embedding first) -> fc (2H -> H)
-> one Llama decoder layer without input_layernorm and without a final norm -> a predicted
feature for position t+1. The target's embedding and lm_head turn tokens into inputs and
predicted features into draft logits; the head owns neither (an `embed_tokens.weight` in a
checkpoint is accepted and ignored in favour of the target's).

Optionally the draft logits cover a reduced vocabulary (the `draft_vocab` most frequent target
tokens, EAGLE-3 style): `d2t[i]` is the target token id of draft index i. Verification is
unaffected; only which tokens can be proposed changes.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import nn
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaDecoderLayer

from eagle2.attention import HeadRotary, KVCache, StepInputs, decoder_layer, sequence_inputs
from eagle2.calibration import Calibration
from eagle2.eagle3 import (
    AUX_IDS_KEY,
    Eagle3Head,
    config_says_eagle3,
    default_feature_layers,
    is_eagle3,
    published_config,
    published_state,
)
from eagle2.eagle3 import from_state as eagle3_from_state
from eagle2.head_config import head_config_for
from eagle2.ngram import NgramStore

IGNORED_KEYS = ("embed_tokens.weight",)


class DraftHead(nn.Module):
    """fc + one decoder layer. `forward_layer` does not own a cache; the drafter passes one.

    The drafter uses `step`, `pre_logits`, `output_weight`, `feature_layers`, `rotary`, `d2t`
    and `calibration`, which `eagle2.eagle3.Eagle3Head` provides too."""

    kind = "eagle2"

    def __init__(self, config: LlamaConfig, bias: bool = True):
        super().__init__()
        self.config = config
        hidden = config.hidden_size
        self.head_dim = getattr(config, "head_dim", None) or hidden // config.num_attention_heads
        self.fc = nn.Linear(2 * hidden, hidden, bias=bias)
        self.layers = nn.ModuleList([LlamaDecoderLayer(config, layer_idx=0)])
        self.layers[0].input_layernorm = nn.Identity()  # skipped in EAGLE heads; not in the file
        self.rotary = HeadRotary(config=config)  # fp32 frequencies in a bf16 head
        self.register_buffer("d2t", torch.empty(0, dtype=torch.long), persistent=False)
        self.calibration: Calibration | None = None  # `calibration.json` beside the weights
        self.ngram: NgramStore | None = None  # `ngram.npz` beside the weights

    @property
    def bias(self) -> bool:
        return self.fc.bias is not None

    def allocate_cache(self, num_slots: int, max_len: int) -> KVCache:
        w = self.fc.weight
        return KVCache.allocate(1, num_slots, self.config.num_key_value_heads, max_len,
                                self.head_dim, w.dtype, w.device)

    def fuse(self, token_embeds: torch.Tensor, features: torch.Tensor) -> torch.Tensor:
        """[B, N, H] x 2 -> [B, N, H]: fc(concat(embed, feature))."""
        return self.fc(torch.cat([token_embeds, features.to(token_embeds.dtype)], dim=-1))

    def forward_layer(self, x: torch.Tensor, cache: KVCache, inp: StepInputs) -> torch.Tensor:
        """The decoder layer (input_layernorm skipped) over the head's cache: -> [B, N, H]."""
        return decoder_layer(self.layers[0], 0, x, cache, inp, self.head_dim,
                             skip_input_norm=True)

    def step(self, token_embeds: torch.Tensor, features: torch.Tensor, cache: KVCache,
             inp: StepInputs) -> torch.Tensor:
        """Embeddings + features (the target's or the head's own, both [B, N, H]) -> the
        predicted features [B, N, H], writing the layer's K/V into the cache."""
        return self.forward_layer(self.fuse(token_embeds, features), cache, inp)

    @property
    def decoder(self) -> nn.Module:
        return self.layers[0]

    def layer_input(self, token_embeds: torch.Tensor, features: torch.Tensor
                    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(the q/k/v projections' input, the residual) of `step`'s decoder layer, for
        `eagle2.cpu.fused.native_head_layer`: both fc(concat(embed, feature)) (no input norm)."""
        x = self.fuse(token_embeds, features)
        return x, x

    def feature_layers(self, num_layers: int) -> None:
        """None: the head reads the target's last hidden state after the final norm."""
        return None

    def pre_logits(self, out: torch.Tensor) -> torch.Tensor:
        return out

    def output_weight(self, target_lm_head: nn.Module) -> torch.Tensor:
        """[Vd, H]: the target's lm_head rows of the draft vocabulary."""
        weight = target_lm_head.weight.detach()
        if self.d2t.numel():
            weight = weight[self.d2t.to(weight.device)]
        return weight

    def forward_train(self, token_embeds: torch.Tensor, features: torch.Tensor,
                      lengths: torch.Tensor | None = None) -> torch.Tensor:
        """Causal pass over whole sequences for training (same layer code as inference).

        token_embeds, features: [B, T, H] (right-padded; lengths [B]) -> predicted [B, T, H].
        """
        x = self.fuse(token_embeds, features)
        num_b, num_t, _ = x.shape
        if lengths is None:
            lengths = torch.full((num_b,), num_t, device=x.device)
        cache = self.allocate_cache(num_b, num_t)
        return self.forward_layer(x, cache, sequence_inputs(cache, lengths, num_t, self.rotary, x))


def new_head(target_config, seed: int = 0, bias: bool = False,
             draft_vocab: torch.Tensor | None = None,
             dtype: torch.dtype = torch.float32) -> DraftHead:
    """An untrained head (seeded init). Its drafts are poor, but output stays lossless."""
    torch.manual_seed(seed)
    head = DraftHead(head_config_for(target_config, bias=bias), bias=bias)
    if draft_vocab is not None:
        head.d2t = draft_vocab.long()
    return head.to(dtype).eval()


def load_head(path: str | Path, dtype: torch.dtype = torch.float32,
              device: torch.device | str = "cpu") -> DraftHead | Eagle3Head:
    """Load a published head as downloaded: config.json + model.safetensors or
    pytorch_model.bin, EAGLE-1/2 or EAGLE-3 (told apart by the config and tensor names)."""
    path = Path(path)
    raw = read_head_config(path)
    state = _read_state(path)
    if is_eagle3(raw, set(state)):
        head = eagle3_from_state(raw, state)
    else:
        head = _eagle2_from_state(raw, state)
    head.calibration = Calibration.of_head(path)
    head.ngram = NgramStore.of_head(path)  # the target's answers' n-grams (`eagle2.ngram`)
    return head.to(device=device, dtype=dtype).eval()


def read_head_config(path: str | Path) -> dict:
    cfg_path = Path(path) / "config.json"
    if not cfg_path.exists():
        raise ValueError(f"draft head {str(path)!r} has no config.json")
    return json.loads(cfg_path.read_text())


def head_feature_layers(path: str | Path | None, num_layers: int | Callable[[], int]
                        ) -> tuple[int, ...] | None:
    """The target layers whose inputs a head directory's head reads (EAGLE-3), or None (the
    final hidden state), from its config.json alone: what the target side must produce.
    num_layers: the target's decoder layer count, or a function giving it (only called for an
    EAGLE-3 head without explicit layer ids)."""
    if path is None or path == "untrained":
        return None
    raw = read_head_config(path)
    # the tensor names are read only when the config alone does not say EAGLE-3
    names = set() if config_says_eagle3(raw) else _state_names(Path(path))
    if not is_eagle3(raw, names):
        return None
    aux = (raw.get("eagle_config") or {}).get(AUX_IDS_KEY)
    if aux:
        return tuple(i + 1 for i in aux)
    return default_feature_layers(num_layers() if callable(num_layers) else num_layers)


def _state_names(path: Path) -> set[str]:
    if (path / "model.safetensors").exists():
        from safetensors import safe_open

        with safe_open(path / "model.safetensors", framework="pt") as f:
            return set(f.keys())
    return set(_read_state(path))


def _eagle2_from_state(raw: dict, state: dict[str, torch.Tensor]) -> DraftHead:
    if raw.get("num_hidden_layers", 1) != 1:
        raise ValueError(f"draft head config has num_hidden_layers={raw['num_hidden_layers']}; "
                         "an EAGLE-1/2 head has exactly one decoder layer")
    config = LlamaConfig(**{k: v for k, v in raw.items() if k not in ("architectures",)})
    for key in IGNORED_KEYS:
        state.pop(key, None)
    d2t = state.pop("d2t", None)
    bias = raw.get("bias", "fc.bias" in state)
    if bias and "fc.bias" not in state:
        raise ValueError("draft head config says bias=true but fc.bias is missing")
    head = DraftHead(config, bias=bool(bias))
    missing, unexpected = head.load_state_dict(state, strict=False)
    if missing or unexpected:
        raise ValueError(f"draft head checkpoint does not match the EAGLE layout: "
                         f"missing {sorted(missing)}, unexpected {sorted(unexpected)}")
    if d2t is not None:
        head.d2t = d2t.long()
    return head


def _read_state(path: Path) -> dict[str, torch.Tensor]:
    if (path / "model.safetensors").exists():
        return load_file(path / "model.safetensors")
    if (path / "pytorch_model.bin").exists():
        return torch.load(path / "pytorch_model.bin", map_location="cpu", weights_only=True)
    raise ValueError(f"draft head {str(path)!r} has neither model.safetensors "
                     "nor pytorch_model.bin")


def save_head(head: DraftHead | Eagle3Head, path: str | Path, extra_config: dict | None = None,
              target_config=None) -> None:
    """Write the published layout (config.json + model.safetensors, published key names).
    An EAGLE-3 head needs the target's config (its t2d mask spans the target vocabulary)."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    if isinstance(head, Eagle3Head):
        if target_config is None:
            raise ValueError("saving an EAGLE-3 head needs the target's config")
        config = published_config(head, target_config)
        config.update(extra_config or {})
        save_file(published_state(head, target_config.vocab_size), path / "model.safetensors")
        (path / "config.json").write_text(json.dumps(config, indent=2, default=str))
        return
    config = head.config.to_dict()
    config.update({"num_hidden_layers": 1, "bias": head.bias,
                   "architectures": ["LlamaForCausalLM"]})
    config.update(extra_config or {})
    state = {k: v.detach().contiguous().cpu() for k, v in head.state_dict().items()
             if not k.startswith("rotary")}
    if head.d2t.numel():
        state["d2t"] = head.d2t.cpu()
    save_file(state, path / "model.safetensors")
    (path / "config.json").write_text(json.dumps(config, indent=2, default=str))
