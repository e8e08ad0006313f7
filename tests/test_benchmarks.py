"""Benchmark tools that tests can afford: ``compare_steps`` on the toy experiment."""

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
