"""The formulas of advantages.py, losses.py, critic.py, kl.py, infra/batches.py, infra/optim.lr_lambda and rewards.py's
overlong punishment and pass@k: hand-computed cases, plain loops, and masking (padding, and gaps inside a response);
and ppo.ActorLoss on a tiny model, for the switches that act inside it."""
import math

import pytest
import torch

from critic import explained_variance, value_loss
from kl import KLController, kl_estimate, kl_penalty_rewards
from infra.batches import chunked_logprobs_entropy, LogprobsEntropy, split_micro
from advantages import (gae, grpo, masked_whiten, reinforce_plus_plus, reinforce_plus_plus_baseline, rloo, Settings,
                        varied_groups)
from losses import agg_loss, cispo, Clip, Counts, gspo, rejection_mask, rollout_is_weights, vanilla
from ppo import ActorLoss, policy_loss_mask
from infra.optim import lr_lambda
from rewards import overlong_reward
from validation import pass_and_majority, pass_at_k, validation_metrics


def settings(gamma=1.0, lam=0.95, n=1, norm_by_std=True, whiten=False, reduce_sum=None):
    """advantages.Settings for a test: the estimators read only the fields they use."""
    return Settings(gamma, lam, n, norm_by_std, whiten, reduce_sum)


def policy_loss(logprobs, old_logprobs, advantages, clip_low, clip_high, clip_c):
    """losses.vanilla with its clip range spelled out (the mask does not enter the vanilla loss)."""
    return vanilla(logprobs, old_logprobs, advantages, torch.ones_like(advantages), Clip(clip_low, clip_high, clip_c))


def random_mask(B, T, seed=0):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, T + 1, (B,), generator=g)
    return (torch.arange(T)[None] < lengths[:, None]).float()


def mask_with_gaps(B, T, seed=0):
    """A right-padded mask with holes (tool output inside an agent's response): in every row of 3 or more real tokens
    the second is dropped and each later one but the last with probability ⅓, so a real token follows every gap."""
    mask = random_mask(B, T, seed)
    g = torch.Generator().manual_seed(seed)
    holes = torch.rand(mask.shape, generator=g) < 1 / 3  # (B, T)
    holes[:, 0], holes[:, 1] = False, True
    holes[torch.arange(len(mask)), mask.sum(1).long() - 1] = False  # each row's last real token stays
    gapped = mask * (~holes).to(mask.dtype)
    assert torch.all(gapped[mask.sum(1) >= 3, 1] == 0)
    return gapped


# ---- GAE


def test_gae_hand_case():
    """Two tokens, γ=0.9, λ=0.5: δ1 = 1 − 0.5 = 0.5; δ0 = 0 + 0.9·0.5 − 1 = −0.55; Â0 = δ0 + 0.45·Â1 = −0.325."""
    rewards = torch.tensor([[0.0, 1.0]])
    values = torch.tensor([[1.0, 0.5]])
    adv, ret = gae(rewards, torch.ones(1, 2), values, settings(gamma=0.9, lam=0.5))
    assert torch.allclose(adv, torch.tensor([[-0.325, 0.5]]))
    assert torch.allclose(ret, adv + values)


def test_gae_equals_plain_loop_per_sequence():
    """The batched GAE equals a plain Python loop run on each sequence cut at its last real token."""
    B, T, gamma, lam = 6, 9, 0.97, 0.9
    mask = random_mask(B, T)
    rewards, values = torch.randn(B, T), torch.randn(B, T)
    adv, ret = gae(rewards, mask, values, settings(gamma, lam))
    for i in range(B):
        n = int(mask[i].sum())
        last = 0.0
        for t in reversed(range(n)):
            next_v = values[i, t + 1].item() if t + 1 < n else 0.0
            last = rewards[i, t].item() + gamma * next_v - values[i, t].item() + gamma * lam * last
            assert adv[i, t].item() == pytest.approx(last, abs=1e-5)
            assert ret[i, t].item() == pytest.approx(last + values[i, t].item(), abs=1e-5)
        assert torch.all(adv[i, n:] == 0) and torch.all(ret[i, n:] == 0)


def test_gae_steps_over_gaps_as_a_plain_loop():
    """With gaps in the mask, GAE runs over the real tokens only, as if the gaps were cut out: a plain loop over each
    row's real positions gives the same advantages and returns there (verl 0.9.1 carries V and Â over a gap), and
    gap and padding positions hold 0."""
    B, T, gamma, lam = 6, 10, 0.97, 0.9
    mask = mask_with_gaps(B, T)
    rewards, values = torch.randn(B, T), torch.randn(B, T)
    adv, ret = gae(rewards, mask, values, settings(gamma, lam))
    for i in range(B):
        real, last = mask[i].nonzero()[:, 0].tolist(), 0.0
        for k in reversed(range(len(real))):
            t = real[k]
            next_v = values[i, real[k + 1]].item() if k + 1 < len(real) else 0.0
            last = rewards[i, t].item() + gamma * next_v - values[i, t].item() + gamma * lam * last
            assert adv[i, t].item() == pytest.approx(last, abs=1e-5)
            assert ret[i, t].item() == pytest.approx(last + values[i, t].item(), abs=1e-5)
    assert torch.all(adv[mask == 0] == 0) and torch.all(ret[mask == 0] == 0)


def test_gae_and_reinforce_plus_plus_ignore_what_gaps_hold():
    """Rewards and values at gap positions change no advantage or return."""
    mask = mask_with_gaps(5, 8, seed=1)
    rewards, values = torch.randn(5, 8), torch.randn(5, 8)
    for estimator in (gae, reinforce_plus_plus):
        a1, r1 = estimator(rewards, mask, values, settings(0.9, 0.8))
        a2, r2 = estimator(rewards + 100 * (1 - mask), mask, values - 50 * (1 - mask), settings(0.9, 0.8))
        assert torch.allclose(a1, a2) and torch.allclose(r1, r2)


def test_gae_ignores_padding():
    """Rewards and values at padded positions change nothing."""
    mask = random_mask(5, 7, seed=1)
    rewards, values = torch.randn(5, 7), torch.randn(5, 7)
    a1, r1 = gae(rewards, mask, values, settings())
    a2, r2 = gae(rewards + 100 * (1 - mask), mask, values - 50 * (1 - mask), settings())
    assert torch.allclose(a1, a2) and torch.allclose(r1, r2)


# ---- GRPO / RLOO / REINFORCE++-baseline / whitening / dynamic sampling's filter


def test_grpo_hand_case():
    """Group [1, 0, 0, 1]: mean ½, sample std 1/√3, so Â = ±(½)·√3; without std, ±½."""
    returns, mask = torch.tensor([1.0, 0, 0, 1]), torch.ones(4, 3)
    adv, _ = grpo(returns[:, None] * mask[:, :1], mask, None, settings(n=4))
    expected = 0.5 * math.sqrt(3)
    assert torch.allclose(adv[:, 0], torch.tensor([expected, -expected, -expected, expected]), atol=1e-5)
    dr_grpo, _ = grpo(returns[:, None] * mask[:, :1], mask, None, settings(n=4, norm_by_std=False))
    assert torch.allclose(dr_grpo[:, 0], torch.tensor([0.5, -0.5, -0.5, 0.5]))


def test_grpo_matches_loop_and_masks():
    """Each group is normalised on its own (plain loop) by the sum of each response's token rewards, and the
    advantage is spread over real tokens only."""
    n, mask = 4, random_mask(12, 5, seed=2)
    rewards = torch.randn(12, 5) * mask
    returns = rewards.sum(1)
    adv, _ = grpo(rewards, mask, None, settings(n=n))
    for g in range(3):
        group = returns[g * n:(g + 1) * n]
        for j in range(n):
            expect = (group[j] - group.mean()) / (group.std() + 1e-6)
            row = adv[g * n + j]
            assert torch.allclose(row[mask[g * n + j] == 1], expect.expand(int(mask[g * n + j].sum())), atol=1e-5)
            assert torch.all(row[mask[g * n + j] == 0] == 0)


def test_rloo_hand_case():
    """[1, 0, 0]: Â = 1 − 0 = 1, 0 − ½ = −½, 0 − ½ = −½."""
    adv, _ = rloo(torch.tensor([[0.0, 1], [0, 0], [0, 0]]), torch.ones(3, 2), None, settings(n=3))
    assert torch.allclose(adv[:, 0], torch.tensor([1.0, -0.5, -0.5]))


def test_reinforce_plus_plus_baseline_hand_case():
    """Groups [1, 0] and [2, 2], one token each: R − mean_g R = [½, −½, 0, 0]; over the 4 tokens μ = 0,
    σ² = (¼ + ¼)/4 = ⅛, so Â = [√2, −√2, 0, 0]: the equal group, centred to 0, stays at −μ/σ = 0."""
    rewards, mask = torch.tensor([[1.0], [0.0], [2.0], [2.0]]), torch.ones(4, 1)
    adv, ret = reinforce_plus_plus_baseline(rewards, mask, None, settings(n=2))
    assert torch.allclose(adv[:, 0], torch.tensor([2 ** 0.5, -(2 ** 0.5), 0.0, 0.0]), atol=1e-5)
    assert torch.equal(adv, ret)


def test_reinforce_plus_plus_baseline_equals_plain_loop_and_masks():
    """Each response's summed reward minus its group's mean, spread over its real tokens, then whitened over every
    real token of the batch (a long response counts once per token; population variance), equals the batched
    function; padding gets 0."""
    n, mask = 4, random_mask(12, 5, seed=9)
    rewards = torch.randn(12, 5) * mask
    adv, _ = reinforce_plus_plus_baseline(rewards, mask, None, settings(n=n))
    centred = []
    for g in range(3):
        totals = [rewards[g * n + j].sum().item() for j in range(n)]
        centred += [x - sum(totals) / n for x in totals]
    tiled = torch.tensor(centred)[:, None] * mask
    real = tiled[mask == 1]
    assert torch.allclose(adv, (tiled - real.mean()) / real.std(unbiased=False) * mask, atol=1e-5)
    assert torch.all(adv[mask == 0] == 0)


def test_varied_groups_keeps_the_prompts_whose_scores_differ():
    """Groups of 3: [1, 1, 1] and [0, 0, 0] are dropped (no advantage to learn), [1, 0, 1] and [0.5, 0.5, 0.6] kept."""
    scores = torch.tensor([1.0, 1, 1, 1, 0, 1, 0, 0, 0, 0.5, 0.5, 0.6])
    assert varied_groups(scores, 3).tolist() == [False, True, False, True]


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


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"])
def test_agg_loss_micro_batches_sum_to_mini_batch(mode):
    """Splitting a mini-batch into micro-batches leaves the total loss unchanged (plain formula as reference)."""
    loss, mask, L = torch.randn(8, 5), random_mask(8, 5, seed=4), 7.0
    counts = Counts(mask.sum().item(), 8)
    total = sum(agg_loss(loss[i:i + 3], mask[i:i + 3], mode, counts, L) for i in range(0, 8, 3))
    if mode == "token-mean":
        ref = (loss * mask).sum() / mask.sum()
    elif mode == "seq-mean-token-sum":
        ref = (loss * mask).sum(1).mean()
    elif mode == "seq-mean-token-sum-norm":
        ref = (loss * mask).sum(1).mean() / L
    else:
        ref = ((loss * mask).sum(1) / mask.sum(1)).mean()
    assert torch.allclose(total, ref, atol=1e-6)
    garbage = loss + 1e3 * (1 - mask)  # masked positions contribute nothing
    assert torch.allclose(agg_loss(garbage, mask, mode, counts, L), agg_loss(loss, mask, mode, counts, L))


def test_seq_mean_token_sum_norm_hand_case_and_needs_its_constant():
    """Dr. GRPO's aggregation: losses of 1 on responses of 3 and 1 tokens, 2 sequences, L = 4: (3 + 1)/(2·4) = ½,
    whatever the lengths' own mean; without L it refuses rather than guess."""
    loss, mask = torch.ones(2, 4), torch.tensor([[1.0, 1, 1, 0], [1, 0, 0, 0]])
    assert agg_loss(loss, mask, "seq-mean-token-sum-norm", Counts(4.0, 2.0), 4.0).item() == pytest.approx(0.5)
    with pytest.raises(ValueError, match="loss_scale_factor"):
        agg_loss(loss, mask, "seq-mean-token-sum-norm", Counts(4.0, 2.0))


# ---- GSPO and CISPO


def test_gspo_hand_case_value_and_gradient():
    """log π − log π_old = [0.2, −0.1 | pad 5]: log s = (0.2 − 0.1)/2 = 0.05, s = e^0.05 ≈ 1.051 on both real tokens.
    With Â = 1 and ε_high = 0.04 the ratio is clipped (pg = −1.04, no gradient); with ε_high = 0.1 it is not
    (pg = −s) and each real token's gradient is its own −Â·s, padding's 0."""
    old = torch.zeros(1, 3)
    mask, adv = torch.tensor([[1.0, 1, 0]]), torch.ones(1, 3)
    for high, clipped_expected in ((0.04, 1.0), (0.1, 0.0)):
        logp = torch.tensor([[0.2, -0.1, 5.0]], requires_grad=True)
        pg, clipped = gspo(logp, old, adv, mask, Clip(0.04, high, 3.0))
        s = math.exp(0.05)
        assert pg[0, :2].tolist() == pytest.approx([-min(s, 1 + high)] * 2, rel=1e-6)
        assert clipped[0, :2].tolist() == [clipped_expected] * 2
        (pg * mask).sum().backward()
        expected_grad = [0.0, 0.0, 0.0] if clipped_expected else [-s, -s, 0.0]
        assert logp.grad[0].tolist() == pytest.approx(expected_grad, abs=1e-6)


def test_gspo_equals_plain_loop_and_ignores_padding():
    """Per response, s = exp(mean over its real tokens of log π − log π_old), pg = max(−Â·s, −Â·clip(s)), on every
    real token (a plain loop); log-probs at padding change nothing on a real token."""
    B, T = 5, 6
    mask = random_mask(B, T, seed=10)
    old, logp, adv = 0.2 * torch.randn(B, T), 0.2 * torch.randn(B, T), torch.randn(B, T)
    clip = Clip(0.05, 0.08, 3.0)
    pg, _ = gspo(logp, old, adv, mask, clip)
    for i in range(B):
        real = mask[i].nonzero()[:, 0].tolist()
        s = math.exp(sum(logp[i, t].item() - old[i, t].item() for t in real) / len(real))
        for t in real:
            a = adv[i, t].item()
            assert pg[i, t].item() == pytest.approx(max(-a * s, -a * min(max(s, 0.95), 1.08)), rel=1e-5, abs=1e-6)
    garbage, _ = gspo(logp + 9 * (1 - mask), old, adv, mask, clip)
    assert torch.allclose(garbage * mask, pg * mask)


def test_cispo_hand_case_gradient_is_the_clipped_weight():
    """CISPO's gradient per token is −sg[clip(r)]·Â·∇log π: r = e^0.5 ≈ 1.65 is clipped to 1.28 (ε_high 0.28),
    r = e^−0.5 ≈ 0.61 is kept whole with no lower bound (ε_low = 1), so with Â = [2, −1] the gradients are −2.56 and +0.61;
    PPO's clip would give the first token no gradient at all."""
    logp, old = torch.tensor([[0.5, -0.5]], requires_grad=True), torch.zeros(1, 2)
    adv = torch.tensor([[2.0, -1.0]])
    pg, clipped = cispo(logp, old, adv, torch.ones(1, 2), Clip(1.0, 0.28, 3.0))
    pg.sum().backward()
    assert logp.grad[0].tolist() == pytest.approx([-2 * 1.28, math.exp(-0.5)], rel=1e-6)
    assert clipped.tolist() == [[1.0, 0.0]]
    assert pg[0].tolist() == pytest.approx([-1.28 * 2 * 0.5, -math.exp(-0.5) * 1 * 0.5], rel=1e-6)


def test_policy_losses_share_the_gradient_at_ratio_one():
    """At ratio 1 (one epoch of one mini-batch, ppo.py departure 3) vanilla, gspo and cispo give every real token
    the same gradient, −Â: they differ only off-policy."""
    mask, adv = random_mask(3, 5, seed=11), torch.randn(3, 5)
    grads = []
    for loss in (vanilla, gspo, cispo):
        logp = torch.randn(3, 5, generator=torch.Generator().manual_seed(0)).requires_grad_()
        pg, _ = loss(logp, logp.detach(), adv, mask, Clip(0.2, 0.28, 3.0))
        (pg * mask).sum().backward()
        grads.append(logp.grad)
    for g in grads:
        assert torch.allclose(g, -adv * mask, atol=1e-6)


def test_logprobs_and_entropy_match_torch_distributions():
    """The chunked log-probs and entropies of softmax(logits / T) equal torch.distributions.Categorical's, whatever
    the chunk (one position, an uneven split, all at once)."""
    logits, tokens = torch.randn(2, 3, 11), torch.randint(0, 11, (2, 3))
    dist = torch.distributions.Categorical(logits=logits / 0.7)
    for chunk in (1, 4, 6):
        logprobs, entropy = chunked_logprobs_entropy(logits, tokens, 0.7, True, chunk)
        assert torch.allclose(logprobs, dist.log_prob(tokens), atol=1e-6)
        assert torch.allclose(entropy, dist.entropy(), atol=1e-5)
    logprobs, entropy = chunked_logprobs_entropy(logits, tokens, 0.7, False, 4)
    assert entropy is None and torch.allclose(logprobs, dist.log_prob(tokens), atol=1e-6)


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
    """rewards = −β·kl everywhere real, score added at the last real token, 0 on padding; with a gap, "last" is the
    last token whose mask is 1, not the count of real tokens (row 3: 2 real tokens, the last at index 3)."""
    mask = torch.tensor([[1.0, 1, 0, 0], [1, 1, 1, 1], [1, 0, 0, 1]])
    kl = torch.ones(3, 4)
    r = kl_penalty_rewards(torch.tensor([2.0, 5.0, 3.0]), kl, mask, beta=0.1)
    assert torch.allclose(r, torch.tensor([[-0.1, 1.9, 0.0, 0.0], [-0.1, -0.1, -0.1, 4.9], [-0.1, 0.0, 0.0, 2.9]]))


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


def test_chunked_logprobs_entropy_gradients_by_hand_are_autograds():
    """LogprobsEntropy's hand-written backward: gradcheck (float64) against finite differences for the log-probs, the
    entropy and both together, chunked unevenly; in fp32 it equals autograd through log_softmax and the entropy
    formula, also when the logits are bf16 (as under autocast), and leaves the logits untouched at T = 1."""
    logits = torch.randn(7, 13, dtype=torch.float64, requires_grad=True)
    tokens = torch.randint(0, 13, (7,))
    for weights in ((1.0, 0.0), (0.0, 1.0), (1.0, 0.3)):
        def f(z):
            logprobs, entropy = LogprobsEntropy.apply(z, tokens, 0.7, True, 3)
            return weights[0] * logprobs + weights[1] * entropy
        assert torch.autograd.gradcheck(f, (logits,))
    for dtype in (torch.float32, torch.bfloat16):
        z = torch.randn(3, 5, 17).to(dtype).requires_grad_()
        tokens, before = torch.randint(0, 17, (3, 5)), z.detach().clone()
        lp, ent = chunked_logprobs_entropy(z, tokens, 1.0, True, chunk=4)
        (g,) = torch.autograd.grad((lp + 0.1 * ent).sum(), z)
        zf = z.detach().float().requires_grad_()
        log_p = zf.log_softmax(-1)
        lp_ref, ent_ref = log_p.gather(-1, tokens[..., None])[..., 0], -(log_p.exp() * log_p).sum(-1)
        (g_ref,) = torch.autograd.grad((lp_ref + 0.1 * ent_ref).sum(), zf)
        assert torch.allclose(lp, lp_ref, atol=1e-6) and torch.allclose(ent, ent_ref, atol=1e-5)
        atol = 1e-6 if dtype == torch.float32 else 1e-2  # bf16 keeps 8 bits of the gradient
        assert g.dtype == dtype and torch.allclose(g.float(), g_ref.to(dtype).float(), atol=atol)
        assert torch.equal(z.detach(), before)


# ---- REINFORCE++


def test_reinforce_plus_plus_hand_case():
    """γ=0.5. Sequence a: rewards [0, 2] → G = [1, 2]; sequence b: [0, pad] → G = [0]. Over the real tokens
    {1, 2, 0}: μ = 1, σ² = 2/3, so Â = [0, √1.5] and [−√1.5, 0 (padding)]."""
    rewards, mask = torch.tensor([[0.0, 2.0], [0.0, 5.0]]), torch.tensor([[1.0, 1], [1, 0]])
    adv, ret = reinforce_plus_plus(rewards, mask, None, settings(gamma=0.5))
    assert torch.allclose(ret, torch.tensor([[1.0, 2.0], [0.0, 0.0]]))
    s = math.sqrt(1.5)
    assert torch.allclose(adv, torch.tensor([[0.0, s], [-s, 0.0]]), atol=1e-6)


def test_reinforce_plus_plus_equals_plain_loop():
    """Discounted returns from a plain loop over each sequence's real tokens, then (G − mean) / std over every
    real token of the batch (population variance, as OpenRLHF's experience_maker), equal the batched function."""
    B, T, gamma = 6, 9, 0.9
    mask = random_mask(B, T, seed=5)
    rewards = torch.randn(B, T)
    adv, ret = reinforce_plus_plus(rewards, mask, None, settings(gamma))
    plain = []
    for i in range(B):
        n, g = int(mask[i].sum()), 0.0
        row = [0.0] * T
        for t in reversed(range(n)):
            g = rewards[i, t].item() + gamma * g
            row[t] = g
        plain.append(row)
    plain = torch.tensor(plain)
    assert torch.allclose(ret, plain, atol=1e-5)
    real = plain[mask == 1]
    expect = (plain - real.mean()) / real.std(unbiased=False) * mask
    assert torch.allclose(adv, expect, atol=1e-4)


def test_reinforce_plus_plus_ignores_padding():
    """Rewards at padded positions change nothing, and advantages and returns are 0 there."""
    mask = random_mask(5, 7, seed=6)
    rewards = torch.randn(5, 7)
    a1, r1 = reinforce_plus_plus(rewards, mask, None, settings(0.95))
    a2, r2 = reinforce_plus_plus(rewards + 100 * (1 - mask), mask, None, settings(0.95))
    assert torch.allclose(a1, a2) and torch.allclose(r1, r2)
    assert torch.all(a1[mask == 0] == 0) and torch.all(r1[mask == 0] == 0)


def test_reinforce_plus_plus_returns_step_over_gaps_as_a_plain_loop():
    """With gaps, G_t = r_t + γ·G_{t'} with t' the next real token: the discount skips the gap (verl 0.9.1 carries
    G over it), the reward sitting in a gap is unread, and gaps and padding hold 0."""
    B, T, gamma = 6, 9, 0.8
    mask = mask_with_gaps(B, T, seed=5)
    rewards = torch.randn(B, T)
    _, ret = reinforce_plus_plus(rewards, mask, None, settings(gamma))
    for i in range(B):
        g = 0.0
        for t in reversed(mask[i].nonzero()[:, 0].tolist()):
            g = rewards[i, t].item() + gamma * g
            assert ret[i, t].item() == pytest.approx(g, abs=1e-5)
    assert torch.all(ret[mask == 0] == 0)


def test_reinforce_plus_plus_whitens_over_the_global_batch():
    """Two processes, each holding half the batch and summing its statistics with the other's (reduce_sum),
    get exactly the advantages of one process holding the whole batch, not each half whitened alone."""
    mask, rewards = random_mask(8, 6, seed=7), torch.randn(8, 6)
    whole, _ = reinforce_plus_plus(rewards, mask, None, settings(0.9))
    sums = {}

    def record(half):
        def f(s):
            sums[half] = s.clone()
            return s
        return f
    halves = {"a": slice(0, 4), "b": slice(4, 8)}
    alone = {h: reinforce_plus_plus(rewards[s], mask[s], None, settings(0.9, reduce_sum=record(h)))[0]
             for h, s in halves.items()}
    joint = {h: reinforce_plus_plus(rewards[s], mask[s], None, settings(0.9, reduce_sum=lambda t: sums["a"] + sums["b"]))[0]
             for h, s in halves.items()}
    assert torch.allclose(torch.cat([joint["a"], joint["b"]]), whole, atol=1e-5)
    assert not torch.allclose(torch.cat([alone["a"], alone["b"]]), whole, atol=1e-3)


# ---- truncated importance sampling (algorithm.rollout_is)


def test_rollout_is_weights_hand_case():
    """log π_old − log π_rollout = [0.5, −0.3, 1.5 | pad]: token weights e^0.5, e^−0.3 and 2 (e^1.5 = 4.48
    truncated at C = 2); sequence weight min(e^1.7, 2) = 2, and with C = 10, e^1.7 on every token."""
    old, rollout = torch.tensor([[0.5, -0.3, 1.5, 9.0]]), torch.zeros(1, 4)
    mask = torch.tensor([[1.0, 1, 1, 0]])
    w = rollout_is_weights(old, rollout, mask, "token", 2.0)
    assert torch.allclose(w[0, :3], torch.tensor([math.exp(0.5), math.exp(-0.3), 2.0]))
    assert torch.allclose(rollout_is_weights(old, rollout, mask, "sequence", 2.0)[0, :3], torch.full((3,), 2.0))
    assert torch.allclose(rollout_is_weights(old, rollout, mask, "sequence", 10.0)[0, :3],
                          torch.full((3,), math.exp(1.7)))


def test_rollout_is_weights_equal_plain_loop_and_ignore_padding():
    """Token and sequence weights equal a plain loop over each response's real tokens; log-probs at padded
    positions change no weight on a real token."""
    B, T, C = 5, 6, 1.5
    mask = random_mask(B, T, seed=8)
    old, rollout = 0.3 * torch.randn(B, T), 0.3 * torch.randn(B, T)
    token, seq = rollout_is_weights(old, rollout, mask, "token", C), rollout_is_weights(old, rollout, mask, "sequence", C)
    for i in range(B):
        n = int(mask[i].sum())
        log_seq = sum(old[i, t].item() - rollout[i, t].item() for t in range(n))
        for t in range(n):
            assert token[i, t].item() == pytest.approx(min(math.exp(old[i, t].item() - rollout[i, t].item()), C), rel=1e-5)
            assert seq[i, t].item() == pytest.approx(min(math.exp(log_seq), C), rel=1e-5)
    garbage = old + 50 * (1 - mask)
    for level in ("token", "sequence"):
        assert torch.allclose(rollout_is_weights(garbage, rollout, mask, level, C) * mask,
                              rollout_is_weights(old, rollout, mask, level, C) * mask)


def test_sequence_mean_weight_is_the_geometric_mean():
    """sequence_mean: log ρ = [0.5, −0.3, 1.5 | pad] has mean 1.7/3, so the weight is e^0.567 ≈ 1.76 on every real
    token (under C = 2), where the product e^1.7 ≈ 5.5 would be truncated to 2."""
    old, rollout = torch.tensor([[0.5, -0.3, 1.5, 9.0]]), torch.zeros(1, 4)
    mask = torch.tensor([[1.0, 1, 1, 0]])
    w = rollout_is_weights(old, rollout, mask, "sequence_mean", 2.0)
    assert w[0, :3].tolist() == pytest.approx([math.exp(1.7 / 3)] * 3, rel=1e-6)


# ---- rejection sampling (algorithm.rollout_rs)


def test_rejection_mask_hand_case():
    """Band [0.5, 2] (log ±0.693). Row 0, log ρ = [0.5, −1.0, 0.1 | pad]: token level drops the middle token
    (e^−1 = 0.37 < 0.5); the product e^−0.4 = 0.67 and the mean e^−0.13 keep the whole response. Row 1,
    log ρ = [0.3, 0.3, 0.3, 0.3]: every token is in the band, the product e^1.2 = 3.3 is not (all dropped), the
    geometric mean e^0.3 = 1.35 is (all kept). Padding is always 0."""
    old, rollout = torch.tensor([[0.5, -1.0, 0.1, 7.0], [0.3, 0.3, 0.3, 0.3]]), torch.zeros(2, 4)
    mask = torch.tensor([[1.0, 1, 1, 0], [1, 1, 1, 1]])
    expected = {"token": [[1, 0, 1, 0], [1, 1, 1, 1]], "sequence": [[1, 1, 1, 0], [0, 0, 0, 0]],
                "sequence_mean": [[1, 1, 1, 0], [1, 1, 1, 1]]}
    for level, keep in expected.items():
        assert rejection_mask(old, rollout, mask, level, 0.5, 2.0).tolist() == keep, level


def test_rejection_mask_equals_plain_loop_and_ignores_padding():
    """Each level equals a plain loop over each response's real tokens (keep where low ≤ ρ ≤ high, ρ per token, as
    the product, or as the geometric mean), with an asymmetric band; log-probs at padding change nothing."""
    B, T, low, high = 8, 6, 0.8, 1.5
    mask = random_mask(B, T, seed=12)
    old, rollout = 0.3 * torch.randn(B, T), 0.3 * torch.randn(B, T)
    for level in ("token", "sequence", "sequence_mean"):
        keep = rejection_mask(old, rollout, mask, level, low, high)
        for i in range(B):
            real = mask[i].nonzero()[:, 0].tolist()
            logs = [old[i, t].item() - rollout[i, t].item() for t in real]
            for k, t in enumerate(real):
                log_rho = {"token": logs[k], "sequence": sum(logs), "sequence_mean": sum(logs) / len(logs)}[level]
                assert keep[i, t].item() == float(math.log(low) <= log_rho <= math.log(high)), (level, i, t)
        assert torch.all(keep[mask == 0] == 0)
        assert torch.equal(rejection_mask(old + 20 * (1 - mask), rollout, mask, level, low, high), keep)


def test_policy_loss_mask_drops_truncated_responses_and_rejected_tokens():
    """ppo.policy_loss_mask: reward.overlong_filter drops every token of a truncated response (row 1);
    algorithm.rollout_rs=token drops the token whose ratio e^1 leaves [0.5, 2] (row 0, token 2), and logs the share
    of real tokens rejected (1 of 7); response_mask itself is left as it was."""
    from infra import cli
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 1, 0]])
    batch = {"response_mask": mask, "old_logprobs": torch.tensor([[0.0, 0.1, 1.0, 0.0], [0.0, 0.0, 0.0, 0.0]]),
             "rollout_logprobs": torch.zeros(2, 4)}
    truncated = torch.tensor([False, True])
    cfg = cli.load_config(None, ["reward.overlong_filter=true", "algorithm.rollout_rs=token"])
    loss_mask, metrics = policy_loss_mask(batch, truncated, cfg)
    assert loss_mask.tolist() == [[1, 1, 0, 1], [0, 0, 0, 0]]
    assert metrics["rollout/rs_rejected_frac"] == pytest.approx(1 / 7)
    assert torch.equal(batch["response_mask"], mask)
    neither, metrics = policy_loss_mask(batch, truncated, cli.load_config(None, []))
    assert torch.equal(neither, mask.float()) and metrics == {}


# ---- DAPO's overlong punishment, validation at k samples


def test_overlong_reward_hand_case():
    """L_max = 16, L_cache = 4, factor 1: lengths 10 and 12 are free, 13 loses ¼, 16 (the limit) loses 1; with
    factor 0.5 the last loses ½."""
    lengths = torch.tensor([10, 12, 13, 16])
    assert overlong_reward(lengths, 16, 4, 1.0).tolist() == pytest.approx([0, 0, -0.25, -1.0])
    assert overlong_reward(lengths, 16, 4, 0.5)[-1].item() == pytest.approx(-0.5)


def test_pass_at_k_hand_cases_and_plain_enumeration():
    """4 samples, 1 right: pass@1 = ¼, pass@2 = 1 − C(3,2)/C(4,2) = ½, pass@4 = 1; none right: 0. For every
    (n, c, k) up to 6 it is the share of the C(n, k) subsets of k samples that hold a right one."""
    import itertools
    assert [pass_at_k(4, 1, k) for k in (1, 2, 4)] == pytest.approx([0.25, 0.5, 1.0])
    assert pass_at_k(4, 0, 4) == 0
    for n in range(1, 7):
        for c in range(n + 1):
            for k in range(1, n + 1):
                subsets = list(itertools.combinations([True] * c + [False] * (n - c), k))
                assert pass_at_k(n, c, k) == pytest.approx(sum(any(s) for s in subsets) / len(subsets))


def one_process():
    """What sum_over_processes needs from an Accelerator, for one process."""
    import types
    return types.SimpleNamespace(device=torch.device("cpu"), reduce=lambda x, op: x)


def test_pass_and_majority_per_source_and_overall():
    """Two prompts of source a and one of b, k = 4 samples each (right: score > 0). a: 1 and 3 right → pass@1
    (1/4 + 3/4)/2 = ½, pass@2 (½ + 1)/2 = ¾, pass@4 1; its majority answers are "7" (wrong: the right one is the
    minority "8") and "9" (right) → maj@4 ½. b: 0 right → all 0, and it has no answers, so no maj@4 of its own.
    Over all three prompts pass@1 = 1/3 and maj@4 counts a's two prompts only."""
    rows = [{"data_source": "a"}] * 8 + [{"data_source": "b"}] * 4
    scores = [1, 0, 0, 0] + [1, 1, 0, 1] + [0, 0, 0, 0]
    answers = ["8", "7", "7", "1"] + ["9", "9", "2", "9"] + [None] * 4
    m = pass_and_majority(rows, scores, answers, ["a", "b"], 4, one_process())
    a = [m["val/a/pass@1"], m["val/a/pass@2"], m["val/a/pass@4"], m["val/a/maj@4"]]
    assert a == pytest.approx([0.5, 0.75, 1, 0.5])
    assert [m["val/b/pass@1"], m["val/b/pass@4"]] == [0, 0] and "val/b/maj@4" not in m
    assert m["val/pass@1/mean"] == pytest.approx(1 / 3) and m["val/maj@4/mean"] == pytest.approx(0.5)


def test_validation_metrics_at_k_read_the_rules_answers(tmp_path):
    """validation_metrics with k = 2 and a rule that returns {"score", "pred"} (as verl's DAPO rule): mean@2 is
    val/score/mean, pass@1 and pass@2 follow the scores, and maj@2 the rule's answers ("pred")."""
    from infra import cli
    from rewards import Scorer
    rule = tmp_path / "rule.py"
    rule.write_text('def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n'
                    '    pred = solution_str.strip()\n'
                    '    return {"score": float(pred == ground_truth), "pred": pred}\n')
    scorer = Scorer(cli.load_config(None, [f"reward.function={rule}:compute_score"]).reward, "cpu", None)
    rows = [{"data_source": "s", "ground_truth": "4", "extra_info": {}}] * 2 + [
        {"data_source": "s", "ground_truth": "5", "extra_info": {}}] * 2
    m = validation_metrics(scorer, rows, ["4", "4", "5", "6"], ["s"], one_process(), k=2)
    assert m["val/score/mean"] == pytest.approx(0.75) and m["val/s/score"] == pytest.approx(0.75)
    assert m["val/s/pass@1"] == pytest.approx(0.75) and m["val/s/pass@2"] == pytest.approx(1.0)
    assert m["val/s/maj@2"] == pytest.approx(1.0)  # "4" twice; a tie "5"/"6" goes to the first seen, "5"
    assert "val/s/pass@2" not in validation_metrics(scorer, rows, ["4", "4", "5", "6"], ["s"], one_process(), k=1)


# ---- asymmetric clipping


def test_policy_loss_asymmetric_clip_low_and_high_are_not_swapped():
    """ε_low = 0.1, ε_high = 0.3: ratio 1.25 with Â = 1 is inside [0.9, 1.3] (loss −1.25, unclipped), ratio 0.8
    with Â = −1 is below 0.9 (loss −Â·0.9 = 0.9, clipped). Swapped bounds would give −1.1 and 0.8."""
    logp, old = torch.log(torch.tensor([[1.25, 0.8]])), torch.zeros(1, 2)
    adv = torch.tensor([[1.0, -1.0]])
    pg, clipped = policy_loss(logp, old, adv, clip_low=0.1, clip_high=0.3, clip_c=3.0)
    assert pg[0].tolist() == pytest.approx([-1.25, 0.9])
    assert clipped.tolist() == [[0.0, 1.0]]
    pg_swapped, _ = policy_loss(logp, old, adv, clip_low=0.3, clip_high=0.1, clip_c=3.0)
    assert pg_swapped[0].tolist() == pytest.approx([-1.1, 0.8])


# ---- learning-rate schedule


def test_lr_lambda_warmup_then_cosine_values():
    """10 steps, warmup_ratio 0.2 (2 steps), floor 0.1: 1/3, 2/3 in warm-up, then 1 at step 2, the floor plus half
    the range at the midpoint (step 6), the floor at step 10 and after; 'constant' stays at 1 after warm-up."""
    f = lr_lambda(10, 0.2, "cosine", 0.1)
    assert [f(s) for s in (0, 1, 2)] == pytest.approx([1 / 3, 2 / 3, 1.0])
    assert f(6) == pytest.approx(0.1 + 0.9 * 0.5)
    assert f(10) == pytest.approx(0.1) and f(15) == pytest.approx(0.1)
    for s in range(2, 11):  # the cosine formula, step by step
        assert f(s) == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * (s - 2) / 8)))
    g = lr_lambda(10, 0.2, "constant", 0.1)
    assert [g(s) for s in (0, 1, 2, 9, 10)] == pytest.approx([1 / 3, 2 / 3, 1, 1, 1])
    assert lr_lambda(10, 0.0, "cosine", 0.0)(0) == 1.0  # no warm-up: the peak at once


# ---- actor_loss on a tiny model: the switches that act inside it


@pytest.fixture(scope="module")
def tiny_actor(tmp_path_factory):
    """A tiny causal LM, and a micro-batch of 3 random (prompt, response) pairs, the last response padded."""
    from transformers import AutoModelForCausalLM
    from conftest import make_tiny_model
    policy = AutoModelForCausalLM.from_pretrained(make_tiny_model(tmp_path_factory.mktemp("actor")))
    g = torch.Generator().manual_seed(0)
    mb = dict(queries=torch.randint(5, 100, (3, 4), generator=g), query_mask=torch.ones(3, 4, dtype=torch.long),
              responses=torch.randint(5, 100, (3, 5), generator=g),
              response_mask=torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 1, 1], [1, 1, 1, 0, 0]]))
    return policy, mb


def run_actor_loss(policy, mb, **overrides):
    """ppo.ActorLoss with the config's defaults plus `overrides` (dotted keys), no reference, the micro-batch as its
    whole mini-batch; (loss, metrics). Without mb["old_logprobs"] the loss takes them from its own forward."""
    from infra import cli
    from infra.batches import Forward
    cfg = cli.load_config(None, [f"{k}={v}" for k, v in overrides.items()])
    mb = {"loss_mask": mb["response_mask"], **mb}  # the policy loss sees every real token unless the test says
    mask = mb["loss_mask"]
    counts = Counts(float(mask.sum()), float(len(mask)))
    return ActorLoss.from_config(cfg, Forward(1.0, None, "padded"))(policy, mb, counts)


def logprobs_of(policy, mb):
    from infra.batches import forward_logprobs
    with torch.no_grad():
        return forward_logprobs(policy, mb, 1.0, None, True, "padded")


def test_actor_loss_entropy_bonus(tiny_actor):
    """A positive actor.entropy_coef c lowers the loss by exactly c·H̄ (token-mean entropy), and a gradient
    step on that loss alone (Â = 0) raises the policy's entropy."""
    policy, mb = tiny_actor
    mb = {**mb, "advantages": torch.zeros(3, 5)}
    mask = mb["response_mask"].float()
    _, entropy = logprobs_of(policy, mb)
    h_mean = ((entropy * mask).sum() / mask.sum()).item()
    loss0, _ = run_actor_loss(policy, mb, **{"actor.entropy_coef": 0.0})
    loss1, stats = run_actor_loss(policy, mb, **{"actor.entropy_coef": 0.5})
    assert loss0.item() == pytest.approx(0.0, abs=1e-7)
    assert loss1.item() == pytest.approx(-0.5 * h_mean, rel=1e-5)
    assert stats["policy/entropy"] == pytest.approx(h_mean, rel=1e-5)
    policy.zero_grad()
    loss1.backward()
    with torch.no_grad():
        for p in policy.parameters():
            if p.grad is not None:
                p -= 0.05 * p.grad
    _, after = logprobs_of(policy, mb)
    with torch.no_grad():  # undo the step for the other tests
        for p in policy.parameters():
            if p.grad is not None:
                p += 0.05 * p.grad
    policy.zero_grad()
    assert ((after * mask).sum() / mask.sum()).item() > h_mean


def test_actor_loss_passes_clip_low_and_high_the_right_way_round(tiny_actor):
    """Through actor_loss: old log-probs set so that the ratio is 1.25 where Â = 1 (rows 0, 2) and 0.8 where
    Â = −1 (row 1). With clip_ratio_low 0.1, clip_ratio_high 0.3 only row 1 is clipped (clipfrac 5/13) and the
    policy loss is (−1.25·8 + 0.9·5)/13; a config whose low and high were swapped would clip rows 0 and 2."""
    policy, mb = tiny_actor
    logprobs, _ = logprobs_of(policy, mb)
    ratio = torch.tensor([1.25, 0.8, 1.25])[:, None].expand(3, 5)
    mb = {**mb, "advantages": torch.tensor([1.0, -1.0, 1.0])[:, None].expand(3, 5).clone(),
          "old_logprobs": logprobs - ratio.log()}
    _, stats = run_actor_loss(policy, mb, **{"actor.clip_ratio_low": 0.1, "actor.clip_ratio_high": 0.3})
    assert stats["policy/clipfrac"] == pytest.approx(5 / 13)
    assert stats["loss/policy"] == pytest.approx((-1.25 * 8 + 0.9 * 5) / 13, rel=1e-4)
    _, swapped = run_actor_loss(policy, mb, **{"actor.clip_ratio_low": 0.3, "actor.clip_ratio_high": 0.1})
    assert swapped["policy/clipfrac"] == pytest.approx(8 / 13)


@pytest.mark.parametrize("level", ["token", "sequence", "sequence_mean"])
def test_actor_loss_applies_truncated_rollout_is(tiny_actor, level):
    """With the sampler's log-probs log 3 below the trainer's on every token, algorithm.rollout_is multiplies the
    policy loss by the truncated weight: min(3, C) per token, min(3^T_i, C) per sequence, min(3, C) for the
    sequence's geometric mean; with rollout_is=off the loss is unweighted but the (token) weight is still logged."""
    policy, mb = tiny_actor
    logprobs, _ = logprobs_of(policy, mb)
    mask = mb["response_mask"].float()
    mb = {**mb, "advantages": torch.tensor([1.0, -0.5, 2.0])[:, None].expand(3, 5).clone(),
          "rollout_logprobs": (logprobs - math.log(3)) * mask}
    off_loss, off = run_actor_loss(policy, mb, **{"algorithm.rollout_is": "off"})
    assert off["rollout/is_weight_mean"] == pytest.approx(2.0, rel=1e-4)  # min(3, default threshold 2)
    for threshold in (2.0, 5.0):
        loss, stats = run_actor_loss(policy, mb, **{"algorithm.rollout_is": level,
                                                    "algorithm.rollout_is_threshold": threshold})
        weight = threshold if level == "sequence" else min(3.0, threshold)  # 3^3 and 3^5 both exceed 5
        assert loss.item() == pytest.approx(weight * off_loss.item(), rel=1e-4)
        assert stats["rollout/is_weight_mean"] == pytest.approx(weight, rel=1e-4)


def test_actor_loss_sees_only_loss_mask(tiny_actor):
    """A response outside loss_mask (rejected, or overlong-filtered) adds nothing: with Â only on row 2 and row 2
    out of loss_mask, the policy loss is exactly 0; with it in, it is not."""
    policy, mb = tiny_actor
    mb = {**mb, "advantages": torch.tensor([0.0, 0.0, 1.0])[:, None].expand(3, 5).clone()}
    without_row_2 = mb["response_mask"] * torch.tensor([1, 1, 0])[:, None]
    loss, _ = run_actor_loss(policy, {**mb, "loss_mask": without_row_2})
    assert loss.item() == 0.0
    assert run_actor_loss(policy, mb)[0].item() != 0.0


def test_actor_loss_seq_mean_token_sum_norm_divides_by_the_constant(tiny_actor):
    """actor.loss_agg_mode=seq-mean-token-sum-norm is seq-mean-token-sum divided by L: by default
    rollout.max_response_length (16), else actor.loss_scale_factor (5)."""
    policy, mb = tiny_actor
    mb = {**mb, "advantages": torch.tensor([1.0, -0.5, 2.0])[:, None].expand(3, 5).clone()}
    token_sum, _ = run_actor_loss(policy, mb, **{"actor.loss_agg_mode": "seq-mean-token-sum"})
    normed, _ = run_actor_loss(policy, mb, **{"actor.loss_agg_mode": "seq-mean-token-sum-norm"})
    scaled, _ = run_actor_loss(policy, mb, **{"actor.loss_agg_mode": "seq-mean-token-sum-norm",
                                              "actor.loss_scale_factor": 5})
    assert normed.item() == pytest.approx(token_sum.item() / 16, rel=1e-5)
    assert scaled.item() == pytest.approx(token_sum.item() / 5, rel=1e-5)
