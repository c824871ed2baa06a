"""A run's output folder, shared by ppo.py and reward_model.py: one run at a time (a lock), checkpoints written
atomically (step_<N>.tmp/ renamed to step_<N>/, the last `keep` kept), resuming (and what a resumed run does with
later checkpoints and metric lines), and SIGTERM / Ctrl-C ending a step with a checkpoint. best/ (ppo.py's
trainer.best_metric) is a checkpoint folder too, never pruned; what is kept in it and the rollback to it are
infra/train_state.py's.
The checkpoint's contents (safetensors + JSON) are distributed.save_training_state's; beside them each checkpoint
has the run's config.yaml (the settings it was trained with, kept when a new branch sets it aside into abandoned/) and
a manifest.json (infra/manifests.py): the size and sha256 of every file it wrote and a fingerprint of the base
models it was trained from. Resuming checks both before any model loads (intact_resume, record_bases): a damaged
file is named, resume=auto falls back to the newest intact checkpoint, and a changed base model fails."""
import fcntl
import json
import math
import os
import re
import shutil
import signal
import socket
import time
from typing import Optional

import torch
from accelerate.utils import broadcast_object_list, gather_object
from safetensors import SafetensorError
from torch.distributed.checkpoint.api import CheckpointException

from infra import cli
from infra.config import ConfigError, SaveError
from infra.distributed import load_training_state, save_training_state, write_error
from infra.manifests import BASES_FILE, BEST, changed_base, checkpoint_problem, fingerprint, write_manifest
from infra.metrics import drop_metrics_after

WRITE_ERRORS = (OSError, SafetensorError, CheckpointException)  # a full disk or a folder made read-only


def best_step(output_dir: str) -> Optional[float]:
    """The step best/ was saved at, or None when there is none; infinity when its state.json cannot be read, so that
    set_aside_later moves a damaged best/ aside (unlost, never trusted) whatever step a run goes on from."""
    path = os.path.join(output_dir, BEST, "state.json")
    if not os.path.exists(path):
        return None
    try:
        with open(path) as f:
            return int(json.load(f)["step"])
    except (OSError, ValueError, KeyError, TypeError):
        return math.inf


def checkpoints(output_dir: str) -> list[str]:
    """step_* folders in output_dir, oldest first."""
    if not os.path.isdir(output_dir):
        return []
    names = [n for n in os.listdir(output_dir) if re.fullmatch(r"step_\d+", n)]
    return [os.path.join(output_dir, n) for n in sorted(names, key=lambda n: int(n[5:]))]


def save_checkpoint(accelerator, output_dir: str, step: int, keep: int, models: dict, state: dict,
                    folder: Optional[str] = None) -> str:
    """Models' trainable weights, optimisers, `state` (plain data) and RNG into step_<N> (or `folder`, e.g. best/,
    which keep_checkpoints never prunes), atomically, with its manifest (write_manifest); the last `keep` step_*
    are kept. models: {name: (model, optimizer or None)}; see distributed.save_training_state.
    A write that fails on any process (disk full, a folder made read-only) is a SaveError on every process,
    naming the folder and the checkpoints kept; the half-written folder is removed."""
    final = os.path.join(output_dir, folder or f"step_{step}")
    tmp = final + ".tmp"

    def publish():  # rank 0, once every process has written its files
        if os.path.exists(os.path.join(output_dir, "config.yaml")):  # how it was trained, beside its weights
            shutil.copyfile(os.path.join(output_dir, "config.yaml"), os.path.join(tmp, "config.yaml"))
        write_manifest(tmp, run_bases(output_dir))
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
        for old in checkpoints(output_dir)[:-keep] if keep > 0 and folder is None else []:
            shutil.rmtree(old, ignore_errors=True)

    error = first_error(accelerator, failed_write(lambda: fresh_folder(tmp), accelerator.is_main_process))
    if not error:
        error = first_error(accelerator, failed_write(lambda: save_training_state(tmp, models, state)))
    if not error:
        error = first_error(accelerator, failed_write(publish, accelerator.is_main_process))
    if error:
        if accelerator.is_main_process:
            shutil.rmtree(tmp, ignore_errors=True)
        raise save_failed(final, error, [os.path.basename(path) for path in checkpoints(output_dir)])
    return final


def save_failed(folder: str, error: str, kept: list) -> SaveError:
    """The sentence for a checkpoint that could not be written: why, and what is still there to resume from."""
    if not kept:
        return SaveError(f"cannot write the checkpoint {folder} ({error}); it is not kept, and there is no earlier "
                         f"one: free space or fix the permissions, then run the same command again")
    return SaveError(f"cannot write the checkpoint {folder} ({error}); it is not kept, {these(kept)} intact: free "
                     f"space or fix the permissions, then run the same command again to resume from {kept[-1]}")


def fresh_folder(path: str) -> None:
    shutil.rmtree(path, ignore_errors=True)
    os.makedirs(path)


def failed_write(write, here: bool = True) -> Optional[str]:
    """write() (when `here`: on this process) → None, or why it failed when that is a write error (write_error's
    few words)."""
    if not here:
        return None
    try:
        write()
    except WRITE_ERRORS as e:
        return write_error(e)
    return None


def first_error(accelerator, error: Optional[str]) -> Optional[str]:
    """The first process's error (or None), the same on every process: a collective, so also a barrier."""
    if accelerator.num_processes > 1:
        error = next((e for e in gather_object([error]) if e), None)
    return error


def intact_resume(accelerator, resume: str, output_dir: str, key: str):
    """resolve_resume's checkpoint, checked (checkpoint_problem) on rank 0 before any model loads: a damaged one
    given by path fails in one sentence; with resume=auto the newest intact one is taken, saying which were
    skipped (they are moved aside with the later history, set_aside_later), and none intact fails."""
    def choose():
        if resume != "auto":
            path = resolve_resume(resume, output_dir, key)
            problem = path and checkpoint_problem(path)
            if problem:
                raise ConfigError(f"{key}: the checkpoint {path} is damaged: {problem}; give another checkpoint, or "
                                  f"auto (the newest intact one), or off")
            return path
        skipped = []
        for path in reversed(checkpoints(output_dir)):
            problem = checkpoint_problem(path)
            if problem is None:
                if skipped:
                    print(f"{key}=auto: skipped the damaged {'; '.join(skipped)}; resuming from {path}", flush=True)
                return path
            skipped.append(f"{os.path.basename(path)} ({problem})")
        if skipped:
            raise ConfigError(f"{key}=auto: no checkpoint in {output_dir} is intact: {'; '.join(skipped)}; set "
                              f"{key}=off to start over (they are then moved to {output_dir}/abandoned/)")
        return None
    return on_rank0(accelerator, choose)


def on_rank0(accelerator, fn):
    """fn() run by rank 0 only, its value (or its ConfigError) given to every process."""
    value = error = None
    if accelerator.is_main_process:
        try:
            value = fn()
        except ConfigError as e:
            error = str(e)
    if accelerator.num_processes > 1:
        value, error = broadcast_object_list([value, error])
    if error:
        raise ConfigError(error)
    return value


def run_bases(output_dir: str) -> dict:
    """This run's base models, as record_bases wrote them to <output_dir>/BASES_FILE ({} before it has)."""
    path = os.path.join(output_dir, BASES_FILE)
    if not os.path.exists(path):
        return {}
    with open(path) as f:
        return json.load(f)


BASE_KEYS = {"trainer": ("model.path", "critic.model_path"), "reward_model": ("reward_model.model_path",),
             "sft": ("sft.model_path",), "dpo": ("dpo.model_path",)}


def record_bases(accelerator, cfg, stage: str, unused: frozenset, checkpoint) -> None:
    """Fingerprint this run's base models (BASE_KEYS, but `unused` ones; critic.model_path null means model.path)
    into <output_dir>/BASES_FILE, which every checkpoint's manifest copies; when resuming `checkpoint`, a base
    whose fingerprint differs from the one it recorded fails in one sentence: the saved adapter or optimiser state
    belongs to other weights."""
    def record():
        values = cli.flatten(cli.to_dict(cfg))
        bases = {key: {"path": values[key], "fingerprint": fingerprint(values[key])} for key in BASE_KEYS[stage]
                 if key not in unused and values.get(key)}
        changed = checkpoint and changed_base(checkpoint, bases)
        if changed:
            raise ConfigError(f"{changed}; put that model back, or train from the new one in another output_dir (or "
                              f"with {stage}.resume=off)")
        path = os.path.join(getattr(cfg, stage).output_dir, BASES_FILE)
        with open(path + ".tmp", "w") as f:
            json.dump(bases, f, indent=1)
        os.replace(path + ".tmp", path)
    on_rank0(accelerator, record)


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
    it was trained with (cli.resume_changes; `unused`: keys this run does not read) and print what changed. Returns
    (lock, checkpoint or None, finished), finished when that checkpoint is at total_steps and final/ exists: there is
    nothing to train."""
    section = getattr(cfg, stage)
    lock = lock_output_dir(accelerator, section.output_dir, f"{stage}.output_dir")
    path = intact_resume(accelerator, section.resume, section.output_dir, f"{stage}.resume")
    if path is None:
        record_bases(accelerator, cfg, stage, unused, None)
        return lock, None, False
    saved = os.path.join(path, "config.yaml")  # the checkpoint's own; an older one's: the run's beside it
    saved = saved if os.path.exists(saved) else os.path.join(os.path.dirname(os.path.normpath(path)), "config.yaml")
    changes = cli.resume_changes(cfg, saved, unused) if os.path.exists(saved) else []
    if changes:
        accelerator.print(f"changed since {path}: " + ", ".join(changes))
    record_bases(accelerator, cfg, stage, unused, path)  # the same base models as the checkpoint's
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
    print(f"this run goes on from step {step}: the later checkpoints {[os.path.basename(p) for p in later + best]} "
          f"(each with the config.yaml it was trained with) and their metrics moved to {aside}", flush=True)


class RunError(ConfigError):
    """The run cannot go on usefully (ppo.py and reward_model.py print it as one sentence and exit 1)."""


def skipped_steps_error(in_a_row: int, step: int, stage: str, output_dir: str, every: bool = False) -> RunError:
    """Why a run that skipped `in_a_row` steps in a row (a non-finite loss or gradient: train_step left the weights
    alone), or `every` one of its steps, stops without final/: an untrained model must not look like a trained one."""
    kept = [os.path.basename(path) for path in checkpoints(output_dir)]
    what = (f"every one of this run's {in_a_row} steps skipped its optimiser step" if every else
            f"the last {in_a_row} steps each skipped an optimiser step")
    return RunError(f"stopping at step {step}: {what} because the loss or gradient was not finite (NaN or inf: a "
                    f"reward too large, or a learning rate too high), so the model "
                    + ("learnt nothing" if every else f"is not learning ({stage}.max_skipped_steps={in_a_row})")
                    + "; final/ is not written" + (f" and {these(kept)} kept ({output_dir})" if kept else ""))


def check_learning(in_a_row: int, steps: range, ending: bool, section, stage: str) -> None:
    """RunError (no final/) once section.max_skipped_steps steps in a row skipped their optimiser step, or when the
    run ends at this step (`ending`) with every one of its `steps` (this run's, this one last) skipped, however few:
    a run that learnt nothing never exits 0 (max_skipped_steps=0 turns off only the first)."""
    if section.max_skipped_steps and in_a_row >= section.max_skipped_steps:
        raise skipped_steps_error(in_a_row, steps[-1], stage, section.output_dir)
    if ending and in_a_row == len(steps):
        raise skipped_steps_error(in_a_row, steps[-1], stage, section.output_dir, every=True)


def these(checkpoints: list) -> str:
    """"the checkpoint step_2 is" or "the checkpoints step_2, step_4 are"."""
    if len(checkpoints) == 1:
        return f"the checkpoint {checkpoints[0]} is"
    return f"the checkpoints {', '.join(checkpoints)} are"


class Interrupted(KeyboardInterrupt):
    """A stop signal that could not wait for the end of the step: a second one, or a reward call still running
    reward.timeout_s after the first. The run ends at once (exit code 128 + signum), its last checkpoint kept."""

    def __init__(self, signum: int, why: str):
        super().__init__(f"stopped by {signal.Signals(signum).name} {why}")
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
            raise Interrupted(signum, "a second time, at once; the last checkpoint is kept: run the same command "
                                      "again to resume")
        self.signum, self.since = signum, time.monotonic()
        if self.verbose:  # os.write: print is not safe inside a signal handler
            os.write(2, f"\n{signal.Signals(signum).name}: finishing this step, then saving a checkpoint "
                        f"(send it again to stop now)\n".encode())

    def overdue(self, seconds: float) -> bool:
        """A stop signal came more than `seconds` ago."""
        return self.since is not None and time.monotonic() - self.since > seconds

    def check_overdue(self, seconds: float, what: str = "a reward call", key: str = "reward.timeout_s") -> None:
        """Interrupted when the signal came more than `seconds` ago: called by a wait that the step cannot end
        by itself (`what`: a reward call, infra/worker.py; a request to a reward server or judge, scorers/), so a hung
        call cannot hold a preempted run past its timeout (`key`)."""
        if self.since is not None and time.monotonic() - self.since > seconds:
            raise Interrupted(self.signum, f"while {what} was still running {seconds:g} s later ({key}); this step "
                                           f"is not saved, the last checkpoint is kept: run the same command again "
                                           f"to resume")

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
