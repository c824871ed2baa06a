"""PPO for language models in one file: rollouts, scores, KL, advantages, clipped updates.

    accelerate launch ppo.py --config configs.yaml                          # the demo, CPU or GPU
    accelerate launch ppo.py --config configs.yaml trainer.total_steps=20 algorithm.adv_estimator=grpo
    accelerate launch ppo.py --config recipes/dapo.yaml                     # a recipe: its changes to the defaults
    accelerate launch --config_file accelerate_configs/ddp_cpu.yaml --num_processes 2 ppo.py --config configs.yaml
    accelerate launch --config_file accelerate_configs/fsdp2.yaml --num_processes 2 ppo.py --config configs.yaml
    python ppo.py --help                                                    # every config key

Each step: 1. sample prompts, 2. generate, 3. score, 4. old/ref logprobs and values,
5. rewards = score − β·KL, 6. advantages, 7. PPO epochs, 8. sync rollout weights, 9. log,
10. checkpoint. Steps 1–3 are sampling.py's (the rollout, the scores, dynamic sampling); the math is in the stage
files beside this one (advantages.py, losses.py, kl.py, critic.py); the plumbing (command line, run folder,
processes, model loading, the optimiser step, forwards) is in infra/.

How this departs from the textbook (Schulman et al., 2017; Ziegler et al., 2019):
1. An episode is one response; the task score arrives at its last real token (EOS included), and
   the optional KL penalty at every token.
2. old_logprobs are recomputed by the training model, never taken from the sampler: vLLM's
   kernels and precision differ slightly. The gap is logged (rollout/*) and can be corrected by
   truncated importance sampling (algorithm.rollout_is) or by leaving the farthest samples out (algorithm.rollout_rs).
3. With one PPO epoch, one mini-batch and no KL in the reward, the batch is used once while the
   weights are still those that sampled it: old_logprobs = logprobs.detach() from the update's own
   forward, saving a whole forward pass. The ratio is then exactly 1, as it must be.
4. Losses are normalised by the token (or sequence) count of the whole mini-batch over all
   processes, so gradient accumulation and the number of processes do not change the gradient.
5. GRPO/RLOO take a response's return as the sum of its token rewards (the score, minus the KL
   penalty when use_kl_in_reward), and spread one advantage over all its tokens.
6. Dynamic sampling (algorithm.filter_groups, DAPO) fills each process's share of the batch from that process's own
   rounds; every process runs as many rounds as the one that needs most, so all stay in step and in the data order
   (verl, with one controller, pools the kept prompts of the whole batch).
7. A rollback (trainer.rollback_tolerance) restores best/'s weights, optimiser states and β, but not the step, the
   data position, the LR schedule or the RNG: the run goes on with new prompts instead of replaying the same steps.

Shapes: B sequences on this process (prompts × n), Tq prompt length, Tr response length, V vocab.

The batch, a dict of tensors with one row per sequence, filled step by step (micro_batch takes rows of it):
    queries, query_mask          (B, Tq)  2. the prompts, left-padded
    responses, response_mask     (B, Tr)  2. the responses, right-padded; mask 1 = a real token (EOS included)
    response_attention_mask      (B, Tr)  2. multi-turn (agent.py): 1 on tool answers too, where response_mask is 0
    rollout_logprobs             (B, Tr)  2. the sampler's; absent where the rollout has none (rollout.name=hf)
    old_logprobs                 (B, Tr)  4. the policy's before the update; absent under departure 3
    ref_logprobs                 (B, Tr)  4. the reference's; absent without a KL term (reward or loss)
    old_values                   (B, Tr)  4. the critic's; absent without a critic
    trunk_prompt, trunk_response (B, Tq, H), (B, Tr, H)  4. the frozen trunk's output (infra/trunk.py); absent without
    advantages, returns          (B, Tr)  6. returns are the critic's targets
    loss_mask                    (B, Tr)  6. the tokens the policy loss sees: response_mask less the responses that
                                             reward.overlong_filter drops and the tokens algorithm.rollout_rs rejects
"""
import functools
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
import agent
import judge
import kl
from advantages import COMPARES_SAMPLES, masked_mean, NEEDS_CRITIC
from critic import explained_variance, value_loss
from infra import cli, config
from infra.batches import autocast_dtype, Forward, micro_batch, per_token_pass, split_micro
from infra.checks import check_combinations, check_sizes
from infra.config import ConfigError
from infra.distributed import fsdp_from_launcher, max_over_processes, use_cpu
from infra.layouts import batch_layout
from infra.metrics import check_loggers, console_line, reduce_metrics, sample_table, sum_over_processes, timed
from infra.models import check_model_folders, load_models, policy_tokenizer
from infra.optim import make_optimizer, train_step
from infra.runs import Interrupted, save_checkpoint, skipped_steps_error, start_run, StopSignal
from infra.train_state import keep_best, resume, save_final, TrainState
from infra.trunk import plan_trunk
from kl import KLController, kl_estimate, kl_penalty_rewards
from losses import agg_loss, Clip, Counts, POLICY_LOSSES, rejection_mask, rollout_is_weights
from data import load_prompts
from rewards import check_data_sources, check_reward_inputs, rule_needing_truth, Scorer, validate
from rollout import make_rollout
from sampling import Sampler, step_seed

CONSOLE_KEYS = ["score/mean", "reward/mean", "kl/mean", "policy/entropy", "policy/clipfrac", "loss/policy",
                "loss/value", "value/explained_var", "response/length_mean", "val/score/mean", "val/rule_score/mean",
                "time/step_s"]

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

    @classmethod
    def from_config(cls, cfg, fwd: Forward):
        a, alg = cfg.actor, cfg.algorithm
        return cls(fwd, POLICY_LOSSES[a.policy_loss], Clip(a.clip_ratio_low, a.clip_ratio_high, a.clip_ratio_c),
                   a.loss_agg_mode, a.loss_scale_factor or cfg.rollout.max_response_length, a.entropy_coef,
                   alg.use_kl_loss, alg.kl_loss_coef, alg.kl_loss_type, alg.rollout_is, alg.rollout_is_threshold)

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
        metrics.update({"loss/policy": masked_mean(pg.detach(), mask).item(),
                        "policy/clipfrac": masked_mean(clipped, mask).item(),
                        "policy/approx_kl": masked_mean(kl_estimate(old_logprobs, logprobs.detach(), "k3"),
                                                        mask).item(),
                        "policy/entropy": masked_mean(entropy.detach(), mask).item()})
        return agg_loss(loss, mask, self.loss_agg_mode, counts, self.loss_scale_factor), metrics


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
    mask: str  # the batch's mask of the tokens its loss sees: loss_mask (actor) or response_mask (critic)
    micro_size: int  # sequences per forward/backward
    max_grad_norm: float


def mini_batch_counts(mask, accelerator) -> Counts:
    """The tokens (at least 1) and sequences of a mini-batch, averaged over processes: what its loss is normalised by.
    The mean, not the sum, because DDP and FSDP2 average the processes' gradients (departure 4)."""
    counts = torch.tensor([max(float(mask.sum()), 1.0), float(len(mask))], device=accelerator.device)
    return Counts(*(accelerator.reduce(counts, "sum") / accelerator.num_processes).tolist())


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


def batch_metrics(scores, token_rewards, lengths, truncated) -> dict:
    """Means over this process's batch: scores (B,), the summed token rewards (B, Tr), response lengths (B,), and
    the share of responses cut off at max_response_length."""
    return {"score/mean": scores.mean().item(), "score/max": scores.max().item(), "score/min": scores.min().item(),
            "reward/mean": token_rewards.sum(1).mean().item(), "response/length_mean": lengths.float().mean().item(),
            "response/clip_ratio": truncated.float().mean().item()}


def guards(t, state, metrics: dict) -> tuple[Optional[str], Optional[str]]:
    """(why to stop, or None; a warning, or None): the mean kl/mean of the last trainer.max_kl_window steps (kept in
    state.recent_kl, this step's added) above trainer.max_kl, or policy/entropy below trainer.min_entropy (a stop or
    a warning, as trainer.min_entropy_action says)."""
    state.recent_kl = (state.recent_kl + [metrics.get("kl/mean", 0.0)])[-t.max_kl_window:]
    recent_kl, entropy, stop, warning = state.recent_kl, metrics.get("policy/entropy"), None, None
    mean_kl = sum(recent_kl) / len(recent_kl)
    if t.max_kl and mean_kl > t.max_kl:
        stop = f"kl/mean over the last {len(recent_kl)} steps {mean_kl:.4f} > trainer.max_kl {t.max_kl}"
    if t.min_entropy and entropy is not None and entropy < t.min_entropy:
        message = f"policy/entropy {entropy:.4f} < trainer.min_entropy {t.min_entropy}"
        stop, warning = (message, None) if t.min_entropy_action == "stop" else (stop, message)
    return stop, warning


def check_names(cfg) -> None:
    """Each name that picks a function from a stage's table is in it: an unknown one fails here, before anything
    loads, never silently picking another; an estimator that compares a prompt's samples has more than one; and the
    keys that only work together do (infra/checks.check_combinations)."""
    check_combinations(cfg)
    for key, name, table in (("algorithm.adv_estimator", cfg.algorithm.adv_estimator, advantages.ESTIMATORS),
                             ("actor.policy_loss", cfg.actor.policy_loss, POLICY_LOSSES),
                             ("algorithm.kl_penalty", cfg.algorithm.kl_penalty, kl.ESTIMATORS),
                             ("algorithm.kl_loss_type", cfg.algorithm.kl_loss_type, kl.ESTIMATORS),
                             ("rollout.multi_turn.format", cfg.rollout.multi_turn.format, agent.PARSERS),
                             ("reward.judge.parser", cfg.reward.judge.parser, judge.PARSERS)):
        if name not in table:
            raise ConfigError(f"{key}={name!r} is not one of {', '.join(table)}")
    if cfg.algorithm.adv_estimator in COMPARES_SAMPLES and cfg.rollout.n < 2:
        raise ConfigError(f"algorithm.adv_estimator={cfg.algorithm.adv_estimator} compares the samples of a prompt: "
                          f"set rollout.n ≥ 2 (it is {cfg.rollout.n})")


def policy_loss_mask(batch: dict, truncated, cfg) -> tuple[torch.Tensor, dict]:
    """loss_mask (B, Tr): response_mask less the responses cut off at rollout.max_response_length
    (reward.overlong_filter, DAPO's overlong filtering) and less the tokens, or responses, whose sampler/trainer
    ratio leaves algorithm.rollout_rs's band (losses.rejection_mask); and the share of real tokens rejected."""
    alg, response_mask = cfg.algorithm, batch["response_mask"].float()
    loss_mask, metrics = response_mask, {}
    if cfg.reward.overlong_filter:
        loss_mask = loss_mask * (~truncated).float()[:, None]
    if alg.rollout_rs != "off":
        kept = rejection_mask(batch["old_logprobs"], batch["rollout_logprobs"], response_mask, alg.rollout_rs,
                              alg.rollout_rs_threshold_lower or 1 / alg.rollout_rs_threshold, alg.rollout_rs_threshold)
        metrics["rollout/rs_rejected_frac"] = 1 - masked_mean(kept, response_mask).item()
        loss_mask = loss_mask * kept
    return loss_mask, metrics


def check_inputs(cfg, needs_critic: bool) -> None:
    """Before any model loads: the model folders (and the critic's, when there is one), the reward model or reward
    function, and the loggers' packages."""
    check_model_folders(cfg.model, (cfg.critic.model_path or cfg.model.path) if needs_critic else None)
    check_reward_inputs(cfg.reward, cfg.model.trust_remote_code)
    check_loggers(cfg.trainer.logger, "trainer.logger")


def main(cfg: config.Config):
    check_names(cfg)
    needs_critic = cfg.algorithm.adv_estimator in NEEDS_CRITIC
    accelerator = Accelerator(cpu=use_cpu())  # on a CPU, launched processes join over gloo
    print0 = functools.partial(accelerator.print, flush=True)  # rank 0 only; flushed even into a pipe
    # before anything loads: output_dir is this run's alone, a checkpoint fits this config, the inputs exist
    lock, resume_from, finished = start_run(accelerator, cfg, "trainer",  # the lock is held until the process ends
                                            unused=frozenset() if needs_critic else frozenset({"critic.model_path"}))
    if finished:
        return None
    check_inputs(cfg, needs_critic)
    set_seed(cfg.trainer.seed)
    t, alg, device = cfg.trainer, cfg.algorithm, accelerator.device
    dtype = autocast_dtype(cfg.model.dtype)
    fsdp = fsdp_from_launcher(dtype)  # FSDP2 settings of an accelerate config file, or None
    tokenizer = policy_tokenizer(cfg.model)

    # ---- data: prompts tokenised once, sizes checked before any model is loaded
    train_rows, val_rows = load_prompts(cfg.data, tokenizer, print0,  # a rule's rows must have a ground truth
                                        rule_of=functools.partial(rule_needing_truth, cfg_reward=cfg.reward))
    sizes = check_sizes(cfg, accelerator.num_processes, len(train_rows))
    check_data_sources({r["data_source"] for r in train_rows + val_rows}, cfg.reward)  # each has a rule
    turns = agent.check_multi_turn(cfg, tokenizer)  # multi-turn: the environment or tools start, the template fits
    n, B = cfg.rollout.n, sizes.batch

    # ---- models (infra/models.py builds them all): actor, reference, critic; optimisers after sharding
    fwd = Forward(cfg.rollout.temperature or 1.0, dtype, batch_layout(cfg.model, sharded=fsdp is not None),
                  plan_trunk(cfg, with_critic=needs_critic))  # the frozen layers below the adapters, or None
    policy, ref, critic = load_models(cfg, accelerator, fsdp, fwd, with_critic=needs_critic)
    actor_opt, actor_sched = make_optimizer(policy, cfg.actor.optim, t.total_steps)
    critic_opt, critic_sched = make_optimizer(critic, cfg.critic.optim, t.total_steps) if critic else (None, None)
    # SIGTERM or Ctrl-C from here on ends a step with a checkpoint (a hung reward call delays it ≤ reward.timeout_s)
    stop_signal = StopSignal(verbose=accelerator.is_main_process)
    scorer = Scorer(cfg.reward, device, dtype, trust_remote_code=cfg.model.trust_remote_code, stop=stop_signal)

    # ---- state, resume
    state = TrainState(KLController(alg.kl_ctrl.type, alg.kl_ctrl.kl_coef, alg.kl_ctrl.target_kl,
                                    alg.kl_ctrl.horizon), {"actor": actor_sched, "critic": critic_sched})
    checkpointed = {"policy": (policy, actor_opt),  # {name: (model, optimiser)} saved beside state.json
                    **({"critic": (critic, critic_opt)} if critic is not None else {})}
    logger = resume(accelerator, cfg, resume_from, checkpointed, state)
    rollout = make_rollout(cfg, policy, tokenizer, accelerator, dtype, synced_forwards=fsdp is not None)
    rollout = agent.with_tools(rollout, turns, tokenizer)  # with rollout.multi_turn: an environment between turns
    sample = Sampler(rollout, tokenizer, scorer, accelerator, cfg, sizes.prompts)  # steps 1–3
    reduce_sum = functools.partial(sum_over_processes, accelerator)

    # ---- what steps 6 and 7 compute with, bound once
    estimate = advantages.ESTIMATORS[alg.adv_estimator]
    adv_settings = advantages.Settings(alg.gamma, alg.lam, n, alg.norm_adv_by_std_in_grpo, alg.whiten_advantages,
                                       reduce_sum)
    actor_update = Update("actor", policy, actor_opt, actor_sched, ActorLoss.from_config(cfg, fwd), "loss_mask",
                          sizes.actor_micro, cfg.actor.max_grad_norm)
    critic_update = critic and Update("critic", critic, critic_opt, critic_sched,
                                      CriticLoss(fwd, cfg.critic.cliprange_value, cfg.critic.vf_coef), "response_mask",
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
        times, skipped_before, t0 = {}, state.skipped, time.perf_counter()

        # ---- 1–3. sample prompts, generate n responses each, score them (sampling.Sampler); with algorithm.filter_groups
        # (DAPO's dynamic sampling) in rounds, until every process holds its share of prompts whose scores differ
        samples, metrics = sample.batch(state, train_rows, step, times)
        rows, texts, scores, truncated = samples.rows, samples.texts, samples.scores, samples.truncated  # (B,) each
        batch = samples.as_batch(tokenizer.pad_token_id)  # queries, responses, their masks, rollout_logprobs
        response_mask = batch["response_mask"]  # (B, Tr)
        lengths = batch.get("response_attention_mask", response_mask).sum(1)  # (B,) tokens, EOS and tool answers too
        tok_lengths = (batch["query_mask"].sum(1) + lengths).tolist()  # (B,) real tokens, for token budgets

        # ---- 4. old/ref logprobs and values: no grad, micro-batched, in eval mode (set_train_mode says why)
        set_train_mode([policy, critic], False)
        no_grad_pass = functools.partial(per_token_pass, batch=batch, max_tokens=sizes.max_tokens, lengths=tok_lengths,
                                         size=cfg.actor.log_prob_micro_batch_size_per_device, device=device,
                                         largest_count=max_over_processes)  # as many forwards on every process
        if fwd.trunk is not None:  # issue 25: the frozen layers once per sequence; the forwards below start above them
            with timed(times, "time/trunk_s"):
                batch.update(no_grad_pass(lambda micro: fwd.trunk_states(policy, micro)))  # (B, Tq, H), (B, Tr, H)
        # departure 3: with one epoch of one mini-batch, no KL in the reward and no rejection, ActorLoss takes
        # old_logprobs from the update's own forward instead
        if cfg.actor.ppo_epochs > 1 or sizes.num_mini > 1 or alg.use_kl_in_reward or alg.rollout_rs != "off":
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

        # ---- 6. advantages (B, Tr), zero on padding: advantages.ESTIMATORS[algorithm.adv_estimator]; and the
        # tokens the policy loss sees (overlong filtering, rejection sampling)
        batch["advantages"], batch["returns"] = estimate(token_rewards, response_mask.float(), batch.get("old_values"),
                                                         adv_settings)  # (B, Tr) each
        batch["loss_mask"], mask_metrics = policy_loss_mask(batch, truncated, cfg)  # (B, Tr)

        # ---- 7. PPO epochs over mini-batches, gradient accumulation over micro-batches
        set_train_mode([policy, critic], True)
        update_actor = step > cfg.critic.warmup_steps  # critic warm-up: the actor waits for useful values
        updates = ([actor_update] if update_actor else []) + ([critic_update] if critic is not None else [])
        stats = defaultdict(list)  # metric → its values: one per micro-batch (grad norms: per optimiser step)
        order = torch.Generator().manual_seed(step_seed(t.seed, step, -1))
        for epoch in range(cfg.actor.ppo_epochs):
            for mini_inds in torch.randperm(B, generator=order).split(sizes.mini):
                for u in updates:
                    counts = mini_batch_counts(batch[u.mask][mini_inds], accelerator)  # its loss's norm (departure 4)
                    with timed(times, f"time/update_{u.name}_s"):
                        micro_batches = [micro_batch(batch, i, device) for i in split_micro(
                            mini_inds, tok_lengths, u.micro_size, sizes.max_tokens, largest_count=max_over_processes)]
                        # one optimiser step: loss.backward() per micro-batch, gradients averaged over processes,
                        # clipped over every shard, optimizer.step() unless non-finite
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
        metrics.update({**batch_metrics(scores, token_rewards, lengths, truncated), "kl/coef": beta, **stats,
                        **mask_metrics})
        if critic is not None:
            metrics["value/mean"] = masked_mean(batch["old_values"], response_mask).item()
            metrics["value/explained_var"] = explained_variance(batch["old_values"], batch["returns"], response_mask,
                                                                reduce_sum)
        metrics = reduce_metrics(accelerator, metrics)
        tokens = accelerator.reduce(torch.tensor(float(sum(tok_lengths)), device=device), "sum").item()
        times["time/step_s"] = time.perf_counter() - t0
        metrics.update({**times, "perf/tokens_per_s": tokens / times["time/step_s"],
                        "train/skipped_steps": state.skipped})
        skipped_in_a_row = skipped_in_a_row + 1 if state.skipped > skipped_before else 0
        state.step = step

        # ---- guards: a run that drifts too far from the reference, or collapses, is validated and stops
        stop_reason, warning = guards(t, state, metrics)
        if warning:
            print0("warning: " + warning)

        # validate (every test_freq steps, and at the end however it comes), keep the best, roll back, and log
        if val_rows and ((t.test_freq and step % t.test_freq == 0) or step == t.total_steps or stop_reason):
            val_metrics = validate(cfg, rollout, tokenizer, scorer, val_rows, accelerator)
            metrics.update(val_metrics)
            if t.best_metric and (rollback := keep_best(accelerator, cfg, val_metrics, state, checkpointed)):
                print0(rollback)
                rollout.sync_weights(policy)  # the next batch comes from best/'s weights
        logger.log({**metrics, "train/rollbacks": state.rollbacks}, step)
        bar.set_postfix(score=f"{metrics['score/mean']:.3f}", kl=f"{metrics.get('kl/mean', 0):.4f}")
        print0(f"step {step}  " + console_line(metrics, CONSOLE_KEYS))
        if t.max_skipped_steps and skipped_in_a_row >= t.max_skipped_steps:  # nothing learnt: no final/
            raise skipped_steps_error(skipped_in_a_row, step, "trainer", t.output_dir)
        if t.sample_freq and step % t.sample_freq == 0:
            shown = list(range(0, B, max(1, B // t.num_samples_to_show)))[:t.num_samples_to_show]
            print0(sample_table([(rows[i]["prompt_text"][-40:], agent.transcript(rows[i], texts[i]), scores[i].item(),
                                  rows[i].get("judge_answer", "")) for i in shown]))

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
    rollout.close()  # a vLLM engine destroys its process groups, and the launcher's
    accelerator.end_training()  # the process group, where one is left
    return stop_reason


if __name__ == "__main__":
    cli.run_script(main, __doc__, config.Config, "ppo.py")
