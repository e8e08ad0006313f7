"""Placement rules that always apply, rules overrides, HLO collective parsing, virtual devices."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from embodied_jax.parallel import partition
from embodied_jax.parallel.hlo_collectives import collective_stats
from embodied_jax.parallel.mesh import MeshConfig, abstract_mesh, axis_parts, axis_size, describe_mesh, make_mesh
from embodied_jax.parallel.rules import PRESETS, RulesError, ShardingRules, parse_rules, with_overrides
from embodied_jax.parallel.virtual_devices import VirtualDevicesError, use_virtual_devices
from embodied_jax.train import scaling

FILL = ("fsdp",)


def _shards(spec, mesh) -> int:
    return int(np.prod([mesh.shape[a] for e in spec if e is not None for a in ((e,) if isinstance(e, str) else e)]))


def test_composite_axes_become_prime_parts():
    mesh = abstract_mesh(MeshConfig(data=2, fsdp=12, tensor=2), 48)
    assert mesh.axis_names == ("data", "fsdp_0", "fsdp_1", "fsdp_2", "tensor")
    assert [mesh.shape[a] for a in axis_parts(mesh, "fsdp")] == [2, 2, 3]
    assert axis_size(mesh, "fsdp") == 12 and axis_size(mesh, "data") == 2
    real = make_mesh(MeshConfig(data=1, fsdp=8))
    assert describe_mesh(real) == "data=1 × fsdp=8 × tensor=1 over 8 cpu device(s)"
    # Sharding a dimension over every part is the device layout of the unsplit axis.
    arr = jax.device_put(np.arange(16.0), NamedSharding(real, P(axis_parts(real, "fsdp"))))
    assert [s.data.tolist() for s in arr.addressable_shards][1] == [2.0, 3.0]


@pytest.mark.parametrize("devices", [64, 256, 1024])
def test_gr00t_embodiment_weight_shards_where_it_can(devices):
    # W[32 slots, 32, 1536] with embed=32 on a 64+ device fsdp axis: it must still shard.
    mesh = abstract_mesh(MeshConfig(data=1, fsdp=-1), devices)
    placement = partition.place((32, 32, 1536), ("embodiments", "embed", "mlp"), mesh, fill=FILL)
    assert _shards(placement.spec, mesh) == devices  # all of fsdp
    # Along 1536 alone where it divides (64, 256); at 1024 embed takes 32 and 1536 the other 32.
    want = "(None, None, fsdp)" if devices < 1024 else "(None, fsdp:32, fsdp:32)"
    assert partition.describe_spec(placement.spec, mesh) == want and "embed[32]" in placement.fallback
    for dim, entry in zip((32, 32, 1536), placement.spec, strict=True):
        assert dim % _shards(P(entry), mesh) == 0


def test_siglip_width_takes_part_of_fsdp_and_the_rest_moves():
    mesh = abstract_mesh(MeshConfig(data=1, fsdp=256), 256)
    placement = partition.place((27, 1152, 4304), ("layers", "embed", "mlp"), mesh, fill=FILL)
    assert partition.describe_spec(placement.spec, mesh) == "(None, fsdp:128, fsdp:2)"
    # Divisible axes keep the rules' first choice and report nothing.
    plain = partition.place((18, 2048, 16384), ("layers", "embed", "mlp"), mesh, fill=FILL)
    assert partition.describe_spec(plain.spec, mesh) == "(None, fsdp, None)" and plain.fallback is None


def test_fallback_order_small_arrays_and_unknown_names():
    mesh = abstract_mesh(MeshConfig(data=3, fsdp=4), 12)
    rules = with_overrides(["mlp=data", "mlp=fsdp"])
    # embed (6) takes 2 of fsdp's 4; data (3) does not divide mlp (4): the next entry takes fsdp's rest.
    placement = partition.place((6, 4), ("embed", "mlp"), mesh, rules)
    assert partition.describe_spec(placement.spec, mesh) == "(fsdp:2, fsdp:2)"
    assert "embed[6] over 2 of 4" in placement.fallback and "mlp[4] over 1 of 3 (data)" in placement.fallback
    tiny = partition.place((64, 64), ("embed", "mlp"), mesh, fill=FILL, itemsize=4, min_shard_bytes=1 << 20)
    assert tiny.spec == P(None, None) and "replicated" in tiny.fallback
    nothing = partition.place((3, 5), ("embed", "mlp"), mesh, fill=FILL)
    assert nothing.spec == P(None, None) and "over 1 of 4" in nothing.fallback
    with pytest.raises(KeyError, match="no sharding rule"):
        partition.place((4,), ("no_such_axis",), mesh)


def test_rules_overrides_parse_and_name_their_errors():
    assert parse_rules(["mlp=tensor", "batch=data,fsdp", "vocab="]) == (
        ("mlp", "tensor"),
        ("batch", ("data", "fsdp")),
        ("vocab", None),
    )
    assert parse_rules(["tensor_parallel"]) == PRESETS["tensor_parallel"]
    rules = ShardingRules.from_config(["mlp=tensor"])
    assert [t for n, t in rules.table if n == "mlp"] == ["tensor"] and rules.uses("tensor")
    assert not ShardingRules().uses("tensor")
    with pytest.raises(RulesError, match="unknown logical axis 'mpl'"):
        parse_rules(["mpl=tensor"])
    with pytest.raises(RulesError, match="unknown mesh axis 'tp'"):
        parse_rules(["mlp=tp"])
    with pytest.raises(RulesError, match="preset"):
        parse_rules(["megatron"])


def test_constrain_follows_active_rules_and_skips_without_mesh():
    x = jnp.ones((8, 4, 6))
    assert partition.shard_tokens(x) is x  # no mesh: no-op
    mesh = make_mesh(MeshConfig(data=2, fsdp=4))
    from embodied_jax.parallel.sharding import mesh_context

    with mesh_context(mesh):
        y = jax.jit(lambda a: partition.shard_tokens(a * 2))(x)
    assert y.sharding.spec[0] == ("data", "fsdp_0", "fsdp_1")


def _fsdp_matmul_hlo(mesh, layers=3):
    """A scanned FSDP-style step: weights sharded on fsdp, batch on (data, fsdp)."""
    from embodied_jax.parallel.sharding import batch_axes

    parts = axis_parts(mesh, "fsdp")
    w_sharding = NamedSharding(mesh, P(None, parts, None))
    x_sharding = NamedSharding(mesh, P(batch_axes(mesh), None))
    w = jax.ShapeDtypeStruct((layers, 64, 32), jnp.float32, sharding=w_sharding)
    x = jax.ShapeDtypeStruct((16, 64), jnp.float32, sharding=x_sharding)

    def loss(w, x):
        def body(h, wl):
            h = jax.lax.with_sharding_constraint(h, x_sharding)
            return h + jnp.tanh(h @ wl) @ wl.T, None

        return jnp.sum(jax.lax.scan(jax.checkpoint(body), x, w)[0] ** 2)

    with jax.set_mesh(mesh):
        return jax.jit(jax.grad(loss), out_shardings=w_sharding).lower(w, x).compile().as_text()


@pytest.mark.hlo
def test_collectives_from_hlo_count_loop_trips_and_axes():
    mesh = make_mesh(MeshConfig(data=2, fsdp=4))
    stats = collective_stats(_fsdp_matmul_hlo(mesh), mesh)
    kinds = stats.by_kind()
    assert kinds["all-gather"]["count"] >= 3 * 2  # each layer's weight, forward and in the backward recompute
    assert kinds["reduce-scatter"]["count"] >= 3  # each layer's gradient down to its shard
    gathered = [op for op in stats.ops if op.kind == "all-gather" and op.payload == 64 * 32 * 4]
    assert gathered and all(op.axes == ("fsdp",) and op.group_size == 4 for op in gathered), gathered
    assert sum(op.count for op in gathered) % 3 == 0  # counted once per scan trip
    assert gathered[0].wire == pytest.approx(64 * 32 * 4 * 3 / 4)
    assert "fsdp" in stats.by_axis() and stats.total_bytes > 0


def test_collective_group_formats():
    from embodied_jax.parallel.hlo_collectives import _first_group

    assert _first_group("replica_groups={{0,2},{1,3}}", 4) == [0, 2]
    assert _first_group("replica_groups=[2,4]<=[8]", 8) == [0, 1, 2, 3]
    assert _first_group("replica_groups=[4,2]<=[2,4]T(1,0)", 8) == [0, 4]
    assert _first_group("replica_groups=mesh['axis_0'=4,'axis_1'=2] {'axis_1'}", 8) == [0, 1]
    assert _first_group("replica_groups=mesh['axis_0'=2,'axis_1'=4], device_ids=([4,2]T(1,0)) {'axis_1'}", 8) == [
        0,
        2,
        4,
        6,
    ]


def test_memory_plan_is_affine_in_the_batch():
    gib = 2**30
    plan = scaling.memory_plan(
        {4: 10 * gib, 8: 18 * gib},
        state_total=64 * gib,
        state_per_device=1 * gib,
        gpu_bytes=100 * gib,
        global_examples=1024,
    )
    assert plan["bytes_per_example"] == 2 * gib and plan["fixed_bytes"] == 2 * gib
    assert plan["max_examples_per_device"] == 49
    # (64 GiB of state + 2 GiB x 1024 examples) / (100 GiB - 1 GiB that does not shrink) -> 22 devices
    assert plan["devices_needed"] == 22


def test_virtual_devices_refuse_after_jax_started():
    assert jax.device_count() == 8
    use_virtual_devices(8)  # what is running already
    with pytest.raises(VirtualDevicesError, match="already initialised with 8"):
        use_virtual_devices(64)


def test_matmul_flops_per_loop_trip_and_peak_buffers():
    from embodied_jax.parallel.hlo import compile_with_dumps, dot_flops, peak_buffers

    def f(x, w):
        return jax.lax.scan(lambda h, wl: (jnp.tanh(h @ wl), None), x, w)[0]

    x, w = jnp.ones((16, 64)), jnp.ones((5, 64, 64))
    lowered = jax.jit(f).lower(x, w)
    lowered.compile()  # now in the persistent cache: the dumps must still come from a real compile
    compiled, live = compile_with_dumps(lowered)
    assert dot_flops(compiled.as_text()) == 5 * 2 * 16 * 64 * 64
    peak = peak_buffers(live, compiled.as_text())
    assert peak and peak == sorted(peak, key=lambda b: -b.bytes)
    assert peak[0].bytes >= 5 * 64 * 64 * 4  # the stacked weights are live throughout
