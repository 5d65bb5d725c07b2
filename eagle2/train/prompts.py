"""Synthetic instruction prompts for training a draft head by self-distillation.

See docs/training.md "Training a head".

The reference recipe trains on 68k fixed ShareGPT conversations; nothing can be downloaded
here, and self-distillation needs only prompts (the target model writes the answers), so the
prompts are composed from the hand-written templates and fillers in ``prompt_templates``.
Each category is a product space templates x slot values; ``make_prompts`` draws from each
category its share of ``n`` distinct prompts, with a fixed seed, in a ShareGPT-like mix
(general chat 60%, code 25%, math and reasoning 15%).

The benchmarks (MT-bench, HumanEval) must stay unseen: ``overlap_report`` flags any training
prompt that shares a word 8-gram with a benchmark prompt or whose word 3-gram set has a
Jaccard similarity of 0.5 or more with one. The tests run it against all 80 + 164 benchmark
prompts. See ``PROMPTS.md``.
"""

from __future__ import annotations

import random
import re
import string
from collections import Counter, defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from math import prod

from eagle2.train.prompt_templates import CATEGORIES, CategorySpec

# make_prompts draws at most 1/HEADROOM of any category's space, so sampling stays fast and
# no template is exhausted.
HEADROOM = 2


@dataclass(frozen=True)
class TrainPrompt:
    text: str
    category: str  # CategorySpec.name
    group: str  # "general" | "code" | "math"


def categories() -> tuple[CategorySpec, ...]:
    """All prompt categories with their group and share of the mix."""
    return CATEGORIES


def group_weights() -> dict[str, float]:
    """Share of each group ("general", "code", "math") in the mix."""
    weights: dict[str, float] = defaultdict(float)
    for spec in CATEGORIES:
        weights[spec.group] += spec.weight
    return dict(weights)


def capacity(spec: CategorySpec) -> int:
    """The number of distinct (template, slot values) combinations of a category."""
    return sum(_template_size(spec, template) for template in spec.templates)


def max_prompts() -> int:
    """The largest ``n`` that ``make_prompts`` accepts."""
    return int(min(capacity(spec) / spec.weight for spec in CATEGORIES) / HEADROOM)


def make_prompts(n: int, seed: int = 0) -> list[str]:
    """``n`` distinct training prompts in the category mix; same (n, seed), same list."""
    return [prompt.text for prompt in make_labeled_prompts(n, seed)]


def make_labeled_prompts(n: int, seed: int = 0) -> list[TrainPrompt]:
    """Like ``make_prompts``, with each prompt's category and group."""
    if not 0 <= n <= max_prompts():
        raise ValueError(f"n must be in [0, {max_prompts()}], got {n}; add templates or "
                         "slot values in prompt_templates.py to raise the limit")
    prompts = []
    for spec, count in zip(CATEGORIES, _allocate(n), strict=True):
        rng = random.Random(f"{seed}/{spec.name}")  # str seeds are stable across runs
        texts = _sample_category(spec, count, rng)
        prompts += [TrainPrompt(text, spec.name, spec.group) for text in texts]
    random.Random(seed).shuffle(prompts)
    assert len({p.text for p in prompts}) == n, "categories produced the same prompt"
    return prompts


def _allocate(n: int) -> list[int]:
    """Split n over the categories by weight (largest remainder, ties by category order)."""
    total = sum(spec.weight for spec in CATEGORIES)
    exact = [n * spec.weight / total for spec in CATEGORIES]
    counts = [int(x) for x in exact]
    by_remainder = sorted(range(len(exact)), key=lambda i: counts[i] - exact[i])
    for i in by_remainder[: n - sum(counts)]:
        counts[i] += 1
    return counts


def _fields(template: str) -> tuple[str, ...]:
    """Slot names used by a template, in order: "{bug[1]} {req}" -> ("bug", "req")."""
    names = []
    for _, field, _, _ in string.Formatter().parse(template):
        if field is not None:
            name = re.match(r"\w+", field).group(0)
            if name not in names:
                names.append(name)
    return tuple(names)


def _template_size(spec: CategorySpec, template: str) -> int:
    return prod(len(spec.slots[name]) for name in _fields(template))


def _render(spec: CategorySpec, template: str, combo_idx: int) -> str:
    """The prompt for combination ``combo_idx`` of the template (mixed-radix over its slots).

    E.g. slots x: (a, b), y: (p, q, r): combo_idx 0..5 -> (a,p) (b,p) (a,q) (b,q) (a,r) (b,r).
    """
    values = {}
    for name in _fields(template):
        combo_idx, value_idx = divmod(combo_idx, len(spec.slots[name]))
        values[name] = spec.slots[name][value_idx]
    return template.format(**values).strip()  # strip: optional slots may be ""


def _sample_category(spec: CategorySpec, count: int, rng: random.Random) -> list[str]:
    """``count`` distinct prompts: a template uniformly, then one of its unused combinations."""
    sizes = [_template_size(spec, template) for template in spec.templates]
    used: list[set[int]] = [set() for _ in spec.templates]
    texts: dict[str, None] = {}  # ordered set
    open_templates = list(range(len(spec.templates)))
    while len(texts) < count:
        assert open_templates, f"category {spec.name!r} ran out of distinct prompts"
        t = rng.choice(open_templates)
        combo_idx = rng.randrange(sizes[t])
        if combo_idx in used[t]:
            continue
        used[t].add(combo_idx)
        if len(used[t]) == sizes[t]:
            open_templates.remove(t)
        texts.setdefault(_render(spec, spec.templates[t], combo_idx))
    return list(texts)


# ------------------------------------------------------------------- benchmark disjointness


@dataclass(frozen=True)
class OverlapHit:
    train_idx: int  # index into train_prompts
    bench_idx: int  # index into bench_prompts
    reason: str  # e.g. "shared 8-gram 'a b c d e f g h'" or "3-gram jaccard 0.62"


@dataclass(frozen=True)
class OverlapReport:
    num_train: int
    num_bench: int
    hits: tuple[OverlapHit, ...]

    @property
    def is_clean(self) -> bool:
        return not self.hits


def words(text: str) -> list[str]:
    """Lower-cased alphanumeric words; punctuation, code symbols and spacing are ignored."""
    return re.findall(r"[a-z0-9]+", text.lower())


def ngrams(tokens: Sequence[str], n: int) -> set[tuple[str, ...]]:
    return {tuple(tokens[i: i + n]) for i in range(len(tokens) - n + 1)}


def overlap_report(
    train_prompts: Sequence[str],
    bench_prompts: Sequence[str],
    *,
    shared_n: int = 8,
    jaccard_n: int = 3,
    max_jaccard: float = 0.5,
) -> OverlapReport:
    """Flag training prompts that overlap benchmark prompts.

    A (train, bench) pair is a hit if the two share any word ``shared_n``-gram (a copied
    phrase) or if the Jaccard similarity of their word ``jaccard_n``-gram sets is at least
    ``max_jaccard`` (a near-copy). Inverted indexes over the benchmark n-grams keep this
    linear in the number of training prompts.
    """
    long_index: dict[tuple[str, ...], list[int]] = defaultdict(list)
    short_index: dict[tuple[str, ...], list[int]] = defaultdict(list)
    short_sizes = []
    for j, text in enumerate(bench_prompts):
        tokens = words(text)
        for gram in ngrams(tokens, shared_n):
            long_index[gram].append(j)
        short = ngrams(tokens, jaccard_n)
        short_sizes.append(len(short))
        for gram in short:
            short_index[gram].append(j)

    hits = []
    for i, text in enumerate(train_prompts):
        tokens = words(text)
        flagged: set[int] = set()
        for gram in sorted(ngrams(tokens, shared_n)):
            for j in long_index.get(gram, ()):
                if j not in flagged:
                    flagged.add(j)
                    hits.append(OverlapHit(i, j, f"shared {shared_n}-gram {' '.join(gram)!r}"))
        short = ngrams(tokens, jaccard_n)
        shared = Counter(j for gram in short for j in short_index.get(gram, ()))
        for j, num_shared in sorted(shared.items()):
            jaccard = num_shared / (len(short) + short_sizes[j] - num_shared)
            if jaccard >= max_jaccard and j not in flagged:
                hits.append(OverlapHit(i, j, f"{jaccard_n}-gram jaccard {jaccard:.2f}"))
    return OverlapReport(len(train_prompts), len(bench_prompts), tuple(hits))
