"""Advantages: how much better than expected each response token did, from its rewards (B, Tr).

Every estimator has one calling convention, so that ppo.py's step 6 is one line for all of them:

    advantages, returns = ESTIMATORS[name](rewards, response_mask, values, s)      all (B, Tr)

rewards are the token rewards (the score at the last real token, the scorers', the rollout's and a teacher's token
rewards, − β·KL at every token with KL in the reward),
values the critic's (None without one), s the run's `Settings`; returns are what the critic regresses on (GAE's),
else the estimator's own. Adding an estimator: write one such function below and add its name to ESTIMATORS (and
to NEEDS_CRITIC or COMPARES_SAMPLES when it needs a critic or compares the samples of a prompt); the name is then a
valid `algorithm.adv_estimator`, checked at start-up.

Conventions: every result is 0 on padding and on gaps (response_mask 0 between real tokens, as tool output inside an
agent's response makes them), which GAE and REINFORCE++ step over as verl does; whitening divides by the biased
standard deviation (as
lm-human-preferences; verl's masked_whiten divides by the unbiased one, a factor √(N/(N−1)) apart, which
tests/test_crosscheck.py makes explicit); a response's return is the sum of its token rewards for the estimators
that compare samples (ppo.py, departure 5).
"""
from dataclasses import dataclass
from typing import Callable, Optional

import torch


@dataclass(frozen=True)
class Settings:
    """What the estimators read, bound once per run (ppo.main) from the algorithm config."""
    gamma: float  # discount
    lam: float  # GAE's λ
    n: int  # samples per prompt: rows i·n … i·n + n − 1 are one prompt's
    norm_by_std: bool  # GRPO: divide by the group's std (false: Dr. GRPO)
    whiten: bool  # GAE: whiten the advantages over the batch
    reduce_sum: Optional[Callable] = None  # sums a tensor over processes (None: this process holds the whole batch)

    @classmethod
    def from_config(cls, cfg, reduce_sum=None):
        alg = cfg.algorithm
        return cls(alg.gamma, alg.lam, cfg.rollout.n, alg.norm_adv_by_std_in_grpo, alg.whiten_advantages, reduce_sum)


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


def gae(rewards, response_mask, values, s: Settings):
    """δ_t = r_t + γ·V_{t'} − V_t ;  Â_t = δ_t + γλ·Â_{t'} ;  R_t = Â_t + V_t   (Schulman et al., 2016)

    t' is the next real token after t: a gap inside the response (response_mask 0 between real tokens, e.g. tool
    output) is skipped, its reward and value unread, V and Â carried over it (as verl 0.9.1's GAE). V beyond the last
    real token is 0 (the episode ends at EOS or the length limit). Â whitened when s.whiten.
    """
    next_value = torch.zeros_like(rewards[:, 0])  # (B,) V_{t'}
    next_advantage = torch.zeros_like(rewards[:, 0])  # (B,) Â_{t'}
    advantages = torch.zeros_like(rewards)  # (B, Tr)
    for t in reversed(range(rewards.shape[1])):
        real = response_mask[:, t].bool()  # (B,)
        delta = rewards[:, t] + s.gamma * next_value - values[:, t]
        next_advantage = torch.where(real, delta + s.gamma * s.lam * next_advantage, next_advantage)
        next_value = torch.where(real, values[:, t], next_value)
        advantages[:, t] = next_advantage
    advantages = advantages * response_mask
    returns = (advantages + values) * response_mask
    return (masked_whiten(advantages, response_mask, s.reduce_sum) if s.whiten else advantages), returns


def grpo(rewards, response_mask, values, s: Settings, eps=1e-6):
    """Â_i = (R_i − mean_g R) / (std_g R + ε) over the n samples g of a prompt   (Shao et al., 2024)

    R_i = Σ_t r_it. s.norm_by_std=False drops the division (Liu et al., 2025, "Dr. GRPO").
    """
    groups = rewards.sum(1).view(-1, s.n)  # (B/n, n)
    adv = groups - groups.mean(dim=1, keepdim=True)
    if s.norm_by_std:
        adv = adv / (groups.std(dim=1, keepdim=True) + eps)
    adv = adv.reshape(-1, 1) * response_mask  # (B, Tr)
    return adv, adv


def rloo(rewards, response_mask, values, s: Settings):
    """Â_i = R_i − 1/(n−1) · Σ_{j≠i} R_j,  R_i = Σ_t r_it   (Ahmadian et al., 2024, REINFORCE leave-one-out)"""
    groups = rewards.sum(1).view(-1, s.n)  # (B/n, n)
    baseline = (groups.sum(dim=1, keepdim=True) - groups) / (s.n - 1)
    adv = (groups - baseline).reshape(-1, 1) * response_mask  # (B, Tr)
    return adv, adv


def discounted_returns(rewards, response_mask, gamma: float):
    """G_t = r_t + γ·G_{t'} over the real tokens, t' the next real one (a gap is skipped, G carried over it, as verl
    0.9.1's REINFORCE++), (B, Tr); 0 on padding and gaps."""
    returns = torch.zeros_like(rewards)  # (B, Tr)
    running = torch.zeros_like(rewards[:, 0])  # (B,)
    for t in reversed(range(rewards.shape[1])):
        running = torch.where(response_mask[:, t].bool(), rewards[:, t] + gamma * running, running)
        returns[:, t] = running
    return returns * response_mask


def reinforce_plus_plus(rewards, response_mask, values, s: Settings):
    """REINFORCE++ (Hu, 2025; OpenRLHF's `reinforce` estimator, trainer/ppo_utils/experience_maker.py):

        G_t = r_t + γ·G_{t+1}        r_t = −β·KL_t at every token, + the score at the last real token
        Â_t = (G_t − μ) / σ         μ, σ² = mean and variance of G over the real tokens of the GLOBAL batch
    """
    returns = discounted_returns(rewards, response_mask, s.gamma)
    return masked_whiten(returns, response_mask, s.reduce_sum), returns


def reinforce_plus_plus_baseline(rewards, response_mask, values, s: Settings):
    """REINFORCE++-baseline (Hu et al., 2025; verl's compute_reinforce_plus_plus_baseline_outcome_advantage):

        R_i = Σ_t r_it ;  A_i = R_i − mean_g R     the mean over the n samples g of the prompt
        Â_it = (A_i − μ) / σ                     μ, σ² over the real tokens of the GLOBAL batch (each token counts)
    """
    groups = rewards.sum(1).view(-1, s.n)  # (B/n, n)
    centred = (groups - groups.mean(dim=1, keepdim=True)).reshape(-1, 1) * response_mask  # (B, Tr)
    adv = masked_whiten(centred, response_mask, s.reduce_sum)
    return adv, adv


def varied_groups(scores, n: int):
    """(B/n,) bool: the prompts whose n scores are not all equal. A group of equal scores has zero advantage under
    every estimator that compares a prompt's samples, so DAPO's dynamic sampling (Yu et al., 2025, §3.2; verl's
    algorithm.filter_groups, which keeps a group when the std of its scores is > 0) trains on the others only."""
    groups = scores.view(-1, n)  # (B/n, n)
    return (groups != groups[:, :1]).any(dim=1)


# name → estimator; the sets say which need the critic's values and which compare the n samples of a prompt
ESTIMATORS = {"gae": gae, "grpo": grpo, "rloo": rloo, "reinforce_plus_plus": reinforce_plus_plus,
              "reinforce_plus_plus_baseline": reinforce_plus_plus_baseline}
NEEDS_CRITIC = {"gae"}
COMPARES_SAMPLES = {"grpo", "rloo", "reinforce_plus_plus_baseline"}
