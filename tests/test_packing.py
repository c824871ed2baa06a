"""Sequence packing (model.use_remove_padding) and token-budget micro-batches give the padded path's numbers."""
import pytest
import torch
from transformers import AutoModelForCausalLM

import critic as critic_mod
from conftest import make_tiny_model
from ppo import forward_logprobs, forward_values, micro_batch, per_token_pass
from rollout import left_pad, right_pad

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOL = 1e-4 if DEVICE == "cpu" else 2e-3


def random_batch(B=6, vocab=200, seed=0):
    """Prompts and responses of different lengths, padded the way ppo.py pads them."""
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(3, vocab, (int(n),), generator=g).tolist() for n in torch.randint(3, 12, (B,), generator=g)]
    responses = [torch.randint(3, vocab, (int(n),), generator=g).tolist() for n in torch.randint(1, 9, (B,), generator=g)]
    queries, query_mask = left_pad(prompts, 2)
    resp = right_pad(responses, 2)
    response_mask = (torch.arange(resp.shape[1])[None] < torch.tensor([len(r) for r in responses])[:, None]).long()
    return dict(queries=queries, query_mask=query_mask, responses=resp, response_mask=response_mask)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    path = make_tiny_model(tmp_path_factory.mktemp("packing"))
    policy = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).to(DEVICE).eval()
    value_model = critic_mod.load_critic(path).to(DEVICE).eval()
    return policy, value_model


@torch.no_grad()
def test_packed_logprobs_entropy_and_values_equal_padded(models):
    """Packing every sequence into one row, positions restarting per sequence, gives the padded path's
    logprobs, entropies and values at every real response token (fp32, |diff| < 1e-4 on CPU), and 0 at padding."""
    policy, value_model = models
    mb = {k: v.to(DEVICE) for k, v in random_batch().items()}
    mask = mb["response_mask"].bool()
    lp_pad, ent_pad = forward_logprobs(policy, mb, 1.0, None, True, packed=False)
    lp_pack, ent_pack = forward_logprobs(policy, mb, 1.0, None, True, packed=True)
    assert (lp_pad - lp_pack)[mask].abs().max() < TOL
    assert (ent_pad - ent_pack)[mask].abs().max() < TOL
    assert torch.all(lp_pack[~mask] == 0)
    v_pad, v_pack = forward_values(value_model, mb, None, False), forward_values(value_model, mb, None, True)
    assert (v_pad - v_pack)[mask].abs().max() < TOL


@torch.no_grad()
def test_token_budget_micro_batches_change_nothing(models):
    """Logprobs over the batch are the same whether micro-batches are fixed-size or formed by a token budget."""
    policy, _ = models
    batch = random_batch(B=10, seed=1)
    lengths = (batch["query_mask"].sum(1) + batch["response_mask"].sum(1)).tolist()
    fn = lambda mb: forward_logprobs(policy, mb, 1.0, None, False)[0]  # noqa: E731
    fixed = per_token_pass(fn, batch, 4, 0, lengths, DEVICE)
    budget = per_token_pass(fn, batch, 4, 40, lengths, DEVICE)
    mask = batch["response_mask"].bool()
    assert (fixed - budget)[mask].abs().max() < TOL


def test_micro_batch_trims_padding_columns():
    """A micro-batch keeps only the columns its own rows use."""
    batch = random_batch(B=6, seed=2)
    mb = micro_batch(batch, torch.tensor([0]), "cpu")
    assert mb["query_mask"][:, 0].all() and mb["response_mask"][:, -1].all()
