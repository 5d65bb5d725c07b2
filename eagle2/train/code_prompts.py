"""Code-completion prompts cut from the Python standard library (a second prompt source).

HumanEval asks the model to complete a function from its signature and docstring. The
synthetic chat prompts (`prompts.py`) hold few such turns, so a head trained on them alone
drafts code poorly. This source takes the functions of the running interpreter's standard
library that have a docstring, keeps the signature and the docstring, drops the body, and
wraps the stub in a user message asking for the completion. The target then writes the body
itself (self-distillation), so no library code is trained on, only the model's own answers.

Disjoint from the benchmarks by construction (the standard library is not HumanEval or
MT-bench) and checked: `make_code_prompts` drops any stub whose function name is a HumanEval
entry point or that `overlap_report` flags against the benchmark prompts given to it.
The list depends on the Python version's standard library (the shipped head used 3.11) and
is otherwise deterministic: files and functions in sorted order, shuffled with `seed`.
"""

from __future__ import annotations

import ast
import random
import sysconfig
import textwrap
from pathlib import Path

# several phrasings, so the head does not learn one fixed wrapper
WRAPPERS = (
    "Complete this Python function:",
    "Finish the implementation of the following Python function.",
    "Write the body of this Python function:",
    "Implement the function below in Python.",
)
SKIP_PARTS = {"test", "tests", "idlelib", "lib2to3", "site-packages", "dist-packages",
              "turtledemo", "ensurepip", "__phello__", "pydoc_data", "tkinter"}
MIN_DOC, MAX_DOC = 40, 700  # docstring length in characters
MAX_STUB_LINES = 30


def stdlib_dir() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def function_stubs(root: Path | None = None) -> list[tuple[str, str]]:
    """(name, stub) for every top-level function with a usable docstring, in file order.

    A stub is the `def` line(s) and the docstring, re-indented to column 0; the body is cut.
    """
    root = root or stdlib_dir()
    out = []
    for path in sorted(root.rglob("*.py")):
        if SKIP_PARTS & set(path.relative_to(root).parts) or path.name.startswith("_"):
            continue
        try:
            source = path.read_text(encoding="utf-8")
            tree = ast.parse(source)
        except (SyntaxError, UnicodeDecodeError, ValueError):
            continue
        lines = source.splitlines()
        for node in tree.body:
            stub = _stub(node, lines)
            if stub:
                out.append((node.name, stub))
    return out


def _stub(node: ast.stmt, lines: list[str]) -> str | None:
    if not isinstance(node, ast.FunctionDef) or node.name.startswith("_"):
        return None
    doc = ast.get_docstring(node, clean=False)
    if not doc or not MIN_DOC <= len(doc.strip()) <= MAX_DOC or not node.body:
        return None
    first = node.lineno - 1 if not node.decorator_list else node.decorator_list[0].lineno - 1
    last = node.body[0].end_lineno  # the docstring expression
    if last is None or last - first > MAX_STUB_LINES or len(node.body) < 2:
        return None  # a function that is only a docstring has nothing to complete
    return textwrap.dedent("\n".join(lines[first:last])).rstrip() + "\n"


def make_code_prompts(n: int, seed: int = 0, bench_prompts: list[str] | None = None,
                      exclude_names: set[str] | frozenset[str] = frozenset(),
                      root: Path | None = None) -> list[str]:
    """n distinct user messages (fewer if the library has fewer stubs), deterministic.

    Stubs named in exclude_names, and stubs `overlap_report` flags against bench_prompts,
    are dropped."""
    from eagle2.train.prompts import overlap_report

    stubs = [(name, stub) for name, stub in function_stubs(root) if name not in exclude_names]
    seen: set[str] = set()
    unique = [s for s in stubs if not (s[1] in seen or seen.add(s[1]))]
    rng = random.Random(f"{seed}/stdlib-code")
    rng.shuffle(unique)
    prompts = [f"{WRAPPERS[i % len(WRAPPERS)]}\n\n```python\n{stub}```"
               for i, (_, stub) in enumerate(unique[: 2 * n])]
    if bench_prompts:
        flagged = {h.train_idx for h in overlap_report(prompts, bench_prompts).hits}
        prompts = [p for i, p in enumerate(prompts) if i not in flagged]
    return prompts[:n]
