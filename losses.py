"""The policy loss of PPO for language models, as small pure functions: the surrogate per token, the correction for
the sampler/trainer gap, and how per-token losses become one number for the mini-batch.

Every policy loss has one calling convention, so that ppo.actor_loss calls any of them the same way:

    pg, clipped = POLICY_LOSSES[name](logprobs, old_logprobs, advantages, response_mask, clip)     all (B, Tr)

pg is the loss per token, clipped a float mask of where clipping bit (logged as policy/clipfrac). Adding a policy
loss: write one such function and add its name to POLICY_LOSSES; it is then a valid `actor.policy_loss`.
"""
from dataclasses import dataclass

import torch


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


POLICY_LOSSES = {"vanilla": vanilla}


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


def agg_loss(loss_mat, mask, mode: str, counts: Counts):
    """This micro-batch's share of the mini-batch loss, normalised by the mini-batch's counts:

        token-mean:          Σ_{i,t} ℓ_it / N_tokens
        seq-mean-token-sum:  Σ_i Σ_t ℓ_it / N_seqs
        seq-mean-token-mean: Σ_i (Σ_t ℓ_it / T_i) / N_seqs
    Summing the shares of all micro-batches gives the loss of the whole mini-batch.
    """
    if mode == "token-mean":
        return (loss_mat * mask).sum() / counts.tokens
    if mode == "seq-mean-token-sum":
        return (loss_mat * mask).sum() / counts.sequences
    if mode == "seq-mean-token-mean":
        return ((loss_mat * mask).sum(1) / mask.sum(1).clamp(min=1)).sum() / counts.sequences
    raise ValueError(f"unknown loss_agg_mode {mode!r}")
