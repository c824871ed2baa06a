"""Loggers and curves: wandb (offline) and TensorBoard end to end on a tiny ppo.py run, the checks that run
before any model loads, and `python tools/plot_curves.py`.

wandb and tensorboard come from requirements-logging.txt (`make install` installs it); the tests that need
them are skipped where they are missing.
"""
import glob
import importlib.util
import json
import os
import re
import subprocess
import sys

import pytest

from conftest import REPO, read_metrics
from test_ppo import run_ppo, workdir  # noqa: F401  (workdir: the tiny model, data and reward of test_ppo)

needs = {name: pytest.mark.skipif(importlib.util.find_spec(name) is None,
                                  reason=f"{name} is not installed (pip install -r requirements-logging.txt)")
         for name in ("wandb", "tensorboard")}


def tensorboard_scalars(folder: str) -> dict:
    """step → {tag: value} from the event files in `folder`, read with TensorBoard's own EventAccumulator."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(folder, size_guidance={"scalars": 0})
    events.Reload()
    steps = {}
    for tag in events.Tags()["scalars"]:
        for event in events.Scalars(tag):
            steps.setdefault(event.step, {})[tag] = event.value
    return steps


def wandb_records(wandb_file: str) -> list:
    """The records of a wandb offline run's .wandb log, printed by wandb's own reader (`wandb leet inspect`) and
    parsed back into wandb's protobuf Record messages."""
    from google.protobuf import text_format
    from wandb.proto import wandb_internal_pb2

    wandb_cli = os.path.join(os.path.dirname(sys.executable), "wandb")
    text = subprocess.run([wandb_cli, "leet", "inspect", wandb_file], capture_output=True, text=True, check=True,
                          timeout=120).stdout
    blocks = re.split(r"^# record \d+: \w+\n", text, flags=re.M)[1:]
    return [text_format.Parse(block, wandb_internal_pb2.Record()) for block in blocks]


def wandb_run(wandb_file: str) -> tuple[str, dict]:
    """(run id, step → {key: value}) of one offline run; wandb's own _step, _runtime, _timestamp left out."""
    records = wandb_records(wandb_file)
    run_id = next(r.run.run_id for r in records if r.WhichOneof("record_type") == "run")
    history = {}
    for r in records:
        if r.WhichOneof("record_type") == "history":
            row = {"/".join(item.nested_key) or item.key: json.loads(item.value_json) for item in r.history.item}
            history[row["_step"]] = {k: v for k, v in row.items() if not k.startswith("_")}
    return run_id, history


def assert_same_values(logged: dict, jsonl_rows: list, tol: float) -> None:
    for row in jsonl_rows:
        want = {k: v for k, v in row.items() if k != "step"}
        got = logged[row["step"]]
        assert set(got) == set(want), (row["step"], set(got) ^ set(want))
        assert all(abs(got[k] - want[k]) <= tol * max(1.0, abs(want[k])) for k in want), row["step"]


@needs["wandb"]
@needs["tensorboard"]
def test_wandb_and_tensorboard_get_the_metrics_and_a_resumed_run_continues_the_wandb_run(workdir, tmp_path,  # noqa: F811
                                                                                          monkeypatch):
    """A ppo.py run with trainer.logger=[wandb,tensorboard] writes, at every step, the keys and values of
    metrics.jsonl to a TensorBoard event file and to a wandb offline run; resumed from its step-2 checkpoint
    it continues the same wandb run (same id, steps 3 on) and the same TensorBoard folder."""
    monkeypatch.setenv("WANDB_MODE", "offline")
    out = tmp_path / "logged"
    args = ["trainer.logger=wandb,tensorboard", "trainer.test_freq=2", "trainer.save_freq=2"]
    run_ppo(workdir, out, *args, "trainer.total_steps=2")
    with open(out / "wandb_id.txt") as f:
        run_id = f.read().strip()
    run_ppo(workdir, out, *args, "trainer.total_steps=3", "trainer.resume=auto")

    rows = read_metrics(out)
    assert [r["step"] for r in rows] == [0, 1, 2, 3]
    assert_same_values(tensorboard_scalars(str(out / "tensorboard")), rows, tol=1e-6)  # TB stores float32
    first, resumed = sorted(glob.glob(str(out / "wandb" / "offline-run-*" / "*.wandb")))
    first_id, first_history = wandb_run(first)
    resumed_id, resumed_history = wandb_run(resumed)
    assert first_id == resumed_id == run_id
    with open(out / "wandb_id.txt") as f:
        assert f.read().strip() == run_id
    assert sorted(first_history) == [0, 1, 2] and sorted(resumed_history) == [3]
    assert_same_values({**first_history, **resumed_history}, rows, tol=0)


@pytest.mark.parametrize("logger, message", [
    ("wandb,tensorbord", "trainer.logger: unknown logger(s) ['tensorbord']; the choices are wandb and tensorboard"),
    ("wandb", "trainer.logger has ['wandb'] but the package is not installed: pip install -r requirements-logging.txt"),
])
def test_logger_mistakes_fail_before_any_model_loads(workdir, tmp_path, logger, message):  # noqa: F811
    """An unknown logger name, or a logger whose package is missing (hidden here by a sitecustomize that makes
    its import fail), stops ppo.py at start-up with one sentence naming requirements-logging.txt, no traceback."""
    hide = tmp_path / "hide"
    hide.mkdir()
    (hide / "sitecustomize.py").write_text("import sys\nsys.modules['wandb'] = None\n")
    env = {**os.environ, "PYTHONPATH": str(hide)}
    cmd = [sys.executable, "ppo.py", "--config", "configs.yaml", f"model.path={workdir}/model",
           f"data.train_files={workdir}/train.parquet", f"trainer.output_dir={tmp_path / 'out'}",
           f"trainer.logger={logger}"]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode != 0
    assert message in proc.stderr and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert not os.path.exists(tmp_path / "out" / "metrics.jsonl")


def test_check_loggers_accepts_console_as_a_no_op():
    """`console` (the configs' default) is accepted: the console line and metrics.jsonl are always on."""
    from infra.metrics import check_loggers

    check_loggers(["console"], "trainer.logger")
    check_loggers([], "trainer.logger")


# ---------------------------------------------------------------------------------------
# Curves


def fake_metrics(path, scale: float) -> str:
    """A metrics.jsonl as ppo.py writes it: validation at steps 0, 10, 20; no critic (no loss/value)."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        for step in range(21):
            row = {"step": step}
            if step:
                row.update({"score/mean": scale * step / 20, "kl/mean": 0.001 * step, "policy/entropy": 1 - step / 40,
                            "reward/mean": scale * step / 20 - 0.01})
            if step % 10 == 0:
                row["val/score/mean"] = scale * (0.4 + step / 50)
            f.write(json.dumps(row) + "\n")
    return str(path)


def test_ema_is_debiased_and_smooths():
    """EMA with the TensorBoard start-up correction: a constant stays that constant; a step is approached."""
    from infra.metrics import ema

    assert ema([2.0, 2.0, 2.0], 0.9) == pytest.approx([2.0, 2.0, 2.0])
    assert ema([0.0, 1.0], 0.5) == pytest.approx([0.0, 0.5 / 0.75])


def test_plot_has_a_panel_per_logged_metric_and_overlays_runs(tmp_path, monkeypatch):
    """Only metrics the runs logged get a panel (no loss/value without a critic); two runs draw one line
    each (raw + EMA for training metrics, marked points for validation) on the same panels."""
    import matplotlib.pyplot as plt

    from infra.metrics import plot_curves

    figures = []
    monkeypatch.setattr(plt, "close", figures.append)
    a, b = fake_metrics(tmp_path / "a" / "metrics.jsonl", 1.0), fake_metrics(tmp_path / "b" / "metrics.jsonl", 0.5)
    shown = plot_curves([a, b], str(tmp_path / "both.png"))
    assert shown == ["score/mean", "reward/mean", "kl/mean", "policy/entropy", "val/score/mean"]
    axes = {ax.get_title(): ax for ax in figures[0].axes}
    assert list(axes) == shown
    assert len(axes["score/mean"].lines) == 4  # raw and smoothed, for each run
    val_lines = axes["val/score/mean"].lines
    assert len(val_lines) == 2 and all(line.get_marker() == "o" for line in val_lines)
    assert list(val_lines[0].get_xdata()) == [0, 10, 20]
    assert os.path.getsize(tmp_path / "both.png") > 0


def test_plot_command_writes_the_png(tmp_path):
    """`python tools/plot_curves.py a/metrics.jsonl b/metrics.jsonl -o out.png`, from any directory, writes the PNG
    and names the panels it drew."""
    a, b = fake_metrics(tmp_path / "a" / "metrics.jsonl", 1.0), fake_metrics(tmp_path / "b" / "metrics.jsonl", 0.5)
    proc = subprocess.run([sys.executable, os.path.join(REPO, "tools", "plot_curves.py"), a, b, "-o", "out.png"],
                          cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "out.png: score/mean, reward/mean, kl/mean, policy/entropy, val/score/mean" in proc.stdout
    assert (tmp_path / "out.png").stat().st_size > 0
