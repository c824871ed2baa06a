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

from conftest import as_rows
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
    device = torch.device("cpu")
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
    """engine(dtype) → a VLLMRollout on the tiny model, started once per dtype for this module, and shut down after it
    (an engine left open keeps vLLM's process groups, which a later engine of this process would find stale)."""
    engines = {}

    def get(dtype="fp32"):
        if dtype not in engines:
            engines[dtype] = make_rollout(make_config(tiny_model_dir, dtype), random_model, tokenizer,
                                          FakeAccelerator())
        return engines[dtype]
    yield get
    for rollout in engines.values():
        rollout.close()


# ---- weight sync


def greedy_both(rollout, model, tokenizer, prompts, cfg):
    """Sync `model` into the engine; greedy responses from vLLM and from HF generate on `model` itself."""
    rollout.sync_weights(model)
    vllm_out = rollout.generate(as_rows(prompts), 1, 0.0)
    hf_out = HFRollout(model, tokenizer, cfg.rollout).generate(as_rows(prompts), 1, 0.0)
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
    out = rollout.generate(as_rows(batch), n, T, seed=0)
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
    a, b, c = (rollout.generate(as_rows(batch), 3, 1.0, seed=s) for s in (7, 7, 8))
    assert torch.equal(a.responses, b.responses) and torch.equal(a.logprobs, b.logprobs)
    assert not torch.equal(a.responses, c.responses)
    rollout.rank = 1
    try:
        d = rollout.generate(as_rows(batch), 3, 1.0, seed=7)
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
    out = rollout.generate(as_rows(batch), n, 1.0, seed=1)
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
    greedy = rollout.generate(as_rows(batch), n, 0.0)
    assert len({tuple(r.tolist()) for r in greedy.responses}) > 1
    for i, p in enumerate(batch):
        alone = rollout.generate(as_rows([p]), 1, 0.0).responses[0]
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


def engine_stand_in(engine, dtype=torch.float32, asleep=()):
    """A VLLMRollout around `engine` instead of a vLLM engine (whose own start-up is not under test)."""
    from rollout import VLLMRollout

    rollout = VLLMRollout.__new__(VLLMRollout)
    rollout.cfg, rollout.unwrap, rollout.sleeps, rollout.rank = make_config("unused").rollout, (lambda m: m), True, 0
    rollout.pad_id, rollout.eos_ids, rollout.dtype, rollout.llm = 0, {0}, dtype, engine
    rollout.asleep, rollout.stale_prefix_cache = set(asleep), False
    return rollout


def on_a_gpu(monkeypatch, calls: list):
    """torch.cuda as on a GPU machine, as far as the sleep mode asks: available, and empty_cache recorded in `calls`."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: calls.append("empty_cache"))


def test_a_sleeping_engine_wakes_its_weights_after_torch_releases_its_cached_memory(random_model, monkeypatch):
    """A sync wakes only the sleeping engine's weights, and first empties torch's caching allocator: vLLM maps the
    weights back into memory the driver has free, which blocks torch keeps cached are not (issue 22)."""
    rollout = engine_stand_in(RecordingEngine(), asleep={"weights", "kv_cache"})
    on_a_gpu(monkeypatch, rollout.llm.calls)
    rollout.sync_weights(random_model)
    assert rollout.llm.calls == ["empty_cache", ("wake_up", ["weights"]), "collective_rpc"]
    assert rollout.asleep == {"kv_cache"} and rollout.stale_prefix_cache


@vllm_test  # generate() builds vLLM's SamplingParams
def test_a_sleeping_engine_wakes_weights_then_syncs_then_wakes_its_kv_cache(random_model, monkeypatch):
    """With rollout.free_cache_engine the engine sleeps after each rollout. A sync wakes only its weights; the KV
    cache wakes when the next rollout starts (verl's order), each wake after torch's cache is emptied, and the prefix
    cache computed with the old weights is reset before that rollout."""
    rollout = engine_stand_in(RecordingEngine(), asleep={"weights", "kv_cache"})
    on_a_gpu(monkeypatch, rollout.llm.calls)
    rollout.sync_weights(random_model)
    rollout.generate(as_rows([[1, 2, 3]]), n=1, temperature=1.0, seed=0)
    assert rollout.llm.calls == ["empty_cache", ("wake_up", ["weights"]), "collective_rpc", "empty_cache",
                                 ("wake_up", ["kv_cache"]), "reset_prefix_cache", "generate", "sleep"]
    assert rollout.asleep == {"weights", "kv_cache"}


# ---- weight sync: streamed (checked on CPU with a stand-in engine that consumes what it is given)


class ConsumingEngine:
    """Takes reload_weights' iterator as vLLM's in-place reload does, copying each weight into its own buffers
    (allocated up front, as an engine's are); records the names and the process's peak extra memory."""

    def __init__(self, names_and_shapes: dict, dtype):
        self.weights = {name: torch.zeros(shape, dtype=dtype) for name, shape in names_and_shapes.items()}
        self.received = []

    def collective_rpc(self, method, kwargs):
        assert method == "reload_weights"
        for name, w in kwargs["weights_iterator"]:
            self.weights[name].copy_(w)
            self.received.append(name)


def rss_kb(field: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field + ":"))


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_weight_sync_streams_one_weight_at_a_time(tmp_path, lora):
    """sync_weights hands the engine the policy's weights one at a time, in the engine's dtype (bf16), LoRA merged:
    every weight once, equal to the merged model's. The sync's peak extra memory (this process's peak resident
    memory, reset before it) stays below one decoder layer's fp32 size (40 MiB; measured 16-22 MiB), where the sync
    built a bf16 copy of the whole model before (81 MiB, 130 MiB with LoRA; issue 22: out of memory at 7B)."""
    import copy

    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, LlamaConfig

    config = LlamaConfig(vocab_size=256, hidden_size=1024, intermediate_size=2048, num_hidden_layers=4,
                         num_attention_heads=8, num_key_value_heads=8, tie_word_embeddings=False)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    plain = {name: w.shape for name, w in model.state_dict().items()}
    if lora:
        model = get_peft_model(model, LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"]))
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "lora_B" in name:
                    p.normal_(0, 0.02)  # PEFT starts B at 0: W + s·B·A would be W alone
    layer_bytes = sum(p.numel() * 4 for p in model.get_submodule(
        "base_model.model.model.layers.0" if lora else "model.layers.0").parameters())
    rollout = engine_stand_in(ConsumingEngine(plain, torch.bfloat16), dtype=torch.bfloat16)
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # resets this process's peak resident memory (VmHWM) to its current size
    except OSError as e:
        pytest.skip(f"cannot reset the peak resident memory here: {e}")
    before = rss_kb("VmRSS")
    rollout.sync_weights(model)
    peak_extra = (rss_kb("VmHWM") - before) * 1024
    print(f"\nsync peak extra memory {peak_extra / 2**20:.1f} MiB, one layer in fp32 {layer_bytes / 2**20:.1f} MiB, "
          f"the model in bf16 {sum(w.numel() * 2 for w in rollout.llm.weights.values()) / 2**20:.1f} MiB")
    assert peak_extra < layer_bytes
    assert sorted(rollout.llm.received) == sorted(plain)
    merged = copy.deepcopy(model).merge_and_unload() if lora else model
    for name, w in merged.state_dict().items():
        assert torch.equal(rollout.llm.weights[name], w.to(torch.bfloat16)), name


# ---- the engine's set-up, with a stand-in for vLLM


class FakeLLM:
    """vllm.LLM as VLLMRollout builds it: records its keyword arguments and the weights it is handed."""
    made = []

    def __init__(self, **kwargs):
        self.kwargs, self.received = kwargs, []
        FakeLLM.made.append(self)

    def collective_rpc(self, method, kwargs):
        self.received += [name for name, _ in kwargs["weights_iterator"]]


@pytest.fixture
def fake_vllm(monkeypatch):
    """`import vllm` gives a module whose LLM is FakeLLM."""
    module = type(sys)("vllm")
    module.LLM = FakeLLM
    monkeypatch.setitem(sys.modules, "vllm", module)
    FakeLLM.made.clear()
    return FakeLLM.made


def test_an_engine_under_a_one_process_group_joins_it_as_external_launcher(fake_vllm, monkeypatch, tiny_model_dir,
                                                                          random_model, tokenizer):
    """Whenever a launcher's process group exists (FSDP2 on one GPU runs under torchrun), the engine joins it as
    distributed_executor_backend="external_launcher", as TRL does; vLLM's single-process executor would otherwise
    take the launcher's group for its own. Without a launcher vLLM picks its own executor (also where an earlier
    engine of this process made a group for itself)."""
    from conftest import free_port

    rollout = make_rollout(make_config(tiny_model_dir), random_model, tokenizer, FakeAccelerator())
    assert fake_vllm[-1].kwargs["distributed_executor_backend"] is None
    for name, value in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1")):  # as torchrun sets them
        monkeypatch.setenv(name, value)
    made_here = not torch.distributed.is_initialized()  # else an earlier real engine of this module made one
    if made_here:
        torch.distributed.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0,
                                             world_size=1)
    try:
        rollout = make_rollout(make_config(tiny_model_dir), random_model, tokenizer, FakeAccelerator())
    finally:
        if made_here:
            torch.distributed.destroy_process_group()
    assert fake_vllm[-1].kwargs["distributed_executor_backend"] == "external_launcher" and rollout.rank == 0
    assert len(fake_vllm[-1].received) == len(random_model.state_dict())  # synced at start


def test_multiprocessing_vllm_is_turned_off_with_one_sentence(fake_vllm, monkeypatch, capsys, tiny_model_dir,
                                                              random_model, tokenizer):
    """VLLM_ENABLE_V1_MULTIPROCESSING=1 in the environment would put the engine in another process, where weights
    passed by reference (and streamed) cannot reach it: make_rollout sets it to 0 and says so in one line."""
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "1")
    make_rollout(make_config(tiny_model_dir), random_model, tokenizer, FakeAccelerator())
    assert os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0"
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("warning: VLLM_ENABLE_V1_MULTIPROCESSING=1 is set")


# ---- the HF backend's device and call count


class EOSModel(torch.nn.Module):
    """Parameters away from the compute device (meta here; FSDP2's CPU offload keeps them in host memory): generate
    answers one EOS per row and records the device of its inputs."""

    def __init__(self, eos_id: int):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.empty(1, device="meta"))
        self.eos_id, self.devices = eos_id, []

    def generate(self, input_ids, attention_mask, **kwargs):
        self.devices.append(input_ids.device.type)
        return torch.cat([input_ids, torch.full((len(input_ids), 1), self.eos_id, device=input_ids.device)], 1)


def test_hf_rollout_generates_on_the_accelerators_device_not_its_parameters(tiny_model_dir, tokenizer, prompts):
    """make_rollout's HF backend generates on the accelerator's device, wherever the parameters live (issue 22: under
    CPU offload it took the CPU)."""
    model = EOSModel(tokenizer.eos_token_id)
    cfg = make_config(tiny_model_dir, name="hf")
    out = make_rollout(cfg, model, tokenizer, FakeAccelerator()).generate(as_rows(prompts[:2]), 2, 1.0)
    assert model.devices == ["cpu"] and out.responses.tolist() == [[tokenizer.eos_token_id]] * 4


def test_hf_rollout_under_fsdp2_makes_as_many_generate_calls_as_the_busiest_process(monkeypatch, tiny_model_dir,
                                                                                     tokenizer, prompts):
    """Under FSDP2 every generate call is rounds of all-gathers: a process with fewer prompts (validation rows split
    unevenly, or none) makes as many calls as the busiest one (rollout.max_over_processes), the extra ones on a pad
    token, and returns only its own rows."""
    import rollout as rollout_module

    monkeypatch.setattr(rollout_module, "max_over_processes", lambda count: 3)  # another process makes 3 calls
    cfg = make_config(tiny_model_dir, name="hf")
    cfg.rollout.micro_batch_size = 4
    for batch, rows in ((prompts[:3], 6), ([], 0)):  # 2 calls of its own, or none
        model = EOSModel(tokenizer.eos_token_id)
        out = HFRollout(model, tokenizer, cfg.rollout, synced_gpus=True, device=torch.device("cpu")).generate(
            as_rows(batch), 2, 1.0)
        assert len(model.devices) == 3 and len(out.responses) == rows == len(out.response_mask)


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
        vllm_out = rollout.generate(as_rows(prompts[:6]), 2, 1.0, seed=3)
    finally:
        rollout.cfg.ignore_eos = False
    cfg = make_config(tiny_model_dir)
    cfg.rollout.ignore_eos = True
    hf_out = HFRollout(hello_model, tokenizer, cfg.rollout).generate(as_rows(prompts[:6]), 2, 1.0)
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
