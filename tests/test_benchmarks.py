"""Benchmark tools that tests can afford: ``compare_steps`` on the toy experiment."""

import importlib

import jax
import numpy as np
import pytest
import tyro

from experiments.benchmarks import compare_steps


def test_compare_steps_times_every_variant_in_one_process(capsys):
    report = compare_steps.main(["toy", "--variant", "", "--variant", "--train.batch-size 16", "--rounds", "2"])
    rows = report["variants"]
    assert [r["variant"] for r in rows] == ["", "--train.batch-size 16"]
    assert rows[0]["ratio_to_first"] == 1.0
    for row in rows:
        assert row["median_step_s"] > 0 and row["q1_step_s"] <= row["median_step_s"] and row["median_cpu_s"] > 0
    assert rows[1]["ratio_to_first"] == rows[1]["median_step_s"] / rows[0]["median_step_s"]
    assert capsys.readouterr().out.strip().splitlines()[-1].startswith('{"experiment": "toy"')


@pytest.mark.parametrize(
    "module, argv, expected",
    [
        (
            "serve_load",
            ["RUN", "--honest", "4", "--hostile", "12", "--seconds", "60", "--kinds", "idle", "flood"],
            {"run": "RUN", "honest": 4, "hostile": 12, "seconds": 60.0, "kinds": ("idle", "flood")},
        ),
        (
            "serve_latency",
            ["--policy", "A", "--policy", "B", "--models", "pi05_bench", "gr00t_bench", "--max-batch", "1", "8"],
            {"policy": ("A", "B"), "models": ("pi05_bench", "gr00t_bench"), "max_batch": (1, 8), "clients": (1, 4, 16)},
        ),
        (
            "rtc_delay",
            ["--policy", "RUN", "--task", "reach", "--envs", "64", "--execute-steps", "4", "--delays", "0", "2"],
            {"policy": "RUN", "task": "reach", "envs": 64, "execute_steps": 4, "delays": (0, 2), "seed": None},
        ),
        (
            "image_reliance",
            ["runs/mt10", "--dataset", "DIR", "--episodes", "4"],
            {"run": "runs/mt10", "dataset": "DIR", "episodes": 4, "steps": 8},
        ),
        (
            "rl_random_move",
            ["START", "MOVED", "--moved-step", "10", "--scales", "0.1", "1", "--eval-seed", "1"],
            {"start": "START", "moved": "MOVED", "moved_step": 10, "scales": (0.1, 1.0), "eval_seed": 1},
        ),
        ("metaworld_frames", ["--sizes", "64", "480", "--frames", "5"], {"sizes": (64, 480), "frames": 5}),
        ("metaworld_goal_views", ["--tasks", "reach", "--sizes", "64"], {"tasks": ("reach",), "sizes": (64,)}),
        (
            "metaworld_experts",
            ["--tasks", "metaworld:hard", "--noise", "0.3"],
            {"tasks": "metaworld:hard", "noise": 0.3},
        ),
        (
            "scale_report",
            ["gr00t_n15", "--devices", "1024", "--round-node-hours", "15", "--", "--train.batch-size", "4"],
            {"name": "gr00t_n15", "devices": 1024, "round_node_hours": 15.0, "overrides": ("--train.batch-size", "4")},
        ),
    ],
)
def test_documented_command_lines_parse(module, argv, expected):
    """The benchmarks' flags (tyro) as docs/*.md and their docstrings spell them."""
    flags = tyro.cli(importlib.import_module(f"experiments.benchmarks.{module}").Flags, args=argv)
    assert {key: getattr(flags, key) for key in expected} == expected


def test_variants_and_launcher_overrides_reach_the_launcher_as_given():
    """A variant that is one flag (``--variant "--model.scan-layers"``) is a value, not the next flag;
    train_step passes what is not its own on to the launcher."""
    argv = compare_steps._attach_variant_values(["toy", "--variant", "", "--variant", "--model.scan-layers"])
    assert tyro.cli(compare_steps.Flags, args=argv).variant == ("", "--model.scan-layers")
    from experiments.benchmarks import train_step

    argv = ["gr00t_bench", "--steps", "1", "--train.batch-size", "4", "--matmul-floor"]
    bench, rest = tyro.cli(train_step.Flags, args=argv, return_unknown_args=True, add_help=False)
    assert (bench.steps, bench.warmup, bench.matmul_floor) == (1, 2, True)
    assert rest == ["gr00t_bench", "--train.batch-size", "4"]


def test_lerobot_reference_step_builds_the_bench_model_sizes():
    """The PyTorch harness (run in its own environment) builds LeRobot's GR00T at gr00t_bench's sizes."""
    from experiments.benchmarks import lerobot_gr00t_step as ref
    from experiments.gr00t import BENCH_MODEL as m

    eagle = ref.eagle_config()
    vision, text = eagle["vision_config"], eagle["text_config"]
    assert (vision["hidden_size"], vision["num_hidden_layers"], vision["num_attention_heads"]) == (
        m.vision.width,
        m.vision.depth,
        m.vision.num_heads,
    )
    assert (vision["intermediate_size"], vision["patch_size"], vision["image_size"]) == (
        m.vision.mlp_dim,
        m.vision.patch_size,
        m.vision.image_size,
    )
    llm = m.llm
    assert (text["hidden_size"], text["num_hidden_layers"], text["num_attention_heads"]) == (
        llm.width,
        llm.num_layers,
        llm.num_heads,
    )
    assert (text["num_key_value_heads"], text["head_dim"], text["intermediate_size"], text["vocab_size"]) == (
        llm.num_kv_heads,
        llm.head_dim,
        llm.mlp_dim,
        llm.vocab_size,
    )
    assert (eagle["image_token_index"], ref.MAX_TOKEN_LEN, ref.TEXT_TOKENS) == (
        m.image_token_id,
        m.max_token_len,
        m.synthetic_text_tokens,
    )
    frozen, trainable = ref.groot_config(False), ref.groot_config(True)
    assert not frozen["backbone_cfg"]["tune_llm"] and trainable["backbone_cfg"]["tune_visual"]
    assert frozen["backbone_cfg"]["select_layer"] == m.select_layer
    head, h = frozen["action_head_cfg"], m.action_head
    assert (head["hidden_size"], head["input_embedding_dim"], head["max_num_embodiments"]) == (
        h.hidden_size,
        h.input_embedding_dim,
        h.max_num_embodiments,
    )
    assert (head["num_target_vision_tokens"], head["backbone_embedding_dim"]) == (h.num_future_tokens, llm.width)
    assert (head["action_dim"], head["action_horizon"], head["max_state_dim"]) == (
        m.action_dim,
        m.action_horizon,
        m.max_state_dim,
    )
    dit, vl = head["diffusion_model_cfg"], head["vl_self_attention_cfg"]
    assert (dit["num_layers"], dit["num_attention_heads"], dit["attention_head_dim"], dit["output_dim"]) == (
        h.dit.num_layers,
        h.dit.num_heads,
        h.dit.head_dim,
        h.dit.output_dim,
    )
    assert (vl["num_layers"], vl["num_attention_heads"], vl["attention_head_dim"]) == (
        h.vl_self_attention.num_layers,
        h.vl_self_attention.num_heads,
        h.vl_self_attention.head_dim,
    )
    assert (ref.ADAMW["lr"], ref.ADAMW["betas"], ref.ADAMW["weight_decay"]) == (1e-4, (0.95, 0.999), 1e-5)


def test_matmul_floor_times_each_distinct_matmul_per_execution():
    """A scan of 5 matmuls and one batched matmul: two distinct dots, 5 and 1 executions."""
    import jax
    import jax.numpy as jnp

    from embodied_jax.parallel.hlo import dot_flops, dots
    from experiments.benchmarks.matmul_floor import matmul_floor

    def f(x, w, a, b):
        h = jax.lax.scan(lambda h, wl: (jnp.tanh(h @ wl), None), x, w)[0]
        return h, jnp.einsum("bij,bjk->bik", a, b)

    args = jnp.ones((16, 64)), jnp.ones((5, 64, 64)), jnp.ones((3, 8, 24)), jnp.ones((3, 24, 40))
    hlo = jax.jit(f).lower(*args).compile().as_text()
    found = sorted(dots(hlo), key=lambda d: d.count)
    shapes = [(d.lhs_shape, d.rhs_shape, d.count) for d in found]
    assert shapes == [((3, 8, 24), (3, 24, 40), 1), ((16, 64), (64, 64), 5)]
    assert [d.flops for d in found] == [2 * 3 * 8 * 24 * 40, 2 * 16 * 64 * 64]
    assert dot_flops(hlo) == 2 * 3 * 8 * 24 * 40 + 5 * 2 * 16 * 64 * 64

    report = matmul_floor(hlo, repeats=3)
    assert (report["matmul_floor_distinct"], report["matmul_floor_calls"]) == (2, 6)
    assert report["matmul_floor_flops"] == dot_flops(hlo)
    assert report["matmul_floor_s"] == sum(row["s"] for row in report["matmul_floor_top"])
    assert {row["count"] for row in report["matmul_floor_top"]} == {1, 5}


def test_alternate_calls_every_variant_once_per_round_in_order():
    from experiments.benchmarks.harness import alternate

    calls = []
    times = alternate({"a": lambda: calls.append("a"), "b": lambda: calls.append("b")}, rounds=3, warmup=2)
    assert calls == ["a", "b"] * 5
    assert {name: (len(t["wall"]), len(t["cpu"])) for name, t in times.items()} == {"a": (3, 3), "b": (3, 3)}


def test_the_batch_search_doubles_then_bisects():
    """``largest_batch``: doubling, then bisection; the bytes of two fitting batches, extrapolated,
    jump to the answer when memory is affine; always the largest batch that fits."""
    from experiments.benchmarks.gpu_suite import largest_batch

    affine = lambda b: 1000 + 100 * b  # noqa: E731
    assert largest_batch(affine, 1000 + 100 * 37, 256) == (37, [1, 2, 37, 38])
    assert largest_batch(affine, 1e12, 8) == (8, [1, 2, 8])
    assert largest_batch(affine, 1000, 8) == (0, [1])
    assert largest_batch(lambda b: 1 if b < 10 else None, 1e12, 64)[0] == 9  # None: XLA ran out of memory
    rng = np.random.default_rng(0)
    for _ in range(200):  # memory growing with the batch, but not affinely
        limit = int(rng.integers(1, 400))
        table = np.cumsum(rng.integers(0, 1000, limit + 1) ** int(rng.integers(1, 3)))
        budget = float(rng.uniform(0, table[-1] * 1.1))
        found, probed = largest_batch(lambda b, table=table: int(table[b]), budget, limit)
        assert found == max([b for b in range(1, limit + 1) if table[b] <= budget], default=0)
        assert len(probed) == len(set(probed)) <= 2 * np.log2(limit) + 4


def test_the_batch_search_reads_the_compiled_steps_memory():
    """``batch_search``: each probe compiles the experiment's step for abstract batches of that size."""
    from experiments.benchmarks.gpu_suite import batch_search

    found = batch_search(["toy"], limit=2, budget=1e12)
    assert found["per_device_batch"] == 2 and list(found["probes"]) == [1, 2]
    assert all(b > 0 for b in found["probes"].values())
    assert found["batch_size"] == 2 * jax.device_count()  # toy's batch is split over every device


def test_the_gpu_suite_rehearses_on_cpu():
    """``gpu_suite --rehearse``: the GPU run's code paths on a CPU with tiny variants (here the sections
    that compile little; ``train_steps`` and ``fp8`` reuse ``train_step`` and ``pi05_fp8`` as they are)."""
    from experiments.benchmarks import gpu_suite

    result = gpu_suite.main(["--rehearse", "--sections", "gpu_tests", "attention", "serving"])
    assert result["failed"] == []
    assert result["gpu_tests"]["files"] and result["gpu_tests"].get("failed", 0) == 0
    attention = result["attention"]
    assert attention["blocksparse"]["loss_vs_xla"] == pytest.approx(1.0, rel=1e-5)  # the same attention
    assert "needs a GPU" in attention["pallas"]["unavailable"]  # reported with the dispatch's reason, not timed
    assert {"pi05_tiny b1 c1", "gr00t_tiny b1 c1"} <= set(result["serving"])


def test_a_goal_guessed_from_its_pixel_is_off_by_its_spread_along_the_camera_ray():
    from experiments.benchmarks.metaworld_goal_views import pixel_guess_errors, project

    cam_pos, cam_mat = np.array([0.0, 0.0, 1.0]), np.eye(3)  # looking down the world's -z
    ray = np.array([[0.01, 0.02, z] for z in (0.0, 0.2, 0.4)])  # one ray: x/depth, y/depth vary
    ray[:, :2] *= (1.0 - ray[:, 2:]) / (1.0 - ray[0, 2])
    aside = np.array([[0.3, 0.0, 0.0]])
    pixels = project(np.concatenate([ray, aside]), cam_pos, cam_mat, 90.0, 64)
    assert (pixels[:3] == pixels[0]).all() and (pixels[3] != pixels[0]).any()
    assert (project(np.array([[0.0, 0.0, 0.5]]), cam_pos, cam_mat, 90.0, 64) == 0).all()  # the centre
    errors = pixel_guess_errors(np.concatenate([ray, aside]), pixels)
    np.testing.assert_allclose(errors[:3], np.linalg.norm(ray - ray.mean(axis=0), axis=1))
    assert errors[3] == 0.0


def test_a_random_move_has_the_moves_norm_in_every_leaf_and_another_direction():
    import jax
    import numpy as np

    from experiments.benchmarks.rl_random_move import random_move

    rng = np.random.default_rng(0)
    delta = {"expert": {"w": rng.normal(size=(6, 4)), "b": rng.normal(size=(4,))}, "vision": {"w": np.zeros((3, 3))}}
    for scale in (1.0, 3.0):
        move = random_move(delta, jax.random.key(1), scale)
        for got, want in zip(jax.tree.leaves(move), jax.tree.leaves(delta), strict=True):
            np.testing.assert_allclose(np.linalg.norm(got), scale * np.linalg.norm(want), rtol=1e-5)
    w = np.asarray(random_move(delta, jax.random.key(1), 1.0)["expert"]["w"]).ravel()
    cosine = w @ delta["expert"]["w"].ravel() / (np.linalg.norm(w) * np.linalg.norm(delta["expert"]["w"]))
    assert abs(cosine) < 0.9  # a fresh direction, not RL's
    assert not np.asarray(random_move(delta, jax.random.key(1), 1.0)["vision"]["w"]).any()  # frozen weights stay
