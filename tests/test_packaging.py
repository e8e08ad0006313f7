"""Packaging and tooling agree: pyproject.toml, the requirements files, ruff's settings.

`pip install -r requirements*.txt` (CI, README) and `pip install -e ".[gpu,dev]"` must install the
same things, so each requirements file is compared with its place in pyproject.toml. Reads files
only: no JAX, no build.
"""

import ast
import io
import pathlib
import re
import tokenize
import tomllib

import pytest
import setuptools
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = pathlib.Path(__file__).resolve().parents[1]
# Code directories that ruff lints and whose noqa comments are counted.
CODE_DIRS = ("embodied_jax", "experiments", "tests", "launch")
MAX_NOQA = 20  # the tree has fewer noqa comments than this


@pytest.fixture(scope="module")
def pyproject() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def _requirement_lines(name: str) -> list[str]:
    """A requirements file's requirement lines: no comments, blanks or `-r` includes."""
    lines = []
    for raw in (ROOT / name).read_text().splitlines():
        line = raw.split(" #", 1)[0].strip()
        if not line or line.startswith("#"):
            continue
        if line.startswith(("-r ", "--requirement")):
            continue
        assert not line.startswith("-"), f"{name}: unexpected pip option line {raw!r}"
        lines.append(line)
    return lines


def _by_name(lines: list[str], where: str) -> dict[str, tuple[frozenset[str], str, str]]:
    """Normalised name -> (extras, specifier set, marker), with no name twice."""
    out: dict[str, tuple[frozenset[str], str, str]] = {}
    for line in lines:
        req = Requirement(line)
        name = canonicalize_name(req.name)
        assert name not in out, f"{where}: {req.name} listed twice"
        spec = ",".join(sorted(str(s) for s in req.specifier))
        out[name] = (frozenset(req.extras), spec, str(req.marker or ""))
    return out


def test_dependencies_equal_requirements_txt(pyproject):
    assert "dependencies" not in pyproject["project"].get("dynamic", [])
    want = _by_name(_requirement_lines("requirements.txt"), "requirements.txt")
    got = _by_name(pyproject["project"]["dependencies"], "project.dependencies")
    assert got == want


def test_gpu_extra_equals_requirements_gpu_txt(pyproject):
    text = (ROOT / "requirements-gpu.txt").read_text()
    assert re.search(r"^-r requirements\.txt$", text, re.M), "requirements-gpu.txt builds on requirements.txt"
    want = _by_name(_requirement_lines("requirements-gpu.txt"), "requirements-gpu.txt")
    got = _by_name(pyproject["project"]["optional-dependencies"]["gpu"], "gpu extra")
    assert got == want


def test_dev_extra_equals_requirements_dev_txt(pyproject):
    want = _by_name(_requirement_lines("requirements-dev.txt"), "requirements-dev.txt")
    got = _by_name(pyproject["project"]["optional-dependencies"]["dev"], "dev extra")
    assert got == want


def test_ruff_is_pinned(pyproject):
    for where, lines in [
        ("requirements-dev.txt", _requirement_lines("requirements-dev.txt")),
        ("dev extra", pyproject["project"]["optional-dependencies"]["dev"]),
    ]:
        (ruff,) = [Requirement(line) for line in lines if canonicalize_name(Requirement(line).name) == "ruff"]
        (spec,) = list(ruff.specifier)
        assert spec.operator == "==", f"{where}: ruff must be pinned with ==, not {spec}"


def test_only_embodied_jax_is_installed(pyproject):
    find = pyproject["tool"]["setuptools"]["packages"]["find"]
    packages = setuptools.find_packages(
        where=str(ROOT / find.get("where", ["."])[0]),
        include=find.get("include", ["*"]),
        exclude=find.get("exclude", []),
    )
    assert "embodied_jax" in packages
    assert "embodied_jax.models.weights" in packages  # subpackages come along
    for top in ("experiments", "tests", "launch", "docs"):
        assert not [p for p in packages if p == top or p.startswith(top + ".")], f"{top} would be installed"


def test_version_single_source(pyproject):
    project = pyproject["project"]
    if "version" not in project.get("dynamic", []):
        assert re.fullmatch(r"\d+\.\d+\.\d+", project["version"])
        return
    assert "version" not in project
    assert pyproject["tool"]["setuptools"]["dynamic"]["version"] == {"attr": "embodied_jax.__version__"}
    # setuptools reads the attribute statically (no import of the package) when it is a literal.
    tree = ast.parse((ROOT / "embodied_jax" / "__init__.py").read_text())
    versions = [
        node.value.value
        for node in tree.body
        if isinstance(node, ast.Assign)
        and [getattr(t, "id", None) for t in node.targets] == ["__version__"]
        and isinstance(node.value, ast.Constant)
    ]
    assert len(versions) == 1, 'embodied_jax/__init__.py needs one literal `__version__ = "X.Y.Z"`'
    assert re.fullmatch(r"\d+\.\d+\.\d+", versions[0])


def test_license_and_readme(pyproject):
    project = pyproject["project"]
    assert project["license"] == "Apache-2.0"
    for name in project["license-files"]:
        assert (ROOT / name).is_file(), name
    text = (ROOT / "LICENSE").read_text()
    assert "Apache License" in text and "Version 2.0, January 2004" in text
    assert "END OF TERMS AND CONDITIONS" in text
    assert (ROOT / project["readme"]).is_file()


def test_ruff_config(pyproject):
    ruff = pyproject["tool"]["ruff"]
    assert ruff["line-length"] == 120
    assert ruff["target-version"] == "py311"
    lint = ruff["lint"]
    assert sorted(lint["select"]) == sorted(["E", "F", "W", "I", "B", "UP"])
    # No blanket ignores: an ignore names one rule (with its reason in a comment), never a family.
    for key in ("ignore", "extend-ignore"):
        for code in lint.get(key, []):
            assert re.fullmatch(r"[A-Z]+\d{3,4}", code), f"lint.{key}: {code!r} ignores a whole family"
    for path, codes in lint.get("per-file-ignores", {}).items():
        for code in codes:
            assert re.fullmatch(r"[A-Z]+\d{3,4}", code), f"per-file-ignores[{path!r}]: {code!r} is a family"
    assert lint["isort"]["known-first-party"] == ["embodied_jax", "experiments"]


def _noqa_comments(path: pathlib.Path) -> list[int]:
    """Lines of `path` with a noqa directive in a comment (not in a string)."""
    noqa = re.compile(r"#\s*noqa\b", re.I)
    tokens = tokenize.generate_tokens(io.StringIO(path.read_text()).readline)
    return [tok.start[0] for tok in tokens if tok.type == tokenize.COMMENT and noqa.search(tok.string)]


def test_few_noqa_comments():
    hits = [
        f"{path.relative_to(ROOT)}:{line}"
        for d in CODE_DIRS
        for path in sorted((ROOT / d).rglob("*.py"))
        for line in _noqa_comments(path)
    ]
    assert len(hits) < MAX_NOQA, f"{len(hits)} noqa comments (want < {MAX_NOQA}):\n" + "\n".join(hits)
