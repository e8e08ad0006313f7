"""The library's boundaries: import direction (DESIGN.md) and the Policy contract of every experiment.

The import scan reads every module under ``embodied_jax/`` with ``ast``: ``import`` and
``from ... import`` statements, and string arguments of ``importlib.import_module`` /
``__import__`` / ``importlib.util.find_spec`` (imports by name at run time).
"""

from __future__ import annotations

import ast
import inspect
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
LIBRARY = ROOT / "embodied_jax"

# DESIGN.md "Import direction" (experiments -> train, sim, data, models -> nn -> parallel; train and
# sim read data, never a model; sim never imports train): what each part may import besides itself.
# Top-level modules: the contracts, the error base, the image helpers, the command-line conventions (with the
# process's malloc settings), the saved-config registry and the containment of paths read from
# untrusted directories are importable from anywhere.
ANYWHERE = {
    "assets",
    "cli",
    "config_registry",
    "errors",
    "host_malloc",
    "images",
    "paths",
    "policy",
    "records",
    "variables",
}
ALLOWED = {
    "parallel": set(),
    "nn": {"parallel"},
    "models": {"nn", "parallel"},
    "data": {"nn", "parallel"},
    "train": {"data", "nn", "parallel"},
    "sim": {"data", "nn", "parallel"},
    "bundle": {"data", "nn", "parallel"},
    "evaluation": {"bundle", "loading", "sim", "parallel", "train", "data"},
    "loading": {"bundle", "parallel", "train"},
    "export": {"bundle", "loading", "train"},
    "serve": {"__init__", "bundle", "loading"},
    "evaluate": {"evaluation"},  # the command line's historical name
    # reinforcement learning: a run (train, loading), its bundle's in-program processing, the
    # simulator and the models' flow sampler; nothing imports rl but experiments
    "rl": {"bundle", "loading", "evaluation", "sim", "parallel", "train", "data", "nn"},
    "__init__": {"bundle", "loading"},
    "assets": set(),
    "cli": set(),
    "config_registry": set(),
    "errors": set(),
    "host_malloc": set(),
    "images": set(),
    "paths": set(),
    "policy": set(),
    "records": set(),
    "variables": set(),
}
_BY_NAME = {
    ("importlib", "import_module"),
    ("importlib.util", "find_spec"),
    ("util", "find_spec"),
    (None, "__import__"),
    (None, "import_module"),
    (None, "find_spec"),
}


def _called_name(func: ast.expr) -> tuple[str | None, str] | None:
    if isinstance(func, ast.Name):
        return None, func.id
    if isinstance(func, ast.Attribute):
        return ast.unparse(func.value), func.attr
    return None


def imported_modules(path: pathlib.Path, root: pathlib.Path = ROOT) -> list[tuple[int, str]]:
    """(line, module) of every import in a file, including imports by string at run time."""
    tree = ast.parse(path.read_text(), filename=str(path))
    package = ".".join(path.relative_to(root).with_suffix("").parts[:-1])
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: resolve against this package
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            found.append((node.lineno, module))
        elif isinstance(node, ast.Call) and _called_name(node.func) in _BY_NAME:
            for arg in node.args[:1]:
                if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
                    found.append((node.lineno, arg.value))
                elif isinstance(arg, ast.JoinedStr) and arg.values and isinstance(arg.values[0], ast.Constant):
                    found.append((node.lineno, str(arg.values[0].value)))  # f"{prefix}..." by its literal prefix
    return found


def _part(module: str) -> str | None:
    """The library part a module belongs to (``embodied_jax.data.stats`` -> ``data``)."""
    parts = module.split(".")
    if parts[0] != "embodied_jax":
        return None
    return parts[1] if len(parts) > 1 else "__init__"


def _string_constants(path: pathlib.Path) -> list[tuple[int, str]]:
    tree = ast.parse(path.read_text())
    return [(n.lineno, n.value) for n in ast.walk(tree) if isinstance(n, ast.Constant) and isinstance(n.value, str)]


def test_import_scan_sees_static_relative_and_by_name_imports(tmp_path):
    probe = tmp_path / "embodied_jax" / "data" / "probe.py"
    probe.parent.mkdir(parents=True)
    probe.write_text(
        "import importlib\nfrom . import stats\nfrom ..train import loop\nimport experiments.demo\n"
        "importlib.import_module('experiments.pi05')\nimportlib.import_module(f'experiments.{1}')\n"
    )
    modules = [m for _, m in imported_modules(probe, root=tmp_path)]
    assert {"embodied_jax.data", "embodied_jax.train", "experiments.demo", "experiments.pi05", "experiments."} <= set(
        modules
    )


def test_library_imports_follow_the_design_arrows():
    violations = []
    for path in sorted(LIBRARY.rglob("*.py")):
        rel = path.relative_to(LIBRARY)
        source = rel.parts[0] if len(rel.parts) > 1 else rel.stem
        for line, module in imported_modules(path):
            where = f"embodied_jax/{rel}:{line}"
            if module.split(".")[0] in ("experiments", "tests"):
                violations.append(f"{where} imports {module}")
                continue
            target = _part(module)
            if target is None or target == source or target in ANYWHERE:
                continue
            if target not in ALLOWED.get(source, set()):
                violations.append(f"{where}: {source} -> {target} ({module})")
    assert not violations, "imports against DESIGN.md's arrows:\n" + "\n".join(violations)


def _module_name(path: pathlib.Path, root: pathlib.Path) -> str:
    parts = path.relative_to(root).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_circles(package: pathlib.Path, root: pathlib.Path = ROOT) -> list[list[str]]:
    """The import circles among the modules under ``package``, lazy (function-level) imports and
    imports for type checkers (``if TYPE_CHECKING:``) included: two modules that need each other's
    names, if only for types, are one concept split in two. Each circle a sorted list of module
    names (strongly connected components of two or more)."""
    paths = sorted(package.rglob("*.py"))
    modules = {_module_name(p, root): p for p in paths}

    def resolve(name: str) -> str | None:  # ``pkg.mod.Name`` -> ``pkg.mod``; ``pkg`` -> ``pkg`` (its __init__)
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    graph = {m: set() for m in modules}
    for module, path in modules.items():
        tree = ast.parse(path.read_text(), filename=str(path))
        for node in ast.walk(tree):  # ``from pkg import mod`` names a module too
            if isinstance(node, ast.ImportFrom) and node.module and not node.level:
                for alias in node.names:
                    if (target := resolve(f"{node.module}.{alias.name}")) not in (None, module):
                        graph[module].add(target)
        for _, name in imported_modules(path, root):
            if (target := resolve(name)) not in (None, module):
                graph[module].add(target)
    index, low, stack, on_stack, circles = {}, {}, [], set(), []

    def visit(v: str) -> None:  # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                circles.append(sorted(component))

    for v in graph:
        if v not in index:
            visit(v)
    return circles


def test_the_circle_check_finds_lazy_and_type_checking_circles(tmp_path):
    package = tmp_path / "embodied_jax" / "train"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "config.py").write_text("def run():\n    from embodied_jax.train.loop import train\n")
    (package / "loop.py").write_text("from embodied_jax.train import config\n")
    (package / "step.py").write_text("from embodied_jax.train.config import run\n")
    (package / "state.py").write_text(  # an import for type checkers only closes a circle all the same
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from embodied_jax.train.metrics import M\n"
    )
    (package / "metrics.py").write_text("from embodied_jax.train import state\n")
    (package / "runtime.py").write_text("from embodied_jax.train import state\n")  # one way: no circle
    assert sorted(import_circles(tmp_path / "embodied_jax", root=tmp_path)) == [
        ["embodied_jax.train.config", "embodied_jax.train.loop"],
        ["embodied_jax.train.metrics", "embodied_jax.train.state"],
    ]


def test_no_import_circle_in_the_library_or_the_experiments():
    circles = import_circles(LIBRARY) + import_circles(ROOT / "experiments")
    assert not circles, "import circles (lazy imports included):\n" + "\n".join(" <-> ".join(c) for c in circles)


def test_configs_are_data():
    """No registered config class runs anything: running is ``experiments/registry.py``'s."""
    import dataclasses

    from embodied_jax import config_registry

    classes = {type(config) for config in _registered_experiments().values()}  # every experiment module imported
    classes |= set(config_registry.registered().values())
    runners = [
        f"{cls.__module__}.{cls.__name__}.{name}"
        for cls in classes
        if dataclasses.is_dataclass(cls)
        for name in ("run", "check_reuse", "run_directory")
        if callable(getattr(cls, name, None))
    ]
    assert not runners, runners


def test_library_names_no_experiment_module_in_strings():
    """No config, registry or loader in the library refers to ``experiments`` code by name."""
    hits = [
        f"embodied_jax/{p.relative_to(LIBRARY)}:{line}: {text!r}"
        for p in sorted(LIBRARY.rglob("*.py"))
        for line, text in _string_constants(p)
        if text.startswith("experiments.") and ":" in text
    ]
    assert not hits, hits


def _registered_experiments():
    from experiments.registry import experiments

    return {name: factory() for name, (_, factory) in experiments().items()}


def test_every_experiment_model_conforms_to_the_policy_contract():
    import jax
    from flax import nnx

    from embodied_jax.data.sources import DataSource
    from embodied_jax.parallel.mesh import MeshConfig, make_mesh
    from embodied_jax.parallel.sharding import mesh_context
    from embodied_jax.policy import Policy, PolicyConfig
    from embodied_jax.train.config import Evaluation

    configs = _registered_experiments()
    assert {"demo", "demo_gr00t", "pi05", "pi05_finetune", "gr00t_n15", "gr00t_finetune", "toy"} <= set(configs)
    built = {}
    for name, config in configs.items():
        if getattr(config, "rl", None) is not None and config.model is None:
            continue  # RL of a run (``--init-from RUN``): the model is the run's
        assert isinstance(config.model, PolicyConfig), name
        assert isinstance(config.data, DataSource), name
        assert config.evaluation is None or isinstance(config.evaluation, Evaluation), name
        assert isinstance(config.model.freeze_regexes(), tuple), name
        assert isinstance(config.model.remat_policy, str), name
        # One abstract build per model class (eval_shape: no parameters allocated), the smallest config.
        cls = type(config.model)
        size = sum(len(repr(v)) for v in vars(config.model).values())
        if cls not in built or size < built[cls][0]:
            built[cls] = (size, name, config.model)
    mesh = make_mesh(MeshConfig(data=-1), jax.devices()[:1])
    for _, name, model_config in built.values():
        with mesh_context(mesh):
            model = nnx.eval_shape(lambda c=model_config: c.make(nnx.Rngs(0)))
        assert isinstance(model, Policy), f"{name}: {type(model).__name__} lacks loss/sample_actions"
        for method, keywords in (("loss", {"noise", "time"}), ("sample_actions", {"num_steps", "noise"})):
            params = inspect.signature(getattr(model, method)).parameters
            kw_only = {p for p, v in params.items() if v.kind is inspect.Parameter.KEYWORD_ONLY}
            assert keywords <= kw_only, f"{name}: {type(model).__name__}.{method} keyword-only {sorted(kw_only)}"


def test_a_non_policy_model_config_is_a_config_error():
    import dataclasses

    from embodied_jax.train.config import ExperimentConfig
    from embodied_jax.train.runtime import ConfigError, validate

    @dataclasses.dataclass(frozen=True)
    class NotAPolicy:
        width: int = 1

    with pytest.raises(ConfigError, match="model: NotAPolicy does not subclass embodied_jax.policy.PolicyConfig"):
        validate(ExperimentConfig(model=NotAPolicy()), num_devices=1)


def test_each_model_family_names_its_sizes_once():
    """``models/<family>/variants.py``: the experiments' sizes are these very configs."""
    from embodied_jax.models.gr00t import variants as gr00t_variants
    from embodied_jax.models.pi05 import variants as pi05_variants
    from experiments import demo, gr00t, pi05

    for family in (pi05_variants, gr00t_variants):
        assert set(family.VARIANTS) == {"tiny", "bench", "demo", "full"}
        with pytest.raises(KeyError, match="known: tiny, bench, demo, full"):
            family.variant("huge")
    assert pi05.tiny_model() == pi05_variants.variant("tiny") and pi05.bench_model() == pi05_variants.variant("bench")
    assert gr00t.TINY_MODEL == gr00t_variants.variant("tiny") and gr00t.BENCH_MODEL == gr00t_variants.variant("bench")
    # the demos' models are the demo variants (GR00T's defaults: the demo vocabulary of the built-in tasks)
    assert demo.demo().model == pi05_variants.variant("demo")
    assert demo.demo_gr00t().model == demo.demo_gr00t_model() == gr00t_variants.variant("demo")
