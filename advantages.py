"""Advantages: how much better than expected each response token did, from its rewards (B, Tr).

    gae                    with the critic's values (PPO)
    grpo_advantages        against the other samples of the same prompt (GRPO, Dr. GRPO)
    rloo_advantages        against the mean of the other samples (REINFORCE leave-one-out)
    reinforce_plus_plus    the discounted return, whitened over the whole batch (REINFORCE++)

Conventions: every result is 0 on padding; whitening divides by the biased standard deviation (as
lm-human-preferences; verl's masked_whiten divides by the unbiased one, a factor √(N/(N−1)) apart, which
tests/test_crosscheck.py makes explicit).
"""
import torch


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


def gae(rewards, values, response_mask, gamma: float, lam: float):
    """δ_t = r_t + γ·V_{t+1} − V_t ;  Â_t = δ_t + γλ·Â_{t+1} ;  R_t = Â_t + V_t   (Schulman et al., 2016)

    All (B, Tr). V beyond the last real token is 0 (the episode ends at EOS or the length limit).
    Returns (advantages, returns), zero on padding.
    """
    values = values * response_mask
    next_advantage = torch.zeros_like(rewards[:, 0])  # (B,)
    advantages = torch.zeros_like(rewards)  # (B, Tr)
    for t in reversed(range(rewards.shape[1])):
        next_value = values[:, t + 1] if t + 1 < rewards.shape[1] else torch.zeros_like(next_advantage)
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        next_advantage = delta + gamma * lam * next_advantage
        # padding neither earns advantage nor passes it back
        next_advantage = next_advantage * response_mask[:, t]
        advantages[:, t] = next_advantage
    returns = (advantages + values) * response_mask
    return advantages, returns


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
