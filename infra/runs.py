"""A run's output folder, shared by ppo.py and reward_model.py: one run at a time (a lock), checkpoints written
atomically (step_<N>.tmp/ renamed to step_<N>/, the last `keep` kept), resuming (and what a resumed run does with
later checkpoints and metric lines), and SIGTERM / Ctrl-C ending a step with a checkpoint. For ppo.py also: the
loop's state (TrainState), the final export, and best/ (trainer.best_metric) with its rollback.
The checkpoint's contents (safetensors + JSON) are distributed.save_training_state's."""
import fcntl
import json
import os
import re
import shutil
import signal
import socket
import time

from typing import Optional

import torch
from accelerate.utils import broadcast_object_list

from infra import cli
from infra.config import ConfigError
from infra.distributed import full_state_dict, load_training_state, rng_state, save_training_state, set_rng_state
from infra.metrics import MetricsLogger, plot_curves, wandb_resume_id
from infra.models import save_pretrained_atomic
from infra.optim import restore_schedule


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


def start_run(accelerator, cfg, stage: str, unused: frozenset = frozenset()):
    """Before any model loads (stage: "trainer" or "reward_model", the section with output_dir, resume and
    total_steps): lock the output folder, find the checkpoint to resume from, check this config against the one
    it was trained with (cli.resume_changes; `unused`: keys this run does not read) and print what changed. Returns (lock, checkpoint or None, finished), finished when
    that checkpoint is at total_steps and final/ exists: there is nothing to train."""
    section = getattr(cfg, stage)
    lock = lock_output_dir(accelerator, section.output_dir, f"{stage}.output_dir")
    path = resolve_resume(section.resume, section.output_dir, f"{stage}.resume")
    if path is None:
        return lock, None, False
    saved = os.path.join(os.path.dirname(os.path.normpath(path)), "config.yaml")
    changes = cli.resume_changes(cfg, saved, unused) if os.path.exists(saved) else []
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
    checkpoints past N (or a best/ past N, or any best/ on a fresh start) this run is a new branch: they, final/ and
    those lines move to <output_dir>/abandoned/from_step_N_<time>/, so that resume=auto follows this branch and
    metrics.jsonl holds one history."""
    later = [path for path in checkpoints(output_dir) if checkpoint_step(path) > step]
    saved_best = best_step(output_dir)
    best = [os.path.join(output_dir, BEST)] if saved_best is not None and (saved_best > step or step == 0) else []
    if not later and not best:
        drop_metrics_after(metrics_path, step)
        return
    aside = os.path.join(output_dir, "abandoned", f"from_step_{step}_{time.strftime('%Y%m%d-%H%M%S')}")
    os.makedirs(aside)
    final = os.path.join(output_dir, "final")
    for path in later + best + ([final] if os.path.isdir(final) else []):
        os.replace(path, os.path.join(aside, os.path.basename(path)))
    drop_metrics_after(metrics_path, step, os.path.join(aside, "metrics.jsonl"))
    print(f"this run goes on from step {step}: the later checkpoints {[os.path.basename(p) for p in later + best]} and "
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
        cli.save(cfg, os.path.join(output_dir, "config.yaml"))
    return state


def checkpoint_step(path: str) -> int:
    return int(re.search(r"step_(\d+)", os.path.basename(os.path.normpath(path))).group(1))


# ---------------------------------------------------------------------------------------
# ppo.py's state in a checkpoint, resuming it, the final export, and best/ with its rollback


class TrainState:
    """What a checkpoint of ppo.py needs beyond weights and optimiser states, as plain data: the step, the data
    position, β (kl_ctrl: kl.KLController), recent KL, how far each LR schedule has gone, the best validation and
    the rollbacks so far."""

    def __init__(self, kl_ctrl, schedulers: dict):
        self.step, self.epoch, self.position, self.skipped, self.kl_ctrl = 0, 0, 0, 0, kl_ctrl
        self.recent_kl = []  # kl/mean of the last trainer.max_kl_window steps, for the guard
        self.schedulers = {name: s for name, s in schedulers.items() if s is not None}
        self.best, self.rollbacks = None, 0  # best: {"step", "value"} of trainer.best_metric, saved in best/

    def state_dict(self):
        return {"step": self.step, "epoch": self.epoch, "position": self.position, "skipped": self.skipped,
                "kl_coef": self.kl_ctrl.value, "recent_kl": self.recent_kl, "best": self.best,
                "rollbacks": self.rollbacks, "lr_steps": {name: s.last_epoch for name, s in self.schedulers.items()}}

    def load_state_dict(self, s):
        self.step, self.epoch, self.position, self.skipped = s["step"], s["epoch"], s["position"], s["skipped"]
        self.kl_ctrl.value, self.recent_kl = s["kl_coef"], s["recent_kl"]
        self.best, self.rollbacks = s.get("best"), s.get("rollbacks", 0)  # absent in older checkpoints
        for name, scheduler in self.schedulers.items():
            restore_schedule(scheduler, s["lr_steps"][name])

    def next_prompts(self, num_rows: int, batch_size: int, seed: int, shuffle: bool) -> list[int]:
        """The next `batch_size` row indices of a seeded per-epoch permutation (the last partial batch is dropped)."""
        if self.position + batch_size > num_rows:
            self.epoch, self.position = self.epoch + 1, 0
        order = (torch.randperm(num_rows, generator=torch.Generator().manual_seed(seed + self.epoch))
                 if shuffle else torch.arange(num_rows))
        inds = order[self.position:self.position + batch_size].tolist()
        self.position += batch_size
        return inds


def resume(accelerator, cfg, checkpoint, checkpointed: dict, state: TrainState):
    """ppo.py's MetricsLogger; from a checkpoint (start_run's, or None), the models and optimisers of
    `checkpointed` ({name: (model, optimiser)}) and `state` restored."""
    t = cfg.trainer
    logger = MetricsLogger(t.output_dir, t.logger, cli.to_dict(cfg), t.project_name, t.experiment_name,
                           accelerator.is_main_process, resume_id=wandb_resume_id(checkpoint))
    saved_state = resume_or_start(accelerator, checkpoint, t.output_dir, logger, cfg, checkpointed)
    if checkpoint:
        state.load_state_dict(saved_state)
        accelerator.print(f"resumed from {checkpoint} at step {state.step}")
    return logger


def save_final(accelerator, policy, tokenizer, cfg) -> None:
    """The policy in HF format in output_dir/final (with LoRA: the adapter), and curves.png from metrics.jsonl."""
    t = cfg.trainer
    final, metrics_path = os.path.join(t.output_dir, "final"), os.path.join(t.output_dir, "metrics.jsonl")
    state_dict = full_state_dict(policy)  # every process takes part in gathering the shards
    if accelerator.is_main_process:
        save_pretrained_atomic(accelerator.unwrap_model(policy), tokenizer, final, state_dict)
        accelerator.print(f"policy saved to {final}" + (f"; merge the adapter with: python tools/merge_lora.py {final} "
                                                        f"{t.output_dir}/merged" if cfg.model.lora_rank else ""))
        if t.plot_curves and os.path.exists(metrics_path):
            plot_curves(metrics_path, os.path.join(t.output_dir, "curves.png"))  # the panels of metrics.CURVE_KEYS


BEST = "best"  # output_dir/best: the checkpoint of the best validation (trainer.best_metric)


def best_step(output_dir: str) -> Optional[int]:
    """The step best/ was saved at, or None when there is none."""
    path = os.path.join(output_dir, BEST, "state.json")
    if not os.path.exists(path):
        return None
    with open(path) as f:
        return json.load(f)["step"]


def save_best(accelerator, output_dir: str, models: dict, state: dict) -> str:
    """best/ as a step_<N> checkpoint is written (best.tmp/ renamed), outside keep_checkpoints' count: never deleted
    by it. models: {name: (model, optimizer)}; see distributed.save_training_state."""
    final = os.path.join(output_dir, BEST)
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
    accelerator.wait_for_everyone()
    return final


def restore_best(accelerator, output_dir: str, models: dict) -> dict:
    """A rollback: best/'s weights and optimiser states into `models`, and its plain-data state returned. The RNG
    is left as it is, so that the run goes on with new samples rather than the best step's again."""
    rng = rng_state()
    state = load_training_state(os.path.join(output_dir, BEST), models)
    set_rng_state(rng)
    accelerator.wait_for_everyone()
    return state


def keep_best(accelerator, cfg, val_metrics: dict, state: TrainState, checkpointed: dict) -> Optional[str]:
    """After a validation: best/ saved where trainer.best_metric beats its best so far; with trainer.rollback_tolerance,
    best/ restored where it falls further than that below it (ppo.py, departure 7), at most trainer.max_rollbacks
    times. Returns the rollback's sentence, or None. The first validation after step 1 is the first candidate: best/
    holds optimiser states, which do not exist before the first update."""
    t = cfg.trainer
    if t.best_metric not in val_metrics:
        raise ConfigError(f"trainer.best_metric={t.best_metric} is not a validation metric of this run; it logs "
                          f"{', '.join(sorted(val_metrics))}")
    value, best = val_metrics[t.best_metric], state.best
    if best is None or value > best["value"]:
        state.best = {"step": state.step, "value": value}
        save_best(accelerator, t.output_dir, checkpointed, state.state_dict())
        return None
    if (t.rollback_tolerance is None or value >= best["value"] - t.rollback_tolerance
            or state.rollbacks >= t.max_rollbacks or best_step(t.output_dir) != best["step"]):
        return None  # best_step differs where a resumed run set a later best/ aside (set_aside_later)
    saved = restore_best(accelerator, t.output_dir, checkpointed)
    state.kl_ctrl.value, state.recent_kl, state.rollbacks = saved["kl_coef"], saved["recent_kl"], state.rollbacks + 1
    return (f"rollback at step {state.step}: {t.best_metric} {value:.4g} fell more than trainer.rollback_tolerance "
            f"{t.rollback_tolerance} below its best, {best['value']:.4g} at step {best['step']}; best/'s weights, "
            f"optimiser states and β restored (rollback {state.rollbacks} of at most {t.max_rollbacks})")
