"""The reward model as a scorer (reward.sources=[model]): a folder written by reward_model.py scores each (prompt,
response) with its own tokenizer, as in training. The network, RewardModel, is here too: reward_model.py trains it,
this file scores with it, so that nothing ppo.py imports is the training script.

    reward.sources=[rule,model] reward.weights=[1.0,0.5] reward.model_path=outputs/reward_model/final
"""
import json
import os

import torch

import data
from infra.batches import autocast
from infra.checks import check_model_path
from infra.config import ConfigError
from infra.models import load_reward_classifier, load_tokenizer
from infra.rollout_common import right_pad
from rewards import Scores, Setup


def last_token_index(attention_mask):
    """i* = max{t : mask_t = 1}, the last real position of each row, for right or left padding. (B, T) → (B,)"""
    positions = torch.arange(attention_mask.shape[1], device=attention_mask.device)
    return (positions * attention_mask).argmax(-1)


def shared_prefix_length(input_ids, attention_mask) -> int:
    """k = how many leading columns hold the same real token in every row, capped so that each row keeps at
    least its last real token after them (right padding). (B, T) → int."""
    same = (input_ids == input_ids[:1]).all(0) & attention_mask.bool().all(0)  # (T,)
    return min(int(same.long().cumprod(0).sum()), int(attention_mask.sum(1).min()) - 1)


class RewardModel(torch.nn.Module):
    """r(x) = w·h_{i*}: a sequence classifier (or a PEFT model of one) read at last_token_index.

    Conversations that open alike (the demo's system prompt and worked example: 33 of its 50 tokens) share
    that prefix: it runs once, its KV cache is copied to every row (keeping the autograd graph), and only the
    rest runs per row. Equal to one plain forward within fp32 rounding (tests/test_reward_model.py).
    """

    def __init__(self, hf_model):
        super().__init__()
        self.hf = hf_model

    def forward(self, input_ids, attention_mask):
        from transformers import DynamicCache

        model = self.hf.get_base_model() if hasattr(self.hf, "get_base_model") else self.hf
        backbone = getattr(model, model.base_model_prefix)
        B, T, k = *input_ids.shape, shared_prefix_length(input_ids, attention_mask)
        cache = DynamicCache() if k > 0 else None
        if cache is not None:
            backbone(input_ids=input_ids[:1, :k], past_key_values=cache, use_cache=True)
            cache.reorder_cache(torch.zeros(B, dtype=torch.long, device=input_ids.device))  # (1, …) → (B, …)
        positions = torch.arange(k, T, device=input_ids.device).expand(B, -1)
        hidden = backbone(input_ids=input_ids[:, k:], attention_mask=attention_mask, position_ids=positions,
                          past_key_values=cache, use_cache=cache is not None).last_hidden_state  # (B, T − k, H)
        last = hidden[torch.arange(B, device=hidden.device), last_token_index(attention_mask) - k]  # (B, H)
        return model.score(last).squeeze(-1).float()  # (B,)


class RewardModelScorer:
    """Scores raw (prompt, response) pairs with a folder written by reward_model.py, rendered with its own
    tokenizer exactly as in training; micro-batched, no grad, eval mode.

    normalize: (s − mean) / std with final/reward_stats.json; clip: clamp to ±clip after normalising.
    """

    def __init__(self, path: str, micro_batch_size: int = 32, normalize: bool = False, clip=None,
                 device="cpu", autocast_dtype=None, *, trust_remote_code: bool = False):
        from transformers import AutoConfig

        if not os.path.isdir(path):
            raise ConfigError(f"reward model folder {path} does not exist; train one with reward_model.py")
        arch = (AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code).architectures or ["?"])[0]
        if not arch.endswith("ForSequenceClassification"):
            raise ConfigError(f"{path} holds a {arch}, not a reward model (…ForSequenceClassification); "
                              f"point reward.model_path at the final/ folder written by reward_model.py")
        self.tokenizer = load_tokenizer(path, "reward.model_path", trust_remote_code=trust_remote_code)
        self.device = torch.device(device)
        model = RewardModel(load_reward_classifier(path, self.tokenizer.pad_token_id,
                                                   trust_remote_code=trust_remote_code))
        self.model = model.to(self.device).eval().requires_grad_(False)
        self.micro_batch_size, self.clip, self.dtype, self.stats = micro_batch_size, clip, autocast_dtype, None
        if normalize:
            stats_path = os.path.join(path, "reward_stats.json")
            if not os.path.isfile(stats_path):
                raise ConfigError(f"reward.normalize needs {stats_path} (written by reward_model.py at the end "
                                  f"of training); retrain, or set reward.normalize=false")
            with open(stats_path) as f:
                self.stats = json.load(f)

    @classmethod
    def from_config(cls, cfg_reward, setup: Setup):
        return cls(cfg_reward.model_path, cfg_reward.micro_batch_size, cfg_reward.normalize, cfg_reward.clip,
                   setup.device, setup.dtype, trust_remote_code=setup.trust_remote_code)

    @torch.no_grad()
    def score(self, prompts: list, responses: list[str]) -> torch.Tensor:
        """prompts (text or chat messages, as stored) and decoded responses → scores (B,) on `device`."""
        texts = [data.render(p, r, self.tokenizer) for p, r in zip(prompts, responses, strict=True)]
        if not texts:
            return torch.zeros(0, device=self.device)
        ids = data.tokenize_prompts(texts, self.tokenizer)
        scores = []
        for i in range(0, len(ids), self.micro_batch_size):
            input_ids, attention_mask = right_pad(ids[i:i + self.micro_batch_size], self.tokenizer.pad_token_id)
            with autocast(self.device, self.dtype):
                scores.append(self.model(input_ids.to(self.device), attention_mask.to(self.device)))  # (b,)
        scores = torch.cat(scores)  # (B,)
        if self.stats is not None:
            scores = (scores - self.stats["mean"]) / max(self.stats["std"], 1e-8)
        if self.clip is not None:
            scores = scores.clamp(-self.clip, self.clip)
        return scores

    def __call__(self, rows: list[dict], texts: list[str], ro=None) -> Scores:
        scores = self.score([row["prompt"] for row in rows], texts).float().cpu()  # (B,)
        return Scores(scores, metrics={"reward/model_score_mean": scores.mean().item()})


def check_model_source(cfg_reward, trust_remote_code: bool) -> None:
    if not cfg_reward.model_path:
        spelled = f"reward.type={cfg_reward.type}" if cfg_reward.type else "reward.sources with model"
        raise ConfigError(f"{spelled} needs reward.model_path (the final/ folder written by reward_model.py)")
    check_model_path(cfg_reward.model_path, "reward.model_path", trust_remote_code=trust_remote_code)
