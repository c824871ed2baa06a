"""The policy loss of PPO for language models, as small pure functions: the surrogate per token, the correction for
the sampler/trainer gap, and how per-token losses become one number for the mini-batch.

Every policy loss has one calling convention, so that ppo.ActorLoss calls any of them the same way:

    pg, clipped = POLICY_LOSSES[name](logprobs, old_logprobs, advantages, response_mask, clip)     all (B, Tr)

pg is the loss per token, clipped a float mask of where clipping bit (logged as policy/clipfrac). Adding a policy
loss: write one such function and add its name to POLICY_LOSSES; it is then a valid `actor.policy_loss`, checked at
start-up. With one PPO epoch of one mini-batch the ratio is 1 (ppo.py, departure 3), and vanilla, gspo and cispo
then have the same gradient, −Â·∇log π per token: they differ on the later mini-batches and epochs.
"""
import math
from dataclasses import dataclass
from typing import Optional

import torch

from advantages import masked_mean
from infra.checks import rejection_band


@dataclass(frozen=True)
class Clip:
    """The ratio's clip range, bound once per run from the actor config."""
    low: float  # ratio ≥ 1 − low
    high: float  # ratio ≤ 1 + high (> low: DAPO's clip-higher)
    c: float  # dual clip: the loss of a negative advantage is at most −Â·c (Ye et al., 2020)


@dataclass(frozen=True)
class Counts:
    """What a mini-batch's loss is normalised by: its response tokens and sequences, averaged over processes
    (ppo.py, departure 4), so that gradient accumulation and the process count leave the gradient unchanged."""
    tokens: float
    sequences: float


def mini_batch_counts(mask, accelerator) -> Counts:
    """The tokens (at least 1) and sequences of a mini-batch, averaged over processes: what its loss is normalised by.
    The mean, not the sum, because DDP and FSDP2 average the processes' gradients (departure 4)."""
    counts = torch.tensor([max(float(mask.sum()), 1.0), float(len(mask))], device=accelerator.device)
    return Counts(*(accelerator.reduce(counts, "sum") / accelerator.num_processes).tolist())


def vanilla(logprobs, old_logprobs, advantages, response_mask, clip: Clip):
    """PPO's clipped surrogate, per token (Schulman et al., 2017), with dual clip (Ye et al., 2020):

        ratio = exp(log π − log π_old)
        pg_loss1 = −Â·ratio ;  pg_loss2 = −Â·clip(ratio, 1 − ε_low, 1 + ε_high) ;  pg = max(pg_loss1, pg_loss2)
        where Â < 0:  pg = min(pg, −Â·c)      (bounds the loss of a huge ratio on a bad action)
    The log-ratio is not clamped (verl clamps it to ±20): a ratio that overflows makes the gradient non-finite, and
    infra/optim.train_step skips the whole step.
    """
    ratio = torch.exp(logprobs - old_logprobs)
    pg_loss1 = -advantages * ratio
    pg_loss2 = -advantages * ratio.clamp(1 - clip.low, 1 + clip.high)
    pg = torch.max(pg_loss1, pg_loss2)
    pg = torch.where(advantages < 0, torch.min(pg, -advantages * clip.c), pg)
    return pg, (pg_loss2 > pg_loss1).float()


def gspo(logprobs, old_logprobs, advantages, response_mask, clip: Clip):
    """GSPO (Zheng et al., 2025, eq. 7 and its token form, eq. 13): one ratio per response, its length-normalised
    sequence ratio, carried by every token with stop-gradient so that each token's gradient is its own:

        log s_i = (1/|y_i|) Σ_t (log π(y_it) − log π_old(y_it))
        s_it = sg[s_i] · π(y_it) / sg[π(y_it)]          (= s_i in value)
        pg_loss1 = −Â·s_it ;  pg_loss2 = −Â·clip(s_it, 1 − ε_low, 1 + ε_high) ;  pg = max(pg_loss1, pg_loss2)
    No dual clip; GSPO's ε are small (3e-4, 4e-4), as a mean log-ratio is. verl clamps log s_it at 10; not here (see
    vanilla).
    """
    log_seq = ((logprobs - old_logprobs) * response_mask).sum(1, keepdim=True) / response_mask.sum(
        1, keepdim=True).clamp(min=1)  # (B, 1)
    ratio = torch.exp(logprobs - logprobs.detach() + log_seq.detach())  # (B, Tr)
    pg_loss1 = -advantages * ratio
    pg_loss2 = -advantages * ratio.clamp(1 - clip.low, 1 + clip.high)
    return torch.max(pg_loss1, pg_loss2), (pg_loss2 > pg_loss1).float()


def cispo(logprobs, old_logprobs, advantages, response_mask, clip: Clip):
    """CISPO (MiniMax-M1, 2025, eq. 4): clip the importance weight, not the update, and stop its gradient, so that no
    token loses its gradient (PPO's clip zeroes it for a ratio outside the range):

        r = exp(log π − log π_old) ;  pg = −sg[clip(r, 1 − ε_low, 1 + ε_high)] · Â · log π
    Its gradient is −clip(r)·Â·∇log π; its value is not a surrogate's (loss/policy is −Â·log π-sized). MiniMax-M1
    sets no lower bound (actor.clip_ratio_low=1). clipped: where r was outside the range.
    """
    ratio = torch.exp(logprobs - old_logprobs)
    clipped_ratio = ratio.clamp(1 - clip.low, 1 + clip.high)
    return -clipped_ratio.detach() * advantages * logprobs, (ratio != clipped_ratio).float()


POLICY_LOSSES = {"vanilla": vanilla, "gspo": gspo, "cispo": cispo}


# ---------------------------------------------------------------------------------------
# Rollout correction: the sampler (vLLM) is not the trainer (ppo.py, departure 2)


def sampler_log_ratio(old_logprobs, rollout_logprobs, response_mask, level: str):
    """log ρ, ρ = π_old / π_rollout, at one of three levels: (B, Tr) for token, (B, 1) for the others.

        token:          log ρ_t = log π_old(y_t) − log π_rollout(y_t)
        sequence:       Σ_t log ρ_t        (the product of the token ratios)
        sequence_mean:  Σ_t log ρ_t / T    (their geometric mean: a ratio whose size does not grow with the length)
    The sums run over the real tokens (padding's log ρ counts as 0).
    """
    log_ratio = (old_logprobs - rollout_logprobs) * response_mask  # (B, Tr)
    if level == "token":
        return log_ratio
    total = log_ratio.sum(1, keepdim=True)  # (B, 1)
    return total if level == "sequence" else total / response_mask.sum(1, keepdim=True).clamp(min=1)


def rollout_is_weights(old_logprobs, rollout_logprobs, response_mask, level: str, threshold: float):
    """Truncated importance weights for the gap between sampler and trainer (Yao et al., 2025), (B, Tr):

        w = min(ρ, C)      ρ at `level` (sampler_log_ratio: token, sequence or sequence_mean), C = threshold
    A sequence-level weight is the same on every token of its response.
    """
    log_w = sampler_log_ratio(old_logprobs, rollout_logprobs, response_mask, level)
    return log_w.exp().clamp(max=threshold).expand_as(old_logprobs)


def rejection_mask(old_logprobs, rollout_logprobs, response_mask, level: str, low: float, high: float):
    """Rollout rejection sampling (verl 0.9.1's compute_rollout_rejection_mask with token_k1, seq_sum_k1 or
    seq_mean_k1; TRL masks by default too): 1 where a real token is kept, 0 where it is rejected, (B, Tr):

        keep = low ≤ ρ ≤ high      ρ at `level` (sampler_log_ratio); at a sequence level, all tokens or none
    Where truncated weights (rollout_is_weights) only cap ρ, this drops the samples the trainer would not have
    drawn, so that they give no gradient at all.
    """
    log_rho = sampler_log_ratio(old_logprobs, rollout_logprobs, response_mask, level)
    keep = (log_rho >= math.log(low)) & (log_rho <= math.log(high))  # (B, Tr) or (B, 1)
    return keep.expand_as(response_mask).to(response_mask.dtype) * response_mask


# ---------------------------------------------------------------------------------------
# Aggregation: per-token losses → the mini-batch's loss


def agg_loss(loss_mat, mask, mode: str, counts: Counts, loss_scale_factor: Optional[float] = None):
    """This micro-batch's share of the mini-batch loss, normalised by the mini-batch's counts:

        token-mean:               Σ_{i,t} ℓ_it / N_tokens
        seq-mean-token-sum:       Σ_i Σ_t ℓ_it / N_seqs
        seq-mean-token-mean:      Σ_i (Σ_t ℓ_it / T_i) / N_seqs
        seq-mean-token-sum-norm:  Σ_i Σ_t ℓ_it / (N_seqs · L)     L = loss_scale_factor, a constant (Dr. GRPO, Liu
                                                                   et al., 2025: no length bias, as verl's)
    Summing the shares of all micro-batches gives the loss of the whole mini-batch.
    """
    if mode == "token-mean":
        return (loss_mat * mask).sum() / counts.tokens
    if mode == "seq-mean-token-sum":
        return (loss_mat * mask).sum() / counts.sequences
    if mode == "seq-mean-token-mean":
        return ((loss_mat * mask).sum(1) / mask.sum(1).clamp(min=1)).sum() / counts.sequences
    if mode == "seq-mean-token-sum-norm" and loss_scale_factor:
        return (loss_mat * mask).sum() / (counts.sequences * loss_scale_factor)
    raise ValueError(f"unknown loss_agg_mode {mode!r}, or seq-mean-token-sum-norm without a loss_scale_factor")


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
                              *rejection_band(alg))
        metrics["rollout/rs_rejected_frac"] = 1 - masked_mean(kept, response_mask).item()
        loss_mask = loss_mask * kept
    return loss_mask, metrics
