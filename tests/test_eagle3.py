"""EAGLE-3 heads: the published checkpoint layout loads, the head computes what the published
architecture computes, the target exposes the right layers, and decoding stays lossless.

The checkpoints here are written by hand in the release's layout (reference tensor names,
`d2t` as offsets, `t2d` as a mask, a `LlamaForCausalLMEagle3` config), not by our saver, and
the head's forward is compared with a plain-torch implementation written from the published
description. See docs/draft-tree.md "EAGLE-3 heads".
"""

from __future__ import annotations

import json

import pytest
import torch
from conftest import make_engine, random_prompts, run, tiny_target
from safetensors.torch import save_file

from eagle2.api import Eagle2
from eagle2.config import SamplingParams, TreeConfig
from eagle2.drafter import Drafter
from eagle2.eagle3 import Eagle3Head
from eagle2.head import head_feature_layers, load_head, save_head
from eagle2.runner import LocalRunner

VOCAB, HIDDEN, LAYERS, HEADS, KV_HEADS = 48, 64, 8, 4, 2
DRAFT_VOCAB = torch.tensor(sorted({0, 3, 5, 7, 9, 11, 12, 20, 21, 22, 30, 31, 33, 40, 41, 47}
                                  | set(range(13, 19))))
GREEDY = SamplingParams(max_tokens=30, ignore_eos=True)
TREES = {
    "eagle2": TreeConfig("eagle2", total_tokens=16, depth=4, top_k=4, budget="fixed"),
    "eagle2-budget": TreeConfig("eagle2", total_tokens=16, depth=4, top_k=4),
    "static": TreeConfig("static", total_tokens=26, budget="fixed"),
    "chain": TreeConfig("chain", depth=5, budget="fixed"),
}


def published_checkpoint(path, seed: int = 0, prefix: str = "midlayer.", fmt: str = "safetensors",
                         aux_ids: list[int] | None = None, draft_vocab=DRAFT_VOCAB,
                         scale: float = 1.0) -> dict[str, torch.Tensor]:
    """Write a shrunk EAGLE-3 head exactly as released: config.json + weights."""
    g = torch.Generator().manual_seed(seed)
    h, dh, inter = HIDDEN, HIDDEN // HEADS, 2 * HIDDEN

    def w(*shape):
        return (torch.randn(*shape, generator=g) * scale / shape[-1] ** 0.5)

    vd = len(draft_vocab)
    state = {
        "fc.weight": w(h, 3 * h),
        f"{prefix}self_attn.q_proj.weight": w(HEADS * dh, 2 * h),
        f"{prefix}self_attn.k_proj.weight": w(KV_HEADS * dh, 2 * h),
        f"{prefix}self_attn.v_proj.weight": w(KV_HEADS * dh, 2 * h),
        f"{prefix}self_attn.o_proj.weight": w(h, HEADS * dh),
        f"{prefix}mlp.gate_proj.weight": w(inter, h),
        f"{prefix}mlp.up_proj.weight": w(inter, h),
        f"{prefix}mlp.down_proj.weight": w(h, inter),
        f"{prefix}input_layernorm.weight": 1 + 0.1 * torch.randn(h, generator=g),
        f"{prefix}hidden_norm.weight": 1 + 0.1 * torch.randn(h, generator=g),
        f"{prefix}post_attention_layernorm.weight": 1 + 0.1 * torch.randn(h, generator=g),
        "norm.weight": 1 + 0.1 * torch.randn(h, generator=g),
        "lm_head.weight": w(vd, h) * 20,
        "d2t": draft_vocab - torch.arange(vd),  # offsets, as released
        "t2d": torch.zeros(VOCAB, dtype=torch.bool).index_fill_(0, draft_vocab, True),
        "embed_tokens.weight": torch.zeros(VOCAB, h),  # shipped by some releases; ignored
    }
    config = {
        "architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama",
        "hidden_size": h, "intermediate_size": inter, "num_attention_heads": HEADS,
        "num_key_value_heads": KV_HEADS, "num_hidden_layers": 1, "hidden_act": "silu",
        "rms_norm_eps": 1e-6, "max_position_embeddings": 1024, "rope_theta": 10000.0,
        "vocab_size": VOCAB, "draft_vocab_size": vd, "tie_word_embeddings": False,
        "torch_dtype": "float32", "bos_token_id": 1, "eos_token_id": 2,
    }
    if aux_ids is not None:
        config["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": aux_ids}
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config))
    if fmt == "safetensors":
        save_file(state, path / "model.safetensors")
    else:
        torch.save(state, path / "pytorch_model.bin")
    return state


def reference_head_forward(state: dict, prefix: str, embeds: torch.Tensor, feats: torch.Tensor,
                           eps: float = 1e-6) -> tuple[torch.Tensor, torch.Tensor]:
    """The published EAGLE-3 head over one whole sequence, in plain torch (causal attention,
    RoPE at positions 0..T-1): -> (g' [T, H], draft logits [T, Vd])."""
    def p(name):
        return state[prefix + name]

    def rms(x, wt):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * wt

    num_t, dh = embeds.shape[0], HIDDEN // HEADS
    g = feats @ state["fc.weight"].T
    h = torch.cat([rms(embeds, p("input_layernorm.weight")), rms(g, p("hidden_norm.weight"))], -1)
    q = (h @ p("self_attn.q_proj.weight").T).view(num_t, HEADS, dh).transpose(0, 1)
    k = (h @ p("self_attn.k_proj.weight").T).view(num_t, KV_HEADS, dh).transpose(0, 1)
    v = (h @ p("self_attn.v_proj.weight").T).view(num_t, KV_HEADS, dh).transpose(0, 1)
    inv = 1.0 / (10000.0 ** (torch.arange(0, dh, 2).float() / dh))
    ang = torch.arange(num_t).float()[:, None] * inv[None]
    cos, sin = torch.cat([ang, ang], -1).cos(), torch.cat([ang, ang], -1).sin()

    def rope(x):
        half = x.shape[-1] // 2
        rot = torch.cat([-x[..., half:], x[..., :half]], -1)
        return x * cos + rot * sin

    q, k = rope(q), rope(k)
    k = k.repeat_interleave(HEADS // KV_HEADS, 0)
    v = v.repeat_interleave(HEADS // KV_HEADS, 0)
    att = (q @ k.transpose(1, 2)) / dh ** 0.5
    att = att.masked_fill(torch.triu(torch.ones(num_t, num_t, dtype=torch.bool), 1), -1e30)
    out = (att.softmax(-1) @ v).transpose(0, 1).reshape(num_t, -1)
    x = g + out @ p("self_attn.o_proj.weight").T
    y = rms(x, p("post_attention_layernorm.weight"))
    mlp = (torch.nn.functional.silu(y @ p("mlp.gate_proj.weight").T) *
           (y @ p("mlp.up_proj.weight").T)) @ p("mlp.down_proj.weight").T
    x = x + mlp
    return x, rms(x, state["norm.weight"]) @ state["lm_head.weight"].T


@pytest.fixture(scope="module")
def target():
    return tiny_target(vocab=VOCAB, hidden=HIDDEN, layers=LAYERS, heads=HEADS,
                       kv_heads=KV_HEADS, seed=31)


@pytest.mark.parametrize("prefix, fmt", [("midlayer.", "safetensors"), ("layers.0.", "bin"),
                                         ("model.layers.0.", "safetensors")])
def test_published_layout_loads_and_computes_the_published_head(tmp_path, prefix, fmt):
    state = published_checkpoint(tmp_path, prefix=prefix, fmt=fmt)
    head = load_head(tmp_path)
    assert isinstance(head, Eagle3Head)
    assert head.d2t.tolist() == DRAFT_VOCAB.tolist()  # offsets -> target ids
    assert head.feature_layers(32) == (2, 16, 29)  # the published default for 32 layers
    g = torch.Generator().manual_seed(3)
    embeds, feats = torch.randn(11, HIDDEN, generator=g), torch.randn(11, 3 * HIDDEN, generator=g)
    ref_out, ref_logits = reference_head_forward(state, prefix, embeds, feats)
    out = head.forward_train(embeds[None], feats[None])[0]
    torch.testing.assert_close(out, ref_out, atol=1e-4, rtol=1e-4)
    logits = head.pre_logits(out) @ head.output_weight().T
    torch.testing.assert_close(logits, ref_logits, atol=1e-3, rtol=1e-4)


def test_save_writes_the_published_layout_and_reloads(tmp_path, target):
    published_checkpoint(tmp_path / "a", aux_ids=[0, 3, 5])
    head = load_head(tmp_path / "a")
    save_head(head, tmp_path / "b", target_config=target.config)
    raw = json.loads((tmp_path / "b" / "config.json").read_text())
    assert raw["architectures"] == ["LlamaForCausalLMEagle3"]
    assert raw["draft_vocab_size"] == len(DRAFT_VOCAB)
    assert raw["eagle_config"] == {"eagle_aux_hidden_state_layer_ids": [0, 3, 5]}
    from safetensors.torch import load_file

    saved = load_file(tmp_path / "b" / "model.safetensors")
    original = load_file(tmp_path / "a" / "model.safetensors")
    assert set(saved) == set(original) - {"embed_tokens.weight"}
    for key, value in saved.items():
        assert torch.equal(value, original[key]), key
    assert head_feature_layers(tmp_path / "b", LAYERS) == (1, 4, 6)


def test_target_features_are_the_inputs_of_the_chosen_layers(target):
    """Against HF's output_hidden_states (index i = the input of decoder layer i)."""
    ids = torch.tensor([random_prompts(1, VOCAB, seed=4, lo=9, hi=10)[0]])
    with torch.no_grad():
        hs = target.hf(ids, output_hidden_states=True).hidden_states
    want = torch.cat([hs[2], hs[4], hs[5]], -1)
    runner = LocalRunner(target, 1, 64)
    target.set_feature_layers((2, 4, 5))
    try:
        n = ids.shape[1]
        mask = torch.tril(torch.ones(1, n, n, dtype=torch.bool))
        feats, logits = runner.forward(ids, torch.arange(n)[None], mask, torch.tensor([0]))
    finally:
        target.set_feature_layers(None)
    torch.testing.assert_close(feats, want, atol=1e-4, rtol=1e-4)
    with torch.no_grad():
        torch.testing.assert_close(logits, target.hf(ids).logits, atol=1e-3, rtol=1e-4)
    with pytest.raises(ValueError, match="outside"):
        target.set_feature_layers((2, 8))


@pytest.mark.parametrize("mode", list(TREES))
def test_eagle3_head_all_modes_equal_vanilla(target, mode):
    prompts = random_prompts(6, VOCAB, seed=7)
    vanilla = run(make_engine(target, None), prompts, GREEDY, TreeConfig("vanilla"))
    engine = make_engine(target, 0, head_kind="eagle3", draft_vocab=DRAFT_VOCAB)
    assert run(engine, prompts, GREEDY, TREES[mode]) == vanilla
    assert engine.stats.steps < 6 * 30


def test_downloaded_directory_decodes_losslessly_and_drafts_only_its_vocabulary(tmp_path,
                                                                                 target):
    """Eagle2 given the directory as downloaded (its config names the feature layers)."""
    published_checkpoint(tmp_path, aux_ids=[0, 3, 5], scale=1.0)
    head = load_head(tmp_path)
    llm = Eagle2(target, head, TREES["eagle2"], max_batch=4, max_context=256)
    assert target.feature_layers == (1, 4, 6)
    prompts = random_prompts(4, VOCAB, seed=8)
    reqs = [llm.request(p, GREEDY) for p in prompts]
    got = [c.token_ids for c in llm.generate_ids(reqs)]
    target.set_feature_layers(None)
    assert got == run(make_engine(target, None), prompts, GREEDY, TreeConfig("vanilla"))
    drafter: Drafter = llm.engine.drafter
    tree = drafter.draft(["x"], torch.randn(1, 3, 3 * HIDDEN), torch.tensor([[1, 2, 3]]),
                         torch.tensor([3]), TREES["eagle2"])
    drafted = set(tree.tokens[0, 1:].tolist())
    assert drafted <= set(DRAFT_VOCAB.tolist())


def test_a_head_for_another_hidden_size_is_refused(tmp_path, target):
    from eagle2.api import resolve_head

    published_checkpoint(tmp_path)
    small = tiny_target(vocab=VOCAB, hidden=32, layers=LAYERS, heads=4, kv_heads=2, seed=1)
    with pytest.raises(ValueError, match="width 64"):
        resolve_head(small, str(tmp_path))


def test_eagle3_over_the_draft_worker_equals_vanilla(target):
    """The head in a DraftService (gRPC on localhost): features [B, A, 3H] cross the wire."""
    from services.draft_client import RemoteDrafter
    from services.draft_worker import DraftServicer, start_server

    engine = make_engine(target, 0, head_kind="eagle3", draft_vocab=DRAFT_VOCAB)
    servicer = DraftServicer(engine.drafter, "eagle3-test")
    server, port = start_server(servicer, 0)
    try:
        engine.drafter = RemoteDrafter(f"127.0.0.1:{port}")
        prompts = random_prompts(4, VOCAB, seed=9)
        got = run(engine, prompts, GREEDY, TREES["eagle2"])
        assert servicer.draft_requests >= 1
    finally:
        server.stop(grace=None)
    assert got == run(make_engine(target, None), prompts, GREEDY, TreeConfig("vanilla"))


def test_eagle3_with_a_reduced_vocab_in_a_batch_with_different_lengths(target):
    prompts = [[1, 2, 3], list(range(5, 22)), [7] * 9, [4, 44, 4, 44, 4]]
    tree = TREES["eagle2"]
    together = run(make_engine(target, 0, max_batch=4, head_kind="eagle3",
                               draft_vocab=DRAFT_VOCAB), prompts, GREEDY, tree)
    alone = [run(make_engine(target, 0, max_batch=1, head_kind="eagle3",
                             draft_vocab=DRAFT_VOCAB), [p], GREEDY, tree)[0] for p in prompts]
    assert together == alone



def test_draft_worker_builds_an_eagle3_head_with_the_target_embedding_only(tmp_path, target):
    """services.draft_worker.build_drafter on a saved target + a downloaded EAGLE-3 directory:
    the target side gets the head's layers from config.json alone, and the worker loads the
    embedding but not the target's lm_head (the head has its own)."""
    from services.config import ServiceConfig
    from services.draft_worker import build_drafter, feature_layers

    target.hf.save_pretrained(tmp_path / "target")
    published_checkpoint(tmp_path / "head", aux_ids=[0, 3, 5])
    cfg = ServiceConfig(target=str(tmp_path / "target"), draft=str(tmp_path / "head"),
                        dtype="float32")
    assert feature_layers(cfg) == (1, 4, 6)
    drafter, desc = build_drafter(cfg, max_slots=2)
    assert desc == str(tmp_path / "head") and isinstance(drafter.head, Eagle3Head)
    assert torch.equal(drafter.draft_lm_head, drafter.head.lm_head.weight)
    torch.testing.assert_close(drafter.embed.weight, target.embed.weight)


def test_the_target_config_is_read_only_for_an_eagle3_head_without_layer_ids(tmp_path, target):
    """An EAGLE-1/2 head never needs the target's layer count (a GGUF or remote target is not
    opened); an EAGLE-3 head without explicit ids takes the default of the target's depth."""
    from eagle2.head import new_head
    from eagle2.target import target_num_layers
    from services.config import ServiceConfig
    from services.draft_worker import feature_layers

    save_head(new_head(target.config), tmp_path / "eagle2-head")
    missing = str(tmp_path / "no-such-target.gguf")
    assert feature_layers(ServiceConfig(target=missing, draft=str(tmp_path / "eagle2-head"))) \
        is None
    target.hf.save_pretrained(tmp_path / "target")
    assert target_num_layers(str(tmp_path / "target")) == LAYERS
    published_checkpoint(tmp_path / "eagle3-head")  # no eagle_config: the default ids
    cfg = ServiceConfig(target=str(tmp_path / "target"), draft=str(tmp_path / "eagle3-head"))
    assert feature_layers(cfg) == (2, LAYERS // 2, LAYERS - 3)
