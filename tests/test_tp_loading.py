"""eagle2.tp.load_sharded: each rank reads only its slices, and the sharded model is the model.

See docs/tensor-parallel.md "Tensor parallelism". A random Llama of ~1 GB (fp32) is written in the
standard multi-shard layout (model-0000X-of-0000N.safetensors + model.safetensors.index.json).
Two spawned processes join a gloo group (tp = 2) and load it; each measures its own peak RSS
(VmHWM, reset at the start through /proc/self/clear_refs) while loading and generating. A third
process loads it with tp = 1. Greedy tokens must be equal; each rank's peak while loading must grow
by at most 0.6x the checkpoint (its half of the layers + the embedding and half the head is ~0.52x),
and over the whole run (fused kernels, KV cache, generation) by at most 0.65x of tp 1's growth.
"""

from __future__ import annotations

import json
import multiprocessing as mp
from pathlib import Path

import pytest
import torch

from eagle2.tp_channel import free_port

NUM_SHARDS = 4
CONFIG = dict(vocab_size=4096, hidden_size=1024, intermediate_size=4096, num_hidden_layers=16,
              num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=512,
              tie_word_embeddings=False, architectures=["LlamaForCausalLM"], model_type="llama",
              rms_norm_eps=1e-5, rope_theta=10000.0, torch_dtype="float32")
PROMPTS = [[5, 17, 300, 42, 7], [1000, 3, 3, 9]]
NEW_TOKENS = 6


def tensor_shapes(cfg: dict) -> dict[str, tuple[int, ...]]:
    """Every parameter of the checkpoint and its full shape, in file order."""
    h, i, v = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    kv = h * cfg["num_key_value_heads"] // cfg["num_attention_heads"]
    shapes = {"model.embed_tokens.weight": (v, h)}
    for n in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{n}."
        shapes.update({
            p + "self_attn.q_proj.weight": (h, h), p + "self_attn.k_proj.weight": (kv, h),
            p + "self_attn.v_proj.weight": (kv, h), p + "self_attn.o_proj.weight": (h, h),
            p + "mlp.gate_proj.weight": (i, h), p + "mlp.up_proj.weight": (i, h),
            p + "mlp.down_proj.weight": (h, i), p + "input_layernorm.weight": (h,),
            p + "post_attention_layernorm.weight": (h,)})
    shapes.update({"model.norm.weight": (h,), "lm_head.weight": (v, h)})
    return shapes


def write_checkpoint(path: Path) -> int:
    """Random weights in NUM_SHARDS files + index; returns the bytes of tensor data."""
    from safetensors.torch import save_file

    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(CONFIG))
    shapes = tensor_shapes(CONFIG)
    names = list(shapes)
    gen = torch.Generator().manual_seed(0)
    weight_map, total = {}, 0
    for s in range(NUM_SHARDS):
        file = f"model-{s + 1:05d}-of-{NUM_SHARDS:05d}.safetensors"
        part = {}
        for name in names[s * len(names) // NUM_SHARDS:(s + 1) * len(names) // NUM_SHARDS]:
            shape = shapes[name]
            scale = 1.0 if len(shape) == 1 else (0.5 if "lm_head" in name else 0.03)
            t = torch.ones(shape) if len(shape) == 1 else torch.randn(shape, generator=gen) * scale
            part[name] = t
            weight_map[name] = file
            total += t.nbytes
        save_file(part, path / file, metadata={"format": "pt"})
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (path / "model.safetensors.index.json").write_text(json.dumps(index))
    return total


def _memory_kb(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise AssertionError(f"no {field} in /proc/self/status")


def rank_main(rank: int, tp_size: int, port: int, path: str, out: mp.Queue) -> None:
    """One rank: join the group, load its shard, generate greedily; report tokens and peak RSS."""
    torch.set_num_threads(1)
    from eagle2.config import SamplingParams, TreeConfig
    from eagle2.engine import Engine, Request
    from eagle2.runner import LocalRunner
    from eagle2.tp import init_tp, load_sharded

    if tp_size > 1:
        init_tp(rank, tp_size, "127.0.0.1", port, backend="gloo")
    base = _memory_kb("VmRSS")
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS now
    target = load_sharded(path, tp_size, rank, torch.float32, "cpu")
    loaded = (_memory_kb("VmHWM") - base) * 1024
    target.fuse(measure=False)  # tp 1 fuses: no kernel plan measured for a throwaway model
    engine = Engine(LocalRunner(target, 2, 64), None, max_batch=2, max_context=32, tree_margin=8)
    params = SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True)
    tokens: dict[str, list[int]] = {f"s{i}": [] for i in range(len(PROMPTS))}
    for i, p in enumerate(PROMPTS):
        engine.add(Request(f"s{i}", tuple(p), params, TreeConfig("vanilla")))
    while engine.has_work():
        for ev in engine.step():
            tokens[ev.seq_id].extend(ev.token_ids)
    out.put((rank, tokens, (_memory_kb("VmHWM") - base) * 1024,
             target.local_kv_heads(), loaded))


def run_ranks(tp_size: int, path: Path) -> list[tuple]:
    # glibc's dynamic mmap threshold otherwise serves some freed-and-reallocated slices from the
    # heap, where fragmentation now and then keeps ~0.15x of the checkpoint resident (seen in 1 of
    # 6 runs): a fixed threshold makes the peak what the loader holds, the same in every run
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = free_port("127.0.0.1")
    procs = [ctx.Process(target=rank_main, args=(r, tp_size, port, str(path), out))
             for r in range(tp_size)]
    with pytest.MonkeyPatch.context() as env:
        env.setenv("MALLOC_MMAP_THRESHOLD_", str(1 << 20))
        for p in procs:
            p.start()
    results = [out.get(timeout=300) for _ in procs]
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    return sorted(results)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("synthetic-llama")
    return path, write_checkpoint(path)


def test_index_layout_is_the_standard_one(checkpoint):
    path, total = checkpoint
    index = json.loads((path / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert files == [f"model-{i:05d}-of-00004.safetensors" for i in range(1, 5)]
    assert 0.95e9 < total < 1.1e9


@pytest.mark.slow  # three processes read a 1 GB checkpoint, ~15 s
@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="needs Linux /proc")
def test_tp2_ranks_read_their_half_and_equal_tp1(checkpoint):
    path, total = checkpoint
    tp2 = run_ranks(2, path)
    tp1 = run_ranks(1, path)
    assert [r[3] for r in tp2] == [2, 2] and tp1[0][3] == 4  # KV heads per rank
    assert tp2[0][1] == tp1[0][1]  # rank 0's greedy tokens equal the unsharded model's
    assert all(len(t) == NEW_TOKENS for t in tp1[0][1].values())
    print(f"checkpoint {total / 1e9:.3f} GB; peak RSS growth loading / whole run: tp2 "
          f"{[(round(r[4] / total, 3), round(r[2] / total, 3)) for r in tp2]}x, "
          f"tp1 {tp1[0][4] / total:.3f} / {tp1[0][2] / total:.3f}x")
    whole = tp1[0][2]
    assert tp1[0][4] >= 0.9 * total  # the measure sees a whole-model load
    for rank, _, growth, _, loaded in tp2:
        # reading: its half of the layers + the embedding and its half of the head (~0.52x)
        assert loaded <= 0.6 * total, f"rank {rank} peak RSS grew {loaded / total:.2f}x loading"
        # the whole run (fusing, the KV cache, generating) adds what the unsharded run adds, in
        # proportion: kernels that pack weights differ between machines, so compare with tp 1
        assert growth <= 0.65 * whole, f"rank {rank} peak {growth / whole:.2f}x of tp 1's"
