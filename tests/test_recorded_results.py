"""Learning and speed results kept as data: rows with commit, config and setting hashes
(``--record``), the tables generated from them (docs/performance.md, README's headline success
rates) and what a run prints from them at its start (expected duration, heartbeat)."""

import dataclasses
import json

import pytest

from embodied_jax import records


def test_performance_doc_holds_the_tables_the_recorded_results_give():
    """docs/performance.md's recorded tables and README's headline success rates are generated
    (``python -m experiments.benchmarks.report``)."""
    from experiments.benchmarks import report

    assert report.main(["--check"]) == 0


def test_readme_headline_rates_come_from_the_rows_of_their_setting(tmp_path, monkeypatch):
    """One line per setting: its clean rows' latest per training seed, one run's rate and interval or
    several runs' mean and min-max; other settings and dirty rows are not counted; a tampered row
    makes the table stale."""
    from experiments.benchmarks import headline_table

    def row(seed, rate, *, overrides=("--task", "pick_place", "--train.seed"), clean=True):
        return {
            "commit": "abc1234def" if clean else "abc1234def-dirty",
            "clean": clean,
            "overrides": [*overrides, str(seed)],
            "seeds": {"training": seed, "test": 1},
            "result": {"success_rate": rate, "success_ci95": [rate - 0.1, rate + 0.05], "episodes": 128},
        }

    rows = [row(0, 0.5), row(0, 0.75), row(1, 0.25), row(2, 0.0, clean=False), row(3, 1.0, overrides=("--train.seed",))]
    (tmp_path / "toy.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    evaluated = {  # an evaluation's row: no overrides, matched by its command's arguments
        "commit": "abc1234def",
        "clean": True,
        "command": "python -m embodied_jax.evaluate runs/x --task reach --noise-scale 0 --record --shared-machine",
        "seeds": {"evaluation": 1},
        "result": {"success_rate": 0.5, "success_ci95": [0.4, 0.6], "episodes": 64},
    }
    (tmp_path / "evaluate.jsonl").write_text(json.dumps(evaluated) + "\n")
    lines = (
        headline_table.Headline("toy pick", "toy", ("--task", "pick_place"), "docs/demo.md"),
        headline_table.Headline("toy reach", "toy", (), "docs/demo.md"),
        headline_table.Headline("never run", "absent", (), "docs/demo.md"),
        headline_table.Headline("centre", "evaluate", ("runs/x", "--task", "reach", "--noise-scale", "0"), "d.md"),
        headline_table.Headline("other", "evaluate", ("runs/x", "--task", "reach"), "docs/demo.md"),
    )
    monkeypatch.setattr(headline_table, "ROWS", lines)
    table = headline_table.render(tmp_path)
    assert "| toy pick | mean 50.0%, min-max 25.0%-75.0% over 2 training runs, 128 test-seed episodes each |" in table
    assert "| toy reach | 100.0% (90.0%-105.0%), 128 test-seed episodes |" in table
    assert "| never run | no recorded run | `results/absent.jsonl` - |" in table
    assert "| centre | 50.0% (40.0%-60.0%), 64 test-seed episodes |" in table
    assert "| other | no recorded run |" in table
    readme = tmp_path / "README.md"
    readme.write_text(f"# x\n\n{headline_table.BEGIN}\n{headline_table.END}\n")
    assert not headline_table.is_current(readme, tmp_path)
    headline_table.write(readme, tmp_path)
    assert headline_table.is_current(readme, tmp_path) and readme.read_text().startswith("# x\n\n")
    (tmp_path / "toy.jsonl").write_text((tmp_path / "toy.jsonl").read_text().replace("0.75", "0.95", 1))
    assert not headline_table.is_current(readme, tmp_path)
    with pytest.raises(ValueError, match="markers"):
        headline_table.write(tmp_path / "toy.jsonl", tmp_path)


def test_a_recorded_row_names_its_commit_machine_and_command(tmp_path, monkeypatch):
    from experiments.benchmarks import harness, report

    monkeypatch.setattr(harness, "machine", lambda: {"cpu": "test cpu", "cores": 2, "backend": "cpu"})
    monkeypatch.setattr(records, "commit", lambda root, outputs=None: "abc123")
    harness.record("toy_bench", {"speedup": 1.5, "nested": {"p99_ms": 12.0}, "note": "x"}, ["--rounds", "2"], tmp_path)
    harness.record("toy_bench", {"speedup": 1.7}, ["--rounds", "2"], tmp_path)  # same configuration: the latest wins
    monkeypatch.setattr(records, "commit", lambda root, outputs=None: "abc123-dirty")
    harness.record("toy_bench", {"speedup": 9.9}, ["--rounds", "2"], tmp_path)  # uncommitted changes: never shown
    rows = report.latest_runs(tmp_path)["toy_bench"]
    assert len(rows) == 1 and rows[0]["result"] == {"speedup": 1.7}
    assert rows[0]["command"] == "python -m experiments.benchmarks.toy_bench --rounds 2" and rows[0]["date"]
    table = report.render(tmp_path)
    assert "| `python -m experiments.benchmarks.toy_bench --rounds 2` | speedup 1.7 |" in table
    assert "test cpu, 2 cores, cpu" in table


def test_a_success_row_from_uncommitted_changes_is_marked_and_left_out_of_the_tables(tmp_path, monkeypatch):
    """``--record`` of a learning result: commit, config hash, overrides, seeds, wall time split and
    machine in one row; a dirty tree's row is kept but marked, and the generated tables skip it."""
    from experiments import record
    from experiments.benchmarks import report
    from experiments.toy import toy

    monkeypatch.setattr(records, "machine", lambda: {"cpu": "test cpu", "cores": 2, "backend": "cpu"})
    config = toy()
    for commit in ("abc123", "abc123-dirty"):
        monkeypatch.setattr(records, "commit", lambda root, outputs=None, commit=commit: commit)
        row = record.success_row(
            "toy_success",
            config,
            result={"success_rate": 0.5, "success_ci95": [0.3, 0.7], "episodes": 20},
            seeds={"training": 0, "test": 1},
            wall_s={"collection": 1.0, "training": 2.0, "evaluation": 3.0},
            overrides=["--train.steps", "5"],
        )
        record.append(row, tmp_path)
    rows = [json.loads(line) for line in (tmp_path / "toy_success.jsonl").read_text().splitlines()]
    assert [r["clean"] for r in rows] == [True, False] and rows[1]["commit"] == "abc123-dirty"
    assert (
        rows[0]["config_hash"]
        == record.config_hash(config)
        != record.config_hash(
            dataclasses.replace(config, train=dataclasses.replace(config.train, steps=config.train.steps + 1))
        )
    )
    assert rows[0]["overrides"] == ["--train.steps", "5"] and rows[0]["seeds"] == {"training": 0, "test": 1}
    # From the command line: the flags after the experiment's name, all of them when none is given.
    assert record.command_overrides(["demo", "--task", "reach", "--record"]) == ["--task", "reach", "--record"]
    assert record.command_overrides(["--task", "reach", "--record"]) == ["--task", "reach", "--record"]
    # A run filed under another name (--name) keeps the experiment it ran in its command.
    assert record.launched_experiment(["metaworld", "--name", "levers"], "levers") == "metaworld"
    assert record.launched_experiment(["--task", "reach"], "demo") == "demo"
    row = record.success_row("levers", config, result={}, seeds={}, wall_s={}, overrides=[], experiment="metaworld")
    assert row["benchmark"] == "levers" and row["command"] == "python -m experiments.launch metaworld"
    assert rows[0]["wall_s"] == {"collection": 1.0, "training": 2.0, "evaluation": 3.0}
    assert rows[0]["machine"]["shared"] is False
    shown = report.latest_runs(tmp_path)["toy_success"]
    assert [r["commit"] for r in shown] == ["abc123"]
    # The generated table shows the clean row's figure; a tampered row makes --check fail.
    doc = tmp_path / "performance.md"
    doc.write_text("# results\n\n" + report.render(tmp_path) + "\n")
    assert report.is_current(doc, tmp_path) and "success_rate 0.5" in doc.read_text()
    path = tmp_path / "toy_success.jsonl"
    path.write_text(path.read_text().replace('"success_rate": 0.5', '"success_rate": 0.9', 1))
    assert not report.is_current(doc, tmp_path)
    # The expected duration a run prints at its start: the clean row of the same command only.
    from experiments.progress import expected_duration

    said = expected_duration("toy_success", ["--train.steps", "5", "--record"], tmp_path)
    assert said.startswith("expected duration: 0.1 min (collection 0.0, training 0.0, evaluation 0.1)")
    assert "abc123," in said and "alone on the machine" in said
    assert "no recorded run" in expected_duration("toy_success", ["--train.steps", "6"], tmp_path)
    # Rows carry the hash of their setting (the config less its seed and run directory): a run of the
    # same flags whose defaults have changed since is told so; a run of the same config is not.
    assert "predates config hashes" in expected_duration("toy_success", ["--train.steps", "5"], tmp_path, "0" * 16)
    monkeypatch.setattr(records, "commit", lambda root, outputs=None: "def456")
    reseeded = dataclasses.replace(config, workdir="elsewhere", train=dataclasses.replace(config.train, seed=7))
    assert (
        record.setting_hash(reseeded)
        == record.setting_hash(config)
        != record.setting_hash(
            dataclasses.replace(config, train=dataclasses.replace(config.train, steps=config.train.steps + 1))
        )
    )
    kwargs = dict(seeds={"training": 7}, wall_s={"training": 600.0}, overrides=["--train.steps", "5"])
    record.append(record.success_row("toy_success", reseeded, result={}, setting=reseeded, **kwargs), tmp_path)
    now = record.setting_hash(config)
    assert "def456" in expected_duration("toy_success", ["--train.steps", "5"], tmp_path, now)
    assert "differed" not in expected_duration("toy_success", ["--train.steps", "5"], tmp_path, now)
    changed = expected_duration("toy_success", ["--train.steps", "5"], tmp_path, "0" * 16)
    assert "def456" in changed and "defaults differed from this checkout's" in changed


def test_runs_that_differ_only_in_the_training_seed_are_reported_together(tmp_path, monkeypatch):
    """Several training runs of one setting (a loop over ``--train.seed``, each with ``--record``):
    the mean, the min-max and each run's interval; other settings and dirty rows stay apart."""
    from experiments import record
    from experiments.benchmarks import report
    from experiments.toy import toy

    monkeypatch.setattr(records, "machine", lambda: {"cpu": "test cpu", "cores": 2, "backend": "cpu"})
    runs = [
        ("abc", 0, 0.8, ["--checkpoint.save-every", "250"]),  # checkpoint cadence: the same setting
        ("abc", 1, 0.9, ["--checkpoint.keep-last=9"]),
        ("abc", 2, 0.7, []),
        ("abc-dirty", 3, 0.1, []),
        ("abc", 0, 0.2, ["--x"]),
    ]
    for commit, seed, rate, extra in runs:
        monkeypatch.setattr(records, "commit", lambda root, outputs=None, commit=commit: commit)
        overrides = [
            "--task",
            "pick_place",
            "--train.seed",
            str(seed),
            "--workdir",
            f"runs/s{seed}",
            "--record",
            *extra,
        ]
        row = record.success_row(
            "toy_success",
            toy(),
            result={"success_rate": rate, "success_ci95": [rate - 0.1, rate + 0.05], "episodes": 128},
            seeds={"training": seed, "test": 1},
            wall_s={"training": 1.0},
            overrides=overrides,
        )
        record.append(row, tmp_path)
    (group,) = report.training_runs(tmp_path)["toy_success"]
    assert group["setting"] == "--task pick_place" and len(group["runs"]) == 3
    assert abs(group["mean"] - 0.8) < 1e-9 and (group["min"], group["max"]) == (0.7, 0.9)
    table = report.render(tmp_path)
    assert "| `--task pick_place` | 3 | 80.0% | 70.0-90.0% | seed 0: 80.0% (70.0-85.0%), `abc`" in table


def test_a_heartbeat_prints_while_a_silent_phase_runs():
    import io
    import time

    from experiments.progress import heartbeat

    out = io.StringIO()
    with heartbeat("training", every=0.05, out=out):
        time.sleep(0.3)
    lines = out.getvalue().splitlines()
    assert len(lines) >= 2 and all(line.strip().startswith("training: still running (") for line in lines)
    time.sleep(0.15)
    assert out.getvalue().splitlines() == lines  # stopped with the block


def test_anchors_stand_beside_the_runs_of_their_configuration(tmp_path, monkeypatch):
    """results/anchors.jsonl's figures go next to the latest run they match (ours / theirs where both
    have a figure); an anchored configuration without a run of ours still gets its row."""
    import json

    from experiments.benchmarks import harness, report

    monkeypatch.setattr(harness, "machine", lambda: {"cpu": "test cpu", "cores": 2, "backend": "cpu"})
    monkeypatch.setattr(records, "commit", lambda root, outputs=None: "abc123")
    harness.record("train_step", {"experiment": "a_bench", "median_step_s": 0.25}, ["a_bench"], tmp_path)

    def anchor(name, experiment, date, step_s):
        return {
            "anchor": name,
            "benchmark": "train_step",
            "configuration": {"experiment": experiment},
            "date": date,
            "machine": {"cpu": "their cpu"},
            "command": None,
            "source": "a test",
            "result": {"median_step_s": step_s},
        }

    rows = [anchor("Them", "a_bench", "2026-01-01", 0.4), anchor("Them", "a_bench", "2026-01-02", 0.5)]
    rows.append(anchor("Them", "b_bench", "2026-01-01", 1.0))
    (tmp_path / "anchors.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert set(report.latest_runs(tmp_path)) == {"train_step"}  # anchors are not a benchmark
    table = report.render(tmp_path)
    assert "| `python -m experiments.benchmarks.train_step a_bench` | median_step_s 0.25 | " in table
    assert "Them, 2026-01-02: median_step_s 0.5 (ours 0.50x) |" in table  # the latest of the anchor
    assert "| experiment b_bench: no recorded run | - | Them, 2026-01-01: median_step_s 1 |" in table
    assert "| Them | experiment b_bench | 2026-01-01 | their cpu, ? | not recorded | a test |" in table
