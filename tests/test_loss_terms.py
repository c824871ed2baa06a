"""Two terms no other test pinned (issue 29): the KL loss inside ppo.ActorLoss, and gradient clipping in infra/optim.
Hand-computed cases: each test fails if its term is dropped."""
import pytest
import torch

from infra.cli import load_config
from infra.optim import clip_grad_norm, train_step
from losses import Counts
from ppo import ActorLoss


class FixedForward:
    """A Forward whose policy log-probabilities are the given leaf tensor (B, Tr), entropy 0."""

    def __init__(self, logprobs):
        self.fixed = logprobs

    def logprobs(self, policy, micro, with_entropy=False):
        return self.fixed, torch.zeros_like(self.fixed)


@pytest.mark.parametrize("use_kl_loss, expected_loss, expected_grad", [(True, -0.9, -0.45), (False, -1.0, -0.5)])
def test_the_actor_loss_adds_the_kl_loss_term(use_kl_loss, expected_loss, expected_grad):
    """One response of 2 tokens, log π = (−1, −2), log π_ref = (−2, −3), Â = 1, one epoch (ratio 1, departure 3),
    token-mean over 2 tokens. Policy term: −Â·ratio = −1 a token. k1 KL loss: log π − log π_ref = 1 a token, times
    β = 0.1. So L = (−1 + 0.1·1 − 1 + 0.1·1) / 2 = −0.9 with the KL loss, −1.0 without; ∂L/∂log π_t = (−1 + 0.1) / 2
    = −0.45 with it, −0.5 without."""
    cfg = load_config(None, [f"algorithm.use_kl_loss={str(use_kl_loss).lower()}", "algorithm.kl_loss_coef=0.1",
                             "algorithm.kl_loss_type=k1", "actor.entropy_coef=0", "actor.loss_agg_mode=token-mean"])
    logprobs = torch.tensor([[-1.0, -2.0]], requires_grad=True)
    loss_fn = ActorLoss.from_config(cfg, FixedForward(logprobs))
    micro = {"loss_mask": torch.ones(1, 2), "advantages": torch.ones(1, 2), "ref_logprobs": torch.tensor([[-2.0, -3.0]])}
    loss, metrics = loss_fn(None, micro, Counts(tokens=2.0, sequences=1.0))
    loss.backward()
    assert loss.item() == pytest.approx(expected_loss)
    assert logprobs.grad[0].tolist() == pytest.approx([expected_grad, expected_grad])
    assert metrics["kl/mean"] == pytest.approx(1.0)  # logged k1 either way: the loss term is what differs


def test_clipping_scales_a_gradient_above_max_grad_norm_to_it_and_leaves_a_smaller_one():
    """g = (3, 4): ‖g‖ = 5. With max_grad_norm 1 the norm 5 is returned and g becomes (0.6, 0.8); with 10, g stays."""
    w = torch.nn.Parameter(torch.zeros(2))
    w.grad = torch.tensor([3.0, 4.0])
    assert clip_grad_norm([w], 1.0).item() == pytest.approx(5.0)
    assert w.grad.tolist() == pytest.approx([0.6, 0.8])
    w.grad = torch.tensor([3.0, 4.0])
    assert clip_grad_norm([w], 10.0).item() == pytest.approx(5.0)
    assert w.grad.tolist() == pytest.approx([3.0, 4.0])


def test_train_step_applies_the_clipped_gradient():
    """loss = 3·w₀ + 4·w₁ over two micro-batches (half each): ‖∇‖ = 5, clipped to max_grad_norm 0.5, so one SGD step
    of lr 1 moves w from (0, 0) to −(0.3, 0.4); train_step reports the norm before clipping, 5."""
    model = torch.nn.Module()
    model.w = w = torch.nn.Parameter(torch.zeros(2))
    coef = torch.tensor([3.0, 4.0])
    grad_norm, _ = train_step(model, torch.optim.SGD([w], lr=1.0), [0.5, 0.5],
                              lambda share: ((coef * w).sum() * share, {}), 0.5)
    assert grad_norm == pytest.approx(5.0)
    assert w.detach().tolist() == pytest.approx([-0.3, -0.4])


def test_a_stop_signal_ends_train_step_at_the_next_micro_batch_and_applies_nothing():
    """The signal arrives during the first of three micro-batches: train_step asks before each, so the second one
    never runs, the gradient accumulated so far is dropped and the weights stay; it returns no grad norm. Once the
    signal is known, a later train_step returns before any micro-batch without asking again (issue 29: torchrun's
    30 s do not wait for the rest of a step)."""
    from infra.optim import StopAtMicroBatch
    asked, ran = [], []
    cut = StopAtMicroBatch(lambda: asked.append(1) or (15 if ran else 0))  # SIGTERM once a micro-batch has run
    model = torch.nn.Module()
    model.w = w = torch.nn.Parameter(torch.ones(2))

    def loss_fn(mb):
        ran.append(mb)
        return (w * mb).sum(), {"m": float(mb)}
    optimizer = torch.optim.SGD([w], lr=1.0)
    assert train_step(model, optimizer, [1.0, 2.0, 3.0], loss_fn, 1e9, stop=cut) == (None, {"m": [1.0]})
    assert ran == [1.0] and len(asked) == 2 and cut.signum == 15
    assert w.grad is None and w.detach().tolist() == [1.0, 1.0]
    assert train_step(model, optimizer, [1.0], loss_fn, 1e9, stop=cut) == (None, {})
    assert ran == [1.0] and len(asked) == 2
