"""KL regularisation towards the reference policy.

Two places a KL term can enter PPO for language models:
  * as a per-token reward penalty, rewards_t = −β·KL_t (Ziegler et al., 2019; Ouyang et al., 2022),
    with β fixed or steered by an adaptive controller;
  * as a loss term, kl_loss_coef·KL added to the policy loss (Shao et al., 2024, GRPO).

The per-token KL is estimated from samples of the policy with the estimators of
John Schulman, "Approximating KL Divergence", http://joschu.net/blog/kl-approx.html .
"""
import dataclasses

import torch
from accelerate.utils import extract_model_from_parallel as unwrap_model

from infra.batches import Forward
from infra.rollout_common import add_token_rewards


def kl_estimate(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, kind: str) -> torch.Tensor:
    """Per-token estimate of KL(π ‖ π_ref) at tokens sampled from π, with log r = log π_ref − log π:

        k1 = −log r                  unbiased, high variance, can be negative
        k2 = ½ (log r)²              biased, low variance
        k3 = (r − 1) − log r         unbiased, low variance, always ≥ 0
        abs = |log r|

    `kind` is a name in ESTIMATORS. k3 clamps log r to ±20, as verl does, so that r stays finite. verl also clamps
    k3 itself to ±10 (kl_penalty, "low_var_kl"); not here: that biases k3 low and gives no gradient to the tokens
    farthest from π_ref.
    """
    return ESTIMATORS[kind](ref_logprobs - logprobs)


def k3(log_ratio):
    log_ratio = log_ratio.clamp(-20, 20)  # e^20 ≈ 5e8: finite in fp32 and bf16
    return (log_ratio.exp() - 1) - log_ratio


# name → the estimate from log r; the names valid for algorithm.kl_penalty and algorithm.kl_loss_type
ESTIMATORS = {"k1": lambda log_ratio: -log_ratio, "k2": lambda log_ratio: 0.5 * log_ratio.square(), "k3": k3,
              "abs": lambda log_ratio: log_ratio.abs()}


def kl_penalty_rewards(scores: torch.Tensor, kl: torch.Tensor, response_mask: torch.Tensor, beta: float,
                       token_rewards=None):
    """rewards_t = token_rewards_t − β·KL_t at every response token, and + score at the last real token.

    scores (B,), kl, response_mask and token_rewards (B, Tr; None: 0, a reward at the end only) → rewards (B, Tr);
    padding and gaps (mask 0 between real tokens, as verl's agent loop makes them for tool output) get 0, and "last"
    is the last token whose mask is 1.
    """
    dense = -beta * kl if token_rewards is None else token_rewards - beta * kl
    rewards = dense * response_mask  # (B, Tr)
    position = torch.arange(1, response_mask.shape[1] + 1, device=response_mask.device)  # (Tr,) 1 … Tr
    last = (response_mask * position).argmax(dim=1)  # (B,) index of the last real token
    rewards[torch.arange(len(scores)), last] += scores
    return rewards


class KLController:
    """β for the reward penalty: fixed, or adaptive (Ziegler et al., 2019, §2.2):

        e = clip(KL / KL_target − 1, −0.2, 0.2) ;  β ← β · (1 + e · n_steps / horizon)

    where KL is the mean per-sequence KL of the batch and n_steps the samples it came from.
    """

    def __init__(self, kind: str, kl_coef: float, target_kl: float, horizon: int):
        self.kind, self.value, self.target, self.horizon = kind, kl_coef, target_kl, horizon

    @classmethod
    def from_config(cls, kl_ctrl):
        """algorithm.kl_ctrl's type, kl_coef, target_kl and horizon."""
        return cls(kl_ctrl.type, kl_ctrl.kl_coef, kl_ctrl.target_kl, kl_ctrl.horizon)

    def update(self, current_kl: float, n_steps: int) -> None:
        if self.kind == "adaptive":
            error = min(max(current_kl / self.target - 1, -0.2), 0.2)
            self.value *= 1 + error * n_steps / self.horizon


def distillation_rewards(token_rewards, batch: dict, teacher_cfg):
    """The token rewards (B, Tr; None: none) plus on-policy distillation's, −coef·KL_t(π ‖ π_teacher) at every token,
    with algorithm.teacher.mode=reward (Agarwal et al., 2024; verl, TRL): the policy's own samples, each token
    rewarded by how likely the teacher finds it."""
    if "teacher_logprobs" not in batch or teacher_cfg.mode != "reward":
        return token_rewards
    kl_teacher = kl_estimate(batch["old_logprobs"], batch["teacher_logprobs"], teacher_cfg.kl_estimator)  # (B, Tr)
    return add_token_rewards(token_rewards, -teacher_cfg.coef * kl_teacher)


def ref_logprobs(ref, policy, micro, fwd: Forward):
    """log π_ref(y_t | prefix), (B, Tr): the reference model's, or with LoRA the actor's with its adapter disabled."""
    if ref is not None:
        return fwd.logprobs(ref, micro)[0]
    with unwrap_model(policy).disable_adapter():
        return fwd.logprobs(unwrap_model(policy), micro)[0]


def teacher_logprobs(teacher, micro, fwd: Forward):
    """log π_teacher(y_t | prefix), (B, Tr): from the teacher's own layers, never the policy's trunk."""
    return dataclasses.replace(fwd, trunk=None).logprobs(teacher, micro)[0]
