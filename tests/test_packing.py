"""Sequence packing (model.use_remove_padding), the shared prompt prefix (model.share_prompt_prefix) and
token-budget micro-batches give the padded path's numbers."""
import pytest
import torch
from transformers import AutoModelForCausalLM

from infra import batches, layouts
from infra.models import load_critic
from conftest import make_tiny_model
from infra.batches import forward_logprobs, forward_values, micro_batch, per_token_pass
from rollout import left_pad, right_pad

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOL = 1e-4 if DEVICE == "cpu" else 2e-3


def random_batch(B=6, vocab=200, seed=0, n=1):
    """Prompts (each repeated n times in a row, as GRPO samples them) and responses of different lengths,
    padded the way ppo.py pads them."""
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(3, vocab, (int(k),), generator=g).tolist() for k in torch.randint(3, 12, (B // n,), generator=g)]
    prompts = [p for p in prompts for _ in range(n)]
    responses = [torch.randint(3, vocab, (int(n),), generator=g).tolist() for n in torch.randint(1, 9, (B,), generator=g)]
    queries, query_mask = left_pad(prompts, 2)
    resp, response_mask = right_pad(responses, 2)
    return dict(queries=queries, query_mask=query_mask, responses=resp, response_mask=response_mask)


@pytest.fixture(scope="module", params=[2, 1], ids=["mha", "gqa"])
def models(tmp_path_factory, request):
    """Policy and critic with layouts.varlen_sdpa, as ppo.py sets it under packing (padded forwards unchanged): with
    2 KV heads for the 2 query heads, and with 1 (grouped-query attention, as Qwen2.5's 14 query / 2 KV heads)."""
    path = make_tiny_model(tmp_path_factory.mktemp("packing"), kv_heads=request.param)
    policy = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).to(DEVICE).eval()
    value_model = load_critic(path).to(DEVICE).eval()
    for model in (policy, value_model):
        layouts.use_varlen_attention(model)
    return policy, value_model


def shuffled_batch(B, seed, n):
    """random_batch with each prompt n times, rows shuffled as a GRPO mini-batch draws them."""
    order = torch.randperm(B, generator=torch.Generator().manual_seed(seed))
    return {k: v[order].to(DEVICE) for k, v in random_batch(B=B, seed=seed, n=n).items()}


@pytest.mark.parametrize("n", [1, 3])
@torch.no_grad()
def test_packed_logprobs_entropy_and_values_equal_padded(models, n):
    """Every distinct prompt once and every response once in one row (prompts alone with n = 1, shared by 3
    responses with n = 3) gives the padded path's logprobs, entropies and values at every real response
    token (fp32, |diff| < 1e-4 on CPU), and 0 at padding."""
    policy, value_model = models
    mb = shuffled_batch(12, seed=n, n=n)
    mask = mb["response_mask"].bool()
    lp_pad, ent_pad = forward_logprobs(policy, mb, 1.0, None, True, "padded")
    lp_pack, ent_pack = forward_logprobs(policy, mb, 1.0, None, True, "packed")
    assert (lp_pad - lp_pack)[mask].abs().max() < TOL
    assert (ent_pad - ent_pack)[mask].abs().max() < TOL
    assert torch.all(lp_pack[~mask] == 0)
    v_pad, v_pack = forward_values(value_model, mb, None, "padded"), forward_values(value_model, mb, None, "packed")
    assert (v_pad - v_pack)[mask].abs().max() < TOL


@pytest.mark.parametrize("kv_heads", [2, 1], ids=["mha", "gqa"])
@pytest.mark.parametrize("checkpointing", [False, True])
def test_packed_gradients_equal_padded_and_take_the_packed_attention(tmp_path, monkeypatch, checkpointing, kv_heads):
    """Through varlen_sdpa's packed branch (it really ran, in every layer) the gradient of a loss on the
    packed logprobs equals the padded path's (prompts shared by 3 responses, rows shuffled), also when
    the layers are recomputed in the backward pass (gradient checkpointing) and with grouped-query attention; a
    padded forward under varlen_sdpa is transformers' SDPA unchanged."""
    calls, varlen_sdpa = [], layouts.varlen_sdpa

    def counted(*args, packed_attention=None, **kwargs):
        calls.append(packed_attention is not None)
        return varlen_sdpa(*args, packed_attention=packed_attention, **kwargs)

    policy = AutoModelForCausalLM.from_pretrained(make_tiny_model(tmp_path, kv_heads=kv_heads),
                                                  dtype=torch.float32).to(DEVICE)
    if checkpointing:
        policy.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        policy.train()  # transformers checkpoints only in training mode
    mb = shuffled_batch(12, seed=4, n=3)
    mask = mb["response_mask"].bool()
    results = []
    for layout in ("padded", "packed", "padded"):
        if len(results) == 1:
            monkeypatch.setattr(layouts, "varlen_sdpa", counted)
            layouts.use_varlen_attention(policy)
        policy.zero_grad()
        logprobs, entropy = forward_logprobs(policy, mb, 0.8, None, True, layout)
        (logprobs * mask).sum().backward()
        results.append((logprobs.detach(), entropy.detach(), policy.model.layers[0].self_attn.q_proj.weight.grad))
    (lp_pad, ent_pad, g_pad), (lp_pack, ent_pack, g_pack), (lp_pad2, _, _) = results
    assert calls[:len(policy.model.layers)] == [True] * len(policy.model.layers)
    assert sum(calls) == len(policy.model.layers) * (2 if checkpointing else 1)  # recomputed: packed again
    assert (lp_pad - lp_pack)[mask].abs().max() < TOL and (ent_pad - ent_pack)[mask].abs().max() < TOL
    assert (g_pad - g_pack).abs().max() < TOL * g_pad.abs().max()
    assert (lp_pad - lp_pad2)[mask].abs().max() < TOL


def test_packed_grouped_query_attention_calls_sdpa_in_a_form_cuda_kernels_take(tmp_path, monkeypatch):
    """With grouped-query attention (1 KV head for 2 query heads) the packed path hands SDPA its mask with as many KV
    heads as query heads and no enable_gqa: CUDA's memory-efficient kernel takes a mask but not enable_gqa, and
    flash takes no mask, so the earlier mask + enable_gqa=True fell to the math kernel (issue 22)."""
    calls, sdpa = [], torch.nn.functional.scaled_dot_product_attention

    def recorded(q, k, v, **kwargs):
        calls.append((q.shape[1], k.shape[1], v.shape[1], kwargs.get("attn_mask") is not None,
                      kwargs.get("enable_gqa", False)))
        return sdpa(q, k, v, **kwargs)

    policy = AutoModelForCausalLM.from_pretrained(make_tiny_model(tmp_path, kv_heads=1), dtype=torch.float32)
    layouts.use_varlen_attention(policy)
    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", recorded)
    with torch.no_grad():
        forward_logprobs(policy, {k: v for k, v in random_batch(B=6, seed=6, n=3).items()}, 1.0, None, False, "packed")
    assert calls == [(2, 2, 2, True, False)] * len(policy.model.layers)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the kernel choice is CUDA's (bench/gpu_check.sh runs it)")
@pytest.mark.parametrize("dtype", [None, torch.bfloat16], ids=["fp32", "bf16"])
def test_packed_grouped_query_attention_runs_without_the_math_kernel_on_cuda(tmp_path, dtype):
    """On CUDA, with SDPA's math kernel ruled out (flash, memory-efficient and cuDNN allowed), the packed forward and
    backward of a grouped-query model run: no layer needs the math kernel's fp32 (G, H, Wq, Wk) scores. SDPA raises
    "No available kernel" where none of the allowed ones takes its inputs."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    policy = AutoModelForCausalLM.from_pretrained(make_tiny_model(tmp_path, kv_heads=1), dtype=torch.float32).cuda()
    layouts.use_varlen_attention(policy)
    mb = shuffled_batch(12, seed=7, n=3)
    with sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.CUDNN_ATTENTION]):
        logprobs, _ = forward_logprobs(policy, mb, 1.0, dtype, False, "packed")
        (logprobs * mb["response_mask"]).sum().backward()
    assert torch.isfinite(policy.model.layers[0].self_attn.k_proj.weight.grad).all()


def test_shared_prompt_prefix_equals_padded_and_gradients_too(models):
    """Running each distinct prompt once and gathering its KV cache for its responses (prompts repeated
    3× and shuffled, as in a GRPO mini-batch) gives the padded path's logprobs and entropies (fp32,
    |diff| < 1e-4 on CPU) and the same gradient of a loss on them, prompt positions included."""
    policy, _ = models
    mb = shuffled_batch(12, seed=3, n=3)
    mask = mb["response_mask"].bool()
    grads = []
    for layout in ("padded", "shared"):
        policy.zero_grad()
        logprobs, entropy = forward_logprobs(policy, mb, 0.7, None, True, layout)
        (logprobs * mask).sum().backward()
        grads.append((logprobs.detach(), entropy.detach(), policy.model.embed_tokens.weight.grad.clone()))
    (lp_pad, ent_pad, g_pad), (lp_shared, ent_shared, g_shared) = grads
    assert (lp_pad - lp_shared)[mask].abs().max() < TOL and (ent_pad - ent_shared)[mask].abs().max() < TOL
    assert (g_pad - g_shared).abs().max() < TOL * g_pad.abs().max()
    policy.zero_grad()


def test_shared_prompt_prefix_gives_the_critic_padded_values_and_gradients(models):
    """The critic (a token classifier, which returns no cache) through the shared prompt prefix: the padded
    path's values before every response token, the first one at the prompt's last token, and the same
    gradient of a loss on them."""
    _, value_model = models
    mb = {k: v.to(DEVICE) for k, v in random_batch(B=12, seed=5, n=4).items()}
    mask = mb["response_mask"].bool()
    results = []
    for layout in ("padded", "shared"):
        value_model.zero_grad()
        values = forward_values(value_model, mb, None, layout)
        (values * mask).square().sum().backward()
        results.append((values.detach(), value_model.score.weight.grad.clone()))
    (v_pad, g_pad), (v_shared, g_shared) = results
    assert v_shared.shape == v_pad.shape
    assert (v_pad - v_shared)[mask].abs().max() < TOL
    assert (g_pad - g_shared).abs().max() < TOL * g_pad.abs().max()
    value_model.zero_grad()


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


def test_packed_inputs_worked_example():
    """layouts.packed_inputs' docstring example holds: prompt A = 11 12 with responses 31 32 and 33, prompt B =
    21 22 23 with 41 42 give that packed row, those positions, what each group's queries see, and `keep`."""
    queries, query_mask = left_pad([[11, 12], [11, 12], [21, 22, 23]], 0)
    responses, response_mask = right_pad([[31, 32], [33], [41, 42]], 0)
    inputs, keep = layouts.packed_inputs(dict(queries=queries, query_mask=query_mask, responses=responses,
                                              response_mask=response_mask))
    ids = inputs["input_ids"][0]
    assert ids.tolist() == [11, 12, 21, 22, 23, 31, 32, 33, 41, 42]
    assert inputs["position_ids"][0].tolist() == [0, 1, 0, 1, 2, 2, 3, 2, 3, 4]
    p = inputs["packed_attention"]
    seen = {}  # query token → the tokens of the keys it sees
    for g in range(len(p["q_index"])):
        for slot in p["q_valid"][g].nonzero()[:, 0].tolist():
            keys = p["k_index"][g][p["mask"][g, slot]]
            seen[int(ids[p["q_index"][g, slot]])] = ids[keys].tolist()
    assert seen == {11: [11], 12: [11, 12], 21: [21], 22: [21, 22], 23: [21, 22, 23],
                    31: [11, 12, 31], 32: [11, 12, 31, 32], 33: [11, 12, 33],
                    41: [21, 22, 23, 41], 42: [21, 22, 23, 41, 42]}
    assert keep.tolist() == [1, 5, 1, 4, 8]
    assert ids[keep].tolist() == [12, 31, 12, 23, 41]  # the tokens whose outputs predict 31, 32, 33, 41, 42


def test_token_budget_micro_batches_reach_the_count_of_the_process_that_makes_most():
    """split_micro by a token budget, told that another process makes more micro-batches (largest_count), makes
    exactly that many: every row once, each within the budget (issue 22: unequal counts hang FSDP2)."""
    lengths = [30, 10, 12, 50, 8, 9, 11, 40]
    inds = torch.arange(len(lengths))
    own = batches.split_micro(inds, lengths, 4, max_tokens=60)
    for count in (len(own), len(own) + 1, len(lengths)):
        micro = batches.split_micro(inds, lengths, 4, max_tokens=60, largest_count=lambda c: max(c, count))
        assert len(micro) == count
        assert sorted(torch.cat(micro).tolist()) == list(range(len(lengths)))
        assert all(max(lengths[i] for i in m.tolist()) * len(m) <= 60 for m in micro)
