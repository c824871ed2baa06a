"""Plumbing shared by ppo.py and reward_model.py: models, schedule, logging, checkpoints, curves."""
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
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.config.use_cache = False
    if cfg_model.lora_rank > 0:
        from peft import LoraConfig, get_peft_model

        n_layers, top = model.config.num_hidden_layers, cfg_model.lora_top_layers
        lora = LoraConfig(r=cfg_model.lora_rank, lora_alpha=cfg_model.lora_alpha, lora_dropout=cfg_model.lora_dropout,
                          target_modules=list(cfg_model.target_modules), task_type="CAUSAL_LM",
                          layers_to_transform=list(range(n_layers - top, n_layers)) if 0 < top < n_layers else None)
        model = get_peft_model(model, lora)
        if cfg_model.gradient_checkpointing:
            model.enable_input_require_grads()
    return model


def load_reference(path: str, accelerator):
    """The frozen reference policy: sharded like the actor under FSDP, else one replica per device
    (not DDP-wrapped: it has no gradients to average)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval().requires_grad_(False)
    if accelerator.distributed_type.name == "FSDP":
        return accelerator.prepare_model(model)
    return model.to(accelerator.device)


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


# ---------------------------------------------------------------------------------------
# Logging


class MetricsLogger:
    """One JSON line per step in metrics.jsonl, plus wandb / tensorboard when asked. Rank 0 only."""

    def __init__(self, output_dir: str, loggers: list, config: dict, project: str, name: str, enabled: bool):
        self.enabled, self.path, self.wandb, self.tb = enabled, os.path.join(output_dir, "metrics.jsonl"), None, None
        if not enabled:
            return
        os.makedirs(output_dir, exist_ok=True)
        unknown = set(loggers) - {"console", "wandb", "tensorboard"}
        if unknown:
            raise ValueError(f"trainer.logger: unknown logger(s) {sorted(unknown)}; use console, wandb, tensorboard")
        if "wandb" in loggers:
            try:
                import wandb
            except ImportError:
                raise SystemExit("trainer.logger has `wandb` but the package is missing: pip install wandb") from None
            self.wandb = wandb.init(project=project, name=name, config=config)
        if "tensorboard" in loggers:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError:
                raise SystemExit("trainer.logger has `tensorboard` but the package is missing: "
                                 "pip install tensorboard") from None
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


def drop_metrics_after(path: str, step: int) -> None:
    """On resume, forget lines logged after the checkpoint, so metrics.jsonl reads as one run."""
    if os.path.exists(path):
        with open(path) as f:
            lines = [line for line in f if json.loads(line)["step"] <= step]
        with open(path + ".tmp", "w") as f:
            f.writelines(lines)
        os.replace(path + ".tmp", path)


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


def save_checkpoint(accelerator, output_dir: str, step: int, keep: int) -> str:
    """accelerator.save_state (models, optimisers, registered objects, RNG) into step_<N>, atomically."""
    final = os.path.join(output_dir, f"step_{step}")
    tmp = final + ".tmp"
    if accelerator.is_main_process:
        shutil.rmtree(tmp, ignore_errors=True)
    accelerator.wait_for_everyone()
    accelerator.save_state(tmp)
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
        for old in checkpoints(output_dir)[:-keep] if keep > 0 else []:
            shutil.rmtree(old, ignore_errors=True)
    accelerator.wait_for_everyone()
    return final


def resolve_resume(resume: str, output_dir: str):
    """trainer.resume → a checkpoint folder, or None to start fresh."""
    if resume == "off":
        return None
    if resume == "auto":
        found = checkpoints(output_dir)
        return found[-1] if found else None
    if not os.path.isdir(resume):
        raise FileNotFoundError(f"trainer.resume: checkpoint folder {resume} does not exist")
    return resume


def resume_or_start(accelerator, resume: str, output_dir: str, logger, cfg):
    """Load the checkpoint trainer.resume names (forgetting metrics logged after it), or start a fresh
    log; either way write the resolved config.yaml. Returns the checkpoint folder, or None."""
    import config

    path = resolve_resume(resume, output_dir)
    if path:
        accelerator.load_state(path)
        if accelerator.is_main_process:
            drop_metrics_after(logger.path, checkpoint_step(path))
    elif accelerator.is_main_process and os.path.exists(logger.path):
        os.remove(logger.path)  # a fresh run starts a fresh log
    if accelerator.is_main_process:
        os.makedirs(output_dir, exist_ok=True)
        config.save(cfg, os.path.join(output_dir, "config.yaml"))
    return path


def reduce_metrics(accelerator, metrics: dict) -> dict:
    """Means over processes (maxima for *_max keys); every process holds the same keys."""
    values = torch.tensor(list(metrics.values()), device=accelerator.device, dtype=torch.float64)
    means, maxima = accelerator.reduce(values, "mean").tolist(), accelerator.reduce(values, "max").tolist()
    return {k: (hi if k.endswith("_max") else m) for k, m, hi in zip(metrics, means, maxima)}


def checkpoint_step(path: str) -> int:
    return int(re.search(r"step_(\d+)", os.path.basename(os.path.normpath(path))).group(1))


def save_pretrained_atomic(model, tokenizer, path: str, state_dict=None) -> None:
    """The model in HF format (a LoRA model writes adapter_model.safetensors + adapter_config.json).

    `state_dict`: the full weights when the model is sharded (accelerator.get_state_dict)."""
    tmp = path + ".tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp, state_dict=state_dict)
    tokenizer.save_pretrained(tmp)
    shutil.rmtree(path, ignore_errors=True)
    os.replace(tmp, path)


# ---------------------------------------------------------------------------------------
# Curves


def plot_curves(metrics_path: str, out_png: str, keys: list) -> None:
    """A grid of metric-vs-step plots from metrics.jsonl (matplotlib, no display)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    with open(metrics_path) as f:
        rows = [json.loads(line) for line in f]
    fig, axes = plt.subplots(1, len(keys), figsize=(4 * len(keys), 3.2))
    for ax, key in zip(axes, keys):
        points = [(r["step"], r[key]) for r in rows if key in r and r[key] is not None]
        if points:
            ax.plot(*zip(*points), marker="." if len(points) < 50 else None)
        ax.set_title(key)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(out_png, dpi=100)
    plt.close(fig)


@contextmanager
def timed(times: dict, name: str):
    """with timed(times, "gen"): ...  adds the seconds spent inside to times[name]."""
    t0 = time.perf_counter()
    yield
    times[name] = times.get(name, 0.0) + time.perf_counter() - t0
