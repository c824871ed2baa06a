"""A run's output folder, shared by ppo.py and reward_model.py: one run at a time (a lock), checkpoints written
atomically (step_<N>.tmp/ renamed to step_<N>/, the last `keep` kept), resuming (and what a resumed run does with
later checkpoints and metric lines), and SIGTERM / Ctrl-C ending a step with a checkpoint.
The checkpoint's contents (safetensors + JSON) are distributed.save_training_state's."""
import fcntl
import json
import os
import re
import shutil
import signal
import socket
import time

import torch
from accelerate.utils import broadcast_object_list

from infra import cli
from infra.config import ConfigError
from infra.distributed import load_training_state, save_training_state


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


class RunError(ConfigError):
    """The run cannot go on usefully (ppo.py and reward_model.py print it as one sentence and exit 1)."""


def skipped_steps_error(in_a_row: int, step: int, stage: str, output_dir: str) -> RunError:
    """Why a run that skipped `in_a_row` steps in a row (a non-finite loss or gradient, so train_step left the
    weights alone) stops without writing final/: an untrained model must not look like a trained one."""
    kept = [os.path.basename(path) for path in checkpoints(output_dir)]
    return RunError(f"stopping at step {step}: the last {in_a_row} steps each skipped an optimiser step because the "
                    f"loss or gradient was not finite (NaN or inf: a reward too large, or a learning rate too high), "
                    f"so the model is not learning ({stage}.max_skipped_steps={in_a_row}); final/ is not written"
                    + (f", the checkpoints {', '.join(kept)} in {output_dir} are kept" if kept else ""))


class Interrupted(KeyboardInterrupt):
    """A stop signal that could not wait for the end of the step: a second one, or a reward call still running
    reward.timeout_s after the first. The run ends at once (exit code 128 + signum), its last checkpoint kept."""

    def __init__(self, signum: int, why: str):
        super().__init__(f"stopped by {signal.Signals(signum).name} {why}; the last checkpoint is kept: run the same "
                         f"command again to resume")
        self.signum = signum


class StopSignal:
    """SIGTERM (what Slurm sends on preemption or at the time limit, and scancel) or Ctrl-C during training is
    noted, so that the loop finishes its step and saves a checkpoint; a second one stops at once."""

    def __init__(self, verbose: bool):
        self.signum, self.since, self.verbose = 0, None, verbose  # since: time.monotonic() of the first signal
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self.handle)

    def handle(self, signum, frame):
        if self.signum:
            raise Interrupted(signum, "a second time")
        self.signum, self.since = signum, time.monotonic()
        if self.verbose:  # os.write: print is not safe inside a signal handler
            os.write(2, f"\n{signal.Signals(signum).name}: finishing this step, then saving a checkpoint "
                        f"(send it again to stop now)\n".encode())

    def check_overdue(self, seconds: float) -> None:
        """Interrupted when the signal came more than `seconds` ago: called by a wait that the step cannot end
        by itself (a reward call, infra/worker.py), so a hung call cannot hold a preempted run past its timeout."""
        if self.since is not None and time.monotonic() - self.since > seconds:
            raise Interrupted(self.signum, f"while a reward call was still running {seconds:g} s later "
                                           f"(reward.timeout_s); this step is not saved")

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
