"""One frozen trunk for actor, reference and critic (issue 25, infra/trunk.py): forwards that start from the trunk's
hidden states give the numbers and gradients of whole forwards, the critic built on the trunk holds only its top
layers, and a PPO run with the shared trunk logs what a run without it logs (fp32, 1e-5 relative), on 1 process in
each layout and on 2 under FSDP2.

The model is the tests' tiny Llama with 4 layers and LoRA on the top 2 (model.lora_top_layers=2), so layers 0 and 1
are the trunk."""
import os
import shutil
import sys
import types

import pytest
import torch

from conftest import free_port, make_tiny_model, read_metrics
from infra import batches, layouts
from infra.batches import Forward, micro_batch, per_token_pass
from infra.models import add_lora, frozen_linears_in, load_critic, load_policy
from infra.trunk import plan_trunk, Replay, Trunk
from test_packing import random_batch
from test_fsdp import args, COMPARED, REWARD_FILE, run

TOL = 1e-5  # relative; forwards from the trunk run the same kernels on the same inputs, so ~1e-7 is seen
LAYERS, TOP = 4, 2
LORA = dict(lora_rank=4, lora_alpha=8, lora_dropout=0.0, target_modules=["q_proj", "v_proj", "up_proj", "down_proj"],
            lora_top_layers=TOP, gradient_checkpointing=False)


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("trunk")
    dirs = {arch: make_tiny_model(root / arch, arch=arch, layers=LAYERS) for arch in ("llama", "qwen2")}
    return {**dirs, "tied": make_tiny_model(root / "tied", layers=LAYERS, tied=True)}


def lora_models(path, checkpointing=False):
    """A LoRA actor and a LoRA critic on `path`, whole and on the trunk, with the same weights; lora_B is made
    non-zero so that the adapters change the numbers (PEFT starts it at 0)."""
    cfg_model = types.SimpleNamespace(path=path, trust_remote_code=False,
                                      **{**LORA, "gradient_checkpointing": checkpointing})
    torch.manual_seed(0)
    policy = load_policy(cfg_model)
    whole = add_lora(load_critic(path), 4, 8, cfg_model, "TOKEN_CLS")
    top = add_lora(load_critic(path, LAYERS - TOP), 4, 8, cfg_model, "TOKEN_CLS")
    for model in (policy, whole):
        for name, p in model.named_parameters():
            if "lora_B" in name or "score" in name:
                torch.nn.init.normal_(p, std=0.1)
    top.load_state_dict(whole.state_dict(), strict=False)  # the layers it holds
    if checkpointing:
        for model in (policy, whole, top):
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
            model.train()
    return policy, whole, top


def relative(a, b, mask=None):
    a, b = (a[mask], b[mask]) if mask is not None else (a, b)
    return float((a - b).abs().max() / a.abs().max().clamp(min=1e-12))


def forwards(fwd, policy, critic, mb):
    """logprobs, entropies, reference logprobs and values of mb, and the LoRA / head gradients of a loss on them."""
    mask = mb["response_mask"].bool()
    policy.zero_grad()
    critic.zero_grad()
    logprobs, entropy = fwd.logprobs(policy, mb, with_entropy=True)
    values = fwd.values(critic, mb)
    ((logprobs * mask).sum() + (entropy * mask).sum() + (values * mask).square().sum()).backward()
    with policy.disable_adapter():
        ref = fwd.logprobs(policy, mb)[0]
    grads = {f"{i}.{name}": p.grad.clone() for i, model in enumerate((policy, critic))
             for name, p in model.named_parameters() if p.requires_grad}
    return dict(logprobs=logprobs.detach(), entropy=entropy.detach(), ref=ref.detach(), values=values.detach()), grads


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("layout", ["padded", "shared", "packed"])
def test_forwards_from_the_trunk_equal_whole_forwards(model_dirs, layout, arch):
    """In each layout: the trunk's states computed for the batch in micro-batches of 5 in batch order (step 4), a
    micro-batch of 7 shuffled rows (as step 7 draws them) started from them gives the whole forwards' logprobs,
    entropies, reference logprobs (adapter disabled), values, and gradients of every LoRA weight and the value head,
    within 1e-5 relative; and the trunk's own layers never run in those forwards."""
    policy, whole_critic, top_critic = lora_models(model_dirs[arch])
    if layout == "packed":
        for model in (policy, whole_critic, top_critic):
            layouts.use_varlen_attention(model)
    batch = random_batch(B=12, seed=3, n=3)
    lengths = (batch["query_mask"].sum(1) + batch["response_mask"].sum(1)).tolist()
    whole, shared = Forward(0.8, None, layout), Forward(0.8, None, layout, Trunk(LAYERS - TOP, LAYERS, critic=True))
    states = per_token_pass(lambda mb: shared.trunk_states(policy, mb), batch, 5, 0, lengths, "cpu")
    assert states["trunk_prompt"].shape == (*batch["queries"].shape, 128)
    assert states["trunk_response"].shape == (*batch["responses"].shape, 128)
    rows = torch.randperm(12, generator=torch.Generator().manual_seed(7))[:7]
    mb = micro_batch(batch, rows, "cpu")
    expected, expected_grads = forwards(whole, policy, whole_critic, mb)

    calls = []
    hooks = [policy.get_base_model().model.layers[i].register_forward_hook(lambda *_: calls.append(1))
             for i in range(LAYERS - TOP)]
    got, grads = forwards(shared, policy, top_critic, micro_batch({**batch, **states}, rows, "cpu"))
    for hook in hooks:
        hook.remove()
    assert calls == []
    mask = mb["response_mask"].bool()
    for key in expected:
        assert relative(expected[key], got[key], mask) < TOL, key
    assert set(grads) == set(expected_grads) and len(grads) > 2
    for name, grad in grads.items():
        assert relative(expected_grads[name], grad) < TOL, name


@pytest.mark.parametrize("arch", ["llama", "tied"])
@pytest.mark.parametrize("layout", ["padded", "shared", "packed"])
def test_frozen_linears_held_in_bf16_compute_what_autocast_computes(model_dirs, layout, arch):
    """Under bf16 autocast, an actor and a critic whose frozen linear layers are held in bf16 (frozen_linears_in) give
    bit for bit the logprobs, entropies, reference logprobs, values and LoRA gradients of the fp32-held ones, since
    autocast casts those weights to bf16 at every call; every trained weight, the norms and a head tied to the token
    embedding stay fp32."""
    fp32_held, bf16_held = lora_models(model_dirs[arch])[:2], lora_models(model_dirs[arch])[:2]
    for model in bf16_held:
        frozen_linears_in(model, torch.bfloat16)
    if layout == "packed":
        for model in (*fp32_held, *bf16_held):
            layouts.use_varlen_attention(model)
    policy = bf16_held[0]
    assert {p.dtype for name, p in policy.named_parameters() if "base_layer" in name} == {torch.bfloat16}
    assert all(p.dtype == torch.float32 for model in bf16_held for p in model.parameters() if p.requires_grad)
    assert policy.get_base_model().model.norm.weight.dtype == torch.float32
    head = policy.get_base_model().lm_head.weight
    assert head.dtype == (torch.float32 if arch == "tied" else torch.bfloat16)
    assert (head is policy.get_input_embeddings().weight) == (arch == "tied")
    mb = micro_batch(random_batch(B=6, seed=2, n=2), torch.arange(6), "cpu")
    fwd = Forward(0.8, torch.bfloat16, layout)
    (expected, expected_grads), (got, grads) = forwards(fwd, *fp32_held, mb), forwards(fwd, *bf16_held, mb)
    assert all(torch.equal(expected[key], got[key]) for key in expected)
    assert set(grads) == set(expected_grads) and all(torch.equal(expected_grads[k], g) for k, g in grads.items())


def test_trunk_with_gradient_checkpointing_gives_the_same_gradients(model_dirs):
    """Top layers recomputed in the backward pass (gradient checkpointing, train mode, padded as ppo.py lays it out)
    from the trunk's states: the gradients of the whole forwards without checkpointing."""
    policy, whole_critic, _ = lora_models(model_dirs["llama"])
    ckpt_policy, _, ckpt_critic = lora_models(model_dirs["llama"], checkpointing=True)
    mb = micro_batch(random_batch(B=6, seed=1, n=2), torch.arange(6), "cpu")
    expected, expected_grads = forwards(Forward(1.0, None, "padded"), policy, whole_critic, mb)
    shared = Forward(1.0, None, "padded", Trunk(LAYERS - TOP, LAYERS, critic=True))
    with torch.no_grad():
        mb.update(shared.trunk_states(ckpt_policy, mb))
    got, grads = forwards(shared, ckpt_policy, ckpt_critic, mb)
    mask = mb["response_mask"].bool()
    assert all(relative(expected[k], got[k], mask) < TOL for k in expected)
    assert all(relative(expected_grads[name], grad) < TOL for name, grad in grads.items())


def test_the_critic_on_the_trunk_holds_only_its_top_layers(model_dirs):
    """load_critic(path, L) holds no token embedding and no layer below L; what it holds has the whole critic's names
    and weights, its new head draws the whole critic's random numbers, and run without the trunk's states it fails in
    a sentence instead of computing from nothing."""
    path = model_dirs["llama"]
    torch.manual_seed(5)
    whole = load_critic(path)
    torch.manual_seed(5)
    top = load_critic(path, LAYERS - TOP)
    held = dict(top.named_parameters())
    assert set(held) == {name for name in dict(whole.named_parameters())
                         if not name.startswith(("model.embed_tokens", "model.layers.0.", "model.layers.1."))}
    assert all(torch.equal(p, whole.get_parameter(name)) for name, p in held.items())
    assert all(isinstance(top.model.layers[i], Replay) for i in range(LAYERS - TOP))
    assert sum(p.numel() for p in held.values()) < 0.6 * sum(p.numel() for p in whole.parameters())
    mb = micro_batch(random_batch(B=4, seed=0), torch.arange(4), "cpu")
    with pytest.raises(RuntimeError, match="holds no trunk layers"):
        batches.forward_values(top, mb, None)


def config(**model):
    cfg = types.SimpleNamespace(model=types.SimpleNamespace(share_trunk=True, lora_rank=8, lora_top_layers=2),
                                critic=types.SimpleNamespace(model_path=None, lora_rank=8))
    cfg.model.__dict__.update(model)
    return cfg


def test_plan_trunk_shares_only_what_is_frozen():
    """The trunk is the layers below LoRA on the top layers; none for a full fine-tune, LoRA on every layer (0 or
    ≥ n top layers) or model.share_trunk=false; the critic shares it only on model.path with LoRA."""
    assert plan_trunk(config(), with_critic=True, n_layers=4) == Trunk(2, 4, critic=True)
    for no_trunk in (dict(lora_rank=0), dict(lora_top_layers=0), dict(lora_top_layers=4), dict(share_trunk=False)):
        assert plan_trunk(config(**no_trunk), with_critic=True, n_layers=4) is None, no_trunk
    assert plan_trunk(config(), with_critic=False, n_layers=4).critic is False
    for critic in (dict(model_path="reward_model"), dict(lora_rank=0)):
        cfg = config()
        cfg.critic.__dict__.update(critic)
        assert plan_trunk(cfg, with_critic=True, n_layers=4) == Trunk(2, 4, critic=False), critic


# ---------------------------------------------------------------------------------------
# PPO runs with and without the shared trunk

# GAE with a LoRA actor and critic, the KL in the reward (an old-logprob and a reference pass) and as a loss, 2 epochs
# of 2 mini-batches: every forward of a step starts from the trunk
RUN = ["algorithm.adv_estimator=gae", "model.lora_rank=8", f"model.lora_top_layers={TOP}", "critic.lora_rank=8",
       "algorithm.use_kl_in_reward=true", "algorithm.kl_ctrl.kl_coef=0.1", "algorithm.use_kl_loss=true",
       "actor.ppo_mini_batch_size=2", "actor.optim.lr=1e-2", "critic.optim.lr=1e-2", "actor.entropy_coef=0.01"]
LAYOUTS = {"padded": ["model.share_prompt_prefix=false"], "shared": [], "packed": ["model.use_remove_padding=true"]}


@pytest.fixture(scope="module")
def workdir(tmp_path_factory, model_dirs):
    import data
    root = tmp_path_factory.mktemp("trunk_runs")
    shutil.copytree(model_dirs["llama"], root / "model")
    rows = data.make_arithmetic(64, seed=0)
    data.write_parquet(rows[:48], str(root / "train.parquet"))
    data.write_parquet(rows[48:], str(root / "val.parquet"))
    (root / "reward.py").write_text(REWARD_FILE)
    return root


def ppo(root, out, *overrides, processes=1):
    """ppo.py on the tiny 4-layer model (test_fsdp's settings: fp32, greedy full-length responses, 3 steps)."""
    launch = [sys.executable] if processes == 1 else [
        sys.executable, "-m", "accelerate.commands.launch", "--config_file", "accelerate_configs/fsdp2.yaml",
        "--num_processes", str(processes), "--main_process_port", str(free_port())]
    return run([*launch, *args(root, out, *RUN, *overrides)]).stdout


def assert_same_metrics(a, b, tol=TOL):
    """Every compared metric of every step agrees within `tol` (relative, absolute below 1); the policy moved."""
    a, b = read_metrics(a), read_metrics(b)
    assert [m["step"] for m in a] == [m["step"] for m in b] == [1, 2, 3]
    for x, y in zip(a, b):
        for key in COMPARED + ["loss/value", "value/clipfrac"]:
            assert (key in x) == (key in y), key
            if key in x:
                assert abs(x[key] - y[key]) <= tol * max(1.0, abs(x[key])), (x["step"], key, x[key], y[key])
    assert a[-1]["kl/mean"] > 1e-3


@pytest.mark.parametrize("layout", LAYOUTS)
def test_ppo_with_the_shared_trunk_logs_what_it_logs_without(workdir, tmp_path, layout):
    """1 process, each layout: score, KL, policy and value losses, values, entropy and grad norms of every step are
    those of model.share_trunk=false within 1e-5; the log says where the trunk ends and times its pass; the saved
    checkpoints hold the same tensors, and final/ the actor's adapter."""
    shared = ppo(workdir, tmp_path / "shared", *LAYOUTS[layout])
    ppo(workdir, tmp_path / "whole", *LAYOUTS[layout], "model.share_trunk=false")
    assert_same_metrics(tmp_path / "shared", tmp_path / "whole")
    assert ("trunk: decoder layers 0–1 of 4 run once per step, without grad, for actor, reference and critic; "
            "their forwards start at layer 2") in shared
    assert all("time/trunk_s" in m for m in read_metrics(tmp_path / "shared"))
    from safetensors import safe_open
    keys = []
    for out in ("shared", "whole"):
        folder = tmp_path / out / "step_2" / "tensors"
        keys.append({k for f in os.listdir(folder) for k in safe_open(str(folder / f), "pt").keys()})
    assert keys[0] == keys[1] and any(k.startswith("critic.") for k in keys[0])
    assert "adapter_model.safetensors" in os.listdir(tmp_path / "shared" / "final")


def test_a_checkpoint_of_a_shared_trunk_run_resumes_without_it(workdir, tmp_path):
    """The critic on the trunk saves the whole critic's names: a run without the shared trunk resumes from a shared
    run's step-2 checkpoint and logs step 3 as the shared run did."""
    ppo(workdir, tmp_path / "shared")
    shutil.copytree(tmp_path / "shared" / "step_2", tmp_path / "resumed" / "step_2")
    shutil.copy(tmp_path / "shared" / "metrics.jsonl", tmp_path / "resumed" / "metrics.jsonl")
    assert "resumed from" in ppo(workdir, tmp_path / "resumed", "model.share_trunk=false")
    assert_same_metrics(tmp_path / "shared", tmp_path / "resumed")


@pytest.mark.parametrize("layout", ["padded", "packed"])  # FSDP2 lays a micro-batch out padded or packed, not shared
def test_fsdp2_with_the_shared_trunk_logs_what_it_logs_without(workdir, tmp_path, layout):
    """2 processes under FSDP2 (actor and the critic on the trunk sharded per layer): the metrics of every step are
    those of the same 2 processes without the shared trunk, within 1e-5."""
    out = ppo(workdir, tmp_path / "shared", *LAYOUTS[layout], processes=2)
    ppo(workdir, tmp_path / "whole", *LAYOUTS[layout], "model.share_trunk=false", processes=2)
    assert "parallel: fsdp2 over 2 processes" in out and "trunk: decoder layers 0–1 of 4" in out
    assert_same_metrics(tmp_path / "shared", tmp_path / "whole")


def test_a_full_fine_tune_is_unchanged(workdir, tmp_path):
    """Nothing is frozen in a full fine-tune (model.lora_rank=0): model.share_trunk=true changes no number, prints no
    trunk line and times no trunk pass."""
    full = ["model.lora_rank=0", "critic.lora_rank=0", "actor.optim.lr=1e-3", "critic.optim.lr=1e-3"]
    out = ppo(workdir, tmp_path / "on", *full)
    ppo(workdir, tmp_path / "off", *full, "model.share_trunk=false")
    assert_same_metrics(tmp_path / "on", tmp_path / "off", tol=0.0)
    assert "trunk:" not in out and not any("time/trunk_s" in m for m in read_metrics(tmp_path / "on"))
