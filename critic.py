"""The critic: a value model and the clipped value loss (its values make GAE's advantages: advantages.gae).

The value model is a causal-LM backbone with a scalar head on every token
(`AutoModelForTokenClassification`, num_labels=1, as verl does). Initialised from the policy,
the head starts random; initialised from a reward model trained by reward_model.py
(`AutoModelForSequenceClassification`, whose head is also called `score`), it starts from the
reward model's head, so values begin on the scale of the scores.
"""
import torch
import transformers
from transformers import AutoConfig, AutoModelForTokenClassification


def load_critic(path: str) -> torch.nn.Module:
    """A token-level value model (fp32 weights) from a policy or reward-model folder."""
    config = AutoConfig.from_pretrained(path, num_labels=1)
    config.classifier_dropout = 0.0  # dropout would make values differ between rollout and update
    # From a policy, transformers reports lm_head as unused and the head as new: expected, so quiet.
    verbosity = transformers.logging.get_verbosity()
    transformers.logging.set_verbosity_error()
    model = AutoModelForTokenClassification.from_pretrained(path, config=config, dtype=torch.float32)
    transformers.logging.set_verbosity(verbosity)
    if model.config.pad_token_id is None:
        model.config.pad_token_id = model.config.eos_token_id
    return model


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
