"""Convert upstream safetensors checkpoints to/from our Orbax parameter checkpoints.

    python -m embodied_jax.models.convert --arch pi05 --src DIR --out CKPT_DIR [--tokenizer FILE]
    python -m embodied_jax.models.convert --arch pi05 --layout openpi --src OPENPI_PARAMS_DIR --out CKPT_DIR
    python -m embodied_jax.models.convert --arch pi05 --src CKPT_DIR --out DIR --reverse [--like SRC]
    python -m embodied_jax.models.convert --arch gr00t_n15 --src CKPT_DIR --out DIR --reverse --layout nvidia

Forward: ``--src`` is a directory holding ``model.safetensors`` (or a sharded
``model.safetensors.index.json``), or the file itself. The architecture and every size come from
``--arch`` (an entry of ``ARCHS``: our config class and the checkpoint ``Layout``), never from
upstream's ``config.json``. Tensors are streamed one at a time into the parameters of
``nnx.eval_shape(config.make)``, each placed with its sharding on a mesh over all local devices
(FSDP), checked for shape and cast to the config's ``param_dtype``. ``--arch pi05 --layout openpi``
reads openpi's own Orbax ``params`` item instead (``pi05/openpi_weights.py``); it is detected when
``--src`` is an Orbax directory or holds one as ``params/``.

Output format (``CKPT_DIR``, what ``experiments.launch --init-from`` reads): an Orbax
``StandardCheckpointer`` checkpoint of ONE pytree, the model's parameters as a pure nested dict,
``nnx.to_pure_dict(nnx.state(model, nnx.Param))``: string keys for attributes, int keys for list
entries (e.g. ``llm.layers.experts.0``), arrays in ``param_dtype``. Stacks are stored in the layout
of the config's ``scan_layers`` (scanned: a leading ``layers`` axis). Restore it with
``StandardCheckpointer().restore(CKPT_DIR, abstract_pure_dict)`` and ``nnx.replace_by_pure_dict``
(see ``load_params``).

Reverse (``--reverse``): reads such a checkpoint and writes ``DIR/model.safetensors`` in the
upstream layout; tensors on the layout's ignore list (e.g. π0.5's unused expert ``lm_head``) are
written only when ``--like SRC`` names the original checkpoint, whose dtypes are then kept.
"""

from __future__ import annotations

import dataclasses
import logging
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
from flax import nnx

from embodied_jax.assets import write_assets
from embodied_jax.cli import INPUT_ERRORS, parse_flags, run_main
from embodied_jax.errors import InputError
from embodied_jax.models.weights.layout import Layout
from embodied_jax.models.weights.safetensors_io import export_checkpoint, import_checkpoint

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class Arch:
    """A convertible architecture: its default (published-size) config and checkpoint layout."""

    make_config: Callable[[], Any]
    layout: Callable[..., Layout]  # layout() or, for archs with ``layouts``, layout(name)
    layouts: tuple[str, ...] = ()  # named checkpoint layouts (``--layout``); first = default
    detect: Callable[[Any], str] | None = None  # src -> layout name (forward conversion)


def _pi05_config():
    from embodied_jax.models.pi05 import Pi05Config

    return Pi05Config()


def _pi05_layout(name: str = "lerobot"):
    if name == "openpi":
        from embodied_jax.models.pi05.openpi_weights import OPENPI_LAYOUT

        return OPENPI_LAYOUT
    from embodied_jax.models.pi05.weights import PI05_LAYOUT

    return PI05_LAYOUT


def _pi05_detect(src) -> str:
    from embodied_jax.models.pi05.openpi_weights import is_openpi_checkpoint

    return "openpi" if is_openpi_checkpoint(src) else "lerobot"


def _gr00t_config():
    from embodied_jax.models.gr00t import Gr00tConfig

    return Gr00tConfig()


def _gr00t_layout(name: str):
    from embodied_jax.models.gr00t.weights import make_layout

    return make_layout(name)


def _gr00t_detect(src) -> str:
    from embodied_jax.models.gr00t.weights import detect_layout

    return detect_layout(src)


ARCHS: dict[str, Arch] = {
    "pi05": Arch(_pi05_config, _pi05_layout, layouts=("lerobot", "openpi"), detect=_pi05_detect),
    "gr00t_n15": Arch(_gr00t_config, _gr00t_layout, layouts=("lerobot", "nvidia"), detect=_gr00t_detect),
}


def _mesh():
    from embodied_jax.parallel.mesh import MeshConfig, make_mesh

    return make_mesh(MeshConfig(data=1, fsdp=-1, tensor=1))


def abstract_params(config, mesh):
    """The parameter pure dict of ``config.make`` as ShapeDtypeStructs (no memory) and its shardings."""
    from embodied_jax.parallel.sharding import state_shardings

    with nnx.use_eager_sharding(False):
        model = nnx.eval_shape(lambda: config.make(nnx.Rngs(0)))
    params = nnx.state(model, nnx.Param)
    return nnx.to_pure_dict(params), nnx.to_pure_dict(state_shardings(params, mesh))


def to_orbax(src, out, config, layout, mesh=None) -> Path:
    """Upstream checkpoint -> Orbax parameter checkpoint at ``out``.

    ``layout``: a safetensors ``Layout``, or a layout with its own reader (``OpenpiLayout``).
    """
    import orbax.checkpoint as ocp

    mesh = mesh or _mesh()
    abstract, shardings = abstract_params(config, mesh)
    if isinstance(layout, Layout):
        params = import_checkpoint(src, layout, abstract, shardings, mesh=mesh)
    else:
        params = layout.import_params(src, config, abstract, shardings, mesh=mesh)
    out = Path(out).absolute()
    checkpointer = ocp.StandardCheckpointer()
    checkpointer.save(out, params, force=True)
    checkpointer.wait_until_finished()
    return out


def load_params(ckpt_dir, config, mesh=None) -> dict:
    """Restore an Orbax parameter checkpoint (this module's format) as a sharded pure dict."""
    import orbax.checkpoint as ocp

    mesh = mesh or _mesh()
    abstract, shardings = abstract_params(config, mesh)
    target = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), abstract, shardings)
    return ocp.StandardCheckpointer().restore(Path(ckpt_dir).absolute(), target)


def from_orbax(ckpt_dir, dst, config, layout: Layout, *, like=None, dtype=None, mesh=None) -> Path:
    """Orbax parameter checkpoint -> upstream ``model.safetensors`` under ``dst``."""
    params = load_params(ckpt_dir, config, mesh)
    return export_checkpoint(params, layout, dst, like=like, dtype=dtype)


PROG = "python -m embodied_jax.models.convert"


@dataclasses.dataclass(frozen=True)
class ConvertFlags:
    """``python -m embodied_jax.models.convert``'s command line."""

    arch: str
    """the model family and size (ARCHS: pi05, gr00t_n15, ...)"""
    src: str
    """upstream checkpoint dir/file (or CKPT_DIR with --reverse)"""
    out: str
    """CKPT_DIR (or the output dir for --reverse)"""
    reverse: bool = False
    """our Orbax checkpoint -> upstream safetensors"""
    like: str | None = None
    """with --reverse: original checkpoint (ignored tensors, dtypes)"""
    dtype: str | None = None
    """with --reverse: write every model tensor in this dtype"""
    layout: str | None = None
    """checkpoint layout for archs with several (pi05: lerobot|openpi, gr00t_n15: lerobot|nvidia); forward
    conversion detects it when omitted"""
    tokenizer: str | None = None
    """forward: the weights' tokenizer (pi05: PaliGemma's tokenizer.model, gr00t_n15: Qwen3's tokenizer.json),
    copied into CKPT_DIR/assets so that --init-from CKPT_DIR needs no --model.tokenizer-path"""


def convert(args: ConvertFlags) -> Path:
    """The conversion ``args`` describe; what it wrote."""
    if args.arch not in ARCHS:
        raise InputError(f"--arch {args.arch!r}: one of {sorted(ARCHS)}")
    if args.tokenizer is not None and (args.reverse or not Path(args.tokenizer).is_file()):
        problem = "forward conversion only" if args.reverse else "no such file"
        raise InputError(f"--tokenizer {args.tokenizer!r}: {problem}")
    arch = ARCHS[args.arch]
    if args.layout is not None and args.layout not in arch.layouts:
        raise InputError(f"--layout {args.layout!r}: --arch {args.arch} has layouts {arch.layouts or '(only one)'}")
    if arch.layouts:
        name = args.layout or (arch.detect(args.src) if arch.detect and not args.reverse else arch.layouts[0])
        layout = arch.layout(name)
        if args.reverse and not isinstance(layout, Layout):
            raise InputError(f"--layout {name}: forward conversion only")
    else:
        layout = arch.layout()
    config = arch.make_config()
    if args.reverse:
        return from_orbax(args.src, args.out, config, layout, like=args.like, dtype=args.dtype)
    written = to_orbax(args.src, args.out, config, layout)
    if args.tokenizer is not None:
        write_assets({"tokenizer_path": args.tokenizer}, written)
    return written


def main(argv=None) -> int:
    def run(args: list[str]) -> None:
        flags = parse_flags(ConvertFlags, args=args, prog=PROG, description=__doc__.split("\n")[0])
        logging.basicConfig(level=logging.INFO, format="%(message)s")
        print(f"wrote {convert(flags)}")

    return run_main(run, argv, INPUT_ERRORS + (ValueError, KeyError))


if __name__ == "__main__":
    sys.exit(main())
