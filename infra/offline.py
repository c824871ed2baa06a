"""What the stages that train on a fixed dataset (reward_model.py, sft.py, dpo.py) share around their loss: the checks
before a model loads, the policy loaded and placed (sft.py, dpo.py), the step's rows, the batch in ppo.py's layout,
the metrics log and resume, the count of skipped steps, the checkpoint (and the stop on a signal), and final/ as a
plain HF folder, the LoRA adapter merged.

    accelerator, lock, resume_from, finished = begin(cfg, "dpo")     # before any model loads
    tokenizer = check_folders(section, "dpo")
    local, micro = check_batch(section, "dpo", num_processes, len(rows), "pairs", print0)
    policy, ref, fwd, sharded = load_policy_to_train(accelerator, section, "policy", reference=frozen_copy)
    logger, start, skipped = open_log(accelerator, cfg, "dpo", resume_from, models, scheduler)
    …
    checkpoint_or_stop(accelerator, section, step + 1, last, models, state, stop_signal, logger)

The loop itself, its numbered steps and its loss, stays in each stage file.
"""
import json
import os
import signal
import sys
from dataclasses import dataclass

import torch
from accelerate.utils import set_seed

from infra import cli
from infra.batches import autocast_dtype, Forward
from infra.checks import check_model_path, exact_div
from infra.config import ConfigError
from infra.distributed import describe, distribute, fsdp_from_launcher, full_state_dict, make_accelerator
from infra.layouts import batch_layout, use_varlen_attention
from infra.metrics import check_loggers, MetricsLogger, plot_curves, wandb_resume_id
from infra.models import load_policy, load_tokenizer, save_pretrained_atomic
from infra.optim import restore_schedule
from infra.rollout_common import left_pad, right_pad
from infra.runs import resume_or_start, save_checkpoint, skipped_steps_error, start_run


def begin(cfg, stage: str):
    """A run's start, before anything loads: the accelerator (the device, and the launched processes' group), the
    seed, and runs.start_run's lock on output_dir (hold it until the process ends), the checkpoint to resume from
    (or None) and whether that run is already finished."""
    accelerator = make_accelerator()
    set_seed(getattr(cfg, stage).seed)
    return (accelerator, *start_run(accelerator, cfg, stage))


def check_folders(section, stage: str):
    """Before any model loads: an FSDP launcher's settings (fsdp_from_launcher), the loggers' packages, the model
    and tokenizer folders; returns the tokenizer."""
    fsdp_from_launcher()
    check_loggers(section.logger, f"{stage}.logger")
    tokenizer_key = f"{stage}.tokenizer_path" if section.tokenizer_path else f"{stage}.model_path"
    check_model_path(section.model_path, f"{stage}.model_path", trust_remote_code=section.trust_remote_code)
    check_causal_lm(section.model_path, f"{stage}.model_path")
    check_model_path(section.tokenizer_path or section.model_path, tokenizer_key, need="tokenizer",
                     trust_remote_code=section.trust_remote_code)
    return load_tokenizer(section.tokenizer_path or section.model_path, tokenizer_key,
                          trust_remote_code=section.trust_remote_code)


def check_causal_lm(path: str, key: str) -> None:
    """A local model folder whose config.json names architectures, none of them a causal LM (…ForCausalLM), is
    refused in a sentence: a reward model's final/ (…ForSequenceClassification) is not a policy to train."""
    config_file = os.path.join(path, "config.json")
    if not os.path.isfile(config_file):
        return  # a hub id: the hub's config is read when it loads
    with open(config_file) as f:
        architectures = json.load(f).get("architectures") or []
    if architectures and not any(a.endswith(("ForCausalLM", "LMHeadModel")) for a in architectures):
        raise ConfigError(f"{key}: {path} holds a {', '.join(architectures)}, not a causal language model "
                          f"(…ForCausalLM); give a policy's folder, e.g. another stage's final/ from sft.py or dpo.py")


def check_batch(section, stage: str, num_processes: int, rows: int, unit: str, print0) -> tuple[int, int]:
    """The batch sizes for `num_processes` processes over `rows` training rows: (rows per step on one process,
    rows per forward/backward); a size that does not divide, or a batch larger than the data, fails in a sentence."""
    local = exact_div(section.batch_size, num_processes, f"{stage}.batch_size ({unit}) across processes")
    micro = min(section.micro_batch_size_per_device, local)
    exact_div(local, micro, f"{unit} per step on one process by {stage}.micro_batch_size_per_device")
    if section.batch_size > rows:
        raise ConfigError(f"{stage}.batch_size={section.batch_size} is more than the {rows} training {unit}; lower it")
    print0(f"{section.total_steps} steps of {section.batch_size} {unit} = "
           f"{section.total_steps * section.batch_size / rows:.2f} epochs; {local // micro} micro-batches of {micro} "
           f"{unit} per process")
    return local, micro


def batch_indices(step: int, n: int, batch_size: int, seed: int) -> list[int]:
    """The rows of optimiser step `step` (0-based): epoch e = step // (n // B) takes slice k of a permutation
    seeded by (seed, e). A function of the step alone, so resuming at a step replays the same data."""
    epoch, k = divmod(step, n // batch_size)
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(seed * 100_003 + epoch))
    return perm[k * batch_size:(k + 1) * batch_size].tolist()


def load_policy_to_train(accelerator, section, name: str, reference=None):
    """sft.py's and dpo.py's models on this process: the policy from section.model_path (models.load_policy: LoRA or
    full weights), then the frozen model that `reference()` loads (dpo.py's; None: none), each sharded under an FSDP2
    launcher, else the policy replicated (DDP), said in one line (the policy named `name`); and the forward that
    reads them, log π at temperature 1 in the section's layout. The reference loads only once the policy is placed,
    so that a process never holds two whole copies. Returns (policy, reference or None, fwd, sharded)."""
    fsdp = fsdp_from_launcher(autocast_dtype(section.dtype))  # the accelerate config's FSDP2 settings, or None
    policy = distribute(load_policy(section, section.model_path), accelerator, fsdp, trainable=True)
    ref = distribute(reference(), accelerator, fsdp, trainable=False) if reference else None
    accelerator.print(describe(fsdp, accelerator, [name] + (["reference"] if ref is not None else [])))
    sharded = fsdp is not None
    fwd = Forward(1.0, autocast_dtype(section.dtype), batch_layout(section, sharded))  # log π at temperature 1
    if fwd.layout == "packed":  # attention within each prompt / prompt+response group of the packed row
        for model in [accelerator.unwrap_model(policy)] + ([ref] if ref is not None else []):
            use_varlen_attention(model)
    return policy, ref, fwd, sharded


def completion_batch(prompts: list[list[int]], responses: list[list[int]], pad_id: int, device) -> dict:
    """(prompt, response) token lists → ppo.py's batch: queries and query_mask (B, Tq) left-padded, responses and
    response_mask (B, Tr) right-padded, so infra/batches.py's forwards (padded, shared prefix or packed) read it."""
    queries, query_mask = left_pad(prompts, pad_id)
    responses, response_mask = right_pad(responses, pad_id)
    return {k: v.to(device) for k, v in dict(queries=queries, query_mask=query_mask, responses=responses,
                                                 response_mask=response_mask).items()}


def open_log(accelerator, cfg, stage: str, resume_from, models: dict, scheduler):
    """The metrics log (metrics.jsonl, wandb, tensorboard) and, when resuming, the checkpoint's weights, optimiser,
    schedule and RNG restored: (logger, steps done, steps skipped so far)."""
    section = getattr(cfg, stage)
    logger = MetricsLogger(section.output_dir, section.logger, cli.to_dict(cfg), section.project_name,
                           section.experiment_name, accelerator.is_main_process, resume_id=wandb_resume_id(resume_from))
    saved_state = resume_or_start(accelerator, resume_from, section.output_dir, logger, cfg, models)
    if not resume_from:
        return logger, 0, 0
    restore_schedule(scheduler, saved_state["lr_steps"])
    accelerator.print(f"resumed from {resume_from} at step {saved_state['step']}")
    return logger, saved_state["step"], saved_state.get("skipped", 0)


@dataclass
class Skips:
    """Optimiser steps skipped for a non-finite loss or gradient (train_step's grad norm None): in all, and in a
    row, which stops the run at `max_in_a_row` (0 = never) without final/: the model is not learning."""
    total: int
    max_in_a_row: int
    in_a_row: int = 0

    def count(self, grad_norm) -> None:
        self.total += grad_norm is None
        self.in_a_row = self.in_a_row + 1 if grad_norm is None else 0

    def check(self, step: int, stage: str, output_dir: str) -> None:
        """After the step is logged: too many in a row end the run (runs.RunError, one sentence)."""
        if self.max_in_a_row and self.in_a_row >= self.max_in_a_row:
            raise skipped_steps_error(self.in_a_row, step, stage, output_dir)


def checkpoint_or_stop(accelerator, section, step: int, last: bool, models: dict, state: dict, stop_signal,
                       logger) -> None:
    """After step `step` (1-based): a checkpoint every save_freq steps and at the end; on SIGTERM or Ctrl-C
    (stop_signal) also one, then the process exits 128 + signum: running the same command again resumes."""
    signum = stop_signal.received(accelerator)
    if last or (section.save_freq > 0 and step % section.save_freq == 0) or signum:
        save_checkpoint(accelerator, section.output_dir, step, section.keep_checkpoints, models,
                        {"step": step, **state})
    if signum:
        accelerator.print(f"stopped by {signal.Signals(signum).name} after step {step}, checkpoint saved; run the "
                          f"same command again to resume")
        logger.close()
        sys.exit(128 + signum)


def held_out_slices(rows: int, micro: int, accelerator, sharded: bool) -> list:
    """The starts of this process's held-out micro-batches: every num_processes-th slice of `micro` rows. Sharded
    (FSDP2), every forward gathers the shards with every process, so each runs as many as the process with most: the
    extra ones are None (run on the first slice, their result dropped)."""
    stride = accelerator.num_processes * micro
    mine = list(range(accelerator.process_index * micro, rows, stride))
    return mine + [None] * (-(-rows // stride) - len(mine)) if sharded else mine


def finish(accelerator, model, tokenizer, section, curves: list, sharded: bool) -> None:
    """The end of sft.py and dpo.py: rank 0 writes final/ (save_merged) and curves.png (the panels `curves`, from
    metrics.jsonl); then every process leaves together. Sharded (FSDP2), every process first takes part in gathering
    the weights, which rank 0 saves as they are (as ppo.py's save_final); with a LoRA adapter it loads them into a
    whole copy on the CPU first, since merging the adapter needs its layers whole."""
    state_dict = full_state_dict(model) if sharded else None  # a collective under FSDP2
    if accelerator.is_main_process:
        whole = accelerator.unwrap_model(model)
        if sharded and section.lora_rank > 0:
            whole = load_policy(section, section.model_path)
            whole.load_state_dict(state_dict)
            state_dict = None  # the copy holds them
        final = save_merged(whole, tokenizer, section.output_dir, (section.model_path,), state_dict)
        metrics_path = os.path.join(section.output_dir, "metrics.jsonl")
        if os.path.exists(metrics_path):
            plot_curves(metrics_path, os.path.join(section.output_dir, "curves.png"), curves)
        accelerator.print(f"wrote {final} and curves.png")
    accelerator.wait_for_everyone()
    accelerator.end_training()


def save_merged(hf_model, tokenizer, output_dir: str, inputs: tuple = (), state_dict=None) -> str:
    """final/ = the model as a plain HF folder (a LoRA adapter merged in, the adapter alone kept in final_adapter/),
    with its tokenizer: the next stage's model path. state_dict: a sharded model's weights gathered whole (without
    an adapter; None: the model's own). Rank 0 calls it; returns final/'s path."""
    final = os.path.join(output_dir, "final")  # overwrite=True below: final/ and final_adapter/ are this run's own
    if hasattr(hf_model, "merge_and_unload"):
        save_pretrained_atomic(hf_model, tokenizer, os.path.join(output_dir, "final_adapter"), overwrite=True,
                               inputs=inputs)
        hf_model = hf_model.merge_and_unload()
    save_pretrained_atomic(hf_model, tokenizer, final, state_dict, overwrite=True, inputs=inputs)
    return final
