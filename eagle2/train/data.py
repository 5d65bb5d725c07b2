"""Training data for a draft head: self-distilled conversations and feature shards.

See docs/training.md "Training a head".

Two stages, each resumable and written atomically (a crash loses at most one chunk):

1. **Conversations.** Prompts from `make_prompts`, in the target's chat template; the target
   itself writes the answers (self-distillation), batched through the engine in vanilla mode.
   Greedy by default, which matches the T=0 benchmark best; `temperature > 0` samples
   instead, and `sample_every` answers every n-th chunk at T = 1 (a share for sampling
   mode). Stored as token ids: `conversations/chunk_XXXXX.json`.
2. **Features.** One target forward per conversation gives the features (last hidden state
   after the final norm) at every position; stored with the token ids and the loss mask in
   `features/shard_XXXXX.safetensors` (features in fp16).

Loss mask: the head at position t (pair feature[t], token[t+1]) predicts feature[t+1], whose
argmax is token[t+2]. Drafting starts at the first answer token, so position t is trained
when token[t+2] is an answer token: t in [P - 1, L - 3] for a prompt of P tokens and L tokens
in all.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from tqdm import tqdm


@dataclass(frozen=True)
class DataConfig:
    num_prompts: int = 2000
    seed: int = 0
    max_new_tokens: int = 256
    temperature: float = 0.0
    max_batch: int = 16
    chunk_size: int = 64  # conversations per chunk / shard
    # every n-th chunk (n - 1, 2n - 1, ...) is answered at T = 1 so sampling mode improves
    # too; 0 = none
    sample_every: int = 0

    def __post_init__(self) -> None:
        if self.num_prompts < 1:
            raise ValueError(f"num_prompts must be >= 1, got {self.num_prompts}")
        if self.max_new_tokens < 2:
            raise ValueError(f"max_new_tokens must be >= 2, got {self.max_new_tokens}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if self.sample_every < 0:
            raise ValueError(f"sample_every must be >= 0, got {self.sample_every}")
        if self.max_batch < 1 or self.chunk_size < 1:
            raise ValueError("max_batch and chunk_size must be >= 1")

    def temperature_of(self, chunk: int) -> float:
        if self.sample_every and chunk % self.sample_every == self.sample_every - 1:
            return 1.0
        return self.temperature

    @property
    def num_chunks(self) -> int:
        return -(-self.num_prompts // self.chunk_size)


def atomic_write(path: Path, write) -> None:
    """Call write(tmp_path), then rename onto path (readers never see a partial file)."""
    tmp = path.with_name(path.name + ".tmp")
    write(tmp)
    os.replace(tmp, path)


def chunk_path(root: Path, idx: int) -> Path:
    return root / "conversations" / f"chunk_{idx:05d}.json"


def shard_path(root: Path, idx: int) -> Path:
    return root / "features" / f"shard_{idx:05d}.safetensors"


# ----- stage 1: conversations ------------------------------------------------------------------
def generate_conversations(llm, prompts: list[str] | Callable[[int], list[str]],
                           cfg: DataConfig, root: Path, chunks: list[int] | None = None) -> int:
    """Let the target answer the prompts of `chunks` (default all); skip finished chunks.
    prompts: all prompts (chunk i = the i-th slice of chunk_size), or chunk i -> its prompts.

    Returns the number of answer tokens written."""
    if not callable(prompts):
        every = prompts
        prompts = lambda i: every[i * cfg.chunk_size:(i + 1) * cfg.chunk_size]  # noqa: E731
    from eagle2.config import SamplingParams

    (root / "conversations").mkdir(parents=True, exist_ok=True)
    chunks = range(cfg.num_chunks) if chunks is None else chunks
    todo = [i for i in chunks if not chunk_path(root, i).exists()]
    written = 0
    bar = tqdm(todo, desc="self-distill chunks", unit="chunk")
    for idx in bar:
        batch = prompts(idx)
        if not batch:
            continue
        temperature = cfg.temperature_of(idx)
        params = SamplingParams(temperature=temperature, max_tokens=cfg.max_new_tokens,
                                seed=cfg.seed * 100_003 + idx)
        outs = llm.generate(batch, params, mode="vanilla")
        records = [{"prompt": p, "prompt_ids": llm.encode(p), "answer_ids": o.token_ids,
                    "temperature": temperature}
                   for p, o in zip(batch, outs, strict=True)]
        atomic_write(chunk_path(root, idx),
                     lambda tmp, r=records: tmp.write_text(json.dumps(r)))
        written += sum(len(o.token_ids) for o in outs)
        bar.set_postfix(answer_tokens=written)
    return written


# ----- archives: the conversations as a small file that outlives the machine --------------------
ARCHIVED = ("conversations", "prompts")  # chunk files of the data stage (token ids, prompts)


def pack_archive(root: Path, archive: Path) -> int:
    """Write the finished chunk files of `root` (conversations and self-written prompts, not
    feature shards) into an xz-compressed tar (~1 byte per answer token), byte-identical for
    the same chunks (sorted names, no times or owners). Returns the number of files."""
    import io
    import tarfile

    files = sorted(f for d in ARCHIVED for f in (root / d).glob("chunk_*.json"))
    if not files:
        raise ValueError(f"no chunk files under {root}/{{{','.join(ARCHIVED)}}}")

    def write(tmp: Path) -> None:
        with tarfile.open(tmp, "w:xz", preset=9) as tar:
            for f in files:
                body = f.read_bytes()
                info = tarfile.TarInfo(str(f.relative_to(root)))
                info.size, info.mode = len(body), 0o644
                tar.addfile(info, io.BytesIO(body))

    archive.parent.mkdir(parents=True, exist_ok=True)
    atomic_write(archive, write)
    return len(files)


def unpack_archive(archive: Path, root: Path) -> int:
    """Extract the chunk files of an archive into `root`, keeping chunks that already exist
    there (the data stage then continues after the archived chunks). Returns files written."""
    import re
    import tarfile

    written = 0
    with tarfile.open(archive, "r:xz") as tar:
        for info in tar.getmembers():
            parts = info.name.split("/")
            if (not info.isfile() or len(parts) != 2 or parts[0] not in ARCHIVED
                    or not re.fullmatch(r"chunk_\d{5}\.json", parts[1])):
                raise ValueError(f"{archive}: unexpected member {info.name!r}")
            dest = root / parts[0] / parts[1]
            if dest.exists():
                continue
            dest.parent.mkdir(parents=True, exist_ok=True)
            body = tar.extractfile(info).read()
            json.loads(body)  # a damaged archive fails here, before anything is trained on it
            atomic_write(dest, lambda tmp, b=body: tmp.write_bytes(b))
            written += 1
    return written


def load_conversations(root: Path) -> list[dict]:
    files = sorted((root / "conversations").glob("chunk_*.json"))
    return [rec for f in files for rec in json.loads(f.read_text())]


# ----- stage 2: features -----------------------------------------------------------------------
def loss_mask(prompt_len: int, total_len: int) -> torch.Tensor:
    """[L] bool: positions t whose predicted token t+2 is an answer token (see module doc)."""
    mask = torch.zeros(total_len, dtype=torch.bool)
    mask[max(prompt_len - 1, 0):max(total_len - 2, 0)] = True
    return mask


@torch.inference_mode()
def target_features(hf_model, ids: list[list[int]]) -> list[torch.Tensor]:
    """Features [L, H] per sequence (last hidden state after the final norm); right-padded."""
    return [final for final, _ in target_outputs(hf_model, ids)]


@torch.inference_mode()
def target_outputs(hf_model, ids: list[list[int]], layers: tuple[int, ...] | None = None
                   ) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
    """Per sequence (fp32, on the CPU): the final features [L, H] and, for `layers` (EAGLE-3:
    decoder-layer inputs, HF `hidden_states` indices), their residual streams side by side
    [L, 3H] (None without layers). Right-padded batches; the model may be spread over
    devices (accelerate's hooks move the activations, each output comes back here)."""
    lengths = [len(x) for x in ids]
    num_t = max(lengths)
    device = hf_model.device
    batch = torch.zeros(len(ids), num_t, dtype=torch.long, device=device)
    attn = torch.zeros(len(ids), num_t, dtype=torch.long, device=device)
    for b, x in enumerate(ids):
        batch[b, :len(x)] = torch.tensor(x)
        attn[b, :len(x)] = 1
    out = hf_model.model(input_ids=batch, attention_mask=attn,
                         output_hidden_states=layers is not None)
    hidden = out.last_hidden_state.float().cpu()
    aux = None if layers is None else \
        torch.cat([out.hidden_states[i].float().cpu() for i in layers], dim=-1)
    return [(hidden[b, :n], None if aux is None else aux[b, :n])
            for b, n in enumerate(lengths)]


def extract_features(hf_model, root: Path, max_len: int = 2048, batch_size: int = 8,
                     worker: tuple[int, int] = (0, 1),
                     layers: tuple[int, ...] | None = None) -> int:
    """One shard per conversation chunk (same number); skip finished shards. Returns chunks.

    worker (i, n): only chunks whose number is i mod n (several processes in parallel).
    layers: also store these decoder layers' inputs side by side (`aux`, an EAGLE-3 head's
    features; `target_outputs`)."""
    (root / "features").mkdir(parents=True, exist_ok=True)
    chunks = sorted((root / "conversations").glob("chunk_*.json"))
    todo = [c for c in chunks if int(c.stem.split("_")[1]) % worker[1] == worker[0]
            and not shard_path(root, int(c.stem.split("_")[1])).exists()]
    for chunk in tqdm(todo, desc="feature shards", unit="shard"):
        recs = json.loads(chunk.read_text())
        seqs = [(r["prompt_ids"] + r["answer_ids"])[:max_len] for r in recs]
        order = sorted(range(len(seqs)), key=lambda i: len(seqs[i]))  # similar lengths together
        by_idx: dict[int, tuple[torch.Tensor, torch.Tensor | None]] = {}
        for s in range(0, len(order), batch_size):
            group = order[s:s + batch_size]
            outs = target_outputs(hf_model, [seqs[i] for i in group], layers)
            by_idx.update(zip(group, outs, strict=True))
        masks = [loss_mask(len(r["prompt_ids"]), len(x))
                 for r, x in zip(recs, seqs, strict=True)]
        tensors = {
            "input_ids": torch.tensor([t for x in seqs for t in x], dtype=torch.int32),  # [L*]
            "lengths": torch.tensor([len(x) for x in seqs], dtype=torch.int32),  # [N]
            "loss_mask": torch.cat(masks),  # [L*]
            "features": torch.cat([by_idx[i][0] for i in range(len(seqs))]).half(),  # [L*, H]
        }
        if layers is not None:
            tensors["aux"] = torch.cat([by_idx[i][1] for i in range(len(seqs))]).half()  # [L*, 3H]
        atomic_write(shard_path(root, int(chunk.stem.split("_")[1])),
                     lambda tmp, t=tensors: save_file(t, str(tmp)))
    return len(chunks)


@dataclass
class Sequence:
    input_ids: torch.Tensor  # [L] long
    loss_mask: torch.Tensor  # [L] bool
    features: torch.Tensor  # [L, H] fp16
    aux: torch.Tensor | None = None  # [L, 3H] fp16: EAGLE-3 layers' inputs (if stored)


def load_shards(root: Path, mmap: bool = False) -> list[Sequence]:
    """All stored sequences, split back out of their shards. mmap: the features are views of
    the files mapped into memory (read when a batch is collated; the page cache is shared by
    the processes of a node), for data sets larger than the host's memory."""
    out: list[Sequence] = []
    for f in sorted((root / "features").glob("shard_*.safetensors")):
        t = map_file(f) if mmap else load_file(str(f))
        lengths = t["lengths"].tolist()
        ids = t["input_ids"].long().split(lengths)
        masks = t["loss_mask"].split(lengths)
        feats = t["features"].split(lengths)
        aux = t["aux"].split(lengths) if "aux" in t else [None] * len(lengths)
        out.extend(Sequence(*x) for x in zip(ids, masks, feats, aux, strict=True))
    return out


_NUMPY = {"F16": "float16", "BF16": None, "F32": "float32", "I32": "int32", "I64": "int64",
          "BOOL": "bool"}


def map_file(path: Path) -> dict[str, torch.Tensor]:
    """A safetensors file's tensors as copy-on-write views of the mapped file (format: an
    8-byte little-endian header size, a JSON header of dtype, shape and byte offsets, data)."""
    import numpy as np

    with path.open("rb") as fh:
        size = int.from_bytes(fh.read(8), "little")
        header = json.loads(fh.read(size))
    header.pop("__metadata__", None)
    raw = np.memmap(path, dtype=np.uint8, mode="c", offset=8 + size)
    out = {}
    for name, info in header.items():
        dtype = _NUMPY[info["dtype"]]
        assert dtype is not None, f"{path}: {name} is {info['dtype']} (stored fp16 expected)"
        start, end = info["data_offsets"]
        out[name] = torch.from_numpy(raw[start:end].view(dtype).reshape(info["shape"]))
    return out


def token_counts(seqs: list[Sequence], vocab_size: int) -> torch.Tensor:
    """[V] how often each token is a trained prediction target (token[t+2] under the mask)."""
    counts = torch.zeros(vocab_size, dtype=torch.long)
    for s in seqs:
        idx = torch.nonzero(s.loss_mask[:-2]).squeeze(-1) + 2
        counts += torch.bincount(s.input_ids[idx], minlength=vocab_size)
    return counts


def draft_vocab(seqs: list[Sequence], vocab_size: int, size: int,
                always: tuple[int, ...] = ()) -> torch.Tensor:
    """d2t [size]: the `size` most frequent target tokens (plus `always`), sorted by id.

    Ties (mostly tokens unseen in the data) go to the lower id: BPE vocabularies number their
    merges in order, so a lower id is the more common token in the tokenizer's corpus."""
    if not 0 < size <= vocab_size:
        raise ValueError(f"--draft-vocab must be in 1..{vocab_size}, got {size}")
    counts = token_counts(seqs, vocab_size).double()
    counts -= torch.arange(vocab_size, dtype=torch.double) / (2 * vocab_size)
    if always:
        counts[list(always)] = float("inf")
    return counts.topk(size).indices.sort().values
