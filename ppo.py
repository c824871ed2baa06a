"""PPO for language models in one file: rollouts, scores, KL, advantages, clipped updates.

    accelerate launch ppo.py --config configs.yaml                          # the demo, CPU or GPU
    accelerate launch ppo.py --config configs.yaml trainer.total_steps=20 algorithm.adv_estimator=gae
    accelerate launch --multi_gpu --num_processes 2 ppo.py --config configs.yaml  # DDP: 2 processes (gloo on a CPU)
    accelerate launch --config_file accelerate_configs/fsdp2.yaml --num_processes 2 ppo.py --config configs.yaml  # FSDP2
    python ppo.py --help                                                    # every config key

Each step: 1. sample prompts, 2. generate, 3. score, 4. old/ref logprobs and values,
5. rewards = score − β·KL, 6. advantages, 7. PPO epochs, 8. sync rollout weights, 9. log,
10. checkpoint.

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
"""
import functools
import os
import signal
import sys
import time
from collections import defaultdict

import torch
from accelerate import Accelerator
from accelerate.utils import set_seed
from tqdm import tqdm

import config
import data
from batches import (batch_layout, forward_logprobs, forward_values, micro_batch, per_token_pass, split_micro,
                     use_varlen_attention)
from critic import explained_variance, gae, load_critic, value_loss
from distributed import (clip_grad_norm, describe, distribute, fsdp_from_launcher, full_state_dict, gradient_sync,
                         load_training_state, save_training_state)
from kl import KLController, kl_estimate, kl_penalty_rewards
from rewards import check_data_sources, load_reward_function, rule_for, Scorer, score_responses
from rollout import HFRollout, left_pad, make_rollout
from utils import (add_lora, autocast_dtype, check_loggers, check_model_path, console_line, exact_div, load_policy,
                   load_reference, load_tokenizer, make_optimizer, MetricsLogger, plot_curves, reduce_metrics,
                   restore_schedule, resume_or_start, sample_table, save_checkpoint, save_pretrained_atomic, start_run,
                   StopSignal, timed, use_gradient_checkpointing, wandb_resume_id)

# ---------------------------------------------------------------------------------------
# Math: small pure functions, each a line of a paper


def masked_mean(x, mask, dim=None):
    return (x * mask).sum(dim) / mask.sum(dim).clamp(min=1)


def masked_whiten(x, mask, reduce_sum=None, eps=1e-8):
    """(x − mean) / std over the real tokens of the whole batch; padding stays 0. Biased variance, as in
    lm-human-preferences (verl divides by N − 1). reduce_sum sums a tensor over processes (None: one process),
    so that 2 processes whiten as 1 would."""
    sums = torch.stack([(x * mask).sum(), (x.square() * mask).sum(), mask.sum()]).double()  # Σx, Σx², N
    total, total_sq, count = (reduce_sum(sums) if reduce_sum else sums).tolist()
    mean = total / max(count, 1)
    var = max(total_sq / max(count, 1) - mean ** 2, 0.0)
    return ((x - mean) / (var + eps) ** 0.5 * mask).to(x.dtype)


def grpo_advantages(returns, response_mask, n: int, norm_by_std: bool, eps=1e-6):
    """Â_i = (R_i − mean_g R) / (std_g R + ε) over the n samples g of a prompt   (Shao et al., 2024)

    norm_by_std=False drops the division (Liu et al., 2025, "Dr. GRPO"). returns (B,) → (B, Tr).
    """
    groups = returns.view(-1, n)  # (B/n, n)
    adv = groups - groups.mean(dim=1, keepdim=True)
    if norm_by_std:
        adv = adv / (groups.std(dim=1, keepdim=True) + eps)
    return adv.reshape(-1, 1) * response_mask


def rloo_advantages(returns, response_mask, n: int):
    """Â_i = R_i − 1/(n−1) · Σ_{j≠i} R_j   (Ahmadian et al., 2024, REINFORCE leave-one-out)"""
    groups = returns.view(-1, n)  # (B/n, n)
    baseline = (groups.sum(dim=1, keepdim=True) - groups) / (n - 1)
    return (groups - baseline).reshape(-1, 1) * response_mask


def reinforce_plus_plus_advantages(rewards, response_mask, gamma: float, reduce_sum=None):
    """REINFORCE++ (Hu, 2025; OpenRLHF's `reinforce` estimator, trainer/ppo_utils/experience_maker.py):

        G_t = r_t + γ·G_{t+1}        r_t = −β·KL_t at every token, + the score at the last real token
        Â_t = (G_t − μ) / σ         μ, σ² = mean and variance of G over the real tokens of the GLOBAL batch
    reduce_sum sums a tensor over processes (None: this process holds the whole batch).
    rewards, response_mask (B, Tr) → (advantages, returns), both zero on padding.
    """
    rewards = rewards * response_mask
    returns = torch.zeros_like(rewards)  # (B, Tr)
    running = torch.zeros_like(rewards[:, 0])  # (B,)
    for t in reversed(range(rewards.shape[1])):
        running = rewards[:, t] + gamma * running
        returns[:, t] = running
    returns = returns * response_mask
    return masked_whiten(returns, response_mask, reduce_sum), returns


def policy_loss(logprobs, old_logprobs, advantages, clip_low: float, clip_high: float, clip_c: float):
    """PPO's clipped surrogate, per token (Schulman et al., 2017), with dual clip (Ye et al., 2020):

        ratio = exp(log π − log π_old)
        pg_loss1 = −Â·ratio ;  pg_loss2 = −Â·clip(ratio, 1 − ε_low, 1 + ε_high) ;  pg = max(pg_loss1, pg_loss2)
        where Â < 0:  pg = min(pg, −Â·c)      (bounds the loss of a huge ratio on a bad action)
    Returns pg (B, Tr) and a (B, Tr) float mask of where clipping bit.
    """
    ratio = torch.exp(logprobs - old_logprobs)
    pg_loss1 = -advantages * ratio
    pg_loss2 = -advantages * ratio.clamp(1 - clip_low, 1 + clip_high)
    pg = torch.max(pg_loss1, pg_loss2)
    pg = torch.where(advantages < 0, torch.min(pg, -advantages * clip_c), pg)
    return pg, (pg_loss2 > pg_loss1).float()


def rollout_is_weights(old_logprobs, rollout_logprobs, response_mask, level: str, threshold: float):
    """Truncated importance weights for the gap between sampler and trainer (Yao et al., 2025), all (B, Tr):

        token:     w_t = min(exp(log π_old(y_t) − log π_rollout(y_t)), C)
        sequence:  w_t = min(exp(Σ_s log π_old(y_s) − log π_rollout(y_s)), C)   the same for every t of a response
    with C = threshold; padding's log-ratio counts as 0.
    """
    log_w = (old_logprobs - rollout_logprobs) * response_mask
    if level == "sequence":
        log_w = log_w.sum(1, keepdim=True).expand_as(log_w)
    return log_w.exp().clamp(max=threshold)


def agg_loss(loss_mat, mask, mode: str, num_tokens: float, num_seqs: float):
    """This micro-batch's share of the mini-batch loss, normalised by the mini-batch's counts:

        token-mean:          Σ_{i,t} ℓ_it / N_tokens
        seq-mean-token-sum:  Σ_i Σ_t ℓ_it / N_seqs
        seq-mean-token-mean: Σ_i (Σ_t ℓ_it / T_i) / N_seqs
    Summing the shares of all micro-batches gives the loss of the whole mini-batch.
    """
    if mode == "token-mean":
        return (loss_mat * mask).sum() / num_tokens
    if mode == "seq-mean-token-sum":
        return (loss_mat * mask).sum() / num_seqs
    if mode == "seq-mean-token-mean":
        return ((loss_mat * mask).sum(1) / mask.sum(1).clamp(min=1)).sum() / num_seqs
    raise ValueError(f"unknown loss_agg_mode {mode!r}")


# ---------------------------------------------------------------------------------------
# Updates


def train_mini_batch(model, optimizer, micro_batches, loss_fn, max_grad_norm: float):
    """Accumulate gradients over the micro-batches, then one clipped optimiser step.

    A non-finite loss or gradient never reaches the weights: the step is skipped (returns None).
    DDP and FSDP2 average gradients over processes only after the last micro-batch.
    """
    for i, mb in enumerate(micro_batches):
        with gradient_sync(model, enabled=i == len(micro_batches) - 1):
            loss_fn(mb).backward()
    grad_norm = clip_grad_norm(model.parameters(), max_grad_norm)
    finite = bool(torch.isfinite(grad_norm))  # the same on every process: gradients are already averaged
    if finite:
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return grad_norm.item() if finite else None


def actor_loss(cfg, policy, mb, temperature, dtype, layout, norm, on_policy, use_ref, first_epoch, stats):
    """Clipped policy loss (× rollout importance weight) − entropy bonus + KL loss, for one micro-batch."""
    alg, mask = cfg.algorithm, mb["response_mask"].float()
    logprobs, entropy = forward_logprobs(policy, mb, temperature, dtype, True, layout)
    old = logprobs.detach() if on_policy else mb["old_logprobs"]  # departure 3
    pg, clipped = policy_loss(logprobs, old, mb["advantages"], cfg.actor.clip_ratio_low,
                              cfg.actor.clip_ratio_high, cfg.actor.clip_ratio_c)
    if "rollout_logprobs" in mb:  # departure 2: how far the sampler was from the training model
        level = "sequence" if alg.rollout_is == "sequence" else "token"  # off: token weights, logged only
        is_weight = rollout_is_weights(old, mb["rollout_logprobs"], mask, level, alg.rollout_is_threshold)
        if alg.rollout_is != "off":
            pg = pg * is_weight
        diff = (old - mb["rollout_logprobs"]).abs() * mask
        stats["rollout/is_weight_mean"].append(masked_mean(is_weight, mask).item())
        stats["rollout/logprob_diff_mean"].append(masked_mean(diff, mask).item())
        stats["rollout/logprob_diff_max"].append(diff.max().item())
        stats["rollout/ratio_mean"].append(masked_mean((old - mb["rollout_logprobs"]).exp(), mask).item())
    loss_mat = pg - cfg.actor.entropy_coef * entropy
    if use_ref:
        if alg.use_kl_loss:
            loss_mat = loss_mat + alg.kl_loss_coef * kl_estimate(logprobs, mb["ref_logprobs"], alg.kl_loss_type)
        if first_epoch:  # kl/mean: the rollout policy's distance from the reference, as penalised, else k1:
            # unbiased like k3, without k3's heavy tail (r − 1 − log r for a token π has nearly dropped)
            kind = alg.kl_penalty if alg.use_kl_in_reward else "k1"
            stats["kl/mean"].append(masked_mean(kl_estimate(old, mb["ref_logprobs"], kind), mask).item())
    stats["loss/policy"].append(masked_mean(pg.detach(), mask).item())
    stats["policy/clipfrac"].append(masked_mean(clipped, mask).item())
    stats["policy/approx_kl"].append(masked_mean(kl_estimate(old, logprobs.detach(), "k3"), mask).item())
    stats["policy/entropy"].append(masked_mean(entropy.detach(), mask).item())
    return agg_loss(loss_mat, mask, cfg.actor.loss_agg_mode, *norm)


def critic_loss(cfg, critic, mb, dtype, layout, norm, stats):
    """vf_coef · clipped value loss, token-mean over the mini-batch, for one micro-batch."""
    mask = mb["response_mask"].float()
    values = forward_values(critic, mb, dtype, layout)
    vf, vf_clipfrac = value_loss(values, mb["values"], mb["returns"], mask, cfg.critic.cliprange_value)
    stats["loss/value"].append(masked_mean(vf.detach(), mask).item())
    stats["value/clipfrac"].append(vf_clipfrac.item())
    return cfg.critic.vf_coef * agg_loss(vf, mask, "token-mean", *norm)


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


def sum_over_processes(accelerator, x: torch.Tensor) -> torch.Tensor:
    return accelerator.reduce(x.to(accelerator.device), "sum").to(x.device)


def decode_responses(tokenizer, responses, response_mask) -> list[str]:
    return tokenizer.batch_decode([r[m.bool()].tolist() for r, m in zip(responses, response_mask)],
                                  skip_special_tokens=True)


@torch.no_grad()
def validate(cfg, rollout, tokenizer, scorer, val_rows, accelerator):
    """Generate once per validation prompt (greedy by default); mean score overall and per data_source, and
    when a reward model scores, the task's rule on the same answers (rows with a ground truth and a rule)."""
    mine = val_rows[accelerator.process_index::accelerator.num_processes]
    ro = rollout.generate([r["prompt_ids"] for r in mine], n=1, temperature=cfg.rollout.val_temperature)
    texts = decode_responses(tokenizer, ro.responses, ro.response_mask)
    scores, _ = scorer(mine, texts)
    sources = sorted({r["data_source"] for r in val_rows})
    sums = torch.zeros(len(sources), 2)  # (sum of scores, count) per source
    for row, s in zip(mine, scores.tolist()):
        sums[sources.index(row["data_source"])] += torch.tensor([s, 1.0])
    sums = accelerator.reduce(sums.to(accelerator.device), "sum").cpu()
    metrics = {"val/score/mean": (sums[:, 0].sum() / sums[:, 1].sum()).item()}
    metrics.update({f"val/{src}/score": (s / max(c, 1)).item() for src, (s, c) in zip(sources, sums)})
    if scorer.model is not None:  # the task's rule on the same answers: does what the reward model likes score?
        ruled = [(row, text) for row, text in zip(mine, texts)
                 if row["ground_truth"] is not None and (cfg.reward.function or rule_for(row["data_source"]))]
        rule_scores, _, _ = score_responses(scorer.rule_fn or load_reward_function(cfg.reward.function),
                                            [row for row, _ in ruled], [text for _, text in ruled])
        total = accelerator.reduce(torch.tensor([sum(rule_scores), len(rule_scores)], device=accelerator.device),
                                   "sum").tolist()
        if total[1]:
            metrics["val/rule_score/mean"] = total[0] / total[1]
    return metrics


def check_sizes(cfg, world: int, num_rows: int) -> dict:
    """Every derived batch size, computed once; one that does not divide fails here with a sentence."""
    d, a, n = cfg.data, cfg.actor, cfg.rollout.n
    if cfg.algorithm.adv_estimator in ("grpo", "rloo") and n < 2:
        raise config.ConfigError(f"algorithm.adv_estimator={cfg.algorithm.adv_estimator} compares the samples of a "
                         f"prompt: set rollout.n ≥ 2 (it is {n})")
    if num_rows < d.train_batch_size:
        raise config.ConfigError(f"data.train_files has {num_rows} usable prompts, fewer than "
                         f"data.train_batch_size={d.train_batch_size}")
    prompts = exact_div(d.train_batch_size, world, "data.train_batch_size across processes")
    num_mini = exact_div(d.train_batch_size, a.ppo_mini_batch_size,
                         "data.train_batch_size by actor.ppo_mini_batch_size (prompts per mini-batch)")
    mini = exact_div(a.ppo_mini_batch_size * n, world, "actor.ppo_mini_batch_size × rollout.n across processes")
    micro = min(a.ppo_micro_batch_size_per_device, mini)
    exact_div(mini, micro, "sequences per mini-batch on one process by actor.ppo_micro_batch_size_per_device")
    critic_micro = min(cfg.critic.ppo_micro_batch_size_per_device, mini)
    exact_div(mini, critic_micro, "sequences per mini-batch on one process by critic.ppo_micro_batch_size_per_device")
    return dict(prompts=prompts, num_mini=num_mini, mini=mini, micro=micro, critic_micro=critic_micro,
                batch=prompts * n)


def check_inputs(cfg) -> None:
    """The models and the reward function this run will load, checked before anything loads."""
    check_model_path(cfg.model.path, "model.path")
    check_model_path(cfg.model.tokenizer_path or cfg.model.path,
                     "model.tokenizer_path" if cfg.model.tokenizer_path else "model.path", need="tokenizer")
    if cfg.algorithm.adv_estimator == "gae":
        check_model_path(cfg.critic.model_path or cfg.model.path, "critic.model_path")
    if cfg.reward.type in ("model", "both"):
        if not cfg.reward.model_path:
            raise config.ConfigError(f"reward.type={cfg.reward.type} needs reward.model_path (the final/ folder "
                                     f"written by reward_model.py)")
        check_model_path(cfg.reward.model_path, "reward.model_path")
    if cfg.reward.type in ("rule", "both"):
        try:
            load_reward_function(cfg.reward.function)
        except ValueError as e:
            raise config.ConfigError(str(e)) from None


def main(cfg: config.Config):
    accelerator = Accelerator(cpu=not torch.cuda.is_available())  # on a CPU, launched processes join over gloo
    print0 = functools.partial(accelerator.print, flush=True)  # rank 0 only; flushed even into a pipe
    # before anything loads: output_dir is this run's alone, a checkpoint fits this config, the inputs exist
    lock, resume_from, finished = start_run(accelerator, cfg, "trainer")  # the lock is held until the process ends
    if finished:
        return None
    check_inputs(cfg)
    check_loggers(cfg.trainer.logger, "trainer.logger")
    set_seed(cfg.trainer.seed)
    t, alg, device = cfg.trainer, cfg.algorithm, accelerator.device
    dtype = autocast_dtype(cfg.model.dtype)
    fsdp = fsdp_from_launcher(dtype)  # FSDP2 settings of an accelerate config file, or None
    tokenizer = load_tokenizer(cfg.model.tokenizer_path or cfg.model.path)

    # ---- data: prompts tokenised once, sizes checked before any model is loaded
    train_rows, stats = data.load_rl_dataset(cfg.data.train_files, tokenizer, cfg.data.max_prompt_length,
                                             cfg.data.truncation)
    print0(f"train prompts: {stats}")
    val_rows = []
    if cfg.data.val_files:
        val_rows, val_stats = data.load_rl_dataset(cfg.data.val_files, tokenizer, cfg.data.max_prompt_length,
                                                   cfg.data.truncation)
        val_rows = val_rows[:cfg.data.val_max_samples or None]
        print0(f"val prompts: {val_stats}, using {len(val_rows)}")
    sizes = check_sizes(cfg, accelerator.num_processes, len(train_rows))
    check_data_sources({r["data_source"] for r in train_rows + val_rows}, cfg.reward)  # each has a rule
    n, B = cfg.rollout.n, sizes["batch"]
    on_policy_shortcut = (cfg.actor.ppo_epochs == 1 and sizes["num_mini"] == 1 and not alg.use_kl_in_reward)

    # ---- models: actor, reference, critic (each sharded under FSDP2, else replicated), reward
    policy = distribute(load_policy(cfg.model), accelerator, fsdp, trainable=True)
    actor_opt, actor_sched = make_optimizer(policy, cfg.actor.optim, t.total_steps)  # after sharding: DTensors
    use_ref = alg.use_kl_in_reward or alg.use_kl_loss
    ref = None
    if use_ref and cfg.model.lora_rank == 0:  # with LoRA the reference is the actor with its adapter disabled
        ref = distribute(load_reference(cfg.model.path), accelerator, fsdp, trainable=False)
    critic = critic_opt = critic_sched = None
    if alg.adv_estimator == "gae":
        critic = load_critic(cfg.critic.model_path or cfg.model.path)
        if cfg.critic.lora_rank > 0:
            critic = add_lora(critic, cfg.critic.lora_rank, cfg.critic.lora_alpha, cfg.model, "TOKEN_CLS")
        if cfg.model.gradient_checkpointing:
            use_gradient_checkpointing(critic)
        critic = distribute(critic, accelerator, fsdp, trainable=True)
        critic_opt, critic_sched = make_optimizer(critic, cfg.critic.optim, t.total_steps)
    scorer = Scorer(cfg.reward, device, dtype)  # a reward model is replicated: it only runs forward passes
    print0(describe(fsdp, accelerator, [name for name, model in (("policy", policy), ("critic", critic),
                                                                  ("reference", ref)) if model is not None]))
    layout = batch_layout(cfg.model, sharded=fsdp is not None)
    if layout == "packed":  # attention within each prompt / prompt+response group of the packed row
        for model in (policy, ref, critic):
            if model is not None:
                use_varlen_attention(accelerator.unwrap_model(model))

    # ---- state, resume
    state = TrainState(KLController(alg.kl_ctrl.type, alg.kl_ctrl.kl_coef, alg.kl_ctrl.target_kl,
                                    alg.kl_ctrl.horizon), {"actor": actor_sched, "critic": critic_sched})
    checkpointed = {"policy": (policy, actor_opt)}  # {name: (model, optimiser)} saved beside state.json
    if critic is not None:
        checkpointed["critic"] = (critic, critic_opt)
    logger = MetricsLogger(t.output_dir, t.logger, config.to_dict(cfg), t.project_name, t.experiment_name,
                           accelerator.is_main_process, resume_id=wandb_resume_id(resume_from))
    saved_state = resume_or_start(accelerator, resume_from, t.output_dir, logger, cfg, checkpointed)
    if resume_from:
        state.load_state_dict(saved_state)
        print0(f"resumed from {resume_from} at step {state.step}")
    rollout = make_rollout(cfg, policy, tokenizer, accelerator, dtype, synced_forwards=fsdp is not None)
    unwrapped = accelerator.unwrap_model(policy)
    temperature = cfg.rollout.temperature or 1.0
    reduce_sum = functools.partial(sum_over_processes, accelerator)

    def ref_logprobs_of(mb):
        if ref is not None:
            return forward_logprobs(ref, mb, temperature, dtype, False, layout)[0]
        with unwrapped.disable_adapter():
            return forward_logprobs(unwrapped, mb, temperature, dtype, False, layout)[0]

    lp_micro, max_tok = cfg.actor.log_prob_micro_batch_size_per_device, (
        cfg.actor.max_token_len_per_device if cfg.actor.use_dynamic_bsz else 0)
    if t.val_before_train and val_rows and state.step == 0:
        metrics = validate(cfg, rollout, tokenizer, scorer, val_rows, accelerator)
        print0("validation before training: " + console_line(metrics, sorted(metrics)))
        logger.log(metrics, 0)

    stop_reason, stop_signal = None, StopSignal(verbose=accelerator.is_main_process)
    bar = tqdm(range(state.step + 1, t.total_steps + 1), disable=not accelerator.is_main_process,
               desc="ppo", dynamic_ncols=True)
    for step in bar:
        times, metrics = {}, {}
        t0 = time.perf_counter()

        # ---- 1. sample prompts: one global batch from a seeded permutation, this process's slice of it
        inds = next_prompts(state, len(train_rows), cfg.data.train_batch_size, t.seed, cfg.data.shuffle)
        mine = inds[accelerator.process_index * sizes["prompts"]:(accelerator.process_index + 1) * sizes["prompts"]]
        rows = [train_rows[i] for i in mine for _ in range(n)]  # row i·n + j: sample j of prompt i

        # ---- 2. generate n responses per prompt
        with timed(times, "time/gen_s"):
            ro = rollout.generate([train_rows[i]["prompt_ids"] for i in mine], n, cfg.rollout.temperature,
                                  seed=t.seed * 100_003 + step * 1_009 + accelerator.process_index)
        queries, query_mask = left_pad([r["prompt_ids"] for r in rows], tokenizer.pad_token_id)  # (B, Tq)
        responses, response_mask = ro.responses, ro.response_mask  # (B, Tr)
        lengths = response_mask.sum(1)  # (B,)
        batch = dict(queries=queries, query_mask=query_mask, responses=responses, response_mask=response_mask)
        if ro.logprobs is not None:
            batch["rollout_logprobs"] = ro.logprobs

        # ---- 3. score: the task reward of each response
        with timed(times, "time/reward_s"):
            texts = decode_responses(tokenizer, responses, response_mask)
            scores, reward_metrics = scorer(rows, texts)  # (B,)
            last_tokens = responses[torch.arange(B), (lengths - 1).clamp(min=0)]
            truncated = (lengths == cfg.rollout.max_response_length) & ~torch.isin(last_tokens, torch.tensor(
                sorted(rollout.eos_ids)))
            scores = scores + cfg.reward.overlong_penalty * truncated.float()
        metrics.update(reward_metrics)

        # ---- 4. old/ref logprobs and values, without grad, micro-batched. Eval mode here, train mode for the
        # updates: that only switches gradient checkpointing (transformers recomputes only in train mode), since
        # every dropout is 0 (these configs' attention_dropout, lora_dropout's default, the critic's head). A
        # lora_dropout > 0 would make the first epoch's ratio differ from 1.
        for model in (policy, critic):
            if model is not None:
                model.eval()
        tok_lengths = (query_mask.sum(1) + lengths).tolist()
        if not on_policy_shortcut:
            with timed(times, "time/old_logprob_s"):
                batch["old_logprobs"] = per_token_pass(
                    lambda mb: forward_logprobs(policy, mb, temperature, dtype, False, layout)[0],
                    batch, lp_micro, max_tok, tok_lengths, device)
        if use_ref:
            with timed(times, "time/ref_s"):
                batch["ref_logprobs"] = per_token_pass(ref_logprobs_of, batch, lp_micro, max_tok, tok_lengths, device)
        if critic is not None:
            with timed(times, "time/values_s"):
                batch["values"] = per_token_pass(lambda mb: forward_values(critic, mb, dtype, layout), batch, lp_micro,
                                                 max_tok, tok_lengths, device) * response_mask

        # ---- 5. rewards = score at the last token − β·KL at every token
        beta = state.kl_ctrl.value
        if alg.use_kl_in_reward:
            kl = kl_estimate(batch["old_logprobs"], batch["ref_logprobs"], alg.kl_penalty) * response_mask
            token_rewards = kl_penalty_rewards(scores, kl, response_mask, beta)  # (B, Tr)
            seq_kl = masked_mean(kl, response_mask, 1).mean()
            state.kl_ctrl.update(accelerator.reduce(seq_kl.to(device), "mean").item(), cfg.data.train_batch_size * n)
        else:
            token_rewards = kl_penalty_rewards(scores, torch.zeros_like(response_mask, dtype=torch.float32),
                                               response_mask, 0.0)

        # ---- 6. advantages
        if alg.adv_estimator == "gae":
            advantages, returns = gae(token_rewards, batch["values"], response_mask.float(), alg.gamma, alg.lam)
            if alg.whiten_advantages:
                advantages = masked_whiten(advantages, response_mask, reduce_sum)
            batch["returns"] = returns
        elif alg.adv_estimator == "grpo":
            advantages = grpo_advantages(token_rewards.sum(1), response_mask, n, alg.norm_adv_by_std_in_grpo)
        elif alg.adv_estimator == "reinforce_plus_plus":  # whitened with the statistics of every process
            advantages, _ = reinforce_plus_plus_advantages(token_rewards, response_mask.float(), alg.gamma, reduce_sum)
        else:
            advantages = rloo_advantages(token_rewards.sum(1), response_mask, n)
        batch["advantages"] = advantages

        # ---- 7. PPO epochs over mini-batches, gradient accumulation over micro-batches
        stats = defaultdict(list)  # metric name → one value per micro-batch (or per optimiser step)
        for model in (policy, critic):
            if model is not None:
                model.train()
        update_actor = step > cfg.critic.warmup_steps  # critic warmup: the actor waits for useful values
        g = torch.Generator().manual_seed(t.seed * 7919 + step)
        for epoch in range(cfg.actor.ppo_epochs):
            for mb_inds in torch.randperm(B, generator=g).split(sizes["mini"]):
                # normalisers over the whole mini-batch and every process (departure 4)
                counts = torch.tensor([float(response_mask[mb_inds].sum()), float(len(mb_inds))], device=device)
                norm = (accelerator.reduce(counts, "sum") / accelerator.num_processes).tolist()
                if update_actor:
                    with timed(times, "time/update_actor_s"):
                        micros = [micro_batch(batch, i, device) for i in
                                  split_micro(mb_inds, tok_lengths, sizes["micro"], max_tok)]
                        loss_fn = lambda mb: actor_loss(cfg, policy, mb, temperature, dtype, layout, norm, on_policy_shortcut,  # noqa: E731
                                                        use_ref, epoch == 0, stats)
                        grad_norm = train_mini_batch(policy, actor_opt, micros, loss_fn, cfg.actor.max_grad_norm)
                    state.skipped += grad_norm is None
                    stats["actor/grad_norm"] += [grad_norm] if grad_norm is not None else []
                if critic is not None:
                    with timed(times, "time/update_critic_s"):
                        micros = [micro_batch(batch, i, device) for i in
                                  split_micro(mb_inds, tok_lengths, sizes["critic_micro"], max_tok)]
                        loss_fn = lambda mb: critic_loss(cfg, critic, mb, dtype, layout, norm, stats)  # noqa: E731
                        grad_norm = train_mini_batch(critic, critic_opt, micros, loss_fn, cfg.critic.max_grad_norm)
                    state.skipped += grad_norm is None
                    stats["critic/grad_norm"] += [grad_norm] if grad_norm is not None else []
        metrics["actor/lr"] = actor_sched.get_last_lr()[0]
        if update_actor:
            actor_sched.step()
        if critic is not None:
            critic_sched.step()

        # ---- 8. sync rollout weights: the next batch must come from the updated policy
        if update_actor:
            with timed(times, "time/sync_s"):
                rollout.sync_weights(policy)

        # ---- 9. log: means over this process's batch, then over processes
        metrics.update({
            "score/mean": scores.mean().item(), "score/max": scores.max().item(), "score/min": scores.min().item(),
            "reward/mean": token_rewards.sum(1).mean().item(), "kl/coef": beta,
            "response/length_mean": lengths.float().mean().item(),
            "response/clip_ratio": truncated.float().mean().item()})
        metrics.update({k: max(v) if k.endswith("_max") else sum(v) / len(v) for k, v in stats.items() if v})
        if critic is not None:
            metrics["value/mean"] = masked_mean(batch["values"], response_mask).item()
            metrics["value/explained_var"] = explained_variance(batch["values"], batch["returns"], response_mask,
                                                                reduce_sum)
        metrics = reduce_metrics(accelerator, metrics)
        tokens = accelerator.reduce(torch.tensor(float(query_mask.sum() + lengths.sum()), device=device), "sum").item()
        times["time/step_s"] = time.perf_counter() - t0
        metrics.update(times)
        metrics["perf/tokens_per_s"] = tokens / times["time/step_s"]
        metrics["train/skipped_steps"] = state.skipped
        state.step = step

        # ---- guards: a run that drifts too far from the reference, or collapses, is validated and stops
        state.recent_kl = (state.recent_kl + [metrics.get("kl/mean", 0.0)])[-t.max_kl_window:]
        recent_kl = sum(state.recent_kl) / len(state.recent_kl)
        if t.max_kl and recent_kl > t.max_kl:
            stop_reason = (f"kl/mean over the last {len(state.recent_kl)} steps {recent_kl:.4f} "
                           f"> trainer.max_kl {t.max_kl}")
        if t.min_entropy and metrics.get("policy/entropy", t.min_entropy) < t.min_entropy:
            message = f"policy/entropy {metrics['policy/entropy']:.4f} < trainer.min_entropy {t.min_entropy}"
            if t.min_entropy_action == "stop":
                stop_reason = message
            else:
                print0("warning: " + message)

        # validate (every test_freq steps, and at the end however it comes) and log
        if val_rows and ((t.test_freq and step % t.test_freq == 0) or step == t.total_steps or stop_reason):
            metrics.update(validate(cfg, rollout, tokenizer, scorer, val_rows, accelerator))
        logger.log(metrics, step)
        bar.set_postfix(score=f"{metrics['score/mean']:.3f}", kl=f"{metrics.get('kl/mean', 0):.4f}")
        keys = ["score/mean", "reward/mean", "kl/mean", "policy/entropy", "policy/clipfrac", "loss/policy",
                "loss/value", "value/explained_var", "response/length_mean", "val/score/mean", "val/rule_score/mean",
                "time/step_s"]
        print0(f"step {step}  " + console_line(metrics, keys))
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
    final = os.path.join(t.output_dir, "final")
    state_dict = full_state_dict(policy)  # every process takes part in gathering the shards
    if accelerator.is_main_process:
        save_pretrained_atomic(unwrapped, tokenizer, final, state_dict)
        print0(f"policy saved to {final}" + (f"; merge the adapter with: python merge_lora.py {final} "
                                             f"{t.output_dir}/merged" if cfg.model.lora_rank else ""))
        if t.plot_curves and os.path.exists(logger.path):
            plot_curves(logger.path, os.path.join(t.output_dir, "curves.png"))  # the panels of utils.CURVE_KEYS
    logger.close()
    accelerator.wait_for_everyone()
    if isinstance(rollout, HFRollout):  # a vLLM engine destroys the process group itself at exit
        accelerator.end_training()
    return stop_reason


if __name__ == "__main__":
    try:
        main(config.parse_args(sys.argv[1:], __doc__))
    except (config.ConfigError, data.DataError) as e:  # a user's mistake: one sentence, no traceback
        sys.exit(f"ppo.py: {e}" if os.environ.get("RANK", "0") == "0" else 1)  # once, from rank 0
    except KeyboardInterrupt:  # Ctrl-C while loading, or a second signal while training
        if os.environ.get("RANK", "0") == "0":
            print("ppo.py: interrupted; the last checkpoint is kept", file=sys.stderr)
        sys.exit(130)
