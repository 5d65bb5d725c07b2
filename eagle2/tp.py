"""Tensor parallelism for the target: one process per rank, a transformation of a built model.

See docs/tensor-parallel.md "Tensor parallelism". Like gpt-fast's `apply_tp`:
- q/k/v_proj and gate/up_proj are column-parallel: rank r keeps rows [r * n / tp, (r+1) * n / tp)
  of the weight [out, in]; for attention that is whole KV-head groups (q head i uses KV head
  i // (heads / kv_heads), so contiguous blocks of q and KV heads line up);
- o_proj and down_proj are row-parallel: rank r keeps the same block of the weight's columns
  and the partial outputs are summed by an all-reduce (`RowParallelLinear`);
- q|k|v and gate|up are then merged per rank into one column-parallel matrix each
  (`merge_projections`: one matrix product instead of three and two, as the production engines
  build them; the HF modules' weights become views of the merged one);
- lm_head is vocabulary-parallel (`VocabParallelLMHead`): rank r keeps rows
  [r * ceil(V / tp), ...) of the vocabulary; greedy tokens cross the ranks as one (max, index)
  pair a row (`greedy_tokens`), and only sampled rows gather whole logits;
- embed_tokens and the norms stay whole on every rank, so features come out whole on every
  rank. Per layer a forward makes two all-reduces (o_proj, down_proj), nothing else: NCCL's
  on GPUs, on CPUs a `SocketGroup`'s (`eagle2.tp_comm`: gloo's thread handoffs cost
  milliseconds an op where ranks share busy cores).

`load_sharded` builds the model on the meta device and reads only this rank's slices from the
safetensors shards (`safe_open(...).get_slice`), one tensor at a time, straight to the device:
no process ever holds the whole model. `apply_tp` shards an already loaded model in place (GGUF
and the embedded model, which are small). All ranks must run the same calls with the same
inputs in lockstep (`services.tp_runner` drives them).

Pure torch: this module knows nothing of Ray.
"""

from __future__ import annotations

import datetime
import json
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

from eagle2.devices import pick_device
from eagle2.target import TargetModel
from eagle2.tp_comm import SocketGroup

COLUMN = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")  # split the weight's dim 0
ROW = ("o_proj", "down_proj")  # split the weight's dim 1, all-reduce the output


def init_tp(rank: int, world_size: int, master_addr: str, master_port: int,
            backend: str | None = None, timeout_s: float | None = None) -> None:
    """Join the tensor-parallel process group as `rank` of `world_size`.

    backend: "nccl" when this process sees a GPU, else "gloo". A Ray actor sees only its own
    GPU, so the local device is always cuda:0, whatever the global rank. timeout_s: how long
    joining (and the group's ops) may wait for the other ranks (None: torch's default).
    """
    if not 0 <= rank < world_size:
        raise ValueError(f"rank must be in [0, {world_size}), got {rank}")
    backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
    extra = {} if timeout_s is None else {"timeout": datetime.timedelta(seconds=timeout_s)}
    dist.init_process_group(backend, init_method=f"tcp://{master_addr}:{master_port}",
                            rank=rank, world_size=world_size, **extra)


def socket_group(model: torch.nn.Module) -> SocketGroup | None:
    """The socket collectives of a CPU shard (`_parallel_layers`); None where its collectives
    are torch's (GPUs) or it is not split."""
    return getattr(getattr(model, "lm_head", None), "group", None)


def check_tp_size(config, tp_size: int) -> None:
    """ValueError unless `config` (a Llama config) splits evenly over tp_size ranks."""
    num_heads = config.num_attention_heads
    num_kv_heads = getattr(config, "num_key_value_heads", None) or num_heads
    if tp_size < 1:
        raise ValueError(f"tp_size must be >= 1, got {tp_size}")
    if tp_size > num_kv_heads:
        raise ValueError(f"tp_size={tp_size} exceeds the model's {num_kv_heads} KV heads: ranks "
                         "hold whole KV-head groups; use a tp_size that divides it")
    if num_kv_heads % tp_size or num_heads % tp_size:
        raise ValueError(f"tp_size={tp_size} does not divide the model's {num_heads} attention "
                         f"/ {num_kv_heads} KV heads; use a divisor of the KV-head count")
    if config.intermediate_size % tp_size:
        raise ValueError(f"tp_size={tp_size} does not divide the MLP width "
                         f"{config.intermediate_size}; use a divisor of it")


class RowParallelLinear(torch.nn.Linear):
    """x [..., in / tp] @ weight shard [out, in / tp].T, summed over the ranks (all-reduce).
    A bias (whole on every rank) is added once, after the sum."""

    group: SocketGroup | None = None  # CPU ranks: the socket collectives (else torch's)
    row_parallel = True  # (the CPU backend's fused layers call `reduce` after their product)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.reduce(F.linear(x, self.weight))
        return out if self.bias is None else out + self.bias

    def reduce(self, out: torch.Tensor) -> torch.Tensor:
        """out (this rank's partial product) <- its sum over the ranks, in place."""
        if self.group is not None:
            self.group.all_reduce(out)
        elif dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(out)
        return out


class VocabParallelLMHead(torch.nn.Module):
    """This rank's rows of the lm_head: [ceil(V / tp), H] (the last rank's may be fewer), so
    the vocabulary's weight is split over the ranks instead of held whole by each.

    `forward` gives whole logits [..., V] on every rank (an all-gather: for sampled rows, whose
    processed distribution needs all of them); `greedy_tokens` gives the argmax without them:
    each rank's (max, index) pair a row is gathered, [tp, ..., 2] values instead of V."""

    def __init__(self, weight: torch.Tensor, vocab_size: int, tp_size: int, rank: int):
        super().__init__()
        self.vocab_size, self.tp_size, self.rank = vocab_size, tp_size, rank
        self.rows = -(-vocab_size // tp_size)  # rows a rank holds (padded on the last)
        self.start = rank * self.rows  # this rank's first vocabulary index
        self.weight = torch.nn.Parameter(weight, requires_grad=False)  # [rows or fewer, H]
        self.group: SocketGroup | None = None  # CPU ranks: the socket collectives

    def _gather(self, local: torch.Tensor) -> list[torch.Tensor]:
        """Every rank's `local`, in rank order (the socket group's: read only until its next
        collective, as here, where they are joined at once)."""
        if self.group is not None:
            return self.group.gather(local)
        parts = [torch.empty_like(local) for _ in range(self.tp_size)]
        dist.all_gather(parts, local)
        return parts

    def _local(self, x: torch.Tensor) -> torch.Tensor:
        """[..., H] -> this rank's logits [..., rows], -inf past the vocabulary's end."""
        out = F.linear(x, self.weight)
        pad = self.rows - out.shape[-1]
        return F.pad(out, (0, pad), value=float("-inf")) if pad else out

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        local = self._local(x)  # [..., rows]
        parts = self._gather(local.contiguous())
        return torch.cat(parts, dim=-1)[..., : self.vocab_size]  # [..., V]

    def greedy_tokens(self, x: torch.Tensor) -> torch.Tensor:
        """[..., H] -> [...] the argmax of the whole logits (ties: the lowest index, as
        `torch.argmax` on them gives)."""
        best, idx = self._local(x).float().max(dim=-1)  # [...] each
        pair = torch.stack([best, (idx + self.start).float()], dim=-1)  # [..., 2]
        every = torch.stack(self._gather(pair))  # [tp, ..., 2]: ranks in vocabulary order
        rank = every[..., 0].argmax(dim=0, keepdim=True)  # first maximum = lowest index
        return every[..., 1].gather(0, rank)[0].long()


def vocab_rows(vocab_size: int, tp_size: int, rank: int) -> slice:
    """The lm_head rows rank `rank` of tp_size holds (`VocabParallelLMHead`)."""
    rows = -(-vocab_size // tp_size)
    return slice(min(rank * rows, vocab_size), min((rank + 1) * rows, vocab_size))


def _merge(modules: list[torch.nn.Linear]) -> torch.nn.Linear:
    """One Linear whose weight (and bias) concatenates the modules' along the outputs; theirs
    become views of it (no second copy: HF code calling them still sees the same numbers)."""
    weight = torch.cat([m.weight.detach() for m in modules]).contiguous()
    biases = [m.bias for m in modules]
    bias = None if biases[0] is None else torch.cat([b.detach() for b in biases]).contiguous()
    merged = torch.nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None,
                             device="meta")
    merged.weight = torch.nn.Parameter(weight, requires_grad=False)
    if bias is not None:
        merged.bias = torch.nn.Parameter(bias, requires_grad=False)
    start = 0
    for m in modules:
        rows = m.weight.shape[0]
        m.weight = torch.nn.Parameter(weight[start:start + rows], requires_grad=False)
        if bias is not None:
            m.bias = torch.nn.Parameter(bias[start:start + rows], requires_grad=False)
        start += rows
    return merged


def merge_projections(model: torch.nn.Module) -> None:
    """Every decoder layer's q|k|v and gate|up as one matrix each (`attn.qkv_proj` with
    `attn.qkv_sizes`, `mlp.gate_up_proj`), which `attention.decoder_layer` uses. On a shard the
    merged matrix is the rank's own column-parallel block. Idempotent."""
    for layer in model.model.layers:
        merge_layer(layer)


def merge_layer(layer: torch.nn.Module) -> None:
    """`merge_projections` for one decoder layer."""
    attn, mlp = layer.self_attn, layer.mlp
    if getattr(attn, "qkv_proj", None) is None:
        parts = [attn.q_proj, attn.k_proj, attn.v_proj]
        attn.qkv_sizes = tuple(m.weight.shape[0] for m in parts)
        attn.qkv_proj = _merge(parts)
    if getattr(mlp, "gate_up_proj", None) is None:
        mlp.gate_up_proj = _merge([mlp.gate_proj, mlp.up_proj])


def _parallel_layers(model: torch.nn.Module, tp_size: int, rank: int,
                     head_weight: torch.Tensor, device: torch.device) -> None:
    """A shard's layers as the steps run them: row-parallel o/down, merged column-parallel
    q|k|v and gate|up, and the vocabulary-parallel lm_head from its rows `head_weight`; on a
    CPU their collectives go over a `SocketGroup` of the process group's ranks."""
    _mark_row_parallel(model, tp_size)
    if tp_size == 1:
        return
    merge_projections(model)
    model.lm_head = VocabParallelLMHead(head_weight, model.config.vocab_size, tp_size, rank)
    if device.type == "cpu":
        group = SocketGroup()
        model.lm_head.group = group
        for module in model.modules():
            if isinstance(module, RowParallelLinear):
                module.group = group


def split_dim(name: str) -> int | None:
    """The dim of parameter `name` that tensor parallelism splits (None: kept whole).
    E.g. "model.layers.3.self_attn.q_proj.weight" -> 0, "...o_proj.weight" -> 1."""
    parts = name.split(".")
    if len(parts) < 2:
        return None
    module, kind = parts[-2], parts[-1]
    if module in COLUMN:
        return 0  # weight [out, in] and bias [out] both split on out
    if module in ROW and kind == "weight":
        return 1
    return None


def shard_index(name: str, shape: tuple[int, ...], tp_size: int, rank: int) -> tuple[slice, ...]:
    """The slice of the full tensor `name` of `shape` that rank `rank` holds.
    E.g. down_proj.weight [64, 256], tp 2, rank 1 -> (slice(0, 64), slice(128, 256))."""
    index = [slice(0, n) for n in shape]
    dim = split_dim(name)
    if dim is not None and tp_size > 1:
        size = shape[dim] // tp_size
        assert size * tp_size == shape[dim], f"{name}: dim {dim} of {shape} does not split"
        index[dim] = slice(rank * size, (rank + 1) * size)
    return tuple(index)


def _mark_row_parallel(model: torch.nn.Module, tp_size: int) -> None:
    """o_proj / down_proj sum their partial outputs over the ranks. One rank holds whole
    weights: nothing to sum, and plain nn.Linear layers keep the fused layers and blocked
    kernels (`TargetModel.fuse`), so a tp_size 1 rank runs as fast as the in-process target."""
    if tp_size == 1:
        return
    for name, module in model.named_modules():
        if name.rsplit(".", 1)[-1] in ROW:
            assert type(module) is torch.nn.Linear, f"{name} is a {type(module)}"
            module.__class__ = RowParallelLinear


def _need_group(tp_size: int) -> None:
    if tp_size > 1 and (not dist.is_initialized() or dist.get_world_size() != tp_size):
        world = dist.get_world_size() if dist.is_initialized() else None
        raise ValueError(f"tensor parallelism over {tp_size} ranks needs init_tp with world_size "
                         f"{tp_size} first (process group world size: {world})")


def apply_tp(target: TargetModel, tp_size: int, rank: int | None = None,
             device: str | None = None) -> TargetModel:
    """This rank's shard of a whole loaded `target`, placed on `device` (cuda:0 when this
    process sees a GPU, else CPU). Needs `init_tp` first when tp_size > 1."""
    check_tp_size(target.config, tp_size)
    _need_group(tp_size)
    rank = dist.get_rank() if rank is None and tp_size > 1 else (rank or 0)
    model = target.hf
    with torch.no_grad():
        for name, param in model.named_parameters():
            if split_dim(name) is not None and tp_size > 1:
                piece = param.data[shard_index(name, tuple(param.shape), tp_size, rank)]
                param.data = piece.contiguous()
        # (a copy: a tied lm_head shares the embedding's weight, which stays whole)
        head = model.lm_head.weight.detach()[vocab_rows(len(model.lm_head.weight), tp_size,
                                                        rank)].clone()
    dev = pick_device(device)
    # on the device first: the merged q|k|v and gate|up keep the projections as views of
    # them, which a later move would copy apart (every such weight twice on the GPU)
    model.to(dev)
    _parallel_layers(model, tp_size, rank, head.to(dev), dev)
    return TargetModel(model.eval(), target.tokenizer, target.name)


# Kept as the old name: callers shard a loaded target the same way.
shard_target = apply_tp


def checkpoint_files(path: Path) -> dict[str, Path]:
    """Tensor name -> safetensors file, from model.safetensors.index.json or the single file."""
    index = path / "model.safetensors.index.json"
    if index.exists():
        weight_map = json.loads(index.read_text())["weight_map"]
        return {name: path / file for name, file in weight_map.items()}
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ValueError(f"{path} holds no *.safetensors files")
    from safetensors import safe_open

    found = {}
    for file in files:
        with safe_open(file, framework="pt") as f:
            found.update(dict.fromkeys(f.keys(), file))
    return found


def load_sharded(path: str | Path, tp_size: int, rank: int, dtype: torch.dtype,
                 device: str | None = None, name: str | None = None) -> TargetModel:
    """This rank's shard of the safetensors checkpoint at `path`, read slice by slice.

    The model is built on the meta device; every parameter is then read from its file with
    `get_slice` (this rank's rows or columns only) and moved to `device`. Each file is opened
    per tensor, so at most one tensor's pages are mapped at a time. No tokenizer is loaded.
    """
    from safetensors import safe_open
    from transformers import AutoConfig, AutoModelForCausalLM

    path = Path(path)
    config = AutoConfig.from_pretrained(path)
    check_tp_size(config, tp_size)
    _need_group(tp_size)  # without it the row-parallel sums would silently be partial
    dev = pick_device(device)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    files = checkpoint_files(path)
    loaded: dict[tuple, torch.Tensor] = {}  # (tensor name, slice) -> this rank's part
    head = None  # this rank's lm_head rows (tp_size > 1)
    for pname, param in list(model.named_parameters(remove_duplicate=False)):
        key = pname if pname in files else None
        if key is None and pname == "lm_head.weight" and "model.embed_tokens.weight" in files:
            key = "model.embed_tokens.weight"  # tied head: the embedding's tensor
        if key is None:
            raise ValueError(f"{path}: checkpoint has no tensor {pname!r}")
        index = shard_index(pname, tuple(param.shape), tp_size, rank)
        if pname == "lm_head.weight" and tp_size > 1:  # vocabulary-parallel: its rows only
            index = (vocab_rows(param.shape[0], tp_size, rank), *index[1:])
        if (key, str(index)) not in loaded:
            with safe_open(files[key], framework="pt") as f:
                part = f.get_slice(key)[index]
            # a copy: safetensors' CPU tensors are views of the file's mapping, whose touched
            # pages (and their read-around neighbours) would stay in this process' RSS
            loaded[key, str(index)] = part.to(device=dev, dtype=dtype, copy=True).contiguous()
        if pname == "lm_head.weight" and tp_size > 1:
            head = loaded[key, str(index)]
            continue
        _set_param(model, pname, loaded[key, str(index)])
        if tp_size > 1 and pname.endswith("mlp.up_proj.weight"):
            # the layer's q|k|v and gate|up are all read: merge them now, so that the parts'
            # memory is freed for the next layer's reads (merging at the end would hold a
            # second copy of every layer's at once)
            merge_layer(model.get_submodule(pname.rsplit(".", 3)[0]))
            loaded = {k: v for k, v in loaded.items() if k[0] == "model.embed_tokens.weight"}
    _rebuild_buffers(model, config, dev)
    _parallel_layers(model, tp_size, rank, head, dev)
    return TargetModel(model.eval(), None, name or str(path))


def load_rank(spec: str | None, tp_size: int, rank: int, dtype: torch.dtype,
              device: str | None = None) -> TargetModel:
    """This rank's shard of a target given as for `TargetModel.load` (a directory, a .gguf or
    None for the embedded model). Safetensors directories are read slice by slice
    (`load_sharded`); a GGUF is loaded whole on CPU, then sharded (`apply_tp`). The name is
    `TargetModel.load`'s, so that a whole-model rank finds the same cached kernel plan."""
    from eagle2.target import EMBEDDED_NAME, embedded_model_dir

    path = embedded_model_dir() if spec is None else Path(spec)
    if path.is_dir() and any(path.glob("*.safetensors")):
        return load_sharded(path, tp_size, rank, dtype, device, name=spec or EMBEDDED_NAME)
    return apply_tp(TargetModel.load(spec, dtype=dtype, device="cpu"), tp_size, rank, device)


def _set_param(model: torch.nn.Module, name: str, value: torch.Tensor) -> None:
    module_name, _, attr = name.rpartition(".")
    module = model.get_submodule(module_name)
    module._parameters[attr] = torch.nn.Parameter(value, requires_grad=False)


def _rebuild_buffers(model: torch.nn.Module, config, device: torch.device) -> None:
    """Non-persistent buffers (RoPE inv_freq) are not in the checkpoint: build them anew."""
    rotary = model.model.rotary_emb
    model.model.rotary_emb = type(rotary)(config=config).to(device)
    for name, buf in model.named_buffers():
        assert not buf.is_meta, f"buffer {name} left on the meta device"
