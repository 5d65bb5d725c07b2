"""The prompt categories of the synthetic training prompts (self-distillation, docs/training.md
"Training a head"), read from the data file ``prompt_templates.json`` next to this module.

Everything in that file was written for this project: nothing is copied from ShareGPT,
MT-bench or HumanEval, and topics those benchmarks ask about (Fibonacci, palindromes, primes,
dice, LCS, photosynthesis, ...) are left out on purpose. ``eagle2.train.prompts`` samples from
the product templates x slot values of each category and checks n-gram disjointness from the
benchmarks. A template field ``{slot}`` takes one value of ``slots[slot]``; ``{slot[i]}``
indexes into a tuple value, for fields that must agree (a SQL schema and its question).
Mix, like ShareGPT: general chat 0.60, code 0.25, math and reasoning 0.15.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from importlib import resources
from types import MappingProxyType

DATA_FILE = "prompt_templates.json"


@dataclass(frozen=True)
class CategorySpec:
    """One kind of prompt: its share of the mix and the product space it is drawn from."""

    name: str
    group: str  # "general" | "code" | "math"
    weight: float  # share of all prompts; the weights of all categories sum to 1
    templates: tuple[str, ...]
    slots: Mapping[str, tuple]  # slot name -> its values (str, or tuple for {slot[i]})


def _frozen(value):
    """JSON lists back to the tuples the templates index into."""
    return tuple(_frozen(v) for v in value) if isinstance(value, list) else value


def load_categories() -> tuple[CategorySpec, ...]:
    """All categories from the package's data file, in file order."""
    text = resources.files("eagle2.train").joinpath(DATA_FILE).read_text(encoding="utf-8")
    return tuple(
        CategorySpec(c["name"], c["group"], c["weight"], tuple(c["templates"]),
                     MappingProxyType({k: _frozen(v) for k, v in c["slots"].items()}))
        for c in json.loads(text)["categories"])


CATEGORIES = load_categories()
