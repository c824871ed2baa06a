"""The library's math equals verl's and OpenRLHF's own functions, called on the same random tensors.

verl 0.9.1 and OpenRLHF 0.11.2 (the versions the code cites) are installed by these tests with
`pip install --no-deps --target` into kept folders under the temp dir (conftest.pip_install); every test is
skipped, with the reason, where pip cannot install them. Their real code runs; nothing of theirs is rewritten:
  * verl: verl/trainer/ppo/core_algos.py is imported as shipped. Two package __init__ files on its import path
    import ray (verl/__init__.py, verl/utils/profiler/__init__.py): they are skipped (conftest.bare_packages), and
    the one name verl's config modules take from the profiler package, ProfilerConfig, is bound to verl's own class.
    The small packages core_algos needs to import (omegaconf and its antlr4 runtime, tensordict, pyvers,
    codetiming) are installed --no-deps beside it.
  * OpenRLHF: openrlhf/models/utils.py imports deepspeed and trainer/ppo_utils/experience_maker.py imports ray at
    the top; neither installs here (deepspeed ships only as source, to build against torch; ray is 240 MB) and
    the functions compared use neither (checked). Those two files are compiled from their own text minus those
    import lines, with annotations left unevaluated (PEP 563); everything else they import is OpenRLHF's own code,
    its package __init__ files skipped as verl's are.

Conventions that differ on purpose, each asserted as the relation it is:
  1. Whitening: this library (masked_whiten) and OpenRLHF divide by the biased standard deviation (variance
     Σ(x − μ)²/N); verl's masked_whiten uses the unbiased one (/(N − 1)), so verl's whitened values are this
     library's times √((N − 1)/N), N the number of real tokens.
  2. KL clamps: verl caps k3 at 10 (k1, k2, abs unclamped); OpenRLHF caps k1, k2 and k3 at ±10; this library caps
     no estimate, and clamps only k3's log-ratio, to ±20 before exp (as verl does too).
  3. Padding: this library returns 0 on padding everywhere; verl's GAE returns are Â + V with V left on padding,
     OpenRLHF's rewards keep −β·KL and its whitened advantages −μ/σ there. Their losses mask all of it, so the
     comparisons are on real tokens where one side leaves such values.
  4. verl clamps the policy's log-ratio to ±20 before exp (GSPO's sequence log-ratio at 10), this library does not:
     the inputs stay within ±3.
  5. Rejection sampling's band: this library keeps low ≤ ρ ≤ high for ρ = π_old/π_rollout; verl's k1 options bound
     −log ρ, i.e. keep 1/upper ≤ ρ ≤ 1/lower, so this library's [low, high] is verl's threshold "1/high_1/low". The
     defaults (low = 1/high) are the same band on both sides.
  6. verl's DAPO reward manager is imported from its file as shipped, with the package's __init__ skipped (it imports
     every manager, and through them ray); its base class (abstract.py) is verl's own, compiled without its
     `from verl.protocol import DataProto` (an annotation only, left unevaluated). A small stand-in for DataProto
     (len, [i], .batch, .non_tensor_batch: all that DAPORewardManager.__call__ touches) carries the tensors.
     rollout_corr_helper.py is compiled the same way without its DataProto import, which the two functions compared
     do not use (checked).
Masks are right-padded, as this library makes them (a response, then padding), except where a test says it has gaps
(a response with tokens the policy did not write, such as tool output, inside it: mask 0 between real tokens).
"""
import __future__
import ast
import importlib
import os
import sys
import types

import numpy as np
import pytest
import torch
from torch.testing import assert_close

import advantages
import critic
import losses
import kl
import rewards
from advantages import masked_mean, Settings
from conftest import bare_packages, pip_install


def settings(gamma=1.0, lam=1.0, n=1, norm_by_std=True, whiten=False):
    """advantages.Settings on one process: each estimator reads only the fields it uses."""
    return Settings(gamma, lam, n, norm_by_std, whiten)

VERL = "verl==0.9.1"
VERL_IMPORT_DEPS = ["omegaconf==2.3.0", "antlr4-python3-runtime==4.9.3", "tensordict==0.10.0", "pyvers==0.1.0",
                    "codetiming==1.4.0"]
OPENRLHF = "openrlhf==0.11.2"
EXACT64 = dict(rtol=1e-12, atol=1e-12)  # float64 inputs: both sides do the same arithmetic up to rounding order
EXACT32 = dict(rtol=1e-6, atol=1e-6)  # float32 inputs (OpenRLHF computes in float32)


def agg_tolerance(mode):
    """verl's seq-mean-token-mean divides each sequence's sum by its count + 1e-8: a relative 1e-8 at one token."""
    return dict(rtol=2e-8, atol=0) if mode == "seq-mean-token-mean" else EXACT64


@pytest.fixture(scope="module")
def verl():
    """verl's verl.trainer.ppo.core_algos module, from its pip install."""
    root, deps = pip_install(VERL), pip_install(*VERL_IMPORT_DEPS)
    if deps not in sys.path:
        sys.path.append(deps)  # after the venv's packages: only what the venv lacks comes from here
    bare_packages(root, "verl", "verl.utils.profiler")
    try:
        profiler_config = importlib.import_module("verl.utils.profiler.config")
        sys.modules["verl.utils.profiler"].ProfilerConfig = profiler_config.ProfilerConfig
        return importlib.import_module("verl.trainer.ppo.core_algos")
    except ImportError as e:
        pytest.skip(f"verl's core_algos does not import with {', '.join(VERL_IMPORT_DEPS)}: {e}")


@pytest.fixture(scope="module")
def verl_actor_config(verl):
    """verl's ActorConfig (GSPO and CISPO require one) with clip range 0.2/0.28: make(**changes) builds one."""
    actor = importlib.import_module("verl.workers.config.actor")

    def make(**changes):
        fields = dict(strategy="fsdp", rollout_n=4, clip_ratio=0.2, clip_ratio_low=0.2, clip_ratio_high=0.28,
                      ppo_mini_batch_size=4, ppo_micro_batch_size_per_gpu=4)
        return actor.ActorConfig(**{**fields, **changes})
    return make


@pytest.fixture(scope="module")
def verl_rollout_corr(verl):
    """verl's verl/trainer/ppo/rollout_corr_helper.py, without its DataProto import (convention 6)."""
    path = os.path.join(pip_install(VERL), "verl", "trainer", "ppo", "rollout_corr_helper.py")
    module = module_without_imports("verl.trainer.ppo.rollout_corr_helper", path, {"verl.protocol"})
    for fn in (module.compute_rollout_rejection_mask, module.compute_rollout_correction_weights):
        assert "DataProto" not in names_used(fn), fn.__name__
    return module


@pytest.fixture(scope="module")
def verl_dapo(verl):
    """verl's DAPORewardManager from verl/workers/reward_manager/dapo.py, its package __init__ skipped (convention 6)."""
    folder = os.path.join(pip_install(VERL), "verl", "workers", "reward_manager")
    package = types.ModuleType("verl.workers.reward_manager")
    package.__path__ = [folder]
    sys.modules["verl.workers.reward_manager"] = package
    module_without_imports("verl.workers.reward_manager.abstract", os.path.join(folder, "abstract.py"),
                           {"verl.protocol"})
    package.register = importlib.import_module("verl.workers.reward_manager.registry").register
    return module_without_imports("verl.workers.reward_manager.dapo", os.path.join(folder, "dapo.py"),
                                  {"verl"}).DAPORewardManager


def module_without_imports(name: str, path: str, dropped: set):
    """Module `name` compiled from the file at `path` without its top-level imports of the modules in `dropped`,
    annotations unevaluated; registered in sys.modules so that the files importing it find it."""
    with open(path) as f:
        tree = ast.parse(f.read(), path)
    tree.body = [node for node in tree.body
                 if not (isinstance(node, ast.Import) and {a.name for a in node.names} <= dropped)
                 and not (isinstance(node, ast.ImportFrom) and node.module in dropped)]
    module = types.ModuleType(name)
    module.__file__ = path
    sys.modules[name] = module
    exec(compile(tree, path, "exec", flags=__future__.annotations.compiler_flag, dont_inherit=True), module.__dict__)
    return module


def names_used(fn) -> set:
    """Every global name a function's code (nested code included) refers to."""
    codes, names = [fn.__code__], set()
    while codes:
        code = codes.pop()
        names |= set(code.co_names)
        codes += [c for c in code.co_consts if isinstance(c, types.CodeType)]
    return names


@pytest.fixture(scope="module")
def openrlhf():
    """OpenRLHF's compute_approx_kl, compute_reward, Experience, KL controllers and RemoteExperienceMaker."""
    root = pip_install(OPENRLHF)
    bare_packages(root, "openrlhf", "openrlhf.models", "openrlhf.utils", "openrlhf.trainer",
                  "openrlhf.trainer.ppo_utils")
    package = os.path.join(root, "openrlhf")
    try:
        utils = module_without_imports("openrlhf.models.utils", os.path.join(package, "models", "utils.py"),
                                       {"deepspeed"})
        maker = module_without_imports("openrlhf.trainer.ppo_utils.experience_maker",
                                       os.path.join(package, "trainer", "ppo_utils", "experience_maker.py"),
                                       {"ray", "openrlhf.trainer.ray.launcher"})
        from openrlhf.trainer.ppo_utils.experience import Experience
        from openrlhf.trainer.ppo_utils.kl_controller import AdaptiveKLController, FixedKLController
    except ImportError as e:
        pytest.skip(f"OpenRLHF's modules do not import here: {e}")
    compared = [utils.compute_approx_kl, utils.compute_reward, maker.RemoteExperienceMaker.get_cumulative_returns,
                maker.RemoteExperienceMaker.get_advantages_and_returns,
                maker.RemoteExperienceMaker.compute_advantages_and_returns]
    for fn in compared:
        assert not names_used(fn) & {"deepspeed", "ray", "RayActorGroup"}, fn.__qualname__
    return types.SimpleNamespace(compute_approx_kl=utils.compute_approx_kl, compute_reward=utils.compute_reward,
                                 RemoteExperienceMaker=maker.RemoteExperienceMaker, Experience=Experience,
                                 AdaptiveKLController=AdaptiveKLController, FixedKLController=FixedKLController)


def right_padded_mask(B, T, generator, dtype=torch.float64):
    """(B, T) mask of 1s then 0s with random lengths in 1..T; row 0 is full, row 1 has one token."""
    lengths = torch.randint(1, T + 1, (B,), generator=generator)
    lengths[0], lengths[1] = T, 1
    return (torch.arange(T)[None] < lengths[:, None]).to(dtype)


def mask_with_gaps(B, T, generator, dtype=torch.float64):
    """A right-padded mask with holes (tool output inside an agent's response): in every row of 3 or more real tokens
    the second is dropped and each later one but the last with probability ⅓, so a real token follows every gap."""
    mask = right_padded_mask(B, T, generator, dtype)
    g = generator
    holes = torch.rand(mask.shape, generator=g) < 1 / 3  # (B, T)
    holes[:, 0], holes[:, 1] = False, True
    holes[torch.arange(len(mask)), mask.sum(1).long() - 1] = False  # each row's last real token stays
    gapped = mask * (~holes).to(mask.dtype)
    assert torch.all(gapped[mask.sum(1) >= 3, 1] == 0)
    return gapped


def bessel(mask) -> float:
    """√((N − 1)/N) for the N real tokens of mask: verl's unbiased whitening over this library's biased one."""
    n = mask.sum().item()
    return ((n - 1) / n) ** 0.5


def randn(*shape, generator, dtype=torch.float64):
    return torch.randn(*shape, generator=generator, dtype=dtype)


# ---- verl: advantages


def test_gae_equals_verls_before_whitening(verl):
    """advantages.gae's returns equal verl's compute_gae_advantage_return's on every real token, and its advantages
    equal verl's Â = returns − V (verl hands out its advantages only whitened); rewards and values on padding are
    random, so anything either side read from padding would show."""
    g = torch.Generator().manual_seed(0)
    mask = right_padded_mask(6, 9, g)
    rewards, values = randn(6, 9, generator=g), randn(6, 9, generator=g)
    adv, ret = advantages.gae(rewards, mask, values, settings(gamma=0.97, lam=0.9))
    _, verl_ret = verl.compute_gae_advantage_return(rewards, values, mask, gamma=0.97, lam=0.9)
    real = mask.bool()
    assert_close(ret[real], verl_ret[real], **EXACT64)
    assert_close(adv[real], (verl_ret - values)[real], **EXACT64)
    assert torch.all(adv[~real] == 0) and torch.all(ret[~real] == 0)


def test_whitened_gae_is_verls_times_the_bessel_factor(verl):
    """Convention 1: verl whitens GAE advantages with the unbiased variance, masked_whiten with the biased one, so
    on real tokens verl's = masked_whiten(Â) · √((N − 1)/N) with N real tokens (here N is small, so the factor is
    far from 1 and a mismatch in the convention would show)."""
    g = torch.Generator().manual_seed(1)
    mask = right_padded_mask(4, 5, g)
    rewards, values = randn(4, 5, generator=g), randn(4, 5, generator=g)
    adv, _ = advantages.gae(rewards, mask, values, settings(gamma=1.0, lam=0.95))
    verl_adv, _ = verl.compute_gae_advantage_return(rewards, values, mask, gamma=1.0, lam=0.95)
    n, real = mask.sum().item(), mask.bool()
    assert n < 20
    assert_close(verl_adv[real], advantages.masked_whiten(adv, mask)[real] * ((n - 1) / n) ** 0.5, rtol=1e-7, atol=1e-7)


def outcome_rewards(scores, mask):
    """(B, T) token rewards: each score at its response's last real token, as both libraries lay them out."""
    rewards = torch.zeros_like(mask)
    rewards[torch.arange(len(scores)), mask.sum(1).long() - 1] = scores
    return rewards


def group_scores(groups, n, generator):
    """(groups·n,) scores: random, one group all equal (its std is 0) and one group of 0/1 outcomes."""
    scores = randn(groups, n, generator=generator)
    scores[0] = 1.0
    scores[1] = torch.tensor([0.0, 1.0] * (n // 2), dtype=scores.dtype)
    return scores.reshape(-1)


@pytest.mark.parametrize("norm_by_std", [True, False])
def test_grpo_equals_verls(verl, norm_by_std):
    """advantages.grpo equals verl's compute_grpo_outcome_advantage with the same norm_adv_by_std_in_grpo, on every
    token, for groups of n = 4 responses (a group with equal scores gives 0, not a division by zero)."""
    g, n = torch.Generator().manual_seed(2), 4
    mask = right_padded_mask(16, 6, g)
    scores = group_scores(4, n, g)
    index = np.array([f"prompt-{i // n}" for i in range(16)], dtype=object)
    theirs, _ = verl.compute_grpo_outcome_advantage(outcome_rewards(scores, mask), mask, index,
                                                    norm_adv_by_std_in_grpo=norm_by_std)
    ours, _ = advantages.grpo(outcome_rewards(scores, mask), mask, None, settings(n=n, norm_by_std=norm_by_std))
    assert_close(ours, theirs, **EXACT64)
    real = mask[:n].bool()
    assert torch.allclose(ours[:n][real], ours[0, 0].expand(int(real.sum()))) and ours.abs().max() > 0.1


def test_rloo_equals_verls(verl):
    """advantages.rloo equals verl's compute_rloo_outcome_advantage on every token, groups of n = 4."""
    g, n = torch.Generator().manual_seed(3), 4
    mask = right_padded_mask(16, 6, g)
    scores = group_scores(4, n, g)
    index = np.array([f"prompt-{i // n}" for i in range(16)], dtype=object)
    theirs, _ = verl.compute_rloo_outcome_advantage(outcome_rewards(scores, mask), mask, index)
    assert_close(advantages.rloo(outcome_rewards(scores, mask), mask, None, settings(n=n))[0], theirs, **EXACT64)


def test_gae_with_gaps_equals_verls(verl):
    """With gaps in the mask (issue 23: tool tokens inside a response), advantages.gae's returns equal verl's
    compute_gae_advantage_return's on every real token and its advantages equal verl's returns − V there: both carry V
    and Â over a gap. Rewards and values inside the gaps are random, so reading them would show; this library
    leaves 0 on gaps and padding."""
    g = torch.Generator().manual_seed(20)
    mask = mask_with_gaps(8, 10, g)
    rewards, values = randn(8, 10, generator=g), randn(8, 10, generator=g)
    adv, ret = advantages.gae(rewards, mask, values, settings(gamma=0.97, lam=0.9))
    _, verl_ret = verl.compute_gae_advantage_return(rewards, values, mask, gamma=0.97, lam=0.9)
    real = mask.bool()
    assert_close(ret[real], verl_ret[real], **EXACT64)
    assert_close(adv[real], (verl_ret - values)[real], **EXACT64)
    assert torch.all(adv[~real] == 0) and torch.all(ret[~real] == 0)


@pytest.mark.parametrize("gaps", [False, True])
def test_reinforce_plus_plus_equals_verls(verl, gaps):
    """advantages.reinforce_plus_plus's returns equal verl's compute_reinforce_plus_plus_outcome_advantage's on every
    token, on right-padded masks and on masks with gaps (G carried over a gap, 0 there on both sides), and its
    whitened advantages are verl's over the Bessel factor (convention 1)."""
    g = torch.Generator().manual_seed(21)
    mask = (mask_with_gaps if gaps else right_padded_mask)(8, 9, g)
    rewards = randn(8, 9, generator=g)
    adv, ret = advantages.reinforce_plus_plus(rewards, mask, None, settings(gamma=0.9))
    verl_adv, verl_ret = verl.compute_reinforce_plus_plus_outcome_advantage(rewards, mask,
                                                                           config=types.SimpleNamespace(gamma=0.9))
    assert_close(ret, verl_ret, **EXACT64)
    assert_close(verl_adv, adv * bessel(mask), rtol=1e-7, atol=1e-7)


def test_reinforce_plus_plus_baseline_equals_verls(verl):
    """advantages.reinforce_plus_plus_baseline (the score minus its group's mean, whitened over the batch's real tokens)
    is verl's compute_reinforce_plus_plus_baseline_outcome_advantage over the Bessel factor (convention 1), on every
    token; the tokens of a group of equal scores (centred to 0) all get one value, the batch's −μ/σ."""
    g, n = torch.Generator().manual_seed(22), 4
    mask = right_padded_mask(16, 6, g)
    scores = group_scores(4, n, g)
    index = np.array([f"prompt-{i // n}" for i in range(16)], dtype=object)
    theirs, _ = verl.compute_reinforce_plus_plus_baseline_outcome_advantage(outcome_rewards(scores, mask), mask, index)
    ours, _ = advantages.reinforce_plus_plus_baseline(outcome_rewards(scores, mask), mask, None, settings(n=n))
    assert_close(theirs, ours * bessel(mask), rtol=1e-7, atol=1e-7)
    real = mask[:n].bool()
    assert torch.allclose(ours[:n][real], ours[0, 0].expand(int(real.sum()))) and ours.abs().max() > 0.1


# ---- verl: losses


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean"])
def test_policy_loss_equals_verls_vanilla(verl, mode):
    """losses.vanilla + agg_loss equal verl's compute_policy_loss_vanilla (asymmetric clip 0.2/0.28, dual clip c = 3)
    in each aggregation mode, and the clipped share equals verl's pg_clipfrac. agg_loss gets this batch's own token
    and sequence counts, which is what verl uses without global batch info. Log-ratios stay within ±3, so verl's
    ±20 clamp before exp never bites (convention 4); both clips and the dual clip do bite here."""
    from omegaconf import OmegaConf
    g = torch.Generator().manual_seed(4)
    mask = right_padded_mask(8, 8, g)
    old_logprobs = -3 * torch.rand(8, 8, generator=g, dtype=torch.float64)
    logprobs = old_logprobs + (0.8 * randn(8, 8, generator=g)).clamp(-3, 3)
    advantages = randn(8, 8, generator=g)
    ratio, real = (logprobs - old_logprobs).exp(), mask.bool()
    assert ((advantages < 0) & (ratio > 3) & real).any() and ((advantages > 0) & (ratio > 1.28) & real).any()
    config = OmegaConf.create({"clip_ratio": 0.2, "clip_ratio_low": 0.2, "clip_ratio_high": 0.28, "clip_ratio_c": 3.0,
                               "global_batch_info": {}})
    theirs, metrics = verl.compute_policy_loss_vanilla(old_logprobs, logprobs, advantages, mask, mode, config)
    pg, clipped = losses.vanilla(logprobs, old_logprobs, advantages, mask, losses.Clip(low=0.2, high=0.28, c=3.0))
    ours = losses.agg_loss(pg, mask, mode, losses.Counts(tokens=mask.sum().item(), sequences=float(len(mask))))
    assert_close(ours, theirs, **agg_tolerance(mode))
    # verl's masked_mean divides by the count + 1e-8
    assert masked_mean(clipped, mask).item() == pytest.approx(metrics["actor/pg_clipfrac"], rel=1e-8)


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean"])
def test_agg_loss_of_a_micro_batch_equals_verls_with_global_counts(verl, mode):
    """A micro-batch's share: agg_loss with the mini-batch's token and sequence counts equals verl's agg_loss given
    the same counts as batch_num_tokens and global_batch_size (one data-parallel rank)."""
    g = torch.Generator().manual_seed(5)
    mask, loss_mat = right_padded_mask(5, 7, g), randn(5, 7, generator=g)
    num_tokens, num_seqs = 61.0, 16.0  # the mini-batch this micro-batch belongs to
    theirs = verl.agg_loss(loss_mat, mask, mode, dp_size=1, batch_num_tokens=num_tokens, global_batch_size=num_seqs)
    assert_close(losses.agg_loss(loss_mat, mask, mode, losses.Counts(num_tokens, num_seqs)), theirs, **agg_tolerance(mode))


def policy_inputs(seed):
    """old and new log-probs 0.3-apart on average (both clips bite at 0.2/0.28), advantages, a right-padded mask."""
    g = torch.Generator().manual_seed(seed)
    mask = right_padded_mask(8, 8, g)
    old_logprobs = -3 * torch.rand(8, 8, generator=g, dtype=torch.float64)
    logprobs = old_logprobs + (0.3 * randn(8, 8, generator=g)).clamp(-3, 3)
    return logprobs, old_logprobs, randn(8, 8, generator=g), mask


@pytest.mark.parametrize("name", ["gspo", "cispo"])
@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"])
def test_gspo_and_cispo_equal_verls(verl, verl_actor_config, name, mode):
    """losses.gspo / losses.cispo + agg_loss equal verl's compute_policy_loss_gspo / compute_policy_loss_cispo (clip
    0.2/0.28) in value, in the gradient they give every log-prob, and in the clipped share (pg_clipfrac); GSPO's
    ratios spread enough around 1 that its clip bites on some responses and not on others."""
    logprobs, old_logprobs, adv, mask = policy_inputs(23)
    L = 8.0  # seq-mean-token-sum-norm's constant: verl's loss_scale_factor
    config = verl_actor_config(loss_scale_factor=L, global_batch_info={"loss_scale_factor": L})
    ours_lp, theirs_lp = logprobs.clone().requires_grad_(), logprobs.clone().requires_grad_()
    pg, clipped = losses.POLICY_LOSSES[name](ours_lp, old_logprobs, adv, mask, losses.Clip(0.2, 0.28, 3.0))
    ours = losses.agg_loss(pg, mask, mode, losses.Counts(mask.sum().item(), float(len(mask))), L)
    verl_fn = {"gspo": verl.compute_policy_loss_gspo, "cispo": verl.compute_policy_loss_cispo}[name]
    theirs, metrics = verl_fn(old_logprobs, theirs_lp, adv, mask, loss_agg_mode=mode, config=config)
    assert_close(ours, theirs, **agg_tolerance(mode))
    ours.backward()
    theirs.backward()
    assert_close(ours_lp.grad, theirs_lp.grad, rtol=1e-7, atol=1e-12)
    assert 0 < masked_mean(clipped, mask).item() < 1
    assert masked_mean(clipped, mask).item() == pytest.approx(metrics["actor/pg_clipfrac"], rel=1e-8)


@pytest.mark.parametrize("loss_scale_factor", [5.0, None])
def test_seq_mean_token_sum_norm_equals_verls_agg_loss(verl, loss_scale_factor):
    """Dr. GRPO's seq-mean-token-sum-norm: agg_loss with the mini-batch's sequence count and L equals verl's agg_loss
    with the same global_batch_size and loss_scale_factor; verl's default L, the mask's width, is what this library
    is given when actor.loss_scale_factor is 0 (rollout.max_response_length, the width verl pads to)."""
    g = torch.Generator().manual_seed(24)
    mask, loss_mat = right_padded_mask(5, 7, g), randn(5, 7, generator=g)
    theirs = verl.agg_loss(loss_mat, mask, "seq-mean-token-sum-norm", dp_size=1, batch_num_tokens=61.0,
                           global_batch_size=16.0, loss_scale_factor=loss_scale_factor)
    ours = losses.agg_loss(loss_mat, mask, "seq-mean-token-sum-norm", losses.Counts(61.0, 16.0),
                           loss_scale_factor or mask.shape[1])
    assert_close(ours, theirs, **EXACT64)


def test_value_loss_equals_verls(verl):
    """critic.value_loss, token-mean over real tokens, equals verl's compute_value_loss with token-mean, and the
    clipped share equals verl's vf_clipfrac (values move up to ±1 from the old ones, so the ±0.2 clip bites)."""
    g = torch.Generator().manual_seed(6)
    mask = right_padded_mask(6, 8, g)
    old_values, returns = randn(6, 8, generator=g), randn(6, 8, generator=g)
    values = old_values + torch.rand(6, 8, generator=g, dtype=torch.float64) * 2 - 1
    loss_mat, clipfrac = critic.value_loss(values, old_values, returns, mask, cliprange=0.2)
    theirs, verl_clipfrac = verl.compute_value_loss(values, returns, old_values, mask, cliprange_value=0.2,
                                                    loss_agg_mode="token-mean")
    ours = losses.agg_loss(loss_mat, mask, "token-mean", losses.Counts(mask.sum().item(), float(len(mask))))
    assert_close(ours, theirs, **EXACT64)
    assert 0 < clipfrac < 1
    assert_close(clipfrac, verl_clipfrac, rtol=1e-8, atol=0)  # verl's masked_mean divides by the count + 1e-8


# ---- verl: rollout correction, DAPO's overlong punishment


def sampler_gap(seed, B=10, T=8):
    """Trainer and sampler log-probs apart by up to ±0.6 per token (so the bands bite at every level), a mask."""
    g = torch.Generator().manual_seed(seed)
    mask = right_padded_mask(B, T, g)
    rollout_logprobs = -3 * torch.rand(B, T, generator=g, dtype=torch.float64)
    return rollout_logprobs + 1.2 * torch.rand(B, T, generator=g, dtype=torch.float64) - 0.6, rollout_logprobs, mask


@pytest.mark.parametrize("level, option", [("token", "token_k1"), ("sequence", "seq_sum_k1"),
                                           ("sequence_mean", "seq_mean_k1")])
def test_rejection_mask_equals_verls(verl_rollout_corr, level, option):
    """losses.rejection_mask equals verl's compute_rollout_rejection_mask (rollout_rs token_k1, seq_sum_k1, seq_mean_k1)
    on every token: with the default band (verl's threshold "2.0", this library's [1/2, 2]) and with an asymmetric
    one ([0.8, 1.5] here, "1/1.5_1/0.8" there: convention 5). Some tokens or responses are rejected, some kept."""
    old_logprobs, rollout_logprobs, mask = sampler_gap(25)
    for (low, high), threshold in (((0.5, 2.0), 2.0), ((0.8, 1.5), f"{1 / 1.5}_{1 / 0.8}")):
        ours = losses.rejection_mask(old_logprobs, rollout_logprobs, mask, level, low, high)
        theirs, _ = verl_rollout_corr.compute_rollout_rejection_mask(old_logprobs - rollout_logprobs, mask,
                                                                    rollout_rs=option, rollout_rs_threshold=threshold)
        assert_close(ours, theirs, **EXACT64)
        if (low, high) == (0.8, 1.5):
            assert 0 < ours.sum() < mask.sum(), "the band should bite"


@pytest.mark.parametrize("level", ["token", "sequence"])
def test_rollout_is_weights_equal_verls(verl_rollout_corr, level):
    """losses.rollout_is_weights equals verl's compute_rollout_correction_weights (truncated IS, threshold 1.5) on every
    real token, at token and sequence level (verl leaves 0 on padding; this library's padding weight is never read);
    some weights are truncated, some not."""
    old_logprobs, rollout_logprobs, mask = sampler_gap(26)
    theirs, _ = verl_rollout_corr.compute_rollout_correction_weights(old_logprobs - rollout_logprobs, mask,
                                                                     rollout_is=level, rollout_is_threshold=1.5)
    ours = losses.rollout_is_weights(old_logprobs, rollout_logprobs, mask, level, 1.5)
    real = mask.bool()
    assert_close(ours[real], theirs[real], **EXACT64)
    assert (ours[real] == 1.5).any() and (ours[real] < 1.5).any()


class Rows:
    """A stand-in for verl's DataProto with what DAPORewardManager.__call__ reads: len, [i], and each item's .batch
    (tensors) and .non_tensor_batch (convention 6)."""

    def __init__(self, batch: dict, non_tensor: list):
        self.batch, self.non_tensor = batch, non_tensor

    def __len__(self):
        return len(self.non_tensor)

    def __getitem__(self, i):
        return types.SimpleNamespace(batch={k: v[i] for k, v in self.batch.items()},
                                     non_tensor_batch=self.non_tensor[i])


def test_overlong_reward_equals_verls_dapo_reward_manager(verl_dapo):
    """rewards.overlong_reward equals what verl's DAPORewardManager adds to a score of 0 (overlong_buffer len 4,
    penalty_factor 0.7, max_resp_len 16) at the last response token, for lengths inside, at and past the start of
    the buffer, up to the limit."""
    lengths = torch.tensor([3, 11, 12, 13, 15, 16])
    Tq, Tr = 4, 16
    response_mask = (torch.arange(Tr)[None] < lengths[:, None]).long()
    batch = {"prompts": torch.ones(6, Tq, dtype=torch.long), "responses": torch.ones(6, Tr, dtype=torch.long),
             "attention_mask": torch.cat([torch.ones(6, Tq, dtype=torch.long), response_mask], 1)}
    non_tensor = [{"reward_model": {"ground_truth": "1"}, "data_source": "test", "extra_info": {}} for _ in range(6)]
    tokenizer = types.SimpleNamespace(decode=lambda ids, skip_special_tokens=True: "x", eos_token="</s>")
    buffer = types.SimpleNamespace(enable=True, len=4, penalty_factor=0.7, log=False)
    manager = verl_dapo(tokenizer, num_examine=0, compute_score=lambda **kwargs: 0.0, max_resp_len=16,
                        overlong_buffer_cfg=buffer)
    theirs = manager(Rows(batch, non_tensor))[torch.arange(6), lengths - 1]
    ours = rewards.overlong_reward(lengths, 16, 4, 0.7)
    assert_close(ours, theirs.float(), rtol=1e-6, atol=1e-7)
    assert ours[0] == ours[1] == 0 and ours[-1] == pytest.approx(-0.7)


# ---- verl: KL


@pytest.mark.parametrize("ours, theirs", [("k1", "kl"), ("k1", "k1"), ("k2", "mse"), ("k2", "k2"),
                                          ("k3", "low_var_kl"), ("k3", "k3"), ("abs", "abs")])
def test_kl_estimators_equal_verls(verl, ours, theirs):
    """kl_estimate equals verl's kl_penalty under each of verl's names for the estimator, at every token (the
    estimate is per token, so padding holds ordinary values), for log-ratios within ±2 (k3 ≤ 4.4, inside verl's
    cap of 10)."""
    g = torch.Generator().manual_seed(7)
    logprobs = -3 * torch.rand(6, 8, generator=g, dtype=torch.float64)
    ref_logprobs = logprobs + 4 * torch.rand(6, 8, generator=g, dtype=torch.float64) - 2
    expected = verl.kl_penalty(logprobs, ref_logprobs, theirs)
    assert_close(kl.kl_estimate(logprobs, ref_logprobs, ours), expected, **EXACT64)


def test_k3_is_verls_uncapped(verl):
    """Convention 2: for log-ratios log r = log π_ref − log π from −25 to 25, verl's k3 is min(k3, 10): equal up
    to 10, 10 beyond (e.g. log r = 3: e³ − 4 = 16.09 here, 10 in verl); verl's k1, k2, abs equal ours everywhere."""
    logprobs = torch.zeros(101, dtype=torch.float64)
    ref_logprobs = torch.linspace(-25, 25, 101, dtype=torch.float64)
    ours = kl.kl_estimate(logprobs, ref_logprobs, "k3")
    theirs = verl.kl_penalty(logprobs, ref_logprobs, "k3")
    assert_close(theirs, ours.clamp(max=10), **EXACT64)
    assert ours[ref_logprobs == 3].item() == pytest.approx(np.exp(3) - 4) and theirs[ref_logprobs == 3].item() == 10
    for kind, name in [("k1", "kl"), ("k2", "mse"), ("abs", "abs")]:
        assert_close(kl.kl_estimate(logprobs, ref_logprobs, kind), verl.kl_penalty(logprobs, ref_logprobs, name),
                     **EXACT64)


def adaptive_kl_trajectory(controller) -> list:
    """β after each of 30 updates with KLs from 0 to 3× the target 0.1 (so the ±20 % error clip bites)."""
    rng = np.random.default_rng(8)
    values = []
    for current_kl in rng.uniform(0, 0.3, size=30):
        controller.update(float(current_kl), 64)
        values.append(controller.value)
    return values


def test_kl_controllers_equal_verls(verl):
    """KLController("adaptive") gives the same β as verl's AdaptiveKLController after every update (β moves), and
    "fixed" keeps β as verl's FixedKLController does."""
    ours = adaptive_kl_trajectory(kl.KLController("adaptive", kl_coef=0.05, target_kl=0.1, horizon=1000))
    theirs = adaptive_kl_trajectory(verl.AdaptiveKLController(init_kl_coef=0.05, target_kl=0.1, horizon=1000))
    assert ours == pytest.approx(theirs, rel=1e-12) and ours[-1] != pytest.approx(0.05, rel=1e-3)
    fixed = adaptive_kl_trajectory(kl.KLController("fixed", kl_coef=0.05, target_kl=0.1, horizon=1000))
    assert fixed == adaptive_kl_trajectory(verl.FixedKLController(kl_coef=0.05)) == [0.05] * 30


# ---- OpenRLHF


@pytest.mark.parametrize("kind", ["k1", "k2", "k3"])
def test_kl_estimators_equal_openrlhfs(openrlhf, kind):
    """kl_estimate equals OpenRLHF's compute_approx_kl (same names k1, k2, k3) at every token, in float32 as
    OpenRLHF computes, for log-ratios within ±2 (inside its ±10 cap)."""
    g = torch.Generator().manual_seed(9)
    logprobs = -3 * torch.rand(6, 8, generator=g)
    ref_logprobs = logprobs + 4 * torch.rand(6, 8, generator=g) - 2
    theirs = openrlhf.compute_approx_kl(logprobs, ref_logprobs, kl_estimator=kind)
    assert_close(kl.kl_estimate(logprobs, ref_logprobs, kind), theirs, **EXACT32)


def test_openrlhf_caps_every_estimator_at_10(openrlhf):
    """Convention 2: for log-ratios from −25 to 25, OpenRLHF's k1, k2 and k3 are ours clamped to [−10, 10]
    (e.g. k1 at log π − log π_ref = 12 is 12 here, 10 in OpenRLHF)."""
    ref_logprobs = torch.linspace(-25, 25, 101)
    logprobs = torch.zeros(101)
    for kind in ("k1", "k2", "k3"):
        ours = kl.kl_estimate(logprobs, ref_logprobs, kind)
        assert_close(openrlhf.compute_approx_kl(logprobs, ref_logprobs, kl_estimator=kind), ours.clamp(-10, 10),
                     **EXACT32)
    k1_at_12 = kl.kl_estimate(torch.tensor([12.0]), torch.tensor([0.0]), "k1")
    assert k1_at_12.item() == 12 and openrlhf.compute_approx_kl(torch.tensor([12.0]), torch.tensor([0.0])).item() == 10


def test_adaptive_kl_controller_equals_openrlhfs(openrlhf):
    """KLController("adaptive") gives the same β as OpenRLHF's AdaptiveKLController after every update."""
    ours = adaptive_kl_trajectory(kl.KLController("adaptive", kl_coef=0.05, target_kl=0.1, horizon=1000))
    theirs = adaptive_kl_trajectory(openrlhf.AdaptiveKLController(init_kl_coef=0.05, target=0.1, horizon=1000))
    assert ours == pytest.approx(theirs, rel=1e-12)


def openrlhf_batch(seed, B=6, T=7):
    """Scores (B,), per-token KL, values and a right-padded mask, float32."""
    g = torch.Generator().manual_seed(seed)
    mask = right_padded_mask(B, T, g, dtype=torch.float32)
    scores = randn(B, generator=g, dtype=torch.float32)
    kl_tokens = torch.rand(B, T, generator=g) * 0.5
    values = randn(B, T, generator=g, dtype=torch.float32)
    return scores, kl_tokens, values, mask


def test_kl_penalty_rewards_equal_openrlhfs_compute_reward(openrlhf):
    """kl_penalty_rewards equals OpenRLHF's compute_reward (−β·KL at every token, + the score at the last real one)
    on real tokens; on padding ours is 0 (OpenRLHF leaves −β·KL there, convention 3)."""
    scores, kl_tokens, _, mask = openrlhf_batch(10)
    ours = kl.kl_penalty_rewards(scores, kl_tokens, mask, beta=0.05)
    theirs = openrlhf.compute_reward(scores, 0.05, kl_tokens, action_mask=mask.bool())
    real = mask.bool()
    assert_close(ours[real], theirs[real], **EXACT32)
    assert torch.all(ours[~real] == 0)


def test_reinforce_plus_plus_returns_equal_openrlhfs_cumulative_returns(openrlhf):
    """advantages.reinforce_plus_plus's returns G_t = r_t + γ·G_{t+1} equal OpenRLHF's get_cumulative_returns at
    every token, padding (0 on both sides) included, with random rewards on padding that both must ignore."""
    g = torch.Generator().manual_seed(11)
    mask = right_padded_mask(6, 9, g, dtype=torch.float32)
    rewards = randn(6, 9, generator=g, dtype=torch.float32)
    _, ours = advantages.reinforce_plus_plus(rewards, mask, None, settings(gamma=0.9))
    theirs = openrlhf.RemoteExperienceMaker.get_cumulative_returns(None, rewards, mask.bool(), 0.9)
    assert_close(ours, theirs, **EXACT32)


def test_gae_equals_openrlhfs(openrlhf):
    """advantages.gae equals OpenRLHF's get_advantages_and_returns (advantages and returns) at every token, padding
    included, with random rewards and values on padding that both must ignore."""
    g = torch.Generator().manual_seed(12)
    mask = right_padded_mask(6, 9, g)
    rewards, values = randn(6, 9, generator=g), randn(6, 9, generator=g)
    adv, ret = advantages.gae(rewards, mask, values, settings(gamma=0.97, lam=0.9))
    their_adv, their_ret = openrlhf.RemoteExperienceMaker.get_advantages_and_returns(None, values, rewards, mask,
                                                                                     0.97, 0.9)
    assert_close(adv, their_adv, **EXACT64)
    assert_close(ret, their_ret, **EXACT64)


@pytest.mark.parametrize("estimator", ["reinforce", "gae"])
def test_advantages_equal_openrlhfs_experience_maker(openrlhf, estimator):
    """OpenRLHF's compute_advantages_and_returns, run on two experiences as its trainer runs it (rewards from score
    and KL, the `reinforce` (REINFORCE++) or `gae` estimator, then whitening over the real tokens of ALL
    experiences with the biased variance, convention 1) gives, on real tokens, the returns and advantages of
    kl_penalty_rewards → reinforce_plus_plus (or gae, whitened) on the whole batch."""
    scores, kl_tokens, values, mask = openrlhf_batch(13)
    beta, gamma, lam = 0.05, 0.9, 0.95
    experiences = [openrlhf.Experience(action_mask=mask[rows].bool(), kl=kl_tokens[rows], values=values[rows],
                                       rewards=scores[rows].clone(), index=list(range(rows.start, rows.stop)))
                   for rows in (slice(0, 4), slice(4, 6))]
    advantage = types.SimpleNamespace(estimator=estimator, gamma=gamma, lambd=lam, no_std_norm=False)
    args = types.SimpleNamespace(rollout=types.SimpleNamespace(n_samples_per_prompt=1),
                                 algo=types.SimpleNamespace(advantage=advantage),
                                 reward=types.SimpleNamespace(clip_range=None))
    maker = object.__new__(openrlhf.RemoteExperienceMaker)  # its __init__ stores ray actor groups and these:
    maker.strategy = types.SimpleNamespace(args=args)
    maker.kl_ctl = openrlhf.FixedKLController(beta)
    maker.advantage_estimator = estimator
    maker.compute_advantages_and_returns(experiences)
    their_adv = torch.cat([e.advantages for e in experiences])
    their_ret = torch.cat([e.returns for e in experiences])

    rewards = kl.kl_penalty_rewards(scores, kl_tokens, mask, beta)
    if estimator == "reinforce":
        adv, ret = advantages.reinforce_plus_plus(rewards, mask, None, settings(gamma))
    else:
        adv, ret = advantages.gae(rewards, mask, values, settings(gamma, lam, whiten=True))
    real = mask.bool()
    assert_close(ret[real], their_ret[real], **EXACT32)
    assert_close(adv[real], their_adv[real], rtol=1e-5, atol=1e-5)
    assert torch.all(adv[~real] == 0)
