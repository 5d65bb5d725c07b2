"""eagle2.plan: the placement/memory planner and the tensor-parallel shard layout it assumes.

The Llama-3-70B figures are checked against a hand calculation written out below; the shard
layout is checked against what eagle2.tp loads on each rank (built on the meta device).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math

import pytest

from eagle2 import plan as P

GIB = 2**30

# Llama-3-70B (meta-llama/Meta-Llama-3-70B config.json)
H, I, L, V, NH, KV, D = 8192, 28672, 80, 128256, 64, 8, 128


def _parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    P.add_arguments(parser)
    return parser.parse_args(list(argv))


# ---------------------------------------------------------------- hand calculation


def test_llama3_70b_parameter_count_by_hand():
    q, k, v, o = H * H, H * (KV * D), H * (KV * D), H * H  # 67,108,864 / 8,388,608 (x2)
    mlp = 3 * H * I  # gate, up, down: 704,643,072
    norms = 2 * H  # input_layernorm, post_attention_layernorm
    layer = q + k + v + o + mlp + norms
    assert layer == 855_654_400
    total = L * layer + V * H + V * H + H  # layers, embed_tokens, lm_head (untied), final norm
    assert total == 70_553_706_496 == P.num_params(P.PRESETS["llama-3-70b"])
    # other presets: the published parameter counts
    assert P.num_params(P.PRESETS["llama-3-8b"]) == 8_030_261_248
    assert P.num_params(P.PRESETS["llama-2-70b"]) == 68_976_648_192


def test_kv_bytes_per_token_by_hand():
    spec = P.PRESETS["llama-3-70b"]
    assert P.kv_bytes_per_token(spec, 2) == 2 * 80 * 8 * 128 * 2 == 327_680  # bf16
    assert P.kv_bytes_per_token(spec, 4) == 655_360  # fp32
    assert [P.kv_bytes_per_token(spec, 2, tp=4, rank=r) for r in range(4)] == [81_920] * 4


def test_llama3_70b_on_8x80gb_with_draft_worker_matches_hand_calculation():
    p = P.plan(P.PlanRequest(P.PRESETS["llama-3-70b"], num_gpus=8, gpu_mem_gib=80,
                             draft=P.eagle_head_for(P.PRESETS["llama-3-70b"])))
    # 7 GPUs left after the draft GPU; tp must divide 8 KV heads -> tp=4, 3 GPUs idle.
    assert (p.tp_size, p.idle_gpus) == (4, 3)
    assert p.weight_bytes_total == 70_553_706_496 * 2 == 141_107_412_992
    # per rank: every layer's matrices / 4 + its two norms whole, embed_tokens and lm_head
    # whole, final norm whole
    layer_shard = (855_654_400 - 2 * H) // 4 + 2 * H  # 213,925,888
    rank_params = L * layer_shard + V * H + V * H + H
    assert rank_params == 19_215_425_536
    assert p.weight_bytes_per_gpu == rank_params * 2 == 38_430_851_072  # 35.79 GiB
    usable = int(80 * GIB * 0.9)  # 10% reserve: 77,309,411,328
    assert p.usable_bytes_per_gpu == usable
    assert p.kv_bytes_per_token == 327_680
    assert p.kv_bytes_per_token_per_gpu == 327_680 // 4 == 81_920
    assert p.kv_budget_bytes_per_gpu == usable - 38_430_851_072 == 38_878_560_256
    assert p.kv_tokens_per_gpu == 38_878_560_256 // 81_920 == 474_591
    assert p.target_max_sequences == 474_591 // 8192 == 57
    # draft GPU: fc 2H*H + one layer without input_layernorm, + embed_tokens + lm_head copies
    d = p.draft
    assert d.head_params == 2 * H * H + (855_654_400 - H) == 989_863_936
    assert d.shared_params == 2 * V * H == 2_101_346_304
    assert d.weight_bytes == (989_863_936 + 2_101_346_304) * 2 == 6_182_420_480  # 5.76 GiB
    assert d.kv_bytes_per_token == 2 * 1 * 8 * 128 * 2 == 4096
    assert d.max_sequences == (usable - 6_182_420_480) // (4096 * 8192) == 2119
    assert p.max_sequences == 57
    assert "3 GPU(s) idle" in p.notes[0]


def test_llama3_70b_tp8_without_draft_matches_hand_calculation():
    p = P.plan(P.PlanRequest(P.PRESETS["llama-3-70b"], num_gpus=8, gpu_mem_gib=80))
    assert (p.tp_size, p.idle_gpus, p.draft) == (8, 0, None)
    rank_params = L * ((855_654_400 - 2 * H) // 8 + 2 * H) + V * H + V * H + H
    assert p.weight_bytes_per_gpu == rank_params * 2 == 21_318_090_752  # 19.85 GiB
    assert p.weight_bytes_all_target_gpus == 8 * 21_318_090_752
    assert p.kv_bytes_per_token_per_gpu == 40_960
    assert p.kv_tokens_per_gpu == (int(80 * GIB * 0.9) - 21_318_090_752) // 40_960 == 1_366_975
    assert p.max_sequences == 1_366_975 // 8192 == 166


# ---------------------------------------------------------------- refused layouts


LLAMA2_HEAD = P.eagle_head_for(P.PRESETS["llama-2-70b"])


@pytest.mark.parametrize("num_gpus, gpu_mem_gib, overrides, message", [
    (2, 24, {}, "needs 131.42 GiB of weights per GPU at tp=1"),
    (2, 24, {"draft": None}, "needs 67.67 GiB of weights per GPU at tp=2"),
    (8, 80, {"tp_size": 3}, "num_attention_heads (64) is not divisible by tp=3"),
    (8, 80, {"tp_size": 8}, "only 7 are left for the target after the draft GPU"),
    (16, 80, {"tp_size": 16, "draft": None}, "tp=16 > 8 KV heads"),
    (1, 80, {}, "leave none for the target after the draft GPU"),
    (8, 80, {"context_len": 16384}, "exceeds Llama-3-70B's max_position_embeddings 8192"),
    (8, 80, {"draft": LLAMA2_HEAD}, "vocab 32000) does not match target"),
    (8, 80, {"dtype": "int3"}, "unknown dtype"),
])
def test_impossible_layouts_are_refused(num_gpus, gpu_mem_gib, overrides, message):
    kwargs = {"draft": P.eagle_head_for(P.PRESETS["llama-3-70b"]), **overrides}
    with pytest.raises(ValueError) as err:
        P.plan(P.PlanRequest(P.PRESETS["llama-3-70b"], num_gpus, gpu_mem_gib, **kwargs))
    assert message in str(err.value)


def test_tp_problems_and_valid_sizes():
    spec = P.PRESETS["llama-3-70b"]
    assert P.valid_tp_sizes(spec, 16) == [1, 2, 4, 8]
    assert P.tp_problems(spec, 3) == [
        "num_attention_heads (64) is not divisible by tp=3",
        "num_key_value_heads (8) is not divisible by tp=3",
        "intermediate_size (28672) is not divisible by tp=3"]


# ---------------------------------------------------------------- CLI


def test_cli_prints_plan_and_json(capsys):
    assert P.run(_parse("--model", "llama-3-70b", "--gpus", "8", "--gpu-mem", "80")) == 0
    out = capsys.readouterr().out
    assert "tp=4 on GPUs 0-3, draft worker on GPU 4, 3 idle" in out
    assert "327,680 B/token, 81,920 B/token per GPU" in out
    assert "max concurrent sequences at 8192 tokens: 57" in out
    argv = ("--model", "llama-3-70b", "--gpus", "8", "--gpu-mem", "80", "--draft", "none",
            "--json")
    assert P.run(_parse(*argv)) == 0
    data = json.loads(capsys.readouterr().out)
    assert (data["tp_size"], data["weight_bytes_per_gpu"], data["draft"]) == (
        8, 21_318_090_752, None)


@pytest.mark.parametrize("argv, message", [
    (("--model", "llama-3-70b", "--gpus", "2", "--gpu-mem", "24"), "GiB of weights per GPU"),
    (("--model", "llama-3-70b", "--gpus", "8", "--gpu-mem", "80", "--tp", "3"), "tp=3 cannot"),
    (("--model", "/nonexistent/llama", "--gpus", "8", "--gpu-mem", "80"), "neither a preset"),
])
def test_cli_refusal_exits_nonzero_with_message(capsys, argv, message):
    assert P.run(_parse(*argv)) != 0
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.startswith("eagle2 plan: error: ") and message in captured.err


def test_model_and_draft_from_config_json(tmp_path, capsys):
    cfg = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": H,
           "intermediate_size": I, "num_hidden_layers": L, "num_attention_heads": NH,
           "num_key_value_heads": KV, "vocab_size": V, "max_position_embeddings": 8192,
           "rope_theta": 500000.0, "rms_norm_eps": 1e-5, "tie_word_embeddings": False}
    (tmp_path / "target").mkdir()
    (tmp_path / "target" / "config.json").write_text(json.dumps(cfg))
    head = dict(cfg, num_hidden_layers=1, bias=False)  # EAGLE-LLaMA3-Instruct-70B style
    (tmp_path / "head.json").write_text(json.dumps(head))
    spec = P.load_model_spec(str(tmp_path / "target"))  # a directory holding config.json
    assert P.num_params(spec) == P.num_params(P.PRESETS["llama-3-70b"])
    draft = P.load_draft_spec(str(tmp_path / "head.json"), spec)
    assert (draft.fc_bias, P.draft_params(draft)) == (False, 989_863_936)
    assert P.run(_parse("--model", str(tmp_path / "target"), "--gpus", "8", "--gpu-mem", "80",
                        "--draft", str(tmp_path / "head.json"))) == 0
    assert "max concurrent sequences at 8192 tokens: 57" in capsys.readouterr().out


# ---------------------------------------------------------------- shard layout


# per-rank widths for Llama-3-70B: (q_proj rows, k/v_proj rows, MLP width); lm_head is whole
EXPECTED_70B = {2: (4096, 512, 14336), 4: (2048, 256, 7168), 8: (1024, 128, 3584)}


@pytest.mark.parametrize("tp", [2, 4, 8])
def test_shard_shapes_llama3_70b_on_meta(tp):
    shapes = P.shard_shapes(P.PRESETS["llama-3-70b"], tp, rank=tp - 1)
    q, kv, mlp = EXPECTED_70B[tp]
    layer = {"self_attn.q_proj.weight": (q, H), "self_attn.k_proj.weight": (kv, H),
             "self_attn.v_proj.weight": (kv, H), "self_attn.o_proj.weight": (H, q),
             "mlp.gate_proj.weight": (mlp, H), "mlp.up_proj.weight": (mlp, H),
             "mlp.down_proj.weight": (H, mlp), "input_layernorm.weight": (H,),
             "post_attention_layernorm.weight": (H,)}
    expected = {f"model.layers.{i}.{n}": s for i in range(L) for n, s in layer.items()}
    expected.update({"model.embed_tokens.weight": (V, H), "model.norm.weight": (H,),
                     "lm_head.weight": (V, H)})
    assert shapes == expected
    assert sum(math.prod(s) for s in shapes.values()) == P.rank_params(
        P.PRESETS["llama-3-70b"], tp, tp - 1)


def test_shard_shapes_accepts_a_transformers_config():
    spec = _tiny_spec(tied=True)
    assert P.shard_shapes(P.to_hf_config(spec), 2, rank=1) == P.shard_shapes(spec, 2, rank=1)
    with pytest.raises(ValueError, match="exceeds its 2 KV heads"):
        P.shard_shapes(spec, 4)


def _tiny_spec(tied: bool) -> P.ModelSpec:
    return P.ModelSpec("tiny", hidden_size=192, intermediate_size=320, num_hidden_layers=2,
                       num_attention_heads=6, num_key_value_heads=2, vocab_size=1000,
                       max_position_embeddings=256, tie_word_embeddings=tied)


def test_shard_shapes_match_what_eagle2_tp_loads():
    """The planner's per-rank shapes == the shapes eagle2.tp gives each rank (meta device)."""
    import torch
    from transformers import LlamaForCausalLM

    from eagle2.tp import shard_index

    for tied in (False, True):
        spec = _tiny_spec(tied)
        with torch.device("meta"):
            model = LlamaForCausalLM(P.to_hf_config(spec))
        for rank in range(2):
            real = {n: tuple(p[shard_index(n, tuple(p.shape), 2, rank)].shape)
                    for n, p in model.named_parameters(remove_duplicate=False)}
            assert real == P.shard_shapes(spec, 2, rank)
    assert real["model.embed_tokens.weight"] == real["lm_head.weight"] == (1000, 192)
    assert real["model.layers.0.mlp.down_proj.weight"] == (192, 160)


def test_uneven_splits_are_refused():
    spec = P.ModelSpec("odd", hidden_size=192, intermediate_size=320, num_hidden_layers=1,
                       num_attention_heads=6, num_key_value_heads=3, vocab_size=100,
                       max_position_embeddings=64)
    with pytest.raises(ValueError, match="does not split it evenly"):
        P.shard_shapes(spec, 2)


# ---------------------------------------------------------------- node layouts


def test_layouts_rank_two_tp4_replicas_with_a_shared_draft_first_on_8_gpus():
    model = P.PRESETS["llama-3-70b"]
    layouts = P.node_layouts(model, P.eagle_head_for(model), 8)
    best = layouts[0]
    assert (best.replicas, best.tp_size, best.draft, best.idle_gpus) == (2, 4, "shared", 0)
    assert 0 < best.draft_gpu_fraction < 1
    assert [lay.tokens_per_s for lay in layouts] == sorted(
        (lay.tokens_per_s for lay in layouts), reverse=True)
    own = next(lay for lay in layouts if lay.draft == "own" and lay.tp_size == 4)
    assert own.replicas == 1 and own.idle_gpus == 3  # 4 ranks + a draft GPU: one replica fits
    assert own.step_ms == best.step_ms  # same step, but half the replicas per node
    assert any("shares a rank's GPU" in r for r in best.reasons)


def test_layouts_drop_what_does_not_fit_and_cli_prints_them(capsys):
    model = P.PRESETS["llama-3-70b"]
    layouts = P.node_layouts(model, P.eagle_head_for(model), 8, P.Hardware(gpu_mem_gib=40))
    assert all(lay.tp_size >= 4 for lay in layouts)  # 70B bf16 at tp 2 needs > 40 GiB a GPU
    with pytest.raises(ValueError, match="no layout"):
        P.node_layouts(model, None, 1, P.Hardware(gpu_mem_gib=24))
    assert P.run(_parse("--model", "llama-3-70b", "--gpus", "8", "--gpu-mem", "80",
                        "--layouts")) == 0
    assert capsys.readouterr().out.startswith("1. 2 x tp4, draft shared:")


# ---------------------------------------------------------------- EAGLE-3 heads


# yuhuili/EAGLE3-LLaMA3.3-Instruct-70B: Llama-3.3-70B's dims, one layer, 32000 draft tokens
VD = 32000


def test_eagle3_llama33_70b_head_parameter_count_by_hand():
    fc = (3 * H) * H  # three target features in, no bias: 201,326,592
    q, k, v = (NH * D) * (2 * H), (KV * D) * (2 * H), (KV * D) * (2 * H)  # 2H inputs
    o = H * (NH * D)
    mlp = 3 * H * I
    norms = 4 * H  # input_layernorm, hidden_norm, post_attention_layernorm, final norm
    lm_head = VD * H  # its own lm_head over the draft vocabulary
    own = fc + q + k + v + o + mlp + norms + lm_head
    assert (fc, q, k, o, lm_head) == (201_326_592, 134_217_728, 16_777_216, 67_108_864,
                                      262_144_000)
    assert own == 1_403_027_456
    draft = P.DRAFT_PRESETS["eagle3-llama3.3-70b"].spec()
    assert (draft.kind, draft.draft_vocab_size, draft.fc_bias) == ("eagle3", VD, False)
    assert P.draft_params(draft) == own
    # buffers: d2t int64 [Vd] is kept; t2d bool [V] is only checked at load
    assert P.draft_buffer_bytes(draft) == 8 * VD == 256_000
    # the worker loads the target's embedding only (an EAGLE-3 head has its own lm_head)
    model = P.PRESETS["llama-3.3-70b"]
    assert P.draft_worker_target_params(model, draft) == V * H == 1_050_673_152
    assert P.draft_worker_params(model, draft) == own + V * H
    # a draft level reads the head and its own lm_head, never the target's 128256-row one
    assert P.draft_step_params(model, draft) == own
    eagle2_head = P.eagle_head_for(model)
    assert P.draft_step_params(model, eagle2_head) == 989_863_936 + V * H


def test_llama33_70b_plan_defaults_to_its_eagle3_head_by_hand():
    model = P.PRESETS["llama-3.3-70b"]
    draft = P.load_draft_spec("auto", model)
    assert draft == P.DRAFT_PRESETS["eagle3-llama3.3-70b"].spec()
    assert draft.name == "EAGLE3-LLaMA3.3-Instruct-70B"
    p = P.plan(P.PlanRequest(model, num_gpus=8, gpu_mem_gib=80, draft=draft))
    # the target is Llama-3-70B's shapes: the same numbers as above, context 8192 of 131072
    assert (p.tp_size, p.idle_gpus, p.context_len) == (4, 3, 8192)
    assert p.weight_bytes_per_gpu == 38_430_851_072 and p.max_sequences == 57
    d = p.draft
    assert (d.kind, d.head_params, d.shared_params, d.buffer_bytes) == (
        "eagle3", 1_403_027_456, V * H, 256_000)
    assert d.weight_bytes == (1_403_027_456 + V * H) * 2 + 256_000 == 4_907_657_216
    assert d.kv_bytes_per_token == 2 * 1 * KV * D * 2 == 4096  # one layer, 8 KV heads
    usable = int(80 * GIB * 0.9)
    assert d.max_sequences == (usable - 4_907_657_216) // (4096 * 8192) == 2157


def test_default_draft_per_target():
    assert P.load_draft_spec("auto", P.PRESETS["llama-3-70b"]).kind == "eagle2"
    assert P.load_draft_spec("auto", P.PRESETS["llama-3.1-8b"]) == \
        P.DRAFT_PRESETS["eagle3-llama3.1-8b"].spec()
    assert P.load_draft_spec("auto", P.PRESETS["llama-2-70b"]).fc_bias  # LLaMA-2 heads: bias
    tiny = _tiny_spec(tied=False)  # not a preset: an EAGLE-1/2 head shaped like it
    assert P.load_draft_spec("auto", tiny) == P.eagle_head_for(tiny)
    for key, name in P.DEFAULT_DRAFTS.items():
        assert P.DRAFT_PRESETS[name].target == key


def test_eagle3_llama31_8b_preset():
    draft = P.DRAFT_PRESETS["eagle3-llama3.1-8b"].spec()
    h, i, nh, kv, d = 4096, 14336, 32, 8, 128
    own = 3 * h * h + 2 * h * (nh * d + 2 * kv * d) + h * nh * d + 3 * h * i + 4 * h + VD * h
    assert P.draft_params(draft) == own == 424_689_664  # ~850 MB in fp16, as released


REFERENCE_EAGLE3_CONFIG = {  # yuhuili's EAGLE-3 release: a plain Llama config + draft_vocab_size
    "architectures": ["LlamaForCausalLM"], "bos_token_id": 128000, "eos_token_id": 128001,
    "hidden_act": "silu", "hidden_size": H, "initializer_range": 0.02, "intermediate_size": I,
    "max_position_embeddings": 2048, "model_type": "llama", "num_attention_heads": NH,
    "num_key_value_heads": KV, "num_hidden_layers": 1, "pad_token_id": 0,
    "rms_norm_eps": 1e-05, "tie_word_embeddings": False, "torch_dtype": "float16",
    "transformers_version": "4.28.1", "use_cache": True, "vocab_size": V,
    "draft_vocab_size": VD,
}


@pytest.mark.parametrize("changes, draft_vocab", [
    ({}, VD),  # reference release: detected by draft_vocab_size alone
    ({"architectures": ["LlamaForCausalLMEagle3"],  # SpecForge / SGLang
      "eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 39, 76]}}, VD),
    ({"architectures": ["LlamaForCausalLMEagle3"], "draft_vocab_size": None}, V),  # full vocab
])
def test_eagle3_head_detected_from_its_config_json(tmp_path, capsys, changes, draft_vocab):
    cfg = {k: v for k, v in {**REFERENCE_EAGLE3_CONFIG, **changes}.items() if v is not None}
    head_dir = tmp_path / "EAGLE3-LLaMA3.3-Instruct-70B"
    head_dir.mkdir()
    (head_dir / "config.json").write_text(json.dumps(cfg))
    assert P.is_eagle3_config(cfg)
    draft = P.load_draft_spec(str(head_dir), P.PRESETS["llama-3.3-70b"])  # the directory
    assert (draft.kind, draft.draft_vocab_size, draft.fc_bias) == ("eagle3", draft_vocab, False)
    assert P.draft_params(draft) == 1_403_027_456 + (draft_vocab - VD) * H
    assert P.run(_parse("--model", "llama-3.3-70b", "--gpus", "8", "--gpu-mem", "80",
                        "--draft", str(head_dir))) == 0
    out = capsys.readouterr().out
    assert f"EAGLE-3 head {P.draft_params(draft):,} (own lm_head included)" in out
    assert "max concurrent sequences at 8192 tokens: 57" in out


def test_eagle2_head_config_is_not_taken_for_eagle3():
    cfg = {k: v for k, v in REFERENCE_EAGLE3_CONFIG.items() if k != "draft_vocab_size"}
    assert not P.is_eagle3_config(cfg)
    draft = P.draft_spec_from_config(dict(cfg, bias=False), "EAGLE-LLaMA3-Instruct-70B")
    assert (draft.kind, P.draft_params(draft)) == ("eagle2", 989_863_936)


@pytest.mark.parametrize("kwargs, message", [
    ({"fc_bias": True}, "one decoder layer and no fc bias"),
    ({"draft_vocab_size": V + 1}, "must be in [1, vocab_size 128256]"),
    ({"kind": "medusa"}, "unknown draft kind"),
])
def test_bad_eagle3_specs_are_refused(kwargs, message):
    head = dataclasses.replace(P.PRESETS["llama-3.3-70b"], num_hidden_layers=1)
    fields = {"fc_bias": False, "kind": "eagle3", "draft_vocab_size": VD, **kwargs}
    with pytest.raises(ValueError) as err:
        P.DraftSpec(head, **fields)
    assert message in str(err.value)


@pytest.mark.parametrize("kind", ["eagle2", "eagle3"])
def test_draft_shapes_match_the_heads_eagle2_builds(kind):
    """The planner's named head shapes == the parameters of the head eagle2 loads (meta)."""
    import torch

    from eagle2.eagle3 import Eagle3Head
    from eagle2.head import DraftHead

    spec = dataclasses.replace(_tiny_spec(tied=False), num_hidden_layers=1)
    config = P.to_hf_config(spec)
    with torch.device("meta"):
        if kind == "eagle3":
            head = Eagle3Head(config, draft_vocab_size=100)
            draft = P.DraftSpec(spec, False, "eagle3", 100)
        else:
            head = DraftHead(config, bias=True)
            draft = P.DraftSpec(spec, True)
    real = {n: tuple(p.shape) for n, p in head.named_parameters()}
    assert real == P.draft_shapes(draft)
    assert sum(math.prod(s) for s in real.values()) == P.draft_params(draft)


def test_layouts_rank_two_tp4_replicas_with_a_shared_eagle3_draft_first():
    model = P.PRESETS["llama-3.3-70b"]
    draft = P.load_draft_spec("auto", model)
    layouts = P.node_layouts(model, draft, 8)
    best = layouts[0]
    assert (best.replicas, best.tp_size, best.draft, best.idle_gpus) == (2, 4, "shared", 0)
    # 4.57 GiB of weights + 8 x 8192 tokens x 4 KiB of head KV: within a 0.1 share of 80 GiB
    assert best.draft_gpu_fraction == 0.1
    assert [lay.tokens_per_s for lay in layouts] == sorted(
        (lay.tokens_per_s for lay in layouts), reverse=True)
    # a draft level reads 1.40 B params instead of the EAGLE-1/2 head + target lm_head's 2.04 B
    eagle2_best = P.node_layouts(model, P.eagle_head_for(model), 8)[0]
    assert best.step_ms < eagle2_best.step_ms
