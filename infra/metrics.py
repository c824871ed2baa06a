"""What a run reports: metrics.jsonl (and wandb / TensorBoard when asked; on resume its lines past the checkpoint are
dropped, runs.set_aside_later), the console line, the sample table, the reduction of metrics over processes, and
curves.png (`python tools/plot_curves.py` draws it for any run).
wandb, TensorBoard and matplotlib are optional: each is imported where it is used."""
import importlib.util
import json
import math
import os
import time
from contextlib import contextmanager

import torch
from accelerate.utils import gather_object

from infra.config import ConfigError, SaveError

OPTIONAL_LOGGERS = ("wandb", "tensorboard")  # each is also the name of the package it needs
WANDB_ID_FILE = "wandb_id.txt"  # in output_dir: the wandb run a resumed run continues
CURVE_KEYS = ["score/mean", "reward/mean", "kl/mean", "policy/entropy", "loss/value", "val/score/mean",
              "val/perplexity"]


def check_loggers(loggers: list, key: str) -> None:
    """Fail at start-up, before any model loads, on an unknown logger name or a logger whose package is missing.
    `console` is accepted and adds nothing: the console line, the tqdm bar and metrics.jsonl are always on."""
    unknown = sorted(set(loggers) - {"console", *OPTIONAL_LOGGERS})
    if unknown:
        raise ConfigError(f"{key}: unknown logger(s) {unknown}; the choices are wandb and tensorboard "
                          f"(metrics.jsonl and the console line are always written)")
    missing = [name for name in OPTIONAL_LOGGERS if name in loggers and importlib.util.find_spec(name) is None]
    if missing:
        raise ConfigError(f"{key} has {missing} but the package is not installed: "
                          f"pip install -r requirements-logging.txt")


def wandb_resume_id(path):
    """The wandb run id to continue: the one written beside the checkpoint `path` (start_run's), or None."""
    id_file = path and os.path.join(os.path.dirname(os.path.normpath(path)), WANDB_ID_FILE)
    if id_file and os.path.exists(id_file):
        with open(id_file) as f:
            return f.read().strip()
    return None


def drop_metrics_after(path: str, step: int, moved_to: str = None) -> None:
    """On resume, forget lines logged after the checkpoint, and a line cut short by a kill, so metrics.jsonl
    reads as one run. `moved_to`: a file that gets the lines past `step` instead."""
    if not os.path.exists(path):
        return
    kept, later = [], []
    with open(path) as f:
        for line in f:
            try:
                (kept if json.loads(line)["step"] <= step else later).append(line.rstrip("\n") + "\n")
            except (json.JSONDecodeError, KeyError, TypeError):
                continue  # the partial last line of a run killed while writing it
    for lines, target in ((kept, path), (later, moved_to)):
        if target:
            with open(target + ".tmp", "w") as f:
                f.writelines(lines)
            os.replace(target + ".tmp", target)


class MetricsLogger:
    """One JSON line per step in metrics.jsonl, plus wandb / tensorboard when asked, with the same keys. Rank 0 only.

    `resume_id`: continue that wandb run (its id is written to <output_dir>/wandb_id.txt and kept in `.wandb_id`).
    """

    def __init__(self, output_dir: str, loggers: list, config: dict, project: str, name: str, enabled: bool,
                 resume_id=None):
        self.enabled, self.path = enabled, os.path.join(output_dir, "metrics.jsonl")
        self.wandb = self.tb = self.wandb_id = None
        if not enabled:
            return
        os.makedirs(output_dir, exist_ok=True)
        if "wandb" in loggers:
            import wandb

            self.wandb = wandb.init(project=project, name=name, config=config, dir=output_dir, id=resume_id,
                                    resume="allow" if resume_id else None)
            self.wandb_id = self.wandb.id
            with open(os.path.join(output_dir, WANDB_ID_FILE), "w") as f:
                f.write(self.wandb_id + "\n")
        if "tensorboard" in loggers:
            from torch.utils.tensorboard import SummaryWriter

            self.tb = SummaryWriter(os.path.join(output_dir, "tensorboard"))

    def log(self, metrics: dict, step: int) -> None:
        if not self.enabled:
            return
        line = json.dumps({"step": step, **finite_or_null(metrics)}, allow_nan=False)
        try:
            with open(self.path, "a") as f:
                f.write(line + "\n")
        except OSError as e:  # disk full, or the folder made read-only during the run
            raise SaveError(f"cannot append step {step} to {self.path} ({e.strerror}); the lines and checkpoints "
                            f"before it are kept: free space or fix the permissions, then run the same command "
                            f"again to resume") from None
        if self.wandb:
            self.wandb.log(metrics, step=step)
        if self.tb:
            for k, v in metrics.items():
                self.tb.add_scalar(k, v, step)

    def close(self) -> None:
        if self.wandb:
            self.wandb.finish()
        if self.tb:
            self.tb.close()


def finite_or_null(metrics: dict) -> dict:
    """NaN and ±inf as None, so metrics.jsonl stays strict JSON (json.dumps would write NaN and Infinity, which
    JSON has not, and which jq and most readers refuse): a non-finite value reads as null, "not measured"."""
    return {k: None if isinstance(v, float) and not math.isfinite(v) else v for k, v in metrics.items()}


def console_line(metrics: dict, keys: list) -> str:
    return "  ".join(f"{k} {metrics[k]:.4g}" for k in keys if k in metrics)


def shown_samples(samples, count: int) -> list[tuple]:
    """`count` samples spread over the batch (infra.rollout_common.Samples) as sample_table's rows: the prompt's end,
    the response (with multi-turn its transcript: every turn and tool answer, joined by ⟶), its score, and the
    judge's answer where a judge scored it."""
    shown = list(range(0, len(samples.rows), max(1, len(samples.rows) // count)))[:count]
    return [(samples.rows[i]["prompt_text"][-40:], transcript(samples.rows[i], samples.texts[i]),
             samples.scores[i].item(), samples.extras[i].get("judge_answer", "")) for i in shown]


def transcript(row: dict, text: str) -> str:
    if "conversation" not in row:
        return text
    return " ⟶ ".join(m["content"] for m in row["conversation"]["turns"])


def sample_table(rows: list[tuple]) -> str:
    """A plain-text table of (prompt, response, score[, judge]) rows, newlines shown as ⏎; the judge's answers
    (a judge among reward.sources) get a column when any row has one."""
    def clip(s, n):
        s = s.replace("\n", "⏎")
        return s if len(s) <= n else "…" + s[-(n - 1):]
    judged = any(len(row) > 3 and row[3] for row in rows)
    lines = [f"{'prompt':<40} | {'response':<40} | score" + (" | judge" if judged else "")]
    lines += [f"{clip(p, 40):<40} | {clip(r, 40):<40} | "
              + (f"{s:<5.3g} | {clip(rest[0], 40)}" if judged else f"{s:.3g}") for p, r, s, *rest in rows]
    return "\n".join(lines)


def batch_metrics(scores, token_rewards, lengths, truncated) -> dict:
    """Means over this process's batch: scores (B,), the summed token rewards (B, Tr), response lengths (B,), and
    the share of responses cut off at max_response_length."""
    return {"score/mean": scores.mean().item(), "score/max": scores.max().item(), "score/min": scores.min().item(),
            "reward/mean": token_rewards.sum(1).mean().item(), "response/length_mean": lengths.float().mean().item(),
            "response/clip_ratio": truncated.float().mean().item()}


def sum_over_processes(accelerator, x: torch.Tensor) -> torch.Tensor:
    """x summed over processes, on x's own device."""
    return accelerator.reduce(x.to(accelerator.device), "sum").to(x.device)


def reduce_metrics(accelerator, metrics: dict) -> dict:
    """Each metric (a number, or a list: one value per micro-batch) → its mean over the list and then over the
    processes that hold it, or its maximum for *_max keys. A process may lack a name another holds (a reward's extra
    number, an environment's info that only some samples give): the names are agreed first, so that every process
    reduces the same tensor (a differing one is a collective mismatch: gloo aborts, NCCL may hang)."""
    names = list(dict.fromkeys(name for mine in gather_object([list(metrics)]) for name in mine))  # process order
    is_max = [name.endswith("_max") for name in names]
    local = [metrics.get(name, 0.0) for name in names]
    local = torch.tensor([(max(v) if m else sum(v) / len(v)) if isinstance(v, list) else v
                          for v, m in zip(local, is_max)], dtype=torch.float64)
    held = torch.tensor([name in metrics for name in names], dtype=torch.float64)
    sums, counts = accelerator.reduce(torch.cat([local * held, held]).to(accelerator.device), "sum").chunk(2)
    maxima = accelerator.reduce(local.masked_fill(held == 0, -math.inf).to(accelerator.device), "max").tolist()
    return {name: hi if m else mean for name, m, mean, hi in zip(names, is_max, (sums / counts).tolist(), maxima)}


@contextmanager
def timed(times: dict, name: str):
    """with timed(times, "gen"): ...  adds the seconds spent inside to times[name]."""
    t0 = time.perf_counter()
    yield
    times[name] = times.get(name, 0.0) + time.perf_counter() - t0


def ema(values: list, smoothing: float) -> list:
    """s_t = α·s_{t−1} + (1 − α)·x_t, divided by 1 − α^t so the start is not pulled to 0 (as TensorBoard does)."""
    out, s = [], 0.0
    for t, x in enumerate(values, start=1):
        s = smoothing * s + (1 - smoothing) * x
        out.append(s / (1 - smoothing ** t))
    return out


def plot_curves(metrics_paths, out_png: str, keys: list = CURVE_KEYS, smoothing: float = 0.8) -> list:
    """A grid of metric-vs-step panels from one metrics.jsonl, or several overlaid (one colour per run).

    Only keys that some run logged get a panel (when none of `keys` is there: every key logged). Training
    metrics: the raw values faint, their EMA over them; validation (val/*): its points marked. Returns the keys.
    """
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    paths = [metrics_paths] if isinstance(metrics_paths, str) else list(metrics_paths)
    runs = {}  # label (the run's folder) → rows
    for path in paths:
        with open(path) as f:
            runs[os.path.dirname(path) or path] = [json.loads(line) for line in f]
    logged = {k for rows in runs.values() for r in rows for k, v in r.items() if k != "step" and v is not None}
    shown = [k for k in keys if k in logged] or sorted(logged)
    cols = min(3, len(shown))
    rows_n = math.ceil(len(shown) / cols)
    fig, axes = plt.subplots(rows_n, cols, figsize=(4.5 * cols, 3.2 * rows_n), squeeze=False)
    for ax in axes.flat[len(shown):]:
        fig.delaxes(ax)
    for ax, key in zip(axes.flat, shown):
        for i, (label, rows) in enumerate(runs.items()):
            points = [(r["step"], r[key]) for r in rows if r.get(key) is not None]
            steps, values = [p[0] for p in points], [p[1] for p in points]
            name = label if len(runs) > 1 else None
            if key.startswith("val/"):
                ax.plot(steps, values, color=f"C{i}", marker="o", markersize=4, label=name)
            elif points:
                ax.plot(steps, values, color=f"C{i}", alpha=0.25, linewidth=1)
                ax.plot(steps, ema(values, smoothing), color=f"C{i}", linewidth=1.8, label=name)
        ax.set_title(key)
        ax.set_xlabel("step")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.grid(alpha=0.3)
    if len(runs) > 1:
        axes.flat[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out_png, dpi=100)
    plt.close(fig)
    return shown
