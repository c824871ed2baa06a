"""Plumbing shared by ppo.py and reward_model.py: models, schedule, logging, checkpoints, curves."""
import fcntl
import importlib.util
import json
import math
import os
import re
import shutil
import signal
import socket
import sys
import time
from contextlib import contextmanager

import torch

import config
from config import ConfigError
from distributed import load_training_state, save_training_state


def run_script(main, doc: str, root, name: str) -> None:
    """`accelerate launch <name> --config FILE key=value …` → main(config). A user's mistake (ConfigError,
    DataError) ends the run in one sentence, printed once, by rank 0; Ctrl-C while loading ends it quietly (130)."""
    from data import DataError

    rank0 = os.environ.get("RANK", "0") == "0"
    try:
        main(config.parse_args(sys.argv[1:], doc, root))
    except (ConfigError, DataError) as e:
        sys.exit(f"{name}: {e}" if rank0 else 1)
    except KeyboardInterrupt:  # Ctrl-C while loading, or a second signal while training
        if rank0:
            print(f"{name}: interrupted; the last checkpoint is kept", file=sys.stderr)
        sys.exit(130)


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


def load_tokenizer(path: str):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path)
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


# ---------------------------------------------------------------------------------------
# Checkpoints: step_<N>/ written as step_<N>.tmp/ and renamed, the last `keep` kept.


def checkpoints(output_dir: str) -> list[str]:
    """step_* folders in output_dir, oldest first."""
    if not os.path.isdir(output_dir):
        return []
    names = [n for n in os.listdir(output_dir) if re.fullmatch(r"step_\d+", n)]
    return [os.path.join(output_dir, n) for n in sorted(names, key=lambda n: int(n[5:]))]


def save_checkpoint(accelerator, output_dir: str, step: int, keep: int, models: dict, state: dict) -> str:
    """Models' trainable weights, optimisers, `state` (plain data) and RNG into step_<N>, atomically.
    models: {name: (model, optimizer or None)}; see distributed.save_training_state."""
    final = os.path.join(output_dir, f"step_{step}")
    tmp = final + ".tmp"
    if accelerator.is_main_process:
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp)
    accelerator.wait_for_everyone()
    save_training_state(tmp, models, state)
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
        for old in checkpoints(output_dir)[:-keep] if keep > 0 else []:
            shutil.rmtree(old, ignore_errors=True)
    accelerator.wait_for_everyone()
    return final


def lock_output_dir(accelerator, output_dir: str, key: str):
    """Rank 0 holds an exclusive lock on <output_dir>/.lock for the run's life, so two runs never write one
    folder; a second run fails at once, on every rank, naming the holder. The kernel releases the lock when
    its process dies, so a killed run leaves none behind. Returns the open lock file: keep it."""
    from accelerate.utils import broadcast_object_list

    lock, error = None, None
    if accelerator.is_main_process:
        try:
            os.makedirs(output_dir, exist_ok=True)
            lock = open(os.path.join(output_dir, ".lock"), "a+")
        except OSError as e:
            error = f"{key}: cannot write to {output_dir} ({e.strerror}); choose a folder you can write"
        else:
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
                lock.truncate(0)
                lock.write(f"pid {os.getpid()} on host {socket.gethostname()}\n")
                lock.flush()
            except BlockingIOError:
                lock.seek(0)
                holder = lock.read().strip() or "a process that is starting"
                error = (f"{key}: {output_dir} is in use by another run ({holder}); wait for it to end, "
                         f"or choose another output_dir")
    if accelerator.num_processes > 1:
        error = broadcast_object_list([error])[0]
    if error:
        raise ConfigError(error)
    return lock


def start_run(accelerator, cfg, stage: str):
    """Before any model loads (stage: "trainer" or "reward_model", the section with output_dir, resume and
    total_steps): lock the output folder, find the checkpoint to resume from, check this config against the one
    it was trained with and print what changed. Returns (lock, checkpoint or None, finished), finished when
    that checkpoint is at total_steps and final/ exists: there is nothing to train."""
    section = getattr(cfg, stage)
    lock = lock_output_dir(accelerator, section.output_dir, f"{stage}.output_dir")
    path = resolve_resume(section.resume, section.output_dir, f"{stage}.resume")
    if path is None:
        return lock, None, False
    saved = os.path.join(os.path.dirname(os.path.normpath(path)), "config.yaml")
    changes = config.resume_changes(cfg, saved) if os.path.exists(saved) else []
    if changes:
        accelerator.print(f"changed since {path}: " + ", ".join(changes))
    step = checkpoint_step(path)
    finished = step >= section.total_steps and os.path.isdir(os.path.join(section.output_dir, "final"))
    if finished:
        accelerator.print(f"nothing to train: {path} is at step {step} of {stage}.total_steps={section.total_steps} "
                          f"and final/ is written; raise {stage}.total_steps to train on")
    return lock, path, finished


def set_aside_later(output_dir: str, step: int, metrics_path: str) -> None:
    """Resuming at step N (0: a fresh start): metric lines past N are dropped (those steps are redone). With
    checkpoints past N this run is a new branch: they, final/ and those lines move to
    <output_dir>/abandoned/from_step_N_<time>/, so that resume=auto follows this branch and metrics.jsonl
    holds one history."""
    later = [path for path in checkpoints(output_dir) if checkpoint_step(path) > step]
    if not later:
        drop_metrics_after(metrics_path, step)
        return
    aside = os.path.join(output_dir, "abandoned", f"from_step_{step}_{time.strftime('%Y%m%d-%H%M%S')}")
    os.makedirs(aside)
    final = os.path.join(output_dir, "final")
    for path in later + ([final] if os.path.isdir(final) else []):
        os.replace(path, os.path.join(aside, os.path.basename(path)))
    drop_metrics_after(metrics_path, step, os.path.join(aside, "metrics.jsonl"))
    print(f"this run goes on from step {step}: the later checkpoints {[os.path.basename(p) for p in later]} and "
          f"their metrics moved to {aside}", flush=True)


class StopSignal:
    """SIGTERM (what Slurm sends on preemption or at the time limit, and scancel) or Ctrl-C during training is
    noted, so that the loop finishes its step and saves a checkpoint; a second one stops at once."""

    def __init__(self, verbose: bool):
        self.signum, self.verbose = 0, verbose
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self.handle)

    def handle(self, signum, frame):
        if self.signum:
            raise KeyboardInterrupt
        self.signum = signum
        if self.verbose:  # os.write: print is not safe inside a signal handler
            os.write(2, f"\n{signal.Signals(signum).name}: finishing this step, then saving a checkpoint "
                        f"(send it again to stop now)\n".encode())

    def received(self, accelerator) -> int:
        """The signal's number if any process got one (all must stop at the same step), else 0."""
        signum = torch.tensor(float(self.signum), device=accelerator.device)
        return int(accelerator.reduce(signum, "max").item())


def resolve_resume(resume: str, output_dir: str, key: str = "trainer.resume"):
    """trainer.resume → a checkpoint folder, or None to start fresh."""
    if resume == "off":
        return None
    if resume == "auto":
        found = checkpoints(output_dir)
        return found[-1] if found else None
    if not (os.path.isdir(resume) and re.fullmatch(r"step_\d+", os.path.basename(os.path.normpath(resume)))
            and os.listdir(resume)):
        raise ConfigError(f"{key}: {resume} is not a checkpoint (a step_<N> folder written by a run, under its own "
                          f"name); give one, or auto (the latest in output_dir), or off")
    return resume


def resume_or_start(accelerator, path, output_dir: str, logger, cfg, models: dict):
    """Load the checkpoint `path` (start_run's, or None) into `models` (forgetting metrics logged after it), or
    start a fresh log; either way write the resolved config.yaml. Returns the checkpoint's saved state, or None."""
    state = None
    if path:
        state = load_training_state(path, models)
        if accelerator.is_main_process:
            set_aside_later(output_dir, checkpoint_step(path), logger.path)
    elif accelerator.is_main_process:  # a fresh start: checkpoints already here belong to another history
        set_aside_later(output_dir, 0, logger.path)
        if os.path.exists(logger.path):
            os.remove(logger.path)  # a fresh run starts a fresh log
    if accelerator.is_main_process:
        os.makedirs(output_dir, exist_ok=True)
        config.save(cfg, os.path.join(output_dir, "config.yaml"))
    return state


def reduce_metrics(accelerator, metrics: dict) -> dict:
    """Each metric (a number, or a list: one value per micro-batch) → its mean over the list and then over
    processes, or its maximum for *_max keys. Every process must hold the same keys."""
    is_max = [key.endswith("_max") for key in metrics]
    local = [(max(v) if m else sum(v) / len(v)) if isinstance(v, list) else v for v, m in zip(metrics.values(), is_max)]
    values = torch.tensor(local, device=accelerator.device, dtype=torch.float64)
    means, maxima = accelerator.reduce(values, "mean").tolist(), accelerator.reduce(values, "max").tolist()
    return {key: hi if m else mean for key, m, mean, hi in zip(metrics, is_max, means, maxima)}


def checkpoint_step(path: str) -> int:
    return int(re.search(r"step_(\d+)", os.path.basename(os.path.normpath(path))).group(1))


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
