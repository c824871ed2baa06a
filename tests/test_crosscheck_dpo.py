"""dpo.LOSSES equal TRL's own loss functions, called on the same random log-probabilities (float32).

TRL 0.19.1 is installed by the test with `pip install --no-deps --target` (conftest.pip_install), the last release
whose losses are methods of their own, DPOTrainer.dpo_loss and CPOTrainer.cpo_loss (1.x folds them into
DPOTrainer._compute_loss, and its "sigmoid" drops label_smoothing). Their files import transformers' Trainer stack
and more at the top; the two methods use none of it, so each is compiled alone from its file's text and called with
a plain object holding the attributes it reads (beta, label_smoothing, loss_type, …). FDivergenceType and
FDivergenceConstants, the names dpo_loss compares with, are compiled from trl/trainer/dpo_config.py the same way.

Conventions, each asserted as the relation it is:
  1. IPO and SimPO: TRL averages log-probabilities over the completion's tokens before the loss (DPOTrainer's
     concatenated_forward for ipo, CPOTrainer's average_log_prob for simpo); dpo.PER_TOKEN does the same, so both
     are fed the averages here and dpo.sequence_logprobs(per_token=True) is checked to be that average.
  2. rewards/*: TRL's chosen_rewards = β·Δ (DPO, IPO) and β·log π (SimPO): dpo.pair_terms' sums are their sums.
"""
import ast
import os
import types

import pytest
import torch
import torch.nn.functional as F

from conftest import pip_install

import dpo

TRL = "trl==0.19.1"
EXACT32 = dict(rtol=1e-6, atol=1e-6)


def compiled(path: str, wanted: dict, namespace: dict) -> dict:
    """The top-level classes named in wanted[None] and the methods wanted[class] of `path`, each compiled alone
    (annotations unevaluated) into `namespace`; returns it."""
    with open(path) as f:
        tree = ast.parse(f.read(), path)
    nodes = []
    for node in tree.body:
        if isinstance(node, ast.ClassDef) and node.name in wanted.get(None, ()):
            nodes.append(node)
        elif isinstance(node, ast.ClassDef) and node.name in wanted:
            nodes += [n for n in node.body if isinstance(n, ast.FunctionDef) and n.name in wanted[node.name]]
    module = ast.Module(body=nodes, type_ignores=[])
    import __future__
    exec(compile(module, path, "exec", flags=__future__.annotations.compiler_flag, dont_inherit=True), namespace)
    return namespace


@pytest.fixture(scope="module")
def trl():
    root = os.path.join(pip_install(TRL), "trl", "trainer")
    from enum import Enum
    ns = compiled(os.path.join(root, "dpo_config.py"), {None: ("FDivergenceType", "FDivergenceConstants")},
                  {"Enum": Enum})
    ns = compiled(os.path.join(root, "dpo_trainer.py"), {"DPOTrainer": ("dpo_loss",)}, {**ns, "torch": torch, "F": F})
    ns = compiled(os.path.join(root, "cpo_trainer.py"), {"CPOTrainer": ("cpo_loss",)}, ns)
    return ns


def trainer(ns, **settings):
    """A stand-in `self` for TRL's methods: the attributes they read."""
    return types.SimpleNamespace(accelerator=types.SimpleNamespace(device=torch.device("cpu")), reference_free=False,
                                 f_divergence_type=ns["FDivergenceType"].REVERSE_KL.value, f_divergence_params=None,
                                 **settings)


def random_logps(n=64, seed=0):
    """Sequence log-probabilities of a policy and a reference, chosen and rejected: (n,) each, float32."""
    g = torch.Generator().manual_seed(seed)
    return [-20 * torch.rand(n, generator=g) for _ in range(4)]


@pytest.mark.parametrize("label_smoothing", [0.0, 0.1, 0.3])
@pytest.mark.parametrize("beta", [0.1, 0.5])
def test_sigmoid_equals_trl_dpo_loss(trl, beta, label_smoothing):
    """DPO's loss (conservative with ε > 0) and its rewards equal DPOTrainer.dpo_loss(loss_type="sigmoid")."""
    pc, pr, rc, rr = random_logps()
    self = trainer(trl, beta=beta, label_smoothing=label_smoothing, loss_type="sigmoid")
    losses, chosen_rewards, rejected_rewards = trl["dpo_loss"](self, pc, pr, rc, rr)
    ours = dpo.sigmoid_loss(pc - rc, pr - rr, beta, label_smoothing, 0.0)
    assert torch.allclose(ours, losses, **EXACT32)
    d = types.SimpleNamespace(loss_type="sigmoid", beta=beta, label_smoothing=label_smoothing, simpo_gamma=0.0)
    _, sums = dpo.pair_terms(torch.cat([pc, pr]), torch.cat([rc, rr]), d)
    assert sums[3].item() == pytest.approx(chosen_rewards.sum().item(), rel=1e-5)
    assert sums[4].item() == pytest.approx(rejected_rewards.sum().item(), rel=1e-5)
    assert sums[1].item() == (chosen_rewards > rejected_rewards).sum().item()


@pytest.mark.parametrize("beta", [0.1, 1.0])
def test_ipo_equals_trl_on_per_token_logps(trl, beta):
    """IPO equals DPOTrainer.dpo_loss(loss_type="ipo") fed what TRL feeds it, log-probabilities averaged over the
    completion (convention 1); dpo.sequence_logprobs(per_token=True) is that average."""
    g = torch.Generator().manual_seed(1)
    token_logps, mask = -3 * torch.rand(4 * 16, 12, generator=g), (torch.rand(4 * 16, 12, generator=g) > 0.3).long()
    mask[:, 0] = 1
    averaged = dpo.sequence_logprobs(token_logps, mask, per_token=True)
    assert torch.allclose(averaged, (token_logps * mask).sum(1) / mask.sum(1), **EXACT32)
    pc, pr, rc, rr = averaged.chunk(4)
    losses, _, _ = trl["dpo_loss"](trainer(trl, beta=beta, label_smoothing=0.0, loss_type="ipo"), pc, pr, rc, rr)
    assert torch.allclose(dpo.ipo_loss(pc - rc, pr - rr, beta, 0.0, 0.0), losses, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("label_smoothing", [0.0, 0.2])
@pytest.mark.parametrize("beta, gamma", [(2.0, 0.5), (10.0, 1.4)])
def test_simpo_equals_trl_cpo_loss(trl, beta, gamma, label_smoothing):
    """SimPO equals CPOTrainer.cpo_loss(loss_type="simpo", simpo_gamma=γ) on per-token log-probabilities, without a
    reference; its rewards are β·log π (convention 2)."""
    pc, pr, _, _ = (x / 10 for x in random_logps(seed=2))
    self = trainer(trl, beta=beta, label_smoothing=label_smoothing, loss_type="simpo", simpo_gamma=gamma)
    losses, chosen_rewards, _ = trl["cpo_loss"](self, pc, pr)
    assert torch.allclose(dpo.simpo_loss(pc, pr, beta, label_smoothing, gamma), losses, **EXACT32)
    d = types.SimpleNamespace(loss_type="simpo", beta=beta, label_smoothing=label_smoothing, simpo_gamma=gamma)
    _, sums = dpo.pair_terms(torch.cat([pc, pr]), torch.zeros(2 * len(pc)), d)
    assert sums[3].item() == pytest.approx(chosen_rewards.sum().item(), rel=1e-5)
