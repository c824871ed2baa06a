"""ppo.py's run state beyond weights: TrainState (the step, data position, β, schedules, best and rollbacks, as plain
data), resuming it, best/ (trainer.best_metric: the checkpoint of the best validation, never pruned) with its
rollback (trainer.rollback_tolerance), and the final export (final/, curves.png). The folder itself is runs.py's."""
import os
from typing import Optional

import torch

from infra import cli
from infra.checks import lower_is_better
from infra.distributed import full_state_dict, load_training_state, rng_state, set_rng_state
from infra.metrics import MetricsLogger, plot_curves, wandb_resume_id
from infra.models import save_pretrained_atomic
from infra.optim import restore_schedule
from infra.manifests import changed_base, checkpoint_problem
from infra.runs import BEST, best_step, on_rank0, resume_or_start, run_bases, RunError, save_checkpoint


def step_seed(seed: int, step: int, stream: int) -> int:
    """The seed of one random stream of one step: seed·100_003 + step·1_009 + stream, with two primes so that no
    two (seed, step) pairs give the same number. stream: the process index + round × processes for sampling (round:
    dynamic sampling's, 0 without), −1 for the mini-batch order (the same on every process)."""
    return seed * 100_003 + step * 1_009 + stream


class TrainState:
    """What a checkpoint of ppo.py needs beyond weights and optimiser states, as plain data: the step, the data
    position, β (kl_ctrl: kl.KLController), recent KL, how far each LR schedule has gone, the best validation, the
    rollbacks so far, and a reasoning-gym curriculum's levels."""

    def __init__(self, kl_ctrl, schedulers: dict, curriculum=None):
        self.step, self.epoch, self.position, self.skipped, self.kl_ctrl = 0, 0, 0, 0, kl_ctrl
        self.recent_kl = []  # kl/mean of the last trainer.max_kl_window steps, for the guard
        self.schedulers = {name: s for name, s in schedulers.items() if s is not None}
        self.best, self.rollbacks = None, 0  # best: {"step", "value"} of trainer.best_metric, saved in best/
        self.pretrained = None  # trainer.best_metric at the validation before training
        self.curriculum = curriculum  # data.curriculum's levels and windows, or None

    def state_dict(self):
        return {"step": self.step, "epoch": self.epoch, "position": self.position, "skipped": self.skipped,
                "kl_coef": self.kl_ctrl.value, "recent_kl": self.recent_kl, "best": self.best,
                "rollbacks": self.rollbacks, "pretrained": self.pretrained,
                "lr_steps": {name: s.last_epoch for name, s in self.schedulers.items()},
                **({"curriculum": self.curriculum.state_dict()} if self.curriculum else {})}

    def load_state_dict(self, s):
        self.step, self.epoch, self.position, self.skipped = s["step"], s["epoch"], s["position"], s["skipped"]
        self.kl_ctrl.value, self.recent_kl = s["kl_coef"], s["recent_kl"]
        self.best, self.rollbacks = s.get("best"), s.get("rollbacks", 0)  # absent in older checkpoints
        self.pretrained = s.get("pretrained")
        for name, scheduler in self.schedulers.items():
            restore_schedule(scheduler, s["lr_steps"][name])
        if self.curriculum and "curriculum" in s:
            self.curriculum.load_state_dict(s["curriculum"])

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
        save_pretrained_atomic(accelerator.unwrap_model(policy), tokenizer, final, state_dict, overwrite=True,
                               inputs=(cfg.model.path,))  # this run's own final/, never the model it started from
        accelerator.print(f"policy saved to {final}" + (f"; merge the adapter with: python tools/merge_lora.py {final} "
                                                        f"{t.output_dir}/merged" if cfg.model.lora_rank else ""))
        if t.plot_curves and os.path.exists(metrics_path):
            plot_curves(metrics_path, os.path.join(t.output_dir, "curves.png"))  # the panels of metrics.CURVE_KEYS


def restore_best(accelerator, output_dir: str, models: dict) -> dict:
    """A rollback: best/'s weights and optimiser states into `models`, and its plain-data state returned. The RNG
    is left as it is, so that the run goes on with new samples rather than the best step's again."""
    rng = rng_state()
    state = load_training_state(os.path.join(output_dir, BEST), models)
    set_rng_state(rng)
    accelerator.wait_for_everyone()
    return state


def best_problem(output_dir: str, best: dict) -> Optional[str]:
    """Why best/ cannot be rolled back to, checked as resume checks a checkpoint (runs.intact_resume,
    runs.record_bases), or None: it is missing (a resumed run moved a later best/ aside), a file differs from its
    manifest, it holds another step than `best` ({"step", "value"}) says, or it was trained from other base weights."""
    folder = os.path.join(output_dir, BEST)
    if not os.path.isdir(folder):
        return f"{folder} is missing"
    problem = checkpoint_problem(folder) or changed_base(folder, run_bases(output_dir))
    if problem is None and best_step(output_dir) != best["step"]:
        problem = f"{folder} holds step {best_step(output_dir)}, not step {best['step']}"
    return problem


def best_metric_missing(best_metric: str, val_metrics: dict) -> Optional[str]:
    """None where trainer.best_metric is among a validation's metrics, else the sentence saying so. Only an
    environment's val/env/<key> can be missing (validation.check_best_metric held every other name at start-up):
    its steps' infos name it, and a validation where no sample's environment gave it keeps no best/."""
    if best_metric in val_metrics:
        return None
    given = sorted(name for name in val_metrics if name.startswith("val/env/"))
    return (f"trainer.best_metric={best_metric} is not among this validation's metrics: no sample's environment gave "
            f"it in its infos (they gave {', '.join(given) or 'no numbers'})")


def keep_best(accelerator, cfg, val_metrics: dict, state: TrainState, checkpointed: dict) -> Optional[str]:
    """After a validation: best/ saved where trainer.best_metric beats its best so far (checks.lower_is_better says
    which way); with trainer.rollback_tolerance, best/ restored where it is worse than trainer.rollback_baseline (its
    best, or its value before training) by more than that (ppo.py, departure 7), at most trainer.max_rollbacks
    times. Returns the rollback's sentence (or why there is none, or why no best/ was kept: best_metric_missing), or
    None. The validation before training (step 0) gives the pre-trained value and keeps no best/ (best/ holds
    optimiser states, which do not exist before the first update); where a rollback is due against it and no best/
    exists yet, the run stops (RunError: no final/) rather than train on from a model worse than where it started.
    best/ is checked first (best_problem): a damaged or missing one is said once and never read; the run goes on
    from its own weights, and no rollback is tried again until a better validation writes a new best/."""
    t = cfg.trainer
    if missing := best_metric_missing(t.best_metric, val_metrics):
        return f"no best/ at step {state.step}: {missing}"
    value, best, sign = val_metrics[t.best_metric], state.best, -1 if lower_is_better(t) else 1  # sign·value: higher
    if state.step == 0:
        state.pretrained = value
        return None
    pretrained = t.rollback_baseline == "pretrained"
    baseline = state.pretrained if pretrained else best and best["value"]
    tolerance = t.rollback_tolerance
    worse = tolerance is not None and baseline is not None and sign * (baseline - value) > tolerance
    fell = worse and (f"{t.best_metric} {value:.4g} {'fell' if sign > 0 else 'rose'} more than trainer.rollback_"
                      f"tolerance {tolerance:g} {'below' if sign > 0 else 'above'} " + (
                          f"its value before training, {baseline:.4g}" if pretrained else
                          f"its best, {baseline:.4g} at step {best['step']}"))
    if worse and best is None:
        raise RunError(f"stopping at step {state.step}: {fell}, and no best/ exists yet to roll back to "
                       f"(trainer.rollback_baseline=pretrained); no final/ written")
    if best is None or sign * (value - best["value"]) > 0:
        state.best = {"step": state.step, "value": value}
        save_checkpoint(accelerator, t.output_dir, state.step, 0, checkpointed, state.state_dict(), folder=BEST)
        return None
    if not worse or state.rollbacks >= t.max_rollbacks or best.get("problem"):
        return None
    problem = on_rank0(accelerator, lambda: best_problem(t.output_dir, best))
    if problem:
        best["problem"] = problem  # in state.json too: a resumed run does not try again
        return (f"no rollback at step {state.step}: {fell}, but best/ cannot be restored ({problem}); training goes "
                f"on from the current weights, and best/ is written anew when {t.best_metric} beats "
                f"{best['value']:.4g}")
    saved = restore_best(accelerator, t.output_dir, checkpointed)
    state.kl_ctrl.value, state.recent_kl, state.rollbacks = saved["kl_coef"], saved["recent_kl"], state.rollbacks + 1
    return (f"rollback at step {state.step}: {fell}; best/'s weights, optimiser states and β restored (rollback "
            f"{state.rollbacks} of at most {t.max_rollbacks})")
