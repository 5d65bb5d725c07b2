"""Tensors that cross between the head, the engine and the target stay on one device per op.

With the head in the engine process on a GPU (`draft_placement: inprocess`,
`eagle2.gpu_check`), the drafter's trees are built on the head's device while the engine
keeps its bookkeeping (the budget's masks and scales) on the host: any op that mixes the two
raises on CUDA. No GPU here, so two checks stand in for one:
1. a static one: every tensor factory call in the engine-side code names its device, or says
   in a `# host: <reason>` comment (on the call's lines or the line above) that it is meant
   to be on the host (a factory without a device makes a CPU tensor, whatever device the
   tensors it meets are on);
2. a dynamic one: the engine runs with a head whose trees "live" on another device (a torch
   function mode that tracks which tensors came from there and raises on any op that mixes
   them with host tensors, as CUDA would) and must give plain decoding's tokens.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch
from conftest import make_engine, random_prompts, run, tiny_target
from torch.overrides import TorchFunctionMode
from torch.utils.weak import WeakTensorKeyDictionary

from eagle2.budget import CostModel, choose_num_nodes
from eagle2.config import SamplingParams, TreeConfig
from eagle2.engine import Request
from eagle2.tree import DraftTree

ROOT = Path(__file__).resolve().parent.parent
ENGINE_SIDE = ("eagle2/engine.py", "eagle2/engine_admission.py", "eagle2/engine_budget.py",
               "eagle2/sequence.py", "eagle2/budget.py", "eagle2/verify.py", "eagle2/tree.py",
               "eagle2/lookup.py", "eagle2/drafter.py", "eagle2/runner.py")
# factories whose tensor lands on the default device (CPU) unless told otherwise (the *_like
# and new_* ones inherit their input's device)
FACTORIES = {"tensor", "zeros", "ones", "full", "empty", "arange", "eye"}
MARKER = "# host:"
# host-side calls in files whose owners have not marked them yet, with why they are right
# (source line -> reason); an entry stops mattering once its line carries the marker
KNOWN_HOST = {
    "pred = torch.full((num_b, num_n), -1, dtype=torch.long)":
        "verify_greedy_lazily's argmax table: filled from .cpu() results, read as lists",
    "tokens = torch.zeros(len(chains), width, dtype=torch.long)":
        "Drafter._chain_tensors: built from lists, moved to the head's device on return",
    "rates = torch.zeros(len(chains), width)": "Drafter._chain_tensors, as tokens",
    "tokens[b, : len(toks)] = torch.tensor(toks, dtype=torch.long)":
        "Drafter._chain_tensors, written into the host tensor above",
    "rates[b, : len(toks)] = torch.tensor(values)": "Drafter._chain_tensors, as tokens",
    "lengths = torch.tensor([len(toks) for toks, _, _ in chains])":
        "Drafter._chain_tensors, moved to the head's device on return",
    "self.draft([sid], feats, tokens, torch.tensor([2]),":
        "Drafter.warm_up: counts, which Drafter.draft moves to its device",
}


def unmarked_factories(path: Path, root: Path = ROOT) -> list[str]:
    """'file:line: source' (relative to root) of each torch.<factory>(...) call in `path`
    without a device= keyword, a `# host:` marker on its lines or the line above, or a
    KNOWN_HOST entry."""
    source = path.read_text()
    lines = source.splitlines()
    found = []
    for node in ast.walk(ast.parse(source)):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                and node.func.attr in FACTORIES and isinstance(node.func.value, ast.Name)
                and node.func.value.id == "torch"):
            continue
        if any(k.arg == "device" for k in node.keywords):
            continue
        around = lines[max(node.lineno - 2, 0): node.end_lineno]
        text = lines[node.lineno - 1].strip()
        if any(MARKER in line for line in around) or text in KNOWN_HOST:
            continue
        found.append(f"{path.relative_to(root)}:{node.lineno}: {text}")
    return found


def test_engine_side_tensor_factories_name_their_device():
    missing = [hit for name in ENGINE_SIDE for hit in unmarked_factories(ROOT / name)]
    assert not missing, ("tensor factories without device= (add it, or a '# host: <why>' "
                         "comment where the tensor is meant for the host):\n" +
                         "\n".join(missing))


def test_the_factory_check_sees_what_it_should(tmp_path):
    """The walker catches a bare factory and lets the three allowed forms through."""
    sample = tmp_path / "sample.py"
    sample.write_text(
        "import torch\n"
        "a = torch.zeros(3)\n"
        "b = torch.zeros(3, device=a.device)\n"
        "c = torch.arange(4)  # host: read with tolist\n"
        "# host: the lengths go through .tolist()\n"
        "d = torch.tensor([1,\n"
        "                  2])\n"
        "e = torch.zeros_like(a)\n"
        "f = torch.full(\n"
        "    (2,), 1)\n")
    assert unmarked_factories(sample, tmp_path) == ["sample.py:2: a = torch.zeros(3)",
                                                    "sample.py:9: f = torch.full("]


# ----- the dynamic check ----------------------------------------------------------------------
ELSEWHERE = torch.device("cuda", 1)  # where the head's trees pretend to be (no GPU needed)
DEVICE_OF = torch.Tensor.device.__get__  # (a new method-wrapper each time: compared by ==)
# what reads a tensor's values on the host (from a GPU: a synchronization and a copy each)
READS = (torch.Tensor.tolist, torch.Tensor.item, torch.Tensor.numpy, torch.Tensor.__int__,
         torch.Tensor.__float__, torch.Tensor.__bool__, torch.Tensor.__index__)


def _tensors(obj) -> list[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, (list, tuple)):
        return [t for x in obj for t in _tensors(x)]
    if isinstance(obj, dict):
        return [t for x in obj.values() for t in _tensors(x)]
    return []


class Elsewhere(TorchFunctionMode):
    """Runs on the CPU while some tensors count as being on ELSEWHERE: those `put` there,
    and what ops, moves (`.to`) and factories (device=ELSEWHERE) make from them. Their
    `.device` says ELSEWHERE. An op whose tensors are on both (a CPU tensor of one element
    and no dimension excepted: CUDA takes those as scalars; an index may be on the CPU, as
    CUDA allows) raises as CUDA does and is recorded in `mixed`. Moves to the CPU count in
    `moved_back`, other host reads of their values (`tolist`, `int()`...) in `read_there`."""

    def __init__(self):
        super().__init__()
        self.there = WeakTensorKeyDictionary()  # tensor -> True: it is on ELSEWHERE
        self.mixed: list[str] = []
        self.moved_back = 0  # tensors taken from ELSEWHERE to the CPU
        self.read_there: list[str] = []  # host reads of their values in place

    def put(self, t: torch.Tensor) -> torch.Tensor:
        copy = t.clone()
        self.there[copy] = True
        return copy

    def put_tree(self, tree: DraftTree) -> DraftTree:
        return DraftTree(*(self.put(t) for t in tree._fields()))

    def _device(self, t: torch.Tensor) -> torch.device:
        return ELSEWHERE if t in self.there else t.device

    @staticmethod
    def _is(device) -> bool:
        return device is not None and not isinstance(device, torch.Tensor) and \
            not isinstance(device, torch.dtype) and torch.device(device) == ELSEWHERE

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if func == DEVICE_OF:
            return self._device(args[0])
        if func in READS and args[0] in self.there:
            self.read_there.append(func.__name__)
        target = None  # the device the result goes to, where the call names one
        if func in (torch.Tensor.to, torch.Tensor.cpu):
            src = args[0]
            target = torch.device("cpu") if func is torch.Tensor.cpu else self._device(src)
            rest = []
            for a in args[1:]:
                if isinstance(a, torch.Tensor):
                    target = self._device(a)
                    a = a.dtype
                elif isinstance(a, (str, torch.device)):
                    target = torch.device(a)
                    a = "cpu"
                rest.append(a)
            if "device" in kwargs:
                target = torch.device(kwargs["device"])
                kwargs["device"] = "cpu"
            out = func(src, *rest, **kwargs)
            if out is src and target != self._device(src):  # a move copies
                out = out.clone()
            if target == ELSEWHERE:
                self.there[out] = True
            elif src in self.there:
                self.moved_back += 1
            return out
        if "device" in kwargs:  # a factory
            target = torch.device(kwargs["device"]) if kwargs["device"] is not None else None
            if self._is(kwargs["device"]):
                kwargs["device"] = "cpu"
        index_ops = (torch.Tensor.__getitem__, torch.Tensor.__setitem__)
        checked = (_tensors([args[0], *args[2:]]) if func in index_ops
                   else _tensors([args, kwargs]))
        devices = {self._device(t) for t in checked
                   if t in self.there or t.dim() > 0}
        if func in index_ops:  # an index on the CPU is fine for a tensor elsewhere
            base = self._device(args[0])
            if any(self._device(t) not in (base, torch.device("cpu"))
                   for t in _tensors(args[1])):
                devices.add(ELSEWHERE if base.type == "cpu" else torch.device("cpu"))
        if len(devices) > 1:
            self.mixed.append(getattr(func, "__name__", str(func)))
            found = sorted(map(str, devices))
            raise RuntimeError(f"Expected all tensors to be on the same device, but found at "
                               f"least two devices in {self.mixed[-1]}: {found}")
        out = func(*args, **kwargs)
        there = target == ELSEWHERE if target is not None else devices == {ELSEWHERE}
        if there:
            for t in _tensors(out):
                self.there[t] = True
        return out


def test_the_pretend_device_catches_what_cuda_would():
    with Elsewhere() as sim:
        a = sim.put(torch.ones(3))
        host = torch.ones(3)
        assert a.device == ELSEWHERE and (a * 2).device == ELSEWHERE
        with pytest.raises(RuntimeError, match="same device"):
            a * host
        with pytest.raises(RuntimeError, match="same device"):
            torch.cat([torch.zeros(1), a])
        assert (a * torch.tensor(2.0)).device == ELSEWHERE  # a CPU scalar is fine
        assert a[torch.tensor([0, 2])].device == ELSEWHERE  # and so is a CPU index
        assert (a.to("cpu") * host).device == torch.device("cpu")
        b = torch.zeros(2, device=ELSEWHERE)
        assert b.device == ELSEWHERE and (b + a[:2]).device == ELSEWHERE
        with pytest.raises(RuntimeError, match="same device"):
            host[:2] = b
    assert sim.mixed == ["mul", "cat", "__setitem__"]
    assert sim.read_there == [] and sim.moved_back == 1
    with Elsewhere() as sim:
        a = sim.put(torch.ones(3))
        a.tolist(), int(a[0])
    assert sim.read_there == ["tolist", "__int__"]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_draft_candidates_cross_to_the_host_in_one_read(dtype):
    """`build_tree` over candidates on a device (the head's, in process): one move to the
    host, no read in place, the tree on the host where asked (the drafter asks: the engine
    reads it there), equal to the tree built from host candidates: token ids beyond 2^24 and
    bf16 / fp32 scores cross exactly."""
    from test_tree import random_candidates

    from eagle2.tree import HOST, build_tree

    g = torch.Generator().manual_seed(4)
    batch = [random_candidates(g, 3, 3, quantize=False) for _ in range(2)]
    root = torch.tensor([128_255, 7])
    tokens = torch.tensor([b[0] for b in batch]) * 1_000_003  # ids up to ~10^8
    parents, depths = (torch.tensor([b[i] for b in batch]) for i in (1, 3))
    scores = torch.tensor([b[2] for b in batch], dtype=dtype)
    scores[1, -4:] = float("-inf")  # not candidates
    values = scores.float().exp().to(dtype) * 0.9
    lookup = torch.rand(tokens.shape, generator=g) < 0.3
    args = (root, tokens, parents, scores, depths, 9, values, lookup)
    expected = build_tree(*args)
    with Elsewhere() as sim:
        got = build_tree(*(sim.put(a) if isinstance(a, torch.Tensor) else a for a in args),
                         device=HOST)
    assert sim.moved_back == 1 and sim.read_there == [] and not sim.mixed
    for name, want in zip(DraftTree.__dataclass_fields__, expected._fields(), strict=True):
        have = getattr(got, name)
        assert have.device == HOST and torch.equal(have, want), name


def test_lookup_chains_join_device_candidates_in_one_read():
    """`lookup.add_chains` over the head's candidates on a device: one move to the host for
    the candidates and the chains together (it had read each of its 10 tensors), the merged
    candidates back on that device, equal to those merged on the host."""
    from eagle2.lookup import Candidates, add_chains

    cands = Candidates(torch.tensor([[10, 11, 20]]), torch.tensor([[-1, -1, 0]]),
                       torch.tensor([[-0.5, -1.0, -2.0]]), torch.tensor([[1, 1, 2]]),
                       torch.tensor([[0.6, 0.4, 0.1]]), torch.zeros(1, 3, dtype=torch.bool))
    chain = (torch.tensor([[10, 30, 31]]), torch.tensor([3]), torch.tensor([[-0.1, -0.2, -0.3]]),
             torch.tensor([[0.9, 0.8, 0.7]]))
    expected, expected_fresh = add_chains(cands, *chain)
    with Elsewhere() as sim:
        there = Candidates(*(sim.put(getattr(cands, f)) for f in Candidates.__dataclass_fields__))
        got, fresh = add_chains(there, *(sim.put(t) for t in chain))
        assert got.tokens.device == ELSEWHERE and fresh.device == ELSEWHERE
    assert sim.moved_back == 1 and sim.read_there == [] and not sim.mixed
    for name in Candidates.__dataclass_fields__:
        assert torch.equal(getattr(got, name), getattr(expected, name)), name
    assert torch.equal(fresh, expected_fresh)


def test_choose_num_nodes_takes_values_from_any_device():
    """The budget's own tensors follow the values' device (it was a CPU zero, cat with
    values on the head's device)."""
    costs = CostModel((1, 2), (1, 2, 3, 4), ((0.05, 0.052, 0.055, 0.07),) * 2)
    values = torch.tensor([[1.0, 0.9, 0.5, 0.1], [1.0, 0.3, 0.2, 0.0]])
    expected = choose_num_nodes(values, costs, draft_s=0.01)
    with Elsewhere() as sim:
        got = choose_num_nodes(sim.put(values), costs, draft_s=0.01)
    assert got == expected and not sim.mixed


AUTO = TreeConfig("eagle2", total_tokens=12, depth=3, top_k=4)  # budget "auto"


@pytest.mark.parametrize("with_vanilla", [False, True], ids=["auto", "auto+vanilla"])
def test_engine_budget_takes_trees_from_a_head_on_another_device(with_vanilla):
    """A head whose trees are on another device than the engine's bookkeeping: the engine
    takes them to the host where they arrive (`tree.to_device`), so the budget (masks,
    acceptance scales, choose_num_nodes, pruning) and the merge with an undrafted row's tree
    never mix devices; outputs stay plain decoding's. Before the conversion point the first
    drafted step raised: in `Engine._choose_budget` (the tree's values x the host's
    acceptance scales), and with a vanilla request in the batch already in `DraftTree.concat`
    (its host tree beside the drafted ones)."""
    target = tiny_target(seed=5)
    trees = (AUTO, AUTO, TreeConfig("vanilla")) if with_vanilla else (AUTO, AUTO)
    prompts = random_prompts(len(trees), 64, seed=6)
    params = SamplingParams(max_tokens=16, ignore_eos=True)
    expected = run(make_engine(target, None), prompts, params, TreeConfig("vanilla"))
    engine = make_engine(target, 0)
    batches = (1, 2, 4, 8)
    nodes = (1, 2, 4, 8, 16)
    # cheap trees: the budget keeps drafts, so pruned trees reach verification
    engine._costs = CostModel(batches, nodes, tuple(tuple(0.01 + 1e-5 * n for n in nodes)
                                                    for _ in batches),
                              draft_batches=batches, draft_level_s=(1e-5,) * len(batches),
                              draft_narrow_s=(1e-5,) * len(batches))
    sim = Elsewhere()
    real = engine.drafter.draft
    drafted = []

    def draft_elsewhere(*args, **kwargs):
        tree = real(*args, **kwargs)
        drafted.append(tree.batch_size)
        return sim.put_tree(tree)

    engine.drafter.draft = draft_elsewhere
    out: dict[str, list[int]] = {}
    with sim:
        # auto requests (the budget's rows), and a vanilla one (a host tree merged in)
        for i, (p, tree) in enumerate(zip(prompts, trees, strict=True)):
            engine.add(Request(f"s{i}", tuple(p), params, tree))
            out[f"s{i}"] = []
        while engine.has_work():
            for ev in engine.step():
                out[ev.seq_id].extend(ev.token_ids)
    assert not sim.mixed
    assert [out[f"s{i}"] for i in range(len(trees))] == expected
    assert engine.stats.auto_steps > 0 and drafted
    assert sim.moved_back >= len(drafted) * len(DraftTree.__dataclass_fields__)  # to HOST
    assert sum(n for size, n in engine.stats.nodes_chosen.items() if size > 1) > 0


def test_host_lists_reads_a_device_once_beside_host_tensors():
    """`tree.host_lists` (what the rerank, the lookup merge and every forward's step inputs
    read): the device's tensors in one move, the host's as they are, each list equal to the
    tensor's own `.tolist()` (int64 ids, bool, bf16, an empty tensor)."""
    from eagle2.tree import host_lists

    tensors = [torch.tensor([3, 1 << 40]), torch.tensor([[True, False]]), torch.zeros(0),
               torch.tensor([0.1, -2.5]).to(torch.bfloat16), torch.tensor([7, 8])]
    expected = [t.tolist() for t in tensors]
    with Elsewhere() as sim:
        mixed = [sim.put(t) if i != 4 else t for i, t in enumerate(tensors)]  # one on the host
        got = host_lists(mixed)
    assert got == expected and sim.moved_back == 1 and sim.read_there == [] and not sim.mixed
