"""The critic's losses and diagnostics: the clipped value loss, ppo.py's CriticLoss (step 7's loss of the critic)
and explained variance. Its values make GAE's advantages (advantages.gae); the value model itself (a scalar head on
every token) is built by infra/models.load_critic.
"""
from dataclasses import dataclass

import torch

from advantages import masked_mean
from infra.batches import Forward
from losses import agg_loss, Counts


def value_loss(values, old_values, returns, response_mask, cliprange: float):
    """L_V = ½·max((V − R)², (V_clip − R)²),  V_clip = V_old + clip(V − V_old, ±ε)   (per token, (B, Tr))

    As in OpenAI's baselines PPO2 and lm-human-preferences. Also returns the share of tokens
    where the clipped term was the larger one.
    """
    values_clipped = old_values + (values - old_values).clamp(-cliprange, cliprange)
    loss1 = (values - returns).square()
    loss2 = (values_clipped - returns).square()
    clipfrac = ((loss2 > loss1).float() * response_mask).sum() / response_mask.sum().clamp(min=1)
    return 0.5 * torch.max(loss1, loss2), clipfrac


@dataclass(frozen=True)
class CriticLoss:
    """vf_coef · clipped value loss: a micro-batch's share of the mini-batch's token-mean, and its metrics."""
    fwd: Forward
    cliprange_value: float
    vf_coef: float

    @classmethod
    def from_config(cls, cfg, fwd: Forward):
        return cls(fwd, cfg.critic.cliprange_value, cfg.critic.vf_coef)

    def __call__(self, critic, micro: dict, counts: Counts):
        mask = micro["response_mask"].float()
        values = self.fwd.values(critic, micro)  # (B, Tr)
        vf, clipfrac = value_loss(values, micro["old_values"], micro["returns"], mask, self.cliprange_value)
        metrics = {"loss/value": masked_mean(vf.detach(), mask).item(), "value/clipfrac": clipfrac.item()}
        return self.vf_coef * agg_loss(vf, mask, "token-mean", counts), metrics


def explained_variance(values, returns, response_mask, reduce_sum=None) -> float:
    """1 − Var[R − V] / Var[R] over the real tokens of the whole batch (reduce_sum: a sum over processes):
    1 is perfect, 0 is no better than a constant."""
    mask = response_mask.bool()
    r, e = returns[mask].double(), (returns - values)[mask].double()
    sums = torch.stack([r.new_tensor(float(len(r))), r.sum(), r.square().sum(), e.sum(), e.square().sum()])
    n, s_r, s_r2, s_e, s_e2 = (reduce_sum(sums) if reduce_sum else sums).tolist()
    var_r, var_e = s_r2 / max(n, 1) - (s_r / max(n, 1)) ** 2, s_e2 / max(n, 1) - (s_e / max(n, 1)) ** 2
    if n < 2 or var_r <= 0:
        return float("nan")
    return 1 - var_e / var_r


def value_metrics(old_values, returns, response_mask, reduce_sum) -> dict:
    """The step's value/mean (this process's) and value/explained_var (over every process's tokens)."""
    return {"value/mean": masked_mean(old_values, response_mask).item(),
            "value/explained_var": explained_variance(old_values, returns, response_mask, reduce_sum)}
