"""The vLLM rollout backend against the HF one, on tiny models built here; real vLLM on CPU.

    pytest tests/test_rollout.py -s      # -s prints the measured logprob differences

Engines cost ~10 s each to start, so one engine per dtype serves the whole module; every test first
syncs the weights it needs into it, so the tests do not depend on their order.
"""
import copy
import importlib.util
import os
import subprocess
import sys

import pytest
import torch

from infra.cli import load_config
from rollout import HFRollout, make_rollout

# find_spec, not import: vLLM must first be imported by make_rollout, after it has set OMP_NUM_THREADS.
HAVE_VLLM = importlib.util.find_spec("vllm") is not None


def vllm_test(fn):
    """`-m "not vllm"` deselects the test; it is skipped where vLLM is not installed."""
    return pytest.mark.vllm(pytest.mark.skipif(not HAVE_VLLM, reason="vLLM is not installed")(fn))

MAX_PROMPT, MAX_RESPONSE = 48, 12
SUMS = [(a, b) for a in range(12) for b in range(12)]


def make_config(model_dir, dtype="fp32", name="vllm"):
    return load_config(None, [f"model.path={model_dir}", f"rollout.name={name}", f"rollout.dtype={dtype}",
                              f"data.max_prompt_length={MAX_PROMPT}", f"rollout.max_response_length={MAX_RESPONSE}"])


class FakeAccelerator:
    """What make_rollout reads from accelerate's Accelerator."""
    is_main_process = True
    distributed_type = type("DistributedType", (), {"name": "NO"})
    num_processes = 1

    @staticmethod
    def unwrap_model(model):
        return model


def chat(tokenizer, text: str) -> list[int]:
    text = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                         tokenize=False)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def fit(model, tokenizer, prompts: list[list[int]], answers: list[str], steps: int, lr: float):
    """`steps` of Adam on the answer tokens (EOS included); the prompt tokens carry no loss."""
    answers = [tokenizer(a + tokenizer.eos_token, add_special_tokens=False)["input_ids"] for a in answers]
    seqs = [p + a for p, a in zip(prompts, answers)]
    T = max(len(s) for s in seqs)
    ids = torch.tensor([s + [tokenizer.pad_token_id] * (T - len(s)) for s in seqs])  # (B, T)
    labels = torch.full_like(ids, -100)
    for i, (p, s) in enumerate(zip(prompts, seqs)):
        labels[i, len(p):len(s)] = ids[i, len(p):len(s)]
    opt = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=lr)
    model.train()
    for _ in range(steps):
        model(input_ids=ids, labels=labels).loss.backward()
        opt.step()
        opt.zero_grad()
    model.eval()
    return model


def recomputed_logprobs(model, prompts, n, rollout, temperature):
    """The trainer's view: log_softmax(logits / T) of an fp32 forward, at each response position.  (B·n, Tr)"""
    out = torch.zeros_like(rollout.logprobs)
    for row, p in enumerate(p for p in prompts for _ in range(n)):
        L = int(rollout.response_mask[row].sum())
        ids = torch.tensor([p + rollout.responses[row, :L].tolist()])
        with torch.no_grad():
            logits = model(input_ids=ids).logits[0, len(p) - 1:-1].float() / temperature  # (L, V)
        out[row, :L] = logits.log_softmax(-1).gather(-1, ids[0, len(p):, None])[:, 0]
    return out


# ---- fixtures: a tokenizer, prompts, two tiny policies, one engine per dtype


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(tiny_model_dir)


@pytest.fixture(scope="module")
def prompts(tokenizer):
    return [chat(tokenizer, f"What is {a} + {b}?") for a, b in SUMS]


@pytest.fixture(scope="module")
def random_model(tiny_model_dir):
    """The random tiny model with its logits scaled ×30: the top two logits of its greedy choices then differ by
    ≥ 0.02 rather than ≥ 0.0008, far above the ~1e-5 by which fp32 kernels disagree, so no greedy test
    hangs on a near-tie."""
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        model.lm_head.weight *= 30
    return model


@pytest.fixture(scope="module")
def hello_model(random_model, tokenizer, prompts):
    """The random model taught to answer "hello world" and stop: at T=1 some samples end with EOS, some do not."""
    return fit(copy.deepcopy(random_model), tokenizer, prompts[:6], ["hello world"] * 6, steps=30, lr=3e-3)


@pytest.fixture(scope="module")
def engine(tiny_model_dir, random_model, tokenizer):
    """engine(dtype) → a VLLMRollout on the tiny model, started once per dtype for this module."""
    engines = {}

    def get(dtype="fp32"):
        if dtype not in engines:
            engines[dtype] = make_rollout(make_config(tiny_model_dir, dtype), random_model, tokenizer,
                                          FakeAccelerator())
        return engines[dtype]
    return get


# ---- weight sync


def greedy_both(rollout, model, tokenizer, prompts, cfg):
    """Sync `model` into the engine; greedy responses from vLLM and from HF generate on `model` itself."""
    rollout.sync_weights(model)
    vllm_out = rollout.generate(prompts, 1, 0.0)
    hf_out = HFRollout(model, tokenizer, cfg.rollout).generate(prompts, 1, 0.0)
    return vllm_out, hf_out


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
@vllm_test
def test_sync_makes_vllm_greedy_equal_hf_greedy(engine, tiny_model_dir, random_model, tokenizer, prompts, lora):
    """After sync_weights, vLLM's greedy responses equal HF generate's for the same weights; after optimiser
    steps that change the greedy answers and another sync, they are equal again, and differ from before.
    With LoRA the engine gets W + s·B·A, and the training model's own weights are left as they were."""
    from peft import LoraConfig, get_peft_model

    cfg, rollout = make_config(tiny_model_dir), engine("fp32")
    model = copy.deepcopy(random_model)
    if lora:
        model = get_peft_model(model, LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"]))
    batch = prompts[:6]
    before_v, before_h = greedy_both(rollout, model, tokenizer, batch, cfg)
    assert torch.equal(before_v.responses, before_h.responses)
    assert torch.equal(before_v.response_mask, before_h.response_mask)

    fit(model, tokenizer, batch, ["hello world"] * len(batch), steps=10, lr=1e-2)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    after_v, after_h = greedy_both(rollout, model, tokenizer, batch, cfg)
    assert torch.equal(after_v.responses, after_h.responses)
    assert torch.equal(after_v.response_mask, after_h.response_mask)
    assert not torch.equal(after_v.responses, before_v.responses)
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in state.items()), "sync changed the training model"
    if lora:
        assert any(v.abs().sum() > 0 for k, v in state.items() if "lora_B" in k)


# ---- logprobs


@pytest.mark.parametrize("dtype,tol_mean,tol_max", [("fp32", 1e-4, 1e-3), ("bf16", 0.1, 1.0)])
@vllm_test
def test_sampler_logprobs_match_recomputed_logprobs(engine, random_model, prompts, dtype, tol_mean, tol_max):
    """The logprob vLLM reports for each sampled token is the training model's log_softmax(logits / T) there:
    measured mean|max |Δ| 2e-6|2e-5 with an fp32 engine, 3e-2|0.27 with a bf16 one (HF in fp32 both times);
    padding holds 0."""
    rollout, T, n = engine(dtype), 0.7, 4
    rollout.sync_weights(random_model)
    batch = prompts[::12]
    out = rollout.generate(batch, n, T, seed=0)
    ref = recomputed_logprobs(random_model, batch, n, out, T)
    mask = out.response_mask.bool()
    diff = (out.logprobs - ref).abs()[mask]
    print(f"\n{dtype} engine vs fp32 HF: |Δlogprob| mean {diff.mean():.2e} max {diff.max():.2e} "
          f"over {mask.sum()} tokens (mean logprob {ref[mask].mean():.3f})")
    assert diff.mean() < tol_mean and diff.max() < tol_max
    assert (out.logprobs[~mask] == 0).all()


# ---- seeds


@vllm_test
def test_same_seed_same_samples_other_seed_other_samples(engine, random_model, prompts):
    """At T=1 two calls with the same seed return identical responses and logprobs; another seed differs,
    and so does the same seed on another rank (ranks must not draw the same noise)."""
    rollout = engine("fp32")
    rollout.sync_weights(random_model)
    batch = prompts[:4]
    a, b, c = (rollout.generate(batch, 3, 1.0, seed=s) for s in (7, 7, 8))
    assert torch.equal(a.responses, b.responses) and torch.equal(a.logprobs, b.logprobs)
    assert not torch.equal(a.responses, c.responses)
    rollout.rank = 1
    try:
        d = rollout.generate(batch, 3, 1.0, seed=7)
    finally:
        rollout.rank = 0
    assert not torch.equal(a.responses, d.responses)


# ---- the Rollout contract


@vllm_test
def test_rollout_rows_order_eos_and_masks(engine, hello_model, random_model, tokenizer, prompts):
    """Row i·n + j holds sample j of prompt i; a response that ends keeps its EOS as the last masked-in token,
    with no EOS before it; mask is 1 on real tokens then 0, where responses hold the pad id and logprobs 0."""
    rollout, n = engine("fp32"), 3
    rollout.sync_weights(hello_model)
    batch = prompts[:6]
    out = rollout.generate(batch, n, 1.0, seed=1)
    B, Tr = len(batch) * n, out.responses.shape[1]
    assert out.responses.shape == out.response_mask.shape == out.logprobs.shape == (B, Tr) and Tr <= MAX_RESPONSE
    assert out.logprobs.dtype == torch.float32
    lengths = out.response_mask.sum(1)
    assert torch.equal(out.response_mask, (torch.arange(Tr)[None] < lengths[:, None]).long())
    eos = tokenizer.eos_token_id
    ended = 0
    for row in range(B):
        tokens = out.responses[row, :lengths[row]].tolist()
        assert eos not in tokens[:-1]
        ended += tokens[-1] == eos
        assert (out.responses[row, lengths[row]:] == tokenizer.pad_token_id).all()
        assert (out.logprobs[row, :lengths[row]] <= 0).all() and (out.logprobs[row, lengths[row]:] == 0).all()
    assert 0 < ended < B, "expected both finished and truncated responses"

    rollout.sync_weights(random_model)  # greedy answers that differ from prompt to prompt
    batch = prompts[::24]
    greedy = rollout.generate(batch, n, 0.0)
    assert len({tuple(r.tolist()) for r in greedy.responses}) > 1
    for i, p in enumerate(batch):
        alone = rollout.generate([p], 1, 0.0).responses[0]
        for j in range(n):
            row = greedy.responses[i * n + j]
            assert torch.equal(row[:len(alone)], alone) and (row[len(alone):] == tokenizer.pad_token_id).all()


# ---- sleep mode (GPU only in vLLM; the order of the calls is checked with a stand-in engine)


class RecordingEngine:
    """Records the calls a VLLMRollout makes to its engine, and returns one EOS-only sample per request."""

    def __init__(self):
        self.calls = []

    def __getattr__(self, name):
        def call(*args, **kwargs):
            self.calls.append((name, kwargs.get("tags")) if name == "wake_up" else name)
            if name == "generate":
                sample = type("Sample", (), dict(index=0, token_ids=[0], logprobs=[{0: type("L", (), {"logprob": -1.0})}]))
                return [type("Out", (), {"outputs": [sample]}) for _ in args[0]]
        return call


@vllm_test  # generate() builds vLLM's SamplingParams
def test_a_sleeping_engine_wakes_weights_then_syncs_then_wakes_its_kv_cache(random_model):
    """With rollout.free_cache_engine the engine sleeps after each rollout. A sync wakes only its weights; the KV
    cache wakes when the next rollout starts, after the gathered weights are gone (verl's order), and the prefix
    cache computed with the old weights is reset before that rollout."""
    from rollout import VLLMRollout

    rollout = VLLMRollout.__new__(VLLMRollout)  # the engine's own start-up is not under test
    rollout.cfg, rollout.unwrap, rollout.sleeps, rollout.rank = make_config("unused").rollout, (lambda m: m), True, 0
    rollout.pad_id, rollout.eos_ids, rollout.dtype, rollout.llm = 0, {0}, torch.float32, RecordingEngine()
    rollout.asleep, rollout.stale_prefix_cache = {"weights", "kv_cache"}, False
    rollout.sync_weights(random_model)
    rollout.generate([[1, 2, 3]], n=1, temperature=1.0, seed=0)
    assert rollout.llm.calls == [("wake_up", ["weights"]), "collective_rpc", ("wake_up", ["kv_cache"]),
                                 "reset_prefix_cache", "generate", "sleep"]
    assert rollout.asleep == {"weights", "kv_cache"}


# ---- fallback


def test_missing_vllm_falls_back_to_hf_with_one_warning(monkeypatch, capsys, tiny_model_dir, random_model, tokenizer):
    """When `import vllm` fails, make_rollout returns the HF backend and says so in exactly one line."""
    monkeypatch.setitem(sys.modules, "vllm", None)  # makes `import vllm` raise ImportError
    rollout = make_rollout(make_config(tiny_model_dir), random_model, tokenizer, FakeAccelerator())
    assert isinstance(rollout, HFRollout)
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("warning: rollout.name=vllm")


@vllm_test
def test_ignore_eos_gives_full_length_responses(engine, tiny_model_dir, hello_model, tokenizer, prompts):
    """With rollout.ignore_eos every response is max_response_length tokens long and never samples EOS,
    in vLLM as in HF (whose min_new_tokens masks EOS the same way)."""
    rollout = engine("fp32")
    rollout.sync_weights(hello_model)  # a model that would stop early
    rollout.cfg.ignore_eos = True
    try:
        vllm_out = rollout.generate(prompts[:6], 2, 1.0, seed=3)
    finally:
        rollout.cfg.ignore_eos = False
    cfg = make_config(tiny_model_dir)
    cfg.rollout.ignore_eos = True
    hf_out = HFRollout(hello_model, tokenizer, cfg.rollout).generate(prompts[:6], 2, 1.0)
    for out in (vllm_out, hf_out):
        assert out.responses.shape == (12, MAX_RESPONSE) and out.response_mask.all()
        assert not (out.responses == tokenizer.eos_token_id).any()


def test_expected_vllm_warnings_are_dropped_and_no_other():
    """rollout.ExpectedVllmWarnings drops exactly vLLM's per-sync "RotaryEmbedding: Failed to load weights" and its
    start-up "Attempted to load weight … with dtype torch.float32 into …" lines; the same messages for another layer
    or another dtype, and any other warning, pass."""
    import logging
    from rollout import ExpectedVllmWarnings

    def passes(msg, *args):
        return ExpectedVllmWarnings().filter(logging.LogRecord("vllm", logging.WARNING, "x.py", 1, msg, args, None))
    assert not passes("%s: Failed to load weights", "RotaryEmbedding")
    assert passes("%s: Failed to load weights", "QKVParallelLinear")
    load = "Attempted to load weight %s with dtype %s into parameter with dtype %s"
    assert not passes(load, "layers.0.mlp.down_proj.weight", torch.float32, torch.bfloat16)
    assert passes(load, "layers.0.mlp.down_proj.weight", torch.float64, torch.float16)
    assert passes("Triton is not installed.")
