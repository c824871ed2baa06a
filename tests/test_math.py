"""The formulas of ppo.py, batches.py, critic.py and kl.py: hand-computed cases, plain loops, and masking."""
import math

import pytest
import torch

from critic import explained_variance, gae, value_loss
from kl import KLController, kl_estimate, kl_penalty_rewards
from batches import chunked_logprobs_entropy, entropy_from_logits, logprobs_from_logits, split_micro
from ppo import agg_loss, grpo_advantages, masked_whiten, policy_loss, rloo_advantages


def random_mask(B, T, seed=0):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, T + 1, (B,), generator=g)
    return (torch.arange(T)[None] < lengths[:, None]).float()


# ---- GAE


def test_gae_hand_case():
    """Two tokens, γ=0.9, λ=0.5: δ1 = 1 − 0.5 = 0.5; δ0 = 0 + 0.9·0.5 − 1 = −0.55; Â0 = δ0 + 0.45·Â1 = −0.325."""
    rewards = torch.tensor([[0.0, 1.0]])
    values = torch.tensor([[1.0, 0.5]])
    adv, ret = gae(rewards, values, torch.ones(1, 2), gamma=0.9, lam=0.5)
    assert torch.allclose(adv, torch.tensor([[-0.325, 0.5]]))
    assert torch.allclose(ret, adv + values)


def test_gae_equals_plain_loop_per_sequence():
    """The batched GAE equals a plain Python loop run on each sequence cut at its last real token."""
    B, T, gamma, lam = 6, 9, 0.97, 0.9
    mask = random_mask(B, T)
    rewards, values = torch.randn(B, T), torch.randn(B, T)
    adv, ret = gae(rewards, values, mask, gamma, lam)
    for i in range(B):
        n = int(mask[i].sum())
        last = 0.0
        for t in reversed(range(n)):
            next_v = values[i, t + 1].item() if t + 1 < n else 0.0
            last = rewards[i, t].item() + gamma * next_v - values[i, t].item() + gamma * lam * last
            assert adv[i, t].item() == pytest.approx(last, abs=1e-5)
            assert ret[i, t].item() == pytest.approx(last + values[i, t].item(), abs=1e-5)
        assert torch.all(adv[i, n:] == 0) and torch.all(ret[i, n:] == 0)


def test_gae_ignores_padding():
    """Rewards and values at padded positions change nothing."""
    mask = random_mask(5, 7, seed=1)
    rewards, values = torch.randn(5, 7), torch.randn(5, 7)
    a1, r1 = gae(rewards, values, mask, 1.0, 0.95)
    a2, r2 = gae(rewards + 100 * (1 - mask), values - 50 * (1 - mask), mask, 1.0, 0.95)
    assert torch.allclose(a1, a2) and torch.allclose(r1, r2)


# ---- GRPO / RLOO / whitening


def test_grpo_hand_case():
    """Group [1, 0, 0, 1]: mean ½, sample std 1/√3, so Â = ±(½)·√3; without std, ±½."""
    returns, mask = torch.tensor([1.0, 0, 0, 1]), torch.ones(4, 3)
    adv = grpo_advantages(returns, mask, n=4, norm_by_std=True)
    expected = 0.5 * math.sqrt(3)
    assert torch.allclose(adv[:, 0], torch.tensor([expected, -expected, -expected, expected]), atol=1e-5)
    assert torch.allclose(grpo_advantages(returns, mask, 4, False)[:, 0], torch.tensor([0.5, -0.5, -0.5, 0.5]))


def test_grpo_matches_loop_and_masks():
    """Each group is normalised on its own (plain loop), the advantage is spread over real tokens only."""
    n, returns, mask = 4, torch.randn(12), random_mask(12, 5, seed=2)
    adv = grpo_advantages(returns, mask, n, True)
    for g in range(3):
        group = returns[g * n:(g + 1) * n]
        for j in range(n):
            expect = (group[j] - group.mean()) / (group.std() + 1e-6)
            row = adv[g * n + j]
            assert torch.allclose(row[mask[g * n + j] == 1], expect.expand(int(mask[g * n + j].sum())), atol=1e-5)
            assert torch.all(row[mask[g * n + j] == 0] == 0)


def test_rloo_hand_case():
    """[1, 0, 0]: Â = 1 − 0 = 1, 0 − ½ = −½, 0 − ½ = −½."""
    adv = rloo_advantages(torch.tensor([1.0, 0, 0]), torch.ones(3, 2), n=3)
    assert torch.allclose(adv[:, 0], torch.tensor([1.0, -0.5, -0.5]))


def test_whiten_zero_mean_unit_var_on_real_tokens():
    """After whitening, real tokens have mean 0 and variance 1; padding stays 0."""
    x, mask = torch.randn(4, 6) * 3 + 2, random_mask(4, 6, seed=3)
    w = masked_whiten(x, mask)
    real = w[mask == 1]
    assert real.mean().abs() < 1e-5 and (real.var(unbiased=False) - 1).abs() < 1e-3
    assert torch.all(w[mask == 0] == 0)


# ---- policy loss and aggregation


def test_policy_loss_hand_cases():
    """ratio e^0.5≈1.65 with Â=1 is clipped at 1.2; Â=−1 with ratio e^2≈7.39 is dual-clipped at c=3."""
    logp, old = torch.tensor([[0.5, 2.0, 0.0]]), torch.zeros(1, 3)
    adv = torch.tensor([[1.0, -1.0, 2.0]])
    pg, clipped = policy_loss(logp, old, adv, 0.2, 0.2, 3.0)
    assert pg[0, 0].item() == pytest.approx(-1.2)  # min(1.65, 1.2)·Â, negated
    assert pg[0, 1].item() == pytest.approx(3.0)  # max(7.39, 1.2) = 7.39, then min(7.39, 3)
    assert pg[0, 2].item() == pytest.approx(-2.0)  # ratio 1: −Â
    assert clipped.tolist() == [[1.0, 0.0, 0.0]]


def test_policy_loss_ratio_one_gives_minus_advantage():
    """At ratio 1 (the first update of an on-policy batch) the loss is −Â and nothing is clipped."""
    logp, adv = torch.randn(3, 4), torch.randn(3, 4)
    pg, clipped = policy_loss(logp, logp.clone(), adv, 0.2, 0.28, 3.0)
    assert torch.allclose(pg, -adv) and clipped.sum() == 0


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean"])
def test_agg_loss_micro_batches_sum_to_mini_batch(mode):
    """Splitting a mini-batch into micro-batches leaves the total loss unchanged (plain formula as reference)."""
    loss, mask = torch.randn(8, 5), random_mask(8, 5, seed=4)
    ntok, nseq = mask.sum().item(), 8
    total = sum(agg_loss(loss[i:i + 3], mask[i:i + 3], mode, ntok, nseq) for i in range(0, 8, 3))
    if mode == "token-mean":
        ref = (loss * mask).sum() / mask.sum()
    elif mode == "seq-mean-token-sum":
        ref = (loss * mask).sum(1).mean()
    else:
        ref = ((loss * mask).sum(1) / mask.sum(1)).mean()
    assert torch.allclose(total, ref, atol=1e-6)
    garbage = loss + 1e3 * (1 - mask)  # masked positions contribute nothing
    assert torch.allclose(agg_loss(garbage, mask, mode, ntok, nseq), agg_loss(loss, mask, mode, ntok, nseq))


def test_logprobs_and_entropy_match_torch_distributions():
    """Gathered log-softmax and the entropy formula equal torch.distributions.Categorical's."""
    logits, tokens = torch.randn(2, 3, 11), torch.randint(0, 11, (2, 3))
    dist = torch.distributions.Categorical(logits=logits)
    assert torch.allclose(logprobs_from_logits(logits, tokens), dist.log_prob(tokens), atol=1e-6)
    assert torch.allclose(entropy_from_logits(logits), dist.entropy(), atol=1e-5)


def test_split_micro_token_budget():
    """The token budget keeps every micro-batch's padded size (rows × longest) within max_tokens."""
    lengths = [5, 30, 7, 12, 30, 3, 9, 20]
    parts = split_micro(torch.arange(8), lengths, size=4, max_tokens=40)
    assert sorted(sum((p.tolist() for p in parts), [])) == list(range(8))
    assert all(len(p) * max(lengths[i] for i in p.tolist()) <= 40 for p in parts)
    assert [len(p) for p in split_micro(torch.arange(8), lengths, size=3)] == [3, 3, 2]


# ---- KL


def test_kl_estimators_hand_case():
    """log r = ref − logp = −0.5: k1 = 0.5, k2 = 0.125, k3 = e^−0.5 − 1 + 0.5, abs = 0.5."""
    logp, ref = torch.tensor([0.0]), torch.tensor([-0.5])
    assert kl_estimate(logp, ref, "k1").item() == pytest.approx(0.5)
    assert kl_estimate(logp, ref, "k2").item() == pytest.approx(0.125)
    assert kl_estimate(logp, ref, "k3").item() == pytest.approx(math.exp(-0.5) - 0.5)
    assert kl_estimate(logp, ref, "abs").item() == pytest.approx(0.5)


def test_k1_and_k3_are_unbiased_estimates_of_true_kl():
    """Averaged over samples from π, k1 and k3 approach the exact KL(π‖π_ref); k3 is never negative."""
    g = torch.Generator().manual_seed(0)
    p, q = torch.randn(6, generator=g).log_softmax(0), torch.randn(6, generator=g).log_softmax(0)
    true_kl = (p.exp() * (p - q)).sum()
    x = torch.multinomial(p.exp(), 200_000, replacement=True, generator=g)
    for kind in ("k1", "k3"):
        est = kl_estimate(p[x], q[x], kind)
        assert est.mean().item() == pytest.approx(true_kl.item(), abs=0.01)
    assert kl_estimate(p[x], q[x], "k3").min() >= 0


def test_kl_penalty_rewards_put_score_at_last_real_token():
    """rewards = −β·kl everywhere real, score added at the last real token, 0 on padding."""
    mask = torch.tensor([[1.0, 1, 0], [1, 1, 1]])
    kl = torch.ones(2, 3)
    r = kl_penalty_rewards(torch.tensor([2.0, 5.0]), kl, mask, beta=0.1)
    assert torch.allclose(r, torch.tensor([[-0.1, 1.9, 0.0], [-0.1, -0.1, 4.9]]))


def test_adaptive_kl_controller():
    """KL at twice the target: error clipped to 0.2, β ← β·(1 + 0.2·n/horizon); fixed β never moves."""
    ctrl = KLController("adaptive", 0.1, target_kl=1.0, horizon=100)
    ctrl.update(current_kl=2.0, n_steps=10)
    assert ctrl.value == pytest.approx(0.1 * 1.02)
    ctrl.update(current_kl=0.9, n_steps=10)
    assert ctrl.value == pytest.approx(0.1 * 1.02 * (1 - 0.1 * 0.1))
    fixed = KLController("fixed", 0.1, 1.0, 100)
    fixed.update(5.0, 10)
    assert fixed.value == 0.1


# ---- value loss


def test_value_loss_hand_case():
    """V=2, V_old=1, R=3, ε=0.2: V_clip=1.2; max((2−3)², (1.2−3)²)/2 = 1.62, and the clipped term won."""
    loss, clipfrac = value_loss(torch.tensor([[2.0]]), torch.tensor([[1.0]]), torch.tensor([[3.0]]),
                                torch.ones(1, 1), 0.2)
    assert loss.item() == pytest.approx(1.62)
    assert clipfrac.item() == 1.0


def test_explained_variance():
    """Perfect values explain all variance (1); a constant explains none (0); padding is ignored."""
    returns, mask = torch.tensor([[1.0, 2.0, 3.0, 99.0]]), torch.tensor([[1.0, 1, 1, 0]])
    assert explained_variance(returns, returns, mask) == pytest.approx(1.0)
    assert explained_variance(torch.full((1, 4), 2.0), returns, mask) == pytest.approx(0.0)


def test_chunked_logprobs_entropy_equal_whole_and_keep_gradients():
    """Computing log-probs and entropy a few positions at a time (recomputed in backward) gives the
    same values and the same gradients as the whole tensor at once."""
    logits = torch.randn(3, 5, 17, requires_grad=True)
    tokens = torch.randint(0, 17, (3, 5))
    lp_full = logprobs_from_logits(logits.float() / 0.7, tokens)
    ent_full = entropy_from_logits(logits.float() / 0.7)
    (g_full,) = torch.autograd.grad((lp_full + 0.1 * ent_full).sum(), logits)
    lp, ent = chunked_logprobs_entropy(logits, tokens, 0.7, True, chunk=4)
    (g_chunk,) = torch.autograd.grad((lp + 0.1 * ent).sum(), logits)
    assert torch.allclose(lp, lp_full, atol=1e-6) and torch.allclose(ent, ent_full, atol=1e-5)
    assert torch.allclose(g_chunk, g_full, atol=1e-6)
