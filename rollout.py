"""Rollout backends: sample `n` responses per prompt from the current policy.

Both backends return the same `Rollout`, row `i·n + j` holding sample j of prompt i:
    responses      (B·n, Tr)  token ids, right-padded with the pad id
    response_mask  (B·n, Tr)  1 = a real response token (the EOS included), 0 = padding
    logprobs       (B·n, Tr)  the sampler's log-probabilities, or None where the backend has none

`ppo.py` calls `make_rollout(...)` once, then `generate(...)` every step and `sync_weights(...)`
after every optimiser step that changed the policy.
"""
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Optional

import torch


@dataclass
class Rollout:
    responses: torch.Tensor  # (B·n, Tr)
    response_mask: torch.Tensor  # (B·n, Tr)
    logprobs: Optional[torch.Tensor] = None  # (B·n, Tr)


def left_pad(seqs: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Token lists → (ids, mask), both (B, T), padded on the left so that every row ends together."""
    T = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), T), pad_id, dtype=torch.long)
    mask = torch.zeros((len(seqs), T), dtype=torch.long)
    for i, s in enumerate(seqs):
        if s:
            ids[i, T - len(s):] = torch.tensor(s)
            mask[i, T - len(s):] = 1
    return ids, mask


def right_pad(seqs: list[list], pad, dtype=torch.long) -> torch.Tensor:
    """Lists → (B, T) tensor padded on the right with `pad`."""
    T = max(1, max(len(s) for s in seqs))
    out = torch.full((len(seqs), T), pad, dtype=dtype)
    for i, s in enumerate(seqs):
        if s:
            out[i, :len(s)] = torch.tensor(s, dtype=dtype)
    return out


def cut_at_eos(tokens: list[int], eos_ids: set[int]) -> list[int]:
    """Keep tokens up to and including the first EOS (generate pads finished rows with more)."""
    for t, tok in enumerate(tokens):
        if tok in eos_ids:
            return tokens[:t + 1]
    return tokens


def eos_ids_of(tokenizer, model_config=None) -> set[int]:
    """Every id that ends a response: the tokenizer's EOS and the model's generation EOS ids."""
    ids = {tokenizer.eos_token_id}
    eos = getattr(getattr(model_config, "generation_config", None), "eos_token_id", None)
    ids |= set(eos if isinstance(eos, list) else [eos])
    return {i for i in ids if i is not None}


class HFRollout:
    """`model.generate` on the training model itself, batched and left-padded.

    It samples from the very weights being trained, so `sync_weights` has nothing to do.
    """

    def __init__(self, model, tokenizer, cfg, autocast_dtype=None, synced_gpus=False):
        self.model, self.tokenizer, self.cfg = model, tokenizer, cfg
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        self.eos_ids = eos_ids_of(tokenizer, model)
        self.autocast_dtype = autocast_dtype
        self.synced_gpus = synced_gpus  # FSDP: every rank must run the same number of forwards

    @torch.no_grad()
    def generate(self, prompts: list[list[int]], n: int, temperature: float, seed: Optional[int] = None) -> Rollout:
        cfg, device = self.cfg, next(self.model.parameters()).device
        seqs = [p for p in prompts for _ in range(n)]
        greedy = temperature == 0
        kwargs = dict(max_new_tokens=cfg.max_response_length, do_sample=not greedy,
                      pad_token_id=self.pad_id, eos_token_id=sorted(self.eos_ids), synced_gpus=self.synced_gpus)
        if not greedy:
            kwargs.update(temperature=temperature, top_p=cfg.top_p, top_k=cfg.top_k if cfg.top_k > 0 else None)
        autocast = (torch.autocast(device.type, dtype=self.autocast_dtype) if self.autocast_dtype
                    else nullcontext())
        was_training = self.model.training
        self.model.eval()
        responses = []
        for start in range(0, len(seqs), cfg.micro_batch_size):
            ids, mask = left_pad(seqs[start:start + cfg.micro_batch_size], self.pad_id)
            with autocast:
                out = self.model.generate(input_ids=ids.to(device), attention_mask=mask.to(device), **kwargs)
            responses += [cut_at_eos(row, self.eos_ids) for row in out[:, ids.shape[1]:].tolist()]
        self.model.train(was_training)
        lengths = [len(r) for r in responses]
        responses = right_pad(responses, self.pad_id)  # (B·n, Tr)
        response_mask = (torch.arange(responses.shape[1])[None, :] < torch.tensor(lengths)[:, None]).long()
        return Rollout(responses, response_mask, None)

    def sync_weights(self, model) -> None:
        pass


def make_rollout(cfg, model, tokenizer, accelerator, autocast_dtype=None):
    """The backend named by `cfg.rollout.name`; vLLM falls back to HF, with one warning, where it is missing."""
    name = cfg.rollout.name
    if name == "vllm":
        try:
            import vllm  # noqa: F401
        except ImportError as e:
            if accelerator.is_main_process:
                print(f"warning: rollout.name=vllm but vLLM cannot be imported ({e}); using rollout.name=hf")
            name = "hf"
    if name == "vllm":
        raise NotImplementedError("vLLM rollout backend: see issue 3")
    synced = accelerator.distributed_type.name == "FSDP"
    return HFRollout(accelerator.unwrap_model(model), tokenizer, cfg.rollout, autocast_dtype, synced_gpus=synced)
