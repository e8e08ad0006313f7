"""DESIGN.md describes the tree as it is: its module index lists every module of the library and
every benchmark (and nothing else), and every file it names exists."""

from __future__ import annotations

import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[1]
DESIGN = ROOT / "docs" / "DESIGN.md"
INDEXED = ("embodied_jax", "experiments/benchmarks")
OTHERS = {"commit_success.txt"}  # files of other packages the design refers to (Orbax's commit marker)


def _index() -> dict[str, set[str]]:
    text = DESIGN.read_text().split("## Module index", 1)[1]
    listed, current = {root: set() for root in INDEXED}, None
    for line in text.splitlines():
        if header := re.fullmatch(r"`([\w/]+)/`:", line.strip()):
            current = header.group(1)
        elif (entry := re.match(r"- `([\w/.]+\.py)`:", line)) and current is not None:
            listed[current].add(entry.group(1))
    return listed


def test_the_module_index_lists_exactly_the_modules_that_exist():
    listed = _index()
    for root in INDEXED:
        present = {str(p.relative_to(ROOT / root)) for p in (ROOT / root).rglob("*.py") if p.name != "__init__.py"}
        assert listed[root] == present, (
            f"docs/DESIGN.md's module index for {root}/: missing {sorted(present - listed[root])}, "
            f"gone {sorted(listed[root] - present)}"
        )


def test_every_file_the_design_names_exists():
    # a name after a placeholder (``models/<family>/model.py``) is a pattern, not a file
    names = set(re.findall(r"(?<![>\w./-])[\w./-]*\w\.(?:py|md|txt|toml)\b", DESIGN.read_text())) - OTHERS
    everything = [p for p in ROOT.rglob("*") if ".git" not in p.parts and "runs" not in p.parts]
    basenames = {p.name for p in everything}
    tails = {str(p.relative_to(ROOT)) for p in everything}
    missing = [
        name
        for name in sorted(names)
        if not (name in tails or any(t.endswith("/" + name) for t in tails) or ("/" not in name and name in basenames))
    ]
    assert not missing, f"docs/DESIGN.md names files that do not exist: {missing}"
