"""Plumbing shared by ppo.py and reward_model.py: models, LR schedule, logging, curves.
A run's output folder (lock, checkpoints, resume, signals) is runs.py's."""
import importlib.util
import json
import math
import os
import re
import shutil
import time
from contextlib import contextmanager

import torch

from config import ConfigError


def exact_div(a: int, b: int, what: str) -> int:
    """a / b as an int, or a sentence saying which batch size does not divide."""
    if b <= 0 or a % b != 0:
        raise ConfigError(f"{what}: {a} is not divisible by {b}")
    return a // b


def fast_bf16() -> bool:
    """Does this machine multiply bf16 fast? CUDA does; a CPU only with native bf16 (AVX-512 BF16, AMX).
    Elsewhere torch falls back to a scalar bf16 kernel that is ~50× slower than fp32."""
    return torch.cuda.is_available() or torch.ops.mkldnn._is_mkldnn_bf16_supported()


def autocast_dtype(name: str):
    """`model.dtype` → the autocast dtype (None = plain fp32)."""
    if name == "auto":
        name = "bf16" if fast_bf16() else "fp32"
    return {"bf16": torch.bfloat16, "fp32": None}[name]


def autocast(device: torch.device, dtype):
    return torch.autocast(device.type, dtype=dtype, enabled=dtype is not None)


# ---------------------------------------------------------------------------------------
# Models


def load_tokenizer(path: str, key: str = "model.path"):
    """The tokenizer at `path` (a folder, or a hub id), with pad = EOS where it has no pad token. A hub id the hub
    does not give (no network, or no such model) fails in one sentence naming `key`."""
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(path)
    except OSError as e:
        reason = str(e).splitlines()[0]
        raise ConfigError(f"{key}: {path} is not a local folder, and the hub did not give it ({reason}); give a model "
                          f"folder (the demo's: make prepare)") from None
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def load_policy(cfg_model):
    """The actor: a causal LM in fp32 (master weights), with LoRA adapters when lora_rank > 0."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(cfg_model.path, dtype=torch.float32)
    if cfg_model.gradient_checkpointing:
        use_gradient_checkpointing(model)
    if cfg_model.lora_rank > 0:
        model = add_lora(model, cfg_model.lora_rank, cfg_model.lora_alpha, cfg_model, "CAUSAL_LM")
        if cfg_model.gradient_checkpointing:
            model.enable_input_require_grads()
    return model


def add_lora(model, rank: int, alpha: int, cfg_model, task_type: str):
    """PEFT LoRA adapters of rank `rank` on model.target_modules of the top model.lora_top_layers decoder
    layers (every layer when 0). task_type TOKEN_CLS (a critic) also trains the new value head whole."""
    from peft import LoraConfig, get_peft_model

    n_layers, top = model.config.get_text_config().num_hidden_layers, cfg_model.lora_top_layers
    lora = LoraConfig(r=rank, lora_alpha=alpha, lora_dropout=cfg_model.lora_dropout, task_type=task_type,
                      target_modules=list(cfg_model.target_modules),
                      layers_to_transform=list(range(n_layers - top, n_layers)) if 0 < top < n_layers else None)
    return get_peft_model(model, lora)


def use_gradient_checkpointing(model) -> None:
    """Keep only each decoder layer's input in the forward pass and recompute the rest in the backward.
    transformers does so only while model.training: ppo.py switches models to train mode for updates."""
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})


def check_model_path(path: str, key: str, need: str = "model") -> None:
    """Before anything loads: a local folder that is missing or holds no model (need="model": config.json or
    adapter_config.json, and weights) or no tokenizer (need="tokenizer") fails in a sentence. A name that
    reads as a hub id (org/name, where no folder `org` exists here) is left to the hub."""
    hub_id = re.fullmatch(r"[\w-][\w.-]*(/[\w.-]+)?", path) and not os.path.isdir(path.split("/")[0])
    if not os.path.isdir(path):
        if hub_id and not os.path.exists(path):
            return
        raise ConfigError(f"{key}: {path} is not a folder; give a local model folder or a hub id (org/name)")
    files = os.listdir(path)
    if need == "tokenizer":
        if not {"tokenizer.json", "tokenizer_config.json", "tokenizer.model"} & set(files):
            raise ConfigError(f"{key}: {path} holds no tokenizer (tokenizer.json or tokenizer_config.json)")
    elif not ({"config.json", "adapter_config.json"} & set(files) and any(f.endswith((".safetensors", ".bin"))
                                                                          for f in files)):
        raise ConfigError(f"{key}: {path} holds no model (config.json and *.safetensors weights); give the folder "
                          f"a model was saved to")


def load_reference(path: str):
    """The frozen reference policy (eval mode, no gradients)."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval().requires_grad_(False)


def lr_lambda(total_steps: int, warmup_ratio: float, scheduler: str, min_lr_ratio: float):
    """Multiplier of the peak lr at step s: linear warmup, then cosine down to min_lr_ratio (or constant)."""
    warmup = int(warmup_ratio * total_steps)

    def f(step: int) -> float:
        if step < warmup:
            return (step + 1) / (warmup + 1)
        if scheduler == "constant":
            return 1.0
        progress = (step - warmup) / max(1, total_steps - warmup)
        return min_lr_ratio + (1 - min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))

    return f


def make_optimizer(model, optim_cfg, total_steps: int):
    params = [p for p in model.parameters() if p.requires_grad]
    # fused: one kernel for all parameters (on CPU 5× faster than torch's default per-tensor loop there)
    optimizer = torch.optim.AdamW(params, lr=optim_cfg.lr, betas=tuple(optim_cfg.betas),
                                  weight_decay=optim_cfg.weight_decay, fused=True)
    f = lr_lambda(total_steps, optim_cfg.warmup_ratio, optim_cfg.lr_scheduler, optim_cfg.min_lr_ratio)
    return optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, f)


def restore_schedule(scheduler, steps_done: int) -> None:
    """Move a fresh LambdaLR to `steps_done` scheduler steps. Its peak lr stays this run's optim.lr, so a
    resumed run with a new lr uses it; the lr is set on the optimiser too (a scheduler only sets it on step)."""
    scheduler.last_epoch, scheduler._step_count = steps_done, steps_done + 1
    for group, base, f in zip(scheduler.optimizer.param_groups, scheduler.base_lrs, scheduler.lr_lambdas):
        group["lr"] = base * f(steps_done)
    scheduler._last_lr = [group["lr"] for group in scheduler.optimizer.param_groups]


# ---------------------------------------------------------------------------------------
# Logging


OPTIONAL_LOGGERS = ("wandb", "tensorboard")  # each is also the name of the package it needs
WANDB_ID_FILE = "wandb_id.txt"  # in output_dir: the wandb run a resumed run continues


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
        with open(self.path, "a") as f:
            f.write(json.dumps({"step": step, **metrics}) + "\n")
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


def console_line(metrics: dict, keys: list) -> str:
    return "  ".join(f"{k} {metrics[k]:.4g}" for k in keys if k in metrics)


def sample_table(rows: list[tuple]) -> str:
    """A plain-text table of (prompt, response, score) rows, newlines shown as ⏎."""
    def clip(s, n):
        s = s.replace("\n", "⏎")
        return s if len(s) <= n else "…" + s[-(n - 1):]
    lines = [f"{'prompt':<40} | {'response':<40} | score"]
    lines += [f"{clip(p, 40):<40} | {clip(r, 40):<40} | {s:.3g}" for p, r, s in rows]
    return "\n".join(lines)


def sum_over_processes(accelerator, x: torch.Tensor) -> torch.Tensor:
    """x summed over processes, on x's own device."""
    return accelerator.reduce(x.to(accelerator.device), "sum").to(x.device)


def reduce_metrics(accelerator, metrics: dict) -> dict:
    """Each metric (a number, or a list: one value per micro-batch) → its mean over the list and then over
    processes, or its maximum for *_max keys. Every process must hold the same keys."""
    is_max = [key.endswith("_max") for key in metrics]
    local = [(max(v) if m else sum(v) / len(v)) if isinstance(v, list) else v for v, m in zip(metrics.values(), is_max)]
    values = torch.tensor(local, device=accelerator.device, dtype=torch.float64)
    means, maxima = accelerator.reduce(values, "mean").tolist(), accelerator.reduce(values, "max").tolist()
    return {key: hi if m else mean for key, m, mean, hi in zip(metrics, is_max, means, maxima)}


def save_pretrained_atomic(model, tokenizer, path: str, state_dict=None) -> None:
    """The model in HF format (a LoRA model writes adapter_model.safetensors + adapter_config.json).

    `state_dict`: the full weights when the model is sharded (accelerator.get_state_dict)."""
    for adapter in getattr(model, "peft_config", {}).values():  # a local base as an absolute path: the adapter
        if os.path.isdir(adapter.base_model_name_or_path or ""):  # then loads from any directory (issue 13)
            adapter.base_model_name_or_path = os.path.abspath(adapter.base_model_name_or_path)
    tmp = path + ".tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp, state_dict=state_dict)
    tokenizer.save_pretrained(tmp)
    shutil.rmtree(path, ignore_errors=True)
    os.replace(tmp, path)


# ---------------------------------------------------------------------------------------
# Curves


CURVE_KEYS = ["score/mean", "reward/mean", "kl/mean", "policy/entropy", "loss/value", "val/score/mean"]


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


@contextmanager
def timed(times: dict, name: str):
    """with timed(times, "gen"): ...  adds the seconds spent inside to times[name]."""
    t0 = time.perf_counter()
    yield
    times[name] = times.get(name, 0.0) + time.perf_counter() - t0


if __name__ == "__main__":  # python utils.py plot outputs/ppo/metrics.jsonl [other/metrics.jsonl ...] -o out.png
    import argparse

    parser = argparse.ArgumentParser(description="Plot one run's metrics.jsonl, or several overlaid.")
    commands = parser.add_subparsers(dest="command", required=True)
    plot = commands.add_parser("plot", help="curves of one or more metrics.jsonl files into one PNG")
    plot.add_argument("metrics", nargs="+", help="metrics.jsonl files; several are overlaid, one colour each")
    plot.add_argument("-o", "--output", default="curves.png")
    plot.add_argument("--keys", nargs="+", default=CURVE_KEYS, help="metrics to plot (those logged get a panel)")
    plot.add_argument("--smoothing", type=float, default=0.8, help="EMA weight α of the line over the raw values")
    args = parser.parse_args()
    print(f"{args.output}: " + ", ".join(plot_curves(args.metrics, args.output, args.keys, args.smoothing)))
