"""PPO for language models in one file: rollouts, scores, KL, advantages, clipped updates.

    accelerate launch ppo.py --config configs.yaml                          # the demo, CPU or GPU
    accelerate launch ppo.py --config configs.yaml trainer.total_steps=20 algorithm.adv_estimator=grpo
    accelerate launch --config_file accelerate_configs/ddp_cpu.yaml --num_processes 2 ppo.py --config configs.yaml
    accelerate launch --config_file accelerate_configs/fsdp2.yaml --num_processes 2 ppo.py --config configs.yaml
    python ppo.py --help                                                    # every config key

Each step: 1. sample prompts, 2. generate, 3. score, 4. old/ref logprobs and values,
5. rewards = score − β·KL, 6. advantages, 7. PPO epochs, 8. sync rollout weights, 9. log,
10. checkpoint. The math is in the stage files beside this one (advantages.py, losses.py, kl.py, critic.py); the
plumbing (command line, run folder, processes, model loading, the optimiser step, forwards) is in infra/.

How this departs from the textbook (Schulman et al., 2017; Ziegler et al., 2019):
1. An episode is one response; the task score arrives at its last real token (EOS included), and
   the optional KL penalty at every token.
2. old_logprobs are recomputed by the training model, never taken from the sampler: vLLM's
   kernels and precision differ slightly. The gap is logged (rollout/*) and can be corrected by
   truncated importance sampling (algorithm.rollout_is).
3. With one PPO epoch, one mini-batch and no KL in the reward, the batch is used once while the
   weights are still those that sampled it: old_logprobs = logprobs.detach() from the update's own
   forward, saving a whole forward pass. The ratio is then exactly 1, as it must be.
4. Losses are normalised by the token (or sequence) count of the whole mini-batch over all
   processes, so gradient accumulation and the number of processes do not change the gradient.
5. GRPO/RLOO take a response's return as the sum of its token rewards (the score, minus the KL
   penalty when use_kl_in_reward), and spread one advantage over all its tokens.

Shapes: B sequences on this process (prompts × n), Tq prompt length, Tr response length, V vocab.

The batch, a dict of tensors with one row per sequence, filled step by step (micro_batch takes rows of it):
    queries, query_mask          (B, Tq)  2. the prompts, left-padded
    responses, response_mask     (B, Tr)  2. the responses, right-padded; mask 1 = a real token (EOS included)
    rollout_logprobs             (B, Tr)  2. the sampler's; absent where the rollout has none (rollout.name=hf)
    old_logprobs                 (B, Tr)  4. the policy's before the update; absent under departure 3
    ref_logprobs                 (B, Tr)  4. the reference's; absent without a KL term (reward or loss)
    old_values                   (B, Tr)  4. the critic's; absent without a critic
    advantages, returns          (B, Tr)  6. returns are the critic's targets
"""
import functools
import os
import signal
import sys
import time
from collections import defaultdict
from dataclasses import dataclass
from typing import Callable, Optional

import torch
from accelerate import Accelerator
from accelerate.utils import set_seed
from accelerate.utils import extract_model_from_parallel as unwrap_model
from tqdm import tqdm

import advantages
import kl
from advantages import COMPARES_SAMPLES, masked_mean, NEEDS_CRITIC
from critic import explained_variance, value_loss
from infra import cli, config
from infra.batches import autocast_dtype, batch_layout, Forward, micro_batch, per_token_pass, split_micro
from infra.config import ConfigError, exact_div
from infra.distributed import fsdp_from_launcher, full_state_dict
from infra.metrics import (check_loggers, console_line, MetricsLogger, plot_curves, reduce_metrics, sample_table,
                           sum_over_processes, timed, wandb_resume_id)
from infra.models import check_model_folders, load_models, load_tokenizer, save_pretrained_atomic
from infra.optim import make_optimizer, restore_schedule, train_step
from infra.runs import Interrupted, resume_or_start, save_checkpoint, skipped_steps_error, start_run, StopSignal
from kl import KLController, kl_estimate, kl_penalty_rewards
from losses import agg_loss, Clip, Counts, POLICY_LOSSES, rollout_is_weights
from data import load_prompts
from rewards import check_data_sources, check_reward_inputs, rule_needing_truth, score_on_every_process, Scorer
from rollout import cut_off, HFRollout, left_pad, make_rollout

CONSOLE_KEYS = ["score/mean", "reward/mean", "kl/mean", "policy/entropy", "policy/clipfrac", "loss/policy",
                "loss/value", "value/explained_var", "response/length_mean", "val/score/mean", "val/rule_score/mean",
                "time/step_s"]

# ---------------------------------------------------------------------------------------
# The losses of one micro-batch, each returning (loss, metrics), with the run's settings bound once (main)


@dataclass(frozen=True)
class ActorLoss:
    """Policy loss (× truncated rollout importance weight) − entropy bonus + KL loss: a micro-batch's share of the
    mini-batch's loss (counts: departure 4), and its metrics."""
    fwd: Forward
    policy_loss: Callable  # losses.POLICY_LOSSES[actor.policy_loss]
    clip: Clip
    loss_agg_mode: str
    entropy_coef: float
    use_kl_loss: bool
    kl_loss_coef: float
    kl_loss_type: str
    rollout_is: str  # off, token or sequence
    rollout_is_threshold: float

    @classmethod
    def from_config(cls, cfg, fwd: Forward):
        a, alg = cfg.actor, cfg.algorithm
        return cls(fwd, POLICY_LOSSES[a.policy_loss], Clip(a.clip_ratio_low, a.clip_ratio_high, a.clip_ratio_c),
                   a.loss_agg_mode, a.entropy_coef, alg.use_kl_loss, alg.kl_loss_coef, alg.kl_loss_type,
                   alg.rollout_is, alg.rollout_is_threshold)

    def __call__(self, policy, micro: dict, counts: Counts):
        mask = micro["response_mask"].float()
        logprobs, entropy = self.fwd.logprobs(policy, micro, with_entropy=True)  # (B, Tr) each
        old_logprobs = micro["old_logprobs"] if "old_logprobs" in micro else logprobs.detach()  # departure 3
        pg, clipped = self.policy_loss(logprobs, old_logprobs, micro["advantages"], mask, self.clip)  # (B, Tr) each
        metrics = {}
        if "rollout_logprobs" in micro:  # departure 2: how far the sampler was from the training model
            level = "sequence" if self.rollout_is == "sequence" else "token"  # off: token weights, logged only
            is_weight = rollout_is_weights(old_logprobs, micro["rollout_logprobs"], mask, level,
                                           self.rollout_is_threshold)  # (B, Tr)
            if self.rollout_is != "off":
                pg = pg * is_weight
            log_ratio = old_logprobs - micro["rollout_logprobs"]  # (B, Tr)
            metrics.update({"rollout/is_weight_mean": masked_mean(is_weight, mask).item(),
                            "rollout/logprob_diff_mean": masked_mean(log_ratio.abs(), mask).item(),
                            "rollout/logprob_diff_max": (log_ratio.abs() * mask).max().item(),
                            "rollout/ratio_mean": masked_mean(log_ratio.exp(), mask).item()})
        loss = pg - self.entropy_coef * entropy  # (B, Tr)
        if "ref_logprobs" in micro:
            if self.use_kl_loss:
                loss = loss + self.kl_loss_coef * kl_estimate(logprobs, micro["ref_logprobs"], self.kl_loss_type)
            # kl/mean is always k1, whichever estimator the penalty or the loss uses, so that trainer.max_kl means
            # one thing: unbiased like k3, without k3's heavy tail (r − 1 − log r for a token nearly dropped)
            metrics["kl/mean"] = masked_mean(kl_estimate(old_logprobs, micro["ref_logprobs"], "k1"), mask).item()
        metrics.update({"loss/policy": masked_mean(pg.detach(), mask).item(),
                        "policy/clipfrac": masked_mean(clipped, mask).item(),
                        "policy/approx_kl": masked_mean(kl_estimate(old_logprobs, logprobs.detach(), "k3"),
                                                        mask).item(),
                        "policy/entropy": masked_mean(entropy.detach(), mask).item()})
        return agg_loss(loss, mask, self.loss_agg_mode, counts), metrics


@dataclass(frozen=True)
class CriticLoss:
    """vf_coef · clipped value loss: a micro-batch's share of the mini-batch's token-mean, and its metrics."""
    fwd: Forward
    cliprange_value: float
    vf_coef: float

    def __call__(self, critic, micro: dict, counts: Counts):
        mask = micro["response_mask"].float()
        values = self.fwd.values(critic, micro)  # (B, Tr)
        vf, clipfrac = value_loss(values, micro["old_values"], micro["returns"], mask, self.cliprange_value)
        metrics = {"loss/value": masked_mean(vf.detach(), mask).item(), "value/clipfrac": clipfrac.item()}
        return self.vf_coef * agg_loss(vf, mask, "token-mean", counts), metrics


@dataclass(frozen=True)
class Update:
    """One model that step 7 trains, with what its optimiser step needs."""
    name: str  # "actor" or "critic": the prefix of its metrics
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    loss: Callable  # (model, micro-batch, Counts) → (loss, metrics): ActorLoss or CriticLoss
    micro_size: int  # sequences per forward/backward
    max_grad_norm: float


def mini_batch_counts(response_mask, accelerator) -> Counts:
    """The tokens and sequences of a mini-batch, averaged over processes: what its loss is normalised by. The mean,
    not the sum, because DDP and FSDP2 average the processes' gradients (departure 4)."""
    counts = torch.tensor([float(response_mask.sum()), float(len(response_mask))], device=accelerator.device)
    return Counts(*(accelerator.reduce(counts, "sum") / accelerator.num_processes).tolist())


# ---------------------------------------------------------------------------------------
# The run's state and sizes


class TrainState:
    """What a checkpoint needs beyond weights and optimiser states, as plain data: the step, the data
    position, β, recent KL, and how far each LR schedule has gone."""

    def __init__(self, kl_ctrl: KLController, schedulers: dict):
        self.step, self.epoch, self.position, self.skipped, self.kl_ctrl = 0, 0, 0, 0, kl_ctrl
        self.recent_kl = []  # kl/mean of the last trainer.max_kl_window steps, for the guard
        self.schedulers = {name: s for name, s in schedulers.items() if s is not None}

    def state_dict(self):
        return {"step": self.step, "epoch": self.epoch, "position": self.position, "skipped": self.skipped,
                "kl_coef": self.kl_ctrl.value, "recent_kl": self.recent_kl,
                "lr_steps": {name: s.last_epoch for name, s in self.schedulers.items()}}

    def load_state_dict(self, s):
        self.step, self.epoch, self.position, self.skipped = s["step"], s["epoch"], s["position"], s["skipped"]
        self.kl_ctrl.value, self.recent_kl = s["kl_coef"], s["recent_kl"]
        for name, scheduler in self.schedulers.items():
            restore_schedule(scheduler, s["lr_steps"][name])


def next_prompts(state: TrainState, num_rows: int, batch_size: int, seed: int, shuffle: bool):
    """The next `batch_size` row indices of a seeded per-epoch permutation (the last partial batch is dropped)."""
    if state.position + batch_size > num_rows:
        state.epoch, state.position = state.epoch + 1, 0
    order = (torch.randperm(num_rows, generator=torch.Generator().manual_seed(seed + state.epoch))
             if shuffle else torch.arange(num_rows))
    inds = order[state.position:state.position + batch_size].tolist()
    state.position += batch_size
    return inds


def decode_responses(tokenizer, responses, response_mask) -> list[str]:
    return tokenizer.batch_decode([r[m.bool()].tolist() for r, m in zip(responses, response_mask)],
                                  skip_special_tokens=True)


@torch.no_grad()
def validate(cfg, rollout, tokenizer, scorer, val_rows, accelerator) -> dict:
    """One response per validation prompt (greedy by default), scored: Scorer.validation_metrics."""
    mine = val_rows[accelerator.process_index::accelerator.num_processes]
    ro = rollout.generate([r["prompt_ids"] for r in mine], n=1, temperature=cfg.rollout.val_temperature)
    texts = decode_responses(tokenizer, ro.responses, ro.response_mask)
    sources = sorted({r["data_source"] for r in val_rows})
    return scorer.validation_metrics(mine, texts, sources, accelerator)


@dataclass(frozen=True)
class Sizes:
    """Batch sizes derived from the config, computed and checked once (check_sizes); per process unless said."""
    prompts: int  # prompts per step
    batch: int  # B: sequences per step (prompts × rollout.n)
    num_mini: int  # mini-batches (optimiser steps) per PPO epoch, the same on every process
    mini: int  # sequences per mini-batch
    actor_micro: int  # sequences per actor forward/backward (gradient accumulation fills the mini-batch)
    critic_micro: int  # sequences per critic forward/backward


def check_sizes(cfg, world: int, num_rows: int) -> Sizes:
    """Every derived batch size; one that does not divide fails here with a sentence, before any model loads."""
    d, a, n = cfg.data, cfg.actor, cfg.rollout.n
    if cfg.algorithm.adv_estimator in COMPARES_SAMPLES and n < 2:
        raise ConfigError(f"algorithm.adv_estimator={cfg.algorithm.adv_estimator} compares the samples of a "
                                 f"prompt: set rollout.n ≥ 2 (it is {n})")
    if num_rows < d.train_batch_size:
        raise ConfigError(f"data.train_files has {num_rows} usable prompts, fewer than "
                                 f"data.train_batch_size={d.train_batch_size}")
    prompts = exact_div(d.train_batch_size, world, "data.train_batch_size across processes")
    num_mini = exact_div(d.train_batch_size, a.ppo_mini_batch_size,
                         "data.train_batch_size by actor.ppo_mini_batch_size (prompts per mini-batch)")
    mini = exact_div(a.ppo_mini_batch_size * n, world, "actor.ppo_mini_batch_size × rollout.n across processes")
    actor_micro = min(a.ppo_micro_batch_size_per_device, mini)
    exact_div(mini, actor_micro, "sequences per mini-batch on one process by actor.ppo_micro_batch_size_per_device")
    critic_micro = min(cfg.critic.ppo_micro_batch_size_per_device, mini)
    exact_div(mini, critic_micro, "sequences per mini-batch on one process by critic.ppo_micro_batch_size_per_device")
    return Sizes(prompts, prompts * n, num_mini, mini, actor_micro, critic_micro)


def step_seed(seed: int, step: int, stream: int) -> int:
    """The seed of one random stream of one step: seed·100_003 + step·1_009 + stream, with two primes so that no
    two (seed, step) pairs give the same number. stream: the process index for sampling, −1 for the mini-batch
    order (the same on every process)."""
    return seed * 100_003 + step * 1_009 + stream


def ref_logprobs(ref, policy, micro, fwd: Forward):
    """log π_ref(y_t | prefix), (B, Tr): the reference model's, or with LoRA the actor's with its adapter disabled."""
    if ref is not None:
        return fwd.logprobs(ref, micro)[0]
    with unwrap_model(policy).disable_adapter():
        return fwd.logprobs(unwrap_model(policy), micro)[0]


def set_train_mode(models: list, on: bool) -> None:
    """Train mode for the updates, eval mode for the no-grad passes. That only switches gradient checkpointing
    (transformers recomputes only in train mode), since every dropout is 0 (these configs' attention_dropout,
    lora_dropout's default, the critic's head); a lora_dropout > 0 would make the first epoch's ratio differ from 1."""
    for model in models:
        if model is not None:
            model.train(on)


def resume(accelerator, cfg, checkpoint, checkpointed: dict, state: TrainState):
    """The run's MetricsLogger; from a checkpoint (start_run's, or None), the models and optimisers of
    `checkpointed` ({name: (model, optimiser)}) and `state` restored."""
    t = cfg.trainer
    logger = MetricsLogger(t.output_dir, t.logger, cli.to_dict(cfg), t.project_name, t.experiment_name,
                           accelerator.is_main_process, resume_id=wandb_resume_id(checkpoint))
    saved_state = resume_or_start(accelerator, checkpoint, t.output_dir, logger, cfg, checkpointed)
    if checkpoint:
        state.load_state_dict(saved_state)
        accelerator.print(f"resumed from {checkpoint} at step {state.step}")
    return logger


def batch_metrics(scores, token_rewards, lengths, truncated) -> dict:
    """Means over this process's batch: scores (B,), the summed token rewards (B, Tr), response lengths (B,), and
    the share of responses cut off at max_response_length."""
    return {"score/mean": scores.mean().item(), "score/max": scores.max().item(), "score/min": scores.min().item(),
            "reward/mean": token_rewards.sum(1).mean().item(), "response/length_mean": lengths.float().mean().item(),
            "response/clip_ratio": truncated.float().mean().item()}


def guards(t, recent_kl: list, entropy: Optional[float]) -> tuple[Optional[str], Optional[str]]:
    """(why to stop, or None; a warning, or None): the mean kl/mean of the last steps above trainer.max_kl, or
    policy/entropy below trainer.min_entropy (a stop or a warning, as trainer.min_entropy_action says)."""
    stop = warning = None
    mean_kl = sum(recent_kl) / len(recent_kl)
    if t.max_kl and mean_kl > t.max_kl:
        stop = f"kl/mean over the last {len(recent_kl)} steps {mean_kl:.4f} > trainer.max_kl {t.max_kl}"
    if t.min_entropy and entropy is not None and entropy < t.min_entropy:
        message = f"policy/entropy {entropy:.4f} < trainer.min_entropy {t.min_entropy}"
        stop, warning = (message, None) if t.min_entropy_action == "stop" else (stop, message)
    return stop, warning


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


def check_names(cfg) -> None:
    """Each name that picks a function from a stage's table is in it: an unknown one fails here, before anything
    loads, never silently picking another."""
    for key, name, table in (("algorithm.adv_estimator", cfg.algorithm.adv_estimator, advantages.ESTIMATORS),
                             ("actor.policy_loss", cfg.actor.policy_loss, POLICY_LOSSES),
                             ("algorithm.kl_penalty", cfg.algorithm.kl_penalty, kl.ESTIMATORS),
                             ("algorithm.kl_loss_type", cfg.algorithm.kl_loss_type, kl.ESTIMATORS)):
        if name not in table:
            raise ConfigError(f"{key}={name!r} is not one of {', '.join(table)}")


def main(cfg: config.Config):
    check_names(cfg)
    needs_critic = cfg.algorithm.adv_estimator in NEEDS_CRITIC
    accelerator = Accelerator(cpu=not torch.cuda.is_available())  # on a CPU, launched processes join over gloo
    print0 = functools.partial(accelerator.print, flush=True)  # rank 0 only; flushed even into a pipe
    # before anything loads: output_dir is this run's alone, a checkpoint fits this config, the inputs exist
    lock, resume_from, finished = start_run(accelerator, cfg, "trainer",  # the lock is held until the process ends
                                            unused=frozenset() if needs_critic else frozenset({"critic.model_path"}))
    if finished:
        return None
    check_model_folders(cfg.model, (cfg.critic.model_path or cfg.model.path) if needs_critic else None)
    check_reward_inputs(cfg.reward, cfg.model.trust_remote_code)
    check_loggers(cfg.trainer.logger, "trainer.logger")
    set_seed(cfg.trainer.seed)
    t, alg, device = cfg.trainer, cfg.algorithm, accelerator.device
    dtype = autocast_dtype(cfg.model.dtype)
    fsdp = fsdp_from_launcher(dtype)  # FSDP2 settings of an accelerate config file, or None
    tokenizer = load_tokenizer(cfg.model.tokenizer_path or cfg.model.path,
                               "model.tokenizer_path" if cfg.model.tokenizer_path else "model.path",
                               trust_remote_code=cfg.model.trust_remote_code)

    # ---- data: prompts tokenised once, sizes checked before any model is loaded
    train_rows, val_rows = load_prompts(cfg.data, tokenizer, print0,  # a rule's rows must have a ground truth
                                        rule_of=functools.partial(rule_needing_truth, cfg_reward=cfg.reward))
    sizes = check_sizes(cfg, accelerator.num_processes, len(train_rows))
    check_data_sources({r["data_source"] for r in train_rows + val_rows}, cfg.reward)  # each has a rule
    n, B = cfg.rollout.n, sizes.batch

    # ---- models (infra/models.py builds them all): actor, reference, critic; optimisers after sharding
    fwd = Forward(cfg.rollout.temperature or 1.0, dtype, batch_layout(cfg.model, sharded=fsdp is not None))
    policy, ref, critic = load_models(cfg, accelerator, fsdp, fwd.layout, with_critic=needs_critic)
    actor_opt, actor_sched = make_optimizer(policy, cfg.actor.optim, t.total_steps)
    critic_opt, critic_sched = make_optimizer(critic, cfg.critic.optim, t.total_steps) if critic else (None, None)
    # SIGTERM or Ctrl-C from here on ends a step with a checkpoint; a hung reward call holds it up for at most
    # reward.timeout_s (the Scorer's worker checks stop_signal)
    stop_signal = StopSignal(verbose=accelerator.is_main_process)
    scorer = Scorer(cfg.reward, device, dtype, trust_remote_code=cfg.model.trust_remote_code,
                    stop=stop_signal)  # a reward model is replicated: it only runs forward passes

    # ---- state, resume
    state = TrainState(KLController(alg.kl_ctrl.type, alg.kl_ctrl.kl_coef, alg.kl_ctrl.target_kl,
                                    alg.kl_ctrl.horizon), {"actor": actor_sched, "critic": critic_sched})
    checkpointed = {"policy": (policy, actor_opt)}  # {name: (model, optimiser)} saved beside state.json
    if critic is not None:
        checkpointed["critic"] = (critic, critic_opt)
    logger = resume(accelerator, cfg, resume_from, checkpointed, state)
    rollout = make_rollout(cfg, policy, tokenizer, accelerator, dtype, synced_forwards=fsdp is not None)
    reduce_sum = functools.partial(sum_over_processes, accelerator)
    max_tokens = cfg.actor.max_token_len_per_device if cfg.actor.use_dynamic_bsz else 0  # 0: micro-batches by count

    # ---- what steps 6 and 7 compute with, bound once
    estimate = advantages.ESTIMATORS[alg.adv_estimator]
    adv_settings = advantages.Settings(alg.gamma, alg.lam, n, alg.norm_adv_by_std_in_grpo, alg.whiten_advantages,
                                       reduce_sum)
    actor_update = Update("actor", policy, actor_opt, actor_sched, ActorLoss.from_config(cfg, fwd), sizes.actor_micro,
                          cfg.actor.max_grad_norm)
    critic_update = critic and Update("critic", critic, critic_opt, critic_sched,
                                      CriticLoss(fwd, cfg.critic.cliprange_value, cfg.critic.vf_coef),
                                      sizes.critic_micro, cfg.critic.max_grad_norm)

    if t.val_before_train and val_rows and state.step == 0:
        metrics = validate(cfg, rollout, tokenizer, scorer, val_rows, accelerator)
        print0("validation before training: " + console_line(metrics, sorted(metrics)))
        logger.log(metrics, 0)
    if signum := stop_signal.received(accelerator):
        raise Interrupted(signum, "during the validation before training; nothing was trained")
    stop_reason, skipped_in_a_row = None, 0
    bar = tqdm(range(state.step + 1, t.total_steps + 1), disable=not accelerator.is_main_process,
               desc="ppo", dynamic_ncols=True)
    for step in bar:
        times, metrics, skipped_before = {}, {}, state.skipped
        t0 = time.perf_counter()

        # ---- 1. sample prompts: one global batch from a seeded permutation, this process's slice of it
        inds = next_prompts(state, len(train_rows), cfg.data.train_batch_size, t.seed, cfg.data.shuffle)
        mine = inds[accelerator.process_index * sizes.prompts:(accelerator.process_index + 1) * sizes.prompts]
        rows = [train_rows[i] for i in mine for _ in range(n)]  # row i·n + j: sample j of prompt i

        # ---- 2. generate n responses per prompt
        with timed(times, "time/gen_s"):
            ro = rollout.generate([train_rows[i]["prompt_ids"] for i in mine], n, cfg.rollout.temperature,
                                  seed=step_seed(t.seed, step, accelerator.process_index))
        queries, query_mask = left_pad([r["prompt_ids"] for r in rows], tokenizer.pad_token_id)  # (B, Tq)
        responses, response_mask = ro.responses, ro.response_mask  # (B, Tr)
        lengths = response_mask.sum(1)  # (B,) response tokens, the EOS included
        tok_lengths = (query_mask.sum(1) + lengths).tolist()  # (B,) real tokens: micro-batches by token budget
        batch = dict(queries=queries, query_mask=query_mask, responses=responses, response_mask=response_mask)
        if ro.logprobs is not None:
            batch["rollout_logprobs"] = ro.logprobs  # (B, Tr) the sampler's

        # ---- 3. score: the task reward of each response
        with timed(times, "time/reward_s"):
            texts = decode_responses(tokenizer, responses, response_mask)
            scores, reward_metrics = score_on_every_process(scorer, rows, texts, accelerator)  # (B,)
            truncated = cut_off(responses, lengths, cfg.rollout.max_response_length, rollout.eos_ids)  # (B,)
            scores = scores + cfg.reward.overlong_penalty * truncated.float()
        metrics.update(reward_metrics)

        # ---- 4. old/ref logprobs and values: no grad, micro-batched, in eval mode (set_train_mode says why)
        set_train_mode([policy, critic], False)
        no_grad_pass = functools.partial(per_token_pass, batch=batch, max_tokens=max_tokens, lengths=tok_lengths,
                                         size=cfg.actor.log_prob_micro_batch_size_per_device, device=device)
        # departure 3: with one epoch of one mini-batch and no KL in the reward, ActorLoss takes old_logprobs from
        # the update's own forward instead
        if cfg.actor.ppo_epochs > 1 or sizes.num_mini > 1 or alg.use_kl_in_reward:
            with timed(times, "time/old_logprob_s"):
                batch["old_logprobs"] = no_grad_pass(lambda micro: fwd.logprobs(policy, micro)[0])  # (B, Tr)
        if alg.use_kl_in_reward or alg.use_kl_loss:
            with timed(times, "time/ref_s"):
                batch["ref_logprobs"] = no_grad_pass(lambda micro: ref_logprobs(ref, policy, micro, fwd))  # (B, Tr)
        if critic is not None:
            with timed(times, "time/values_s"):
                batch["old_values"] = no_grad_pass(lambda micro: fwd.values(critic, micro)) * response_mask  # (B, Tr)

        # ---- 5. rewards = score at the last token − β·KL at every token
        beta = state.kl_ctrl.value
        kl_tokens = torch.zeros(response_mask.shape)  # (B, Tr)
        if alg.use_kl_in_reward:
            kl_tokens = kl_estimate(batch["old_logprobs"], batch["ref_logprobs"], alg.kl_penalty) * response_mask
            seq_kl = accelerator.reduce(masked_mean(kl_tokens, response_mask, 1).mean().to(device), "mean").item()
            state.kl_ctrl.update(seq_kl, cfg.data.train_batch_size * n)
        token_rewards = kl_penalty_rewards(scores, kl_tokens, response_mask, beta)  # (B, Tr)

        # ---- 6. advantages (B, Tr), zero on padding: advantages.ESTIMATORS[algorithm.adv_estimator]
        batch["advantages"], batch["returns"] = estimate(token_rewards, response_mask.float(), batch.get("old_values"),
                                                         adv_settings)  # (B, Tr) each

        # ---- 7. PPO epochs over mini-batches, gradient accumulation over micro-batches
        set_train_mode([policy, critic], True)
        update_actor = step > cfg.critic.warmup_steps  # critic warm-up: the actor waits for useful values
        updates = ([actor_update] if update_actor else []) + ([critic_update] if critic is not None else [])
        stats = defaultdict(list)  # metric → its values: one per micro-batch (grad norms: per optimiser step)
        order = torch.Generator().manual_seed(step_seed(t.seed, step, -1))
        for epoch in range(cfg.actor.ppo_epochs):
            for mini_inds in torch.randperm(B, generator=order).split(sizes.mini):
                counts = mini_batch_counts(response_mask[mini_inds], accelerator)  # normalise its loss (departure 4)
                for u in updates:
                    with timed(times, f"time/update_{u.name}_s"):
                        micro_batches = [micro_batch(batch, i, device)
                                         for i in split_micro(mini_inds, tok_lengths, u.micro_size, max_tokens)]
                        # one optimiser step: loss.backward() per micro-batch, gradients averaged over processes
                        # after the last one only, clipped over every shard, optimizer.step() unless non-finite
                        loss_fn = functools.partial(u.loss, u.model, counts=counts)
                        grad_norm, losses = train_step(u.model, u.optimizer, micro_batches, loss_fn, u.max_grad_norm)
                    state.skipped += grad_norm is None
                    if grad_norm is not None:  # a skipped step has none
                        stats[f"{u.name}/grad_norm"].append(grad_norm)
                    for key, values in losses.items():
                        stats[key] += values
        metrics["actor/lr"] = actor_sched.get_last_lr()[0]
        for u in updates:
            u.scheduler.step()

        # ---- 8. sync rollout weights: the next batch must come from the updated policy
        if update_actor:
            with timed(times, "time/sync_s"):
                rollout.sync_weights(policy)

        # ---- 9. log: means (maxima for *_max) over this process's batch and micro-batches, then over processes
        metrics.update({**batch_metrics(scores, token_rewards, lengths, truncated), "kl/coef": beta, **stats})
        if critic is not None:
            metrics["value/mean"] = masked_mean(batch["old_values"], response_mask).item()
            metrics["value/explained_var"] = explained_variance(batch["old_values"], batch["returns"], response_mask,
                                                                reduce_sum)
        metrics = reduce_metrics(accelerator, metrics)
        tokens = accelerator.reduce(torch.tensor(float(sum(tok_lengths)), device=device), "sum").item()
        times["time/step_s"] = time.perf_counter() - t0
        metrics.update(times)
        metrics["perf/tokens_per_s"] = tokens / times["time/step_s"]
        metrics["train/skipped_steps"] = state.skipped
        skipped_in_a_row = skipped_in_a_row + 1 if state.skipped > skipped_before else 0
        state.step = step

        # ---- guards: a run that drifts too far from the reference, or collapses, is validated and stops
        state.recent_kl = (state.recent_kl + [metrics.get("kl/mean", 0.0)])[-t.max_kl_window:]
        stop_reason, warning = guards(t, state.recent_kl, metrics.get("policy/entropy"))
        if warning:
            print0("warning: " + warning)

        # validate (every test_freq steps, and at the end however it comes) and log
        if val_rows and ((t.test_freq and step % t.test_freq == 0) or step == t.total_steps or stop_reason):
            metrics.update(validate(cfg, rollout, tokenizer, scorer, val_rows, accelerator))
        logger.log(metrics, step)
        bar.set_postfix(score=f"{metrics['score/mean']:.3f}", kl=f"{metrics.get('kl/mean', 0):.4f}")
        print0(f"step {step}  " + console_line(metrics, CONSOLE_KEYS))
        if t.max_skipped_steps and skipped_in_a_row >= t.max_skipped_steps:  # nothing learnt: no final/
            raise skipped_steps_error(skipped_in_a_row, step, "trainer", t.output_dir)
        if t.sample_freq and step % t.sample_freq == 0:
            shown = list(range(0, B, max(1, B // t.num_samples_to_show)))[:t.num_samples_to_show]
            print0(sample_table([(rows[i]["prompt_text"][-40:], texts[i], scores[i].item()) for i in shown]))

        # ---- 10. checkpoint; SIGTERM (Slurm's preemption) or Ctrl-C ends the run here, and a rerun resumes
        signum = stop_signal.received(accelerator)
        if (t.save_freq and step % t.save_freq == 0) or step == t.total_steps or stop_reason or signum:
            save_checkpoint(accelerator, t.output_dir, step, t.keep_checkpoints, checkpointed, state.state_dict())
        if signum:
            print0(f"stopped by {signal.Signals(signum).name} after step {step}, checkpoint saved; run the same "
                   f"command again to resume")
            logger.close()
            sys.exit(128 + signum)
        if stop_reason:
            print0(f"stopping at step {step}: {stop_reason} (checkpoint saved)")
            break

    # ---- the policy in HF format, and curves for people who would rather look than read
    save_final(accelerator, policy, tokenizer, cfg)
    logger.close()
    accelerator.wait_for_everyone()
    if isinstance(rollout, HFRollout):  # a vLLM engine destroys the process group itself at exit
        accelerator.end_training()
    return stop_reason


if __name__ == "__main__":
    cli.run_script(main, __doc__, config.Config, "ppo.py")
