"""PPO for language models in one file: rollouts, scores, KL, advantages, clipped updates.

    accelerate launch ppo.py --config configs.yaml                          # the demo, CPU or GPU
    accelerate launch ppo.py --config configs.yaml trainer.total_steps=20 algorithm.adv_estimator=grpo
    accelerate launch ppo.py --config recipes/dapo.yaml                     # a recipe: its changes to the defaults
    accelerate launch ppo.py --config examples/guess_number.yaml            # an environment (make env makes its data)
    accelerate launch ppo.py --config examples/verifiers_add_one.yaml       # a verifiers environment (data: its header)
    accelerate launch ppo.py --config examples/reasoning_gym_gcd.yaml       # a reasoning-gym task (data: its header)
    accelerate launch --config_file accelerate_configs/ddp_cpu.yaml --num_processes 2 ppo.py --config configs.yaml
    accelerate launch --config_file accelerate_configs/fsdp2.yaml --num_processes 2 ppo.py --config configs.yaml
    WORLD_SIZE=2 python ppo.py --check --config configs.yaml                # the checks for 2 processes, no model
    python ppo.py --help                                                    # every config key

Each step: 1. sample prompts, 2. generate, 3. score, 4. old/ref logprobs and values,
5. rewards = score − β·KL, 6. advantages, 7. PPO epochs, 8. sync rollout weights, 9. log,
10. checkpoint. Each step calls its stage file: rollout.py (2), rewards.py (3), kl.py (5), advantages.py (6),
losses.py and critic.py (7), validation.py; the plumbing (command line, run folder, processes, model loading, the
optimiser step, forwards) is in infra/; what is off by default (multi-turn agents, other scorers, other rollout kinds)
in agents/, scorers/ and rollout_kinds/, reached by one table line each.

How this departs from the textbook (Schulman et al., 2017; Ziegler et al., 2019):
1. An episode is one response; the task score arrives at its last real token (EOS included), and
   the optional KL penalty at every token, beside any token rewards (a reward function's steps, an environment's
   turns, a teacher's −coef·KL with on-policy distillation).
2. old_logprobs are recomputed by the training model, never taken from the sampler: vLLM's
   kernels and precision differ slightly. The gap is logged (rollout/*) and can be corrected by
   truncated importance sampling (algorithm.rollout_is) or by leaving the farthest samples out (algorithm.rollout_rs).
3. With one PPO epoch, one mini-batch and no KL in the reward, the batch is used once while the
   weights are still those that sampled it: old_logprobs = logprobs.detach() from the update's own
   forward, saving a whole forward pass. The ratio is then exactly 1, as it must be.
4. Losses are normalised by the token (or sequence) count of the whole mini-batch over all
   processes, so gradient accumulation and the number of processes do not change the gradient.
5. GRPO/RLOO/REINFORCE++-baseline take a response's return as the sum of its token rewards (the score, the token
   rewards, minus the KL penalty when use_kl_in_reward), as verl does, and spread one advantage over all its tokens.
6. Dynamic sampling (algorithm.filter_groups, DAPO) fills each process's share of the batch from that process's own
   rounds; every process runs as many rounds as the one that needs most, so all stay in step and in the data order
   (verl, with one controller, pools the kept prompts of the whole batch).
7. A rollback (trainer.rollback_tolerance) restores best/'s weights, optimiser states and β, but not the step, the
   data position, the LR schedule or the RNG: the run goes on with new prompts instead of replaying the same steps.
8. With rollout.steps_ahead = k > 0 the batch of step t is generated when step t − k begins, from the policy then
   (rollout.Generated.version; rollout/staleness_mean|max; a batch older than k is refused), in one background thread while
   the steps before it score and train; new weights reach the rollout between two generations, never during one
   (rollout.RunAhead). The loss is decoupled PPO (Hilton et al., 2021; AReaL's decoupled loss, verl's
   rollout correction): the ratio is clipped around π_old, the trainer's own log-probs at the weights before the
   update (which departure 3's shortcut computes, so it stays), and the gap to the stale sampler is corrected by
   algorithm.rollout_is, token-level by default (auto, as verl's TIS), so the sampler's log-probs are required.
   The bound follows AReaL's max_head_offpolicyness, prime-rl's async level and TRL's max_staleness. Dynamic
   sampling is refused (its rounds wait for scores); validation waits for the generation in flight; a checkpoint
   keeps the data position of the first batch not yet trained, which a resumed run generates again, from the
   checkpoint's weights: the same prompts and seeds, one version fresher than in the run that was stopped.

Shapes: B sequences on this process (prompts × n), Tq prompt length, Tr response length, V vocab.

The batch, a dict of tensors with one row per sequence, filled step by step (micro_batch takes rows of it):
    queries, query_mask          (B, Tq)  2. the prompts, left-padded
    responses, response_mask     (B, Tr)  2. the responses, right-padded; mask 1 = a real token (EOS included)
    response_attention_mask      (B, Tr)  2. multi-turn (agents/multi_turn.py): 1 on tool answers too, where response_mask is 0
    rollout_logprobs             (B, Tr)  2. the sampler's; absent where the rollout has none (rollout.name=hf)
    old_logprobs                 (B, Tr)  4. the policy's before the update; absent under departure 3
    ref_logprobs                 (B, Tr)  4. the reference's; absent without a KL term and trainer.max_kl=0
    teacher_logprobs             (B, Tr)  4. on-policy distillation's teacher's; absent without algorithm.teacher.path
    old_values                   (B, Tr)  4. the critic's; absent without a critic
    trunk_prompt, trunk_response (B, Tq, H), (B, Tr, H)  4. the frozen trunk's output (infra/trunk.py); absent without
    advantages, returns          (B, Tr)  6. returns are the critic's targets
    loss_mask                    (B, Tr)  6. the tokens the policy loss sees: response_mask less the responses that
                                             reward.overlong_filter drops and the tokens algorithm.rollout_rs rejects
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
from accelerate.utils import set_seed
from tqdm import tqdm

import advantages
import kl
from advantages import COMPARES_SAMPLES, masked_mean, NEEDS_CRITIC, varied_groups
from critic import CriticLoss, value_metrics
from infra import cli, config
from infra.batches import (autocast_dtype, Forward, micro_batch, per_token_pass, resolve_dtype, set_train_mode,
                           split_micro)
from infra.checks import (check_combinations, check_model_folders, check_sizes, describe_guards, needs_reference,
                          Sizes)
from infra.config import ConfigError, load_target
from infra.distributed import fsdp_from_launcher, make_accelerator, max_over_processes, use_cpu
from infra.layouts import batch_layout
from infra.metrics import (batch_metrics, check_loggers, console_line, reduce_metrics, sample_table, shown_samples,
                           sum_over_processes, timed)
from infra.rollout_common import Samples
from infra.models import check_teacher, load_models, load_teacher, policy_tokenizer
from infra.optim import make_optimizer, StopAtMicroBatch, train_step
from infra.runs import check_learning, Interrupted, save_checkpoint, start_run, StopSignal
from infra.train_state import keep_best, resume, save_final, step_seed, TrainState
from infra.trunk import plan_trunk
from kl import (distillation_rewards, KLController, kl_estimate, kl_penalty_rewards, ref_logprobs,
                teacher_logprobs)
from losses import agg_loss, Clip, Counts, mini_batch_counts, POLICY_LOSSES, policy_loss_mask, rollout_is_weights
from data import CURRICULUM, draw_prompts, load_prompts
from rewards import check_data_sources, check_reward_inputs, check_sample_call, rule_needing_truth, score_samples, Scorer
from rollout import check_rollout, check_turns, make_rollout, rollout_is_level, RunAhead
from validation import check_best_metric, held_out_perplexity, reference_text, validate

CONSOLE_KEYS = ["score/mean", "reward/mean", "kl/mean", "policy/entropy", "policy/clipfrac", "loss/policy",
                "loss/value", "value/explained_var", "response/length_mean", "val/score/mean", "val/rule_score/mean",
                "val/perplexity", "time/step_s"]

# ---------------------------------------------------------------------------------------
# The losses of one micro-batch, each returning (loss, metrics), with the run's settings bound once (main)


@dataclass(frozen=True)
class ActorLoss:
    """Policy loss (× truncated rollout importance weight) − entropy bonus + KL loss over the tokens of loss_mask: a
    micro-batch's share of the mini-batch's loss (counts: departure 4), and its metrics."""
    fwd: Forward
    policy_loss: Callable  # losses.POLICY_LOSSES[actor.policy_loss]
    clip: Clip
    loss_agg_mode: str
    loss_scale_factor: float  # seq-mean-token-sum-norm's constant L
    entropy_coef: float
    use_kl_loss: bool
    kl_loss_coef: float
    kl_loss_type: str
    rollout_is: str  # off, token, sequence or sequence_mean
    rollout_is_threshold: float
    teacher_loss_coef: float = 0.0  # on-policy distillation with algorithm.teacher.mode=loss; 0: none
    teacher_kl: str = "k1"  # its KL estimator

    @classmethod
    def from_config(cls, cfg, fwd: Forward):
        a, alg, teacher = cfg.actor, cfg.algorithm, cfg.algorithm.teacher
        return cls(fwd=fwd, policy_loss=POLICY_LOSSES[a.policy_loss],
                   clip=Clip(a.clip_ratio_low, a.clip_ratio_high, a.clip_ratio_c),
                   loss_agg_mode=a.loss_agg_mode,
                   loss_scale_factor=a.loss_scale_factor or cfg.rollout.max_response_length,
                   entropy_coef=a.entropy_coef,
                   use_kl_loss=alg.use_kl_loss, kl_loss_coef=alg.kl_loss_coef, kl_loss_type=alg.kl_loss_type,
                   rollout_is=rollout_is_level(cfg), rollout_is_threshold=alg.rollout_is_threshold,
                   teacher_loss_coef=teacher.coef if teacher.path and teacher.mode == "loss" else 0.0,
                   teacher_kl=teacher.kl_estimator)

    def __call__(self, policy, micro: dict, counts: Counts):
        mask = micro["loss_mask"].float()
        logprobs, entropy = self.fwd.logprobs(policy, micro, with_entropy=True)  # (B, Tr) each
        old_logprobs = micro["old_logprobs"] if "old_logprobs" in micro else logprobs.detach()  # departure 3
        pg, clipped = self.policy_loss(logprobs, old_logprobs, micro["advantages"], mask, self.clip)  # (B, Tr) each
        metrics = {}
        if "rollout_logprobs" in micro:  # departure 2: how far the sampler was from the training model
            level = "token" if self.rollout_is == "off" else self.rollout_is  # off: token weights, logged only
            is_weight = rollout_is_weights(old_logprobs, micro["rollout_logprobs"], mask, level,
                                           self.rollout_is_threshold)  # (B, Tr)
            if self.rollout_is != "off":
                pg = pg * is_weight
            log_ratio = old_logprobs - micro["rollout_logprobs"]  # (B, Tr)
            metrics.update({"rollout/is_weight_mean": masked_mean(is_weight, mask).item(),
                            "rollout/logprob_diff_mean": masked_mean(log_ratio.abs(), mask).item(),
                            "rollout/logprob_diff_max": (log_ratio.abs() * mask).max().item(),
                            "rollout/ratio_mean": masked_mean(log_ratio.exp(), mask).item()})
        loss = pg - self.entropy_coef * entropy if self.entropy_coef else pg  # (B, Tr); no entropy backward at 0
        if "ref_logprobs" in micro:
            if self.use_kl_loss:
                loss = loss + self.kl_loss_coef * kl_estimate(logprobs, micro["ref_logprobs"], self.kl_loss_type)
            # kl/mean is always k1, whichever estimator the penalty or the loss uses, so that trainer.max_kl means
            # one thing: unbiased like k3, without k3's heavy tail (r − 1 − log r for a token nearly dropped)
            metrics["kl/mean"] = masked_mean(kl_estimate(old_logprobs, micro["ref_logprobs"], "k1"), mask).item()
        if "teacher_logprobs" in micro:  # on-policy distillation: KL(π ‖ π_teacher), in the loss with mode=loss
            if self.teacher_loss_coef:
                loss = loss + self.teacher_loss_coef * kl_estimate(logprobs, micro["teacher_logprobs"], self.teacher_kl)
            metrics["teacher/kl_mean"] = masked_mean(kl_estimate(old_logprobs, micro["teacher_logprobs"], "k1"),
                                                     mask).item()
        metrics.update({"loss/policy": masked_mean(pg.detach(), mask).item(),
                        "policy/clipfrac": masked_mean(clipped, mask).item(),
                        "policy/approx_kl": masked_mean(kl_estimate(old_logprobs, logprobs.detach(), "k3"),
                                                        mask).item(),
                        "policy/entropy": masked_mean(entropy.detach(), mask).item()})
        return agg_loss(loss, mask, self.loss_agg_mode, counts, self.loss_scale_factor), metrics


@dataclass(frozen=True)
class Update:
    """One model that step 7 trains, with what its optimiser step needs."""
    name: str  # "actor" or "critic": the prefix of its metrics
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    loss: Callable  # (model, micro-batch, Counts) → (loss, metrics): ActorLoss or CriticLoss
    mask: str  # the batch's mask of the tokens its loss sees: loss_mask (actor) or response_mask (critic)
    micro_size: int  # sequences per forward/backward
    max_grad_norm: float


def needs_old_logprobs(cfg, num_mini: int) -> bool:
    """Whether step 4 computes old_logprobs: not under departure 3 (one epoch of one mini-batch, no KL in the reward,
    to the reference or to a teacher, and no rejection sampling)."""
    alg = cfg.algorithm
    return (cfg.actor.ppo_epochs > 1 or num_mini > 1 or alg.use_kl_in_reward or alg.rollout_rs != "off"
            or bool(alg.teacher.path and alg.teacher.mode == "reward"))


def due(freq: int, step: int) -> bool:
    """trainer.test_freq, save_freq, sample_freq: every `freq` steps; 0: never."""
    return bool(freq) and step % freq == 0


def more_rounds(kept: list, rounds: int, need: int, cfg, accelerator) -> bool:
    """Whether steps 1–3 run another round: the first always; with algorithm.filter_groups, while a process holds fewer
    than `need` prompts whose n scores differ (`kept`: Samples, one per round; the same answer on every process), up to
    algorithm.filter_groups.max_num_gen_batches rounds, after which the run stops with a sentence."""
    fg, n = cfg.algorithm.filter_groups, cfg.rollout.n
    if rounds == 0 or not fg.enable:
        return rounds == 0
    have = sum(len(samples.rows) for samples in kept) // n
    short = int(accelerator.reduce(torch.tensor(float(max(need - have, 0)), device=accelerator.device), "max").item())
    if short and rounds == fg.max_num_gen_batches:
        raise ConfigError(f"algorithm.filter_groups: after {rounds} rounds of {cfg.data.train_batch_size} prompts a "
                          f"process still lacks {short} of its {need} prompts whose samples score differently (the "
                          f"data is too easy or too hard for this policy); raise "
                          f"algorithm.filter_groups.max_num_gen_batches")
    return short > 0


def guards(t, state, metrics: dict, warn) -> Optional[str]:
    """Why to stop, or None: the mean kl/mean of the last trainer.max_kl_window steps (kept in state.recent_kl, this
    step's added) above trainer.max_kl, or policy/entropy below trainer.min_entropy (a stop, or a warning said
    through warn, as trainer.min_entropy_action says). kl/mean is absent only where no actor update ran (critic
    warm-up: the policy is still the reference, so 0 is its value) or with trainer.max_kl=0."""
    state.recent_kl = (state.recent_kl + [metrics.get("kl/mean", 0.0)])[-t.max_kl_window:]
    recent_kl, entropy, stop, warning = state.recent_kl, metrics.get("policy/entropy"), None, None
    mean_kl = sum(recent_kl) / len(recent_kl)
    if t.max_kl and mean_kl > t.max_kl:
        stop = f"kl/mean over the last {len(recent_kl)} steps {mean_kl:.4f} > trainer.max_kl {t.max_kl}"
    if t.min_entropy and entropy is not None and entropy < t.min_entropy:
        message = f"policy/entropy {entropy:.4f} < trainer.min_entropy {t.min_entropy}"
        stop, warning = (message, None) if t.min_entropy_action == "stop" else (stop, message)
    if warning:
        warn("warning: " + warning)
    return stop


def check_names(cfg) -> None:
    """Each name that picks a function from a stage's table is in it: an unknown one fails here, before anything
    loads, never silently picking another; an estimator that compares a prompt's samples has more than one (and is
    warned about greedy ones); and the keys that only work together do (infra/checks.check_combinations)."""
    check_combinations(cfg)
    check_rollout(cfg)  # rollout.name is in rollout.KINDS, and that kind gives what the config asks of it
    for key, name, table in (("algorithm.adv_estimator", cfg.algorithm.adv_estimator, advantages.ESTIMATORS),
                             ("actor.policy_loss", cfg.actor.policy_loss, POLICY_LOSSES),
                             ("algorithm.kl_penalty", cfg.algorithm.kl_penalty, kl.ESTIMATORS),
                             ("algorithm.kl_loss_type", cfg.algorithm.kl_loss_type, kl.ESTIMATORS),
                             ("algorithm.teacher.kl_estimator", cfg.algorithm.teacher.kl_estimator, kl.ESTIMATORS)):
        if name not in table:
            raise ConfigError(f"{key}={name!r} is not one of {', '.join(table)}")
    if cfg.algorithm.adv_estimator in COMPARES_SAMPLES and cfg.rollout.n < 2:
        raise ConfigError(f"algorithm.adv_estimator={cfg.algorithm.adv_estimator} compares the samples of a prompt: "
                          f"set rollout.n ≥ 2 (it is {cfg.rollout.n})")
    if cfg.algorithm.adv_estimator in COMPARES_SAMPLES and cfg.rollout.temperature == 0:  # not refused: tests use it
        cli.warn0(f"algorithm.adv_estimator={cfg.algorithm.adv_estimator} compares the samples of a prompt, and greedy "
                  f"ones (rollout.temperature=0) are one response {cfg.rollout.n} times, so every advantage is 0 and "
                  f"only a KL loss or an entropy bonus trains: set rollout.temperature > 0, e.g. 1.0")


@dataclass(frozen=True)
class Inputs:
    """What check_inputs reads: tokenizer, prompts, the sizes they were checked for, with rollout.multi_turn the
    started environment's settings (rollout.check_turns), val/perplexity's text (validation.References), and with
    data.curriculum the reasoning-gym curriculum that makes train_rows."""
    tokenizer: object
    train_rows: list
    val_rows: list
    sizes: Sizes
    turns: object
    references: object
    curriculum: object


def check_inputs(cfg, num_processes: int, print0=print) -> Inputs:
    """Everything before a model loads, for `num_processes` processes: the tables' names, the model folders (the
    critic's too, when there is one), the teacher's with its vocabulary, each reward source's inputs, the loggers'
    packages, the launcher's FSDP settings, the prompts (a rule's rows must have a ground truth), the batch sizes,
    val/perplexity's text and trainer.best_metric; then says in one line each what the guards watch and what
    val/perplexity is measured on. `ppo.py --check` stops here."""
    check_names(cfg)
    needs_critic = cfg.algorithm.adv_estimator in NEEDS_CRITIC
    check_model_folders(cfg.model, (cfg.critic.model_path or cfg.model.path) if needs_critic else None)
    check_teacher(cfg.algorithm.teacher, cfg.model)
    reward_worker = check_reward_inputs(cfg.reward, cfg.model.trust_remote_code)  # reward.function imported, or None
    check_loggers(cfg.trainer.logger, "trainer.logger")
    fsdp_from_launcher()
    tokenizer = policy_tokenizer(cfg.model)
    curriculum = load_target(CURRICULUM)(cfg.data.curriculum, cfg.data, tokenizer, cfg.trainer.seed, print0) \
        if cfg.data.curriculum else None  # reasoning-gym's: its rows, made at the levels of its tasks
    train_rows, val_rows = (curriculum.rows, curriculum.val_rows) if curriculum else load_prompts(
        cfg.data, tokenizer, print0, rule_of=functools.partial(rule_needing_truth, cfg_reward=cfg.reward),
        default_source="environment" if cfg.rollout.multi_turn.env else "unknown")  # environments: no data_source
    sizes = check_sizes(cfg, num_processes, len(train_rows))
    check_data_sources({r["data_source"] for r in train_rows + val_rows}, cfg.reward)  # each has a rule
    check_sample_call(cfg.reward, reward_worker, train_rows[0])  # a TRL or OpenRLHF reward function takes its keywords
    turns = check_turns(cfg, tokenizer, train_rows + val_rows)  # multi-turn: the environment starts, fits; or None
    references = reference_text(cfg, val_rows, tokenizer)  # val/perplexity's text (data.val_reference)
    check_best_metric(cfg, {r["data_source"] for r in val_rows}, turns.metric_names() if turns else (), references)
    print0(describe_guards(cfg) + "\nval/perplexity: " + references.source)
    return Inputs(tokenizer, train_rows, val_rows, sizes, turns, references, curriculum)


def check_only(cfg, num_processes: int) -> str:
    """`ppo.py --check`: check_inputs, then one line of what a run would do; no model is loaded."""
    print0 = print if os.environ.get("RANK", "0") == "0" else (lambda *args, **kwargs: None)
    cfg = resolve_dtype(cfg, torch.device("cpu" if use_cpu() else "cuda"), print0)
    inputs = check_inputs(cfg, num_processes, print0)
    if inputs.turns is not None:  # an environment's worker process ends with the check
        inputs.turns.environment.close()
    s = inputs.sizes
    return (f"{num_processes} process(es), each a step: {s.prompts} prompts × {cfg.rollout.n} = {s.batch} sequences, "
            f"{s.num_mini} mini-batch(es) of {s.mini}, micro-batches of {s.actor_micro} (actor) and {s.critic_micro} "
            f"(critic); the inputs are there; no model loaded")


def main(cfg: config.Config):
    check_names(cfg)
    needs_critic = cfg.algorithm.adv_estimator in NEEDS_CRITIC
    accelerator = make_accelerator()  # the device, and the launched processes' group (infra/distributed.py)
    print0 = functools.partial(accelerator.print, flush=True)  # rank 0 only; flushed even into a pipe
    cfg = resolve_dtype(cfg, accelerator.device, print0)  # model.dtype=auto → bf16 or fp32 here, saying why
    # before anything loads: output_dir is this run's alone, a checkpoint fits this config, the inputs exist
    lock, resume_from, finished = start_run(accelerator, cfg, "trainer",  # the lock is held until the process ends
                                            unused=frozenset() if needs_critic else frozenset({"critic.model_path"}))
    if finished:
        return None
    # ---- inputs and data: prompts tokenised once, sizes checked, before any model is loaded
    inputs = check_inputs(cfg, accelerator.num_processes, print0)
    tokenizer, train_rows, val_rows, sizes = inputs.tokenizer, inputs.train_rows, inputs.val_rows, inputs.sizes
    set_seed(cfg.trainer.seed)
    t, alg, device, dtype = cfg.trainer, cfg.algorithm, accelerator.device, autocast_dtype(cfg.model.dtype)
    fsdp = fsdp_from_launcher(dtype)  # FSDP2 settings of an accelerate config file, or None

    # ---- models (infra/models.py builds them all): actor, reference, critic; optimisers after sharding
    fwd = Forward(cfg.rollout.temperature or 1.0, dtype, batch_layout(cfg.model, sharded=fsdp is not None),
                  plan_trunk(cfg, with_critic=needs_critic))  # the frozen layers below the adapters, or None
    policy, ref, critic = load_models(cfg, accelerator, fsdp, fwd, with_critic=needs_critic)
    teacher = load_teacher(cfg, accelerator, fsdp, fwd)  # on-policy distillation's (algorithm.teacher), or None
    actor_opt, actor_sched = make_optimizer(policy, cfg.actor.optim, t.total_steps)
    critic_opt, critic_sched = make_optimizer(critic, cfg.critic.optim, t.total_steps) if critic else (None, None)
    # SIGTERM or Ctrl-C from here on ends the step with a checkpoint, step 7 cut at its next micro-batch (train_step)
    stop_signal = StopSignal(verbose=accelerator.is_main_process)
    scorer = Scorer.from_config(cfg, device, tokenizer, stop_signal)  # reward.sources, weighted
    cut = StopAtMicroBatch(functools.partial(stop_signal.received, accelerator))

    # ---- state, resume
    state = TrainState(KLController.from_config(alg.kl_ctrl), {"actor": actor_sched, "critic": critic_sched},
                       inputs.curriculum)
    checkpointed = {"policy": (policy, actor_opt),  # {name: (model, optimiser)} saved beside state.json
                    **({"critic": (critic, critic_opt)} if critic is not None else {})}
    logger = resume(accelerator, cfg, resume_from, checkpointed, state)
    rollout = make_rollout(cfg, policy, tokenizer, accelerator, dtype, synced_forwards=fsdp is not None,
                           turns=inputs.turns)  # rollout.multi_turn: an environment answers between turns
    if cfg.rollout.steps_ahead:  # departure 8: generation k steps early, in a background thread
        rollout = RunAhead(rollout, cfg.rollout, version=max(0, state.step - cfg.critic.warmup_steps))
    score = functools.partial(score_samples, scorer=scorer, tokenizer=tokenizer, eos_ids=rollout.eos_ids, cfg=cfg,
                              accelerator=accelerator)  # step 3: (rows, rollout) → Samples, metrics
    reduce_sum = functools.partial(sum_over_processes, accelerator)
    n, rank, world = cfg.rollout.n, accelerator.process_index, accelerator.num_processes
    draw = functools.partial(draw_prompts, state, train_rows, cfg, rank, sizes.prompts)  # step 1: this process's share

    # ---- what steps 6 and 7 compute with, bound once
    adv_settings = advantages.Settings.from_config(cfg, reduce_sum)
    actor_update = Update("actor", policy, actor_opt, actor_sched, ActorLoss.from_config(cfg, fwd), "loss_mask",
                          sizes.actor_micro, cfg.actor.max_grad_norm)
    critic_update = critic and Update("critic", critic, critic_opt, critic_sched, CriticLoss.from_config(cfg, fwd),
                                      "response_mask", sizes.critic_micro, cfg.critic.max_grad_norm)

    validating = functools.partial(validate, cfg, rollout, tokenizer, scorer, val_rows, accelerator,  # val/perplexity:
                                   functools.partial(held_out_perplexity, policy, fwd, inputs.references, accelerator))
    if t.val_before_train and val_rows and state.step == 0:  # the pre-trained values
        metrics = validating()
        print0("validation before training: " + console_line(metrics, sorted(metrics)))
        if t.best_metric and (said := keep_best(accelerator, cfg, metrics, state, checkpointed)):  # val/env/<key>?
            print0(said)
        logger.log(metrics, 0)
    if signum := stop_signal.received(accelerator):
        raise Interrupted(signum, "during the validation before training; nothing was trained")
    stop_reason, skipped_in_a_row, first = None, 0, state.step + 1  # first: this run's first step (resumed: later)
    for step in tqdm(range(first, t.total_steps + 1), disable=not accelerator.is_main_process, desc="ppo",
                     dynamic_ncols=True):
        times, skipped_before, t0 = {}, state.skipped, time.perf_counter()

        # ---- 1–3. sample prompts, generate n responses each (rollout.py), score them (rewards.py); rounds: departure 6
        kept, metrics, rounds = [], defaultdict(list), 0
        while more_rounds(kept, rounds, sizes.prompts, cfg, accelerator):
            if cfg.rollout.steps_ahead:  # departure 8: generated k steps ago; the batches up to step + k start now
                for ahead in rollout.wants(step, t.total_steps):  # the data position before the draw goes first
                    rollout.submit((state.epoch, state.position), draw(), step_seed(t.seed, ahead, rank))
                rows, ro = rollout.next(step, times, metrics)  # refused when older than k versions
            else:
                rows = draw()  # 1. this process's prompts
                with timed(times, "time/gen_s"):  # 2. row i·n + j: sample j of prompt i
                    ro = rollout.generate(rows, n, cfg.rollout.temperature,
                                          seed=step_seed(t.seed, step, rank + world * rounds))
            with timed(times, "time/reward_s"):  # 3. the prompts' rows n times, their responses scored
                got, scored = score([row for row in rows for _ in range(n)], ro)
            if inputs.curriculum:  # reasoning-gym's: each sample's correctness into its task's window
                inputs.curriculum.record(got.rows, got.texts, accelerator)
            varied = varied_groups(got.scores, n) if alg.filter_groups.enable else torch.ones(len(rows)).bool()
            kept.append(got.take(varied.repeat_interleave(n).nonzero()[:, 0].tolist()))  # the prompts kept
            for key, value in {**scored, "sampling/varied_frac": varied.float().mean().item()}.items():
                metrics[key].append(value)  # a mean over rounds
            rounds += 1
        samples = Samples.cat(kept, tokenizer.pad_token_id).take(list(range(sizes.prompts * n)))
        metrics["sampling/rounds"], scores, truncated = rounds, samples.scores, samples.truncated  # (B,) each
        batch = samples.as_batch(tokenizer.pad_token_id)  # queries, responses, their masks, rollout_logprobs
        response_mask = batch["response_mask"]  # (B, Tr)
        lengths = batch.get("response_attention_mask", response_mask).sum(1)  # (B,) tokens, EOS and tool answers too
        tok_lengths = (batch["query_mask"].sum(1) + lengths).tolist()  # (B,) real tokens, for token budgets

        # ---- 4. old/ref logprobs and values: no grad, micro-batched, in eval mode (see set_train_mode)
        set_train_mode([policy, critic], False)
        no_grad_pass = functools.partial(per_token_pass, batch=batch, max_tokens=sizes.max_tokens, lengths=tok_lengths,
                                         size=cfg.actor.log_prob_micro_batch_size_per_device, device=device,
                                         largest_count=max_over_processes)  # as many forwards on every process
        if fwd.trunk is not None:  # the frozen layers once per sequence; the forwards below start above them
            with timed(times, "time/trunk_s"):
                batch.update(no_grad_pass(lambda micro: fwd.trunk_states(policy, micro)))  # (B, Tq, H), (B, Tr, H)
        # departure 3: where ActorLoss can take them from the update's own forward, they are not computed here
        if needs_old_logprobs(cfg, sizes.num_mini):
            with timed(times, "time/old_logprob_s"):
                batch["old_logprobs"] = no_grad_pass(lambda micro: fwd.logprobs(policy, micro)[0])  # (B, Tr)
        if needs_reference(cfg):  # a KL term, or the trainer.max_kl guard's kl/mean
            with timed(times, "time/ref_s"):
                batch["ref_logprobs"] = no_grad_pass(lambda micro: ref_logprobs(ref, policy, micro, fwd))  # (B, Tr)
        if teacher is not None:  # on-policy distillation: the teacher's log-probs of the policy's own samples
            with timed(times, "time/teacher_s"):
                batch["teacher_logprobs"] = no_grad_pass(lambda micro: teacher_logprobs(teacher, micro, fwd))
        if critic is not None:
            with timed(times, "time/values_s"):
                batch["old_values"] = no_grad_pass(lambda micro: fwd.values(critic, micro)) * response_mask  # (B, Tr)

        # ---- 5. rewards = score at the last token + token rewards − β·KL at every token
        beta = state.kl_ctrl.value
        kl_tokens = torch.zeros(response_mask.shape)  # (B, Tr)
        if alg.use_kl_in_reward:
            kl_tokens = kl_estimate(batch["old_logprobs"], batch["ref_logprobs"], alg.kl_penalty) * response_mask
            seq_kl = accelerator.reduce(masked_mean(kl_tokens, response_mask, 1).mean().to(device), "mean").item()
            state.kl_ctrl.update(seq_kl, cfg.data.train_batch_size * cfg.rollout.n)
        dense = distillation_rewards(samples.token_rewards, batch, alg.teacher)  # (B, Tr): scorers', teacher's; or None
        token_rewards = kl_penalty_rewards(scores, kl_tokens, response_mask, beta, dense)  # (B, Tr)

        # ---- 6. advantages (B, Tr), zero on padding: advantages.ESTIMATORS[algorithm.adv_estimator]; and the
        # tokens the policy loss sees (overlong filtering, rejection sampling)
        batch["advantages"], batch["returns"] = advantages.ESTIMATORS[alg.adv_estimator](
            token_rewards, response_mask.float(), batch.get("old_values"), adv_settings)  # (B, Tr) each
        batch["loss_mask"], mask_metrics = policy_loss_mask(batch, truncated, cfg)  # (B, Tr)

        # ---- 7. PPO epochs over mini-batches, gradient accumulation over micro-batches
        set_train_mode([policy, critic], True)
        update_actor = step > cfg.critic.warmup_steps  # critic warm-up: the actor waits for useful values
        updates = ([actor_update] if update_actor else []) + ([critic_update] if critic is not None else [])
        stats = defaultdict(list)  # metric → its values: one per micro-batch (grad norms: per optimiser step)
        order = torch.Generator().manual_seed(step_seed(t.seed, step, -1))
        for epoch in range(cfg.actor.ppo_epochs):
            for mini_inds in torch.randperm(sizes.batch, generator=order).split(sizes.mini):
                for u in updates:
                    counts = mini_batch_counts(batch[u.mask][mini_inds], accelerator)  # its loss's norm (departure 4)
                    with timed(times, f"time/update_{u.name}_s"):
                        micro_batches = [micro_batch(batch, i, device) for i in split_micro(
                            mini_inds, tok_lengths, u.micro_size, sizes.max_tokens, largest_count=max_over_processes)]
                        # one optimiser step: loss.backward() per micro-batch, gradients averaged over processes,
                        # clipped over every shard, optimizer.step() unless non-finite
                        loss_fn = functools.partial(u.loss, u.model, counts=counts)
                        grad_norm, losses = train_step(u.model, u.optimizer, micro_batches, loss_fn, u.max_grad_norm,
                                                       stop=cut)
                    state.skipped += grad_norm is None and not cut.signum
                    if grad_norm is not None:  # a skipped step has none
                        stats[f"{u.name}/grad_norm"].append(grad_norm)
                    for key, values in losses.items():
                        stats[key] += values
        metrics["actor/lr"] = actor_sched.get_last_lr()[0]
        for u in updates:
            u.scheduler.step()

        # ---- 8. sync rollout weights, between generations: the next must come from the updated policy (departure 8)
        if update_actor and not cut.signum:
            with timed(times, "time/sync_s"):
                rollout.sync_weights(policy, step - cfg.critic.warmup_steps)

        # ---- 9. log: means (maxima for *_max) over this process's batch and micro-batches, then over processes
        metrics.update({**batch_metrics(scores, token_rewards, lengths, truncated), "kl/coef": beta, **stats,
                        **mask_metrics, **(inputs.curriculum.update(step) if inputs.curriculum else {})})
        if critic is not None:
            metrics.update(value_metrics(batch["old_values"], batch["returns"], response_mask, reduce_sum))
        metrics = reduce_metrics(accelerator, metrics)
        tokens = accelerator.reduce(torch.tensor(float(sum(tok_lengths)), device=device), "sum").item()
        times["time/step_s"] = time.perf_counter() - t0
        metrics.update({**times, "perf/tokens_per_s": tokens / times["time/step_s"], "train/skipped_steps": state.skipped})
        skipped_in_a_row = skipped_in_a_row + 1 if state.skipped > skipped_before else 0
        state.step = step

        # ---- guards: a run that drifts too far from the reference, or collapses, is validated and stops
        stop_reason = guards(t, state, metrics, warn=print0)

        # validate (every test_freq steps, and at the end however it comes), keep the best, roll back, and log
        if val_rows and not cut.signum and (due(t.test_freq, step) or step == t.total_steps or stop_reason):
            metrics.update(val_metrics := validating())
            if t.best_metric and (rollback := keep_best(accelerator, cfg, val_metrics, state, checkpointed)):
                print0(rollback)
                rollout.sync_weights(policy, max(0, step - cfg.critic.warmup_steps))  # the next: best/'s weights
        logger.log({**metrics, "train/rollbacks": state.rollbacks}, step)
        print0(f"step {step}  " + console_line(metrics, CONSOLE_KEYS))
        # nothing learnt, no final/: trainer.max_skipped_steps in a row, or every step of a run that ends here
        check_learning(skipped_in_a_row, range(first, step + 1), step == t.total_steps or bool(stop_reason), t, "trainer")
        if due(t.sample_freq, step):
            print0(sample_table(shown_samples(samples, t.num_samples_to_show)))

        # ---- 10. checkpoint; SIGTERM (Slurm's preemption) or Ctrl-C ends the run here, and a rerun resumes
        signum = stop_signal.received(accelerator)
        if due(t.save_freq, step) or step == t.total_steps or stop_reason or signum:
            saved = rollout.rewind(state.state_dict()) if cfg.rollout.steps_ahead else state.state_dict()  # departure 8
            save_checkpoint(accelerator, t.output_dir, step, t.keep_checkpoints, checkpointed, saved)
        if signum:
            print0(f"stopped by {signal.Signals(signum).name} after step {step}, checkpoint saved"
                   f"{' (its updates cut short at a micro-batch)' * bool(cut.signum)}; run the same command to resume")
            logger.close()
            sys.exit(128 + signum)
        if stop_reason:
            print0(f"stopping at step {step}: {stop_reason} (checkpoint saved)")
            break

    # ---- the policy in HF format, and curves for people who would rather look than read
    save_final(accelerator, policy, tokenizer, cfg)
    logger.close()
    accelerator.wait_for_everyone()
    rollout.close()  # a vLLM engine destroys its process groups, and the launcher's; a server child stops
    accelerator.end_training()  # the process group, where one is left
    return stop_reason


if __name__ == "__main__":
    cli.run_script(main, __doc__, config.Config, "ppo.py", check=check_only)
