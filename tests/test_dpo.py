"""dpo.py: the losses by hand, the table, training end to end on a tiny model (a subprocess, as a user runs it), the
reference (adapter off, a frozen copy, computed once), and for dpo.py and sft.py both: gradient invariance to
micro-batching and to the number of processes, bit-for-bit resume."""
import math
import os
import subprocess
import sys

import pytest
import torch

from conftest import make_tiny_model, read_metrics, REPO

import data
import dpo


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    """A tiny model, 64 demo preference pairs to train on and 16 held out, 8 validation prompts."""
    root = tmp_path_factory.mktemp("dpo")
    make_tiny_model(root / "model")
    pairs = data.make_arithmetic_preferences(80, seed=0)
    data.write_parquet(pairs[:64], str(root / "train.parquet"))
    data.write_parquet(pairs[64:], str(root / "val.parquet"))
    data.write_parquet(data.make_arithmetic(8, seed=1), str(root / "prompts.parquet"))
    return root


def run_stage(script, section, root, out, *overrides, expect_ok=True, train="train.parquet", env=None):
    """`python <script> --config configs.yaml` on the tiny model and workdir's files, into `out`."""
    cmd = [sys.executable, script, "--config", "configs.yaml", f"{section}.model_path={root}/model",
           f"{section}.train_files={root}/{train}", f"{section}.val_files={root}/val.parquet",
           f"{section}.val_prompts={root}/prompts.parquet", f"{section}.output_dir={out}", f"{section}.batch_size=8",
           f"{section}.micro_batch_size_per_device=4", f"{section}.lora_rank=8", f"{section}.max_response_length=6",
           *overrides]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})})
    if expect_ok:
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return proc


def test_losses_by_hand():
    """sigmoid at Δ_w − Δ_l = 1, β = 0.5: −log σ(0.5) = 0.47408; with ε = 0.1: 0.9·0.47408 + 0.1·0.97408 = 0.52408.
    ipo at 1, β = 0.5: (1 − 1)² = 0; at 2: 1. simpo at 1, β = 2, γ = 0.5: −log σ(1.5) = 0.20141."""
    one, zero = torch.tensor([1.0]), torch.tensor([0.0])
    assert dpo.sigmoid_loss(one, zero, 0.5, 0.0, 0.0).item() == pytest.approx(0.47408, abs=1e-5)
    assert dpo.sigmoid_loss(one, zero, 0.5, 0.1, 0.0).item() == pytest.approx(0.52408, abs=1e-5)
    assert dpo.ipo_loss(one, zero, 0.5, 0.0, 0.0).item() == pytest.approx(0.0, abs=1e-7)
    assert dpo.ipo_loss(2 * one, zero, 0.5, 0.0, 0.0).item() == pytest.approx(1.0, abs=1e-6)
    assert dpo.simpo_loss(one, zero, 2.0, 0.0, 0.5).item() == pytest.approx(0.20141, abs=1e-5)
    x, y = torch.randn(8), torch.randn(8)
    plain = [-math.log(1 / (1 + math.exp(-0.3 * (a - b)))) for a, b in zip(x.tolist(), y.tolist())]
    assert torch.allclose(dpo.sigmoid_loss(x, y, 0.3, 0.0, 0.0), torch.tensor(plain), atol=1e-5)


def test_sequence_logprobs_ignore_padding():
    """Padding positions add nothing to a sequence's log-probability, summed or averaged per token."""
    lp = torch.tensor([[-1.0, -2.0, -50.0], [-0.5, -0.5, -0.5]])
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]])
    assert dpo.sequence_logprobs(lp, mask, per_token=False).tolist() == [-3.0, -1.5]
    assert dpo.sequence_logprobs(lp, mask, per_token=True).tolist() == [-1.5, -0.5]


def test_training_writes_metrics_and_a_loadable_final(workdir, tmp_path):
    """3 LoRA steps: TRL's metric names every step, greedy validation (val/score/mean) before and after, held-out
    rewards/*, and final/ a plain causal LM (adapter merged) that loads as the next stage's model."""
    from transformers import AutoModelForCausalLM
    out = tmp_path / "out"
    run_stage("dpo.py", "dpo", workdir, out, "dpo.total_steps=3", "dpo.eval_freq=0")
    lines = read_metrics(out)
    assert [m["step"] for m in lines] == [0, 1, 2, 3]
    assert "val/score/mean" in lines[0] and "val/score/mean" in lines[-1]
    for key in ("loss", "rewards/chosen", "rewards/rejected", "rewards/margins", "rewards/accuracies", "logps/chosen",
                "logps/rejected", "grad_norm", "lr"):
        assert all(math.isfinite(m[key]) for m in lines[1:]), key
    assert lines[1]["loss"] == pytest.approx(math.log(2), abs=1e-4)  # step 1: policy = reference, every Δ = 0
    assert lines[1]["rewards/margins"] == pytest.approx(0.0, abs=1e-5)
    assert "val/rewards/accuracies" in lines[-1]
    assert not (out / "final" / "adapter_config.json").exists() and (out / "final_adapter").is_dir()
    AutoModelForCausalLM.from_pretrained(out / "final")


SAME = ["loss", "grad_norm", "rewards/chosen", "rewards/rejected", "rewards/accuracies", "logps/chosen"]
SAME_IN = {"dpo": SAME, "sft": ["loss", "grad_norm", "tokens"]}  # the metrics a step's gradient decides


def trained(out) -> list[dict]:
    return [m for m in read_metrics(out) if m["step"] > 0]


@pytest.mark.parametrize("stage", ["dpo", "sft"])
def test_micro_batches_and_processes_give_the_same_steps(workdir, tmp_path, stage):
    """One micro-batch of 8 rows (pairs for dpo.py, chosen answers for sft.py), four of 2, and 2 processes (DDP over
    gloo, 4 each) give the same loss and gradient norm at step 1, and so the same weights: the same metrics at step 2
    (dpo.py's departure 4, sft.py's departure 2)."""
    from conftest import free_port
    args = [f"{stage}.total_steps=2", f"{stage}.eval_freq=0", f"{stage}.val_before_train=false",
            f"{stage}.val_prompts=null", f"{stage}.save_freq=0"]
    script = f"{stage}.py"
    run_stage(script, stage, workdir, tmp_path / "one", *args, f"{stage}.micro_batch_size_per_device=8")
    run_stage(script, stage, workdir, tmp_path / "micro", *args, f"{stage}.micro_batch_size_per_device=2")
    launcher = ["-m", "accelerate.commands.launch", "--config_file", "accelerate_configs/ddp_cpu.yaml",
                "--num_processes", "2", "--main_process_port", str(free_port())]
    proc = subprocess.run([sys.executable, *launcher, script, "--config", "configs.yaml",
                           f"{stage}.model_path={workdir}/model", f"{stage}.train_files={workdir}/train.parquet",
                           f"{stage}.val_files={workdir}/val.parquet", f"{stage}.output_dir={tmp_path / 'ddp'}",
                           f"{stage}.batch_size=8", f"{stage}.micro_batch_size_per_device=4", f"{stage}.lora_rank=8",
                           *args],
                          cwd=REPO, capture_output=True, text=True, timeout=600, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    one = trained(tmp_path / "one")
    for other in (trained(tmp_path / "micro"), trained(tmp_path / "ddp")):
        assert [m["step"] for m in other] == [1, 2]
        for a, b in zip(one, other):
            for key in SAME_IN[stage]:
                assert a[key] == pytest.approx(b[key], rel=1e-4, abs=1e-6), (a["step"], key)
    assert one[1]["loss"] != one[0]["loss"]  # the step changed the weights


@pytest.mark.parametrize("stage,lora_rank", [("sft", "8"), ("dpo", "8"), ("dpo", "0")])
def test_fsdp2_gives_the_same_steps_and_a_whole_final(workdir, tmp_path, stage, lora_rank):
    """Under the FSDP2 launcher (2 processes over gloo, every model sharded: dpo.py's frozen reference too with full
    weights) a step equals one process's (padded layout both), held-out metrics included over 12 rows that split
    unevenly (one process runs an extra forward whose result is dropped), greedy validation runs (every process as
    many forwards), and final/ is gathered whole: the same weights as the one process's final/."""
    from conftest import free_port
    from safetensors.torch import load_file
    args = [f"{stage}.total_steps=2", f"{stage}.eval_freq=0", f"{stage}.val_before_train=false",
            f"{stage}.val_max_rows=12", f"{stage}.save_freq=0", f"{stage}.share_prompt_prefix=false",
            f"{stage}.lora_rank={lora_rank}", f"{stage}.optim.lr=1e-3"]
    script = f"{stage}.py"
    run_stage(script, stage, workdir, tmp_path / "one", *args)
    launcher = ["-m", "accelerate.commands.launch", "--config_file", "accelerate_configs/fsdp2.yaml",
                "--num_processes", "2", "--main_process_port", str(free_port())]
    proc = subprocess.run([sys.executable, *launcher, script, "--config", "configs.yaml",
                           f"{stage}.model_path={workdir}/model", f"{stage}.train_files={workdir}/train.parquet",
                           f"{stage}.val_files={workdir}/val.parquet", f"{stage}.val_prompts={workdir}/prompts.parquet",
                           f"{stage}.output_dir={tmp_path / 'fsdp'}", f"{stage}.batch_size=8",
                           f"{stage}.micro_batch_size_per_device=4", f"{stage}.max_response_length=6", *args],
                          cwd=REPO, capture_output=True, text=True, timeout=600, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    assert "parallel: fsdp2 over 2 processes (gloo); sharded: " in proc.stdout
    one, sharded = trained(tmp_path / "one"), trained(tmp_path / "fsdp")
    held_out = ["val/loss"] if stage == "sft" else ["val/loss", "val/rewards/margins", "val/rewards/accuracies"]
    for a, b in zip(one, sharded):
        for key in SAME_IN[stage] + (held_out + ["val/score/mean"] if a["step"] == 2 else []):
            assert a[key] == pytest.approx(b[key], rel=1e-4, abs=1e-5), (a["step"], key)
    assert one[1]["loss"] != one[0]["loss"]
    whole = [load_file(str(tmp_path / run / "final" / "model.safetensors")) for run in ("one", "fsdp")]
    assert whole[0].keys() == whole[1].keys()
    for name in whole[0]:
        torch.testing.assert_close(whole[0][name], whole[1][name], rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("stage,weights", [("dpo", "adapter_off"), ("dpo", "precomputed_full"), ("sft", "lora"),
                                           ("sft", "full")])
def test_resume_is_bit_for_bit(workdir, tmp_path, stage, weights):
    """4 steps in one run equal 2 steps, stopped, then resumed to 4 from step_2: every metric line but the timings
    is identical: dpo.py under LoRA (the reference: the adapter off) and with full weights and the frozen reference's
    log-probs computed once (precompute_ref_log_probs); sft.py under LoRA and with full weights."""
    args = [f"{stage}.optim.lr_scheduler=constant", f"{stage}.optim.warmup_ratio=0", f"{stage}.save_freq=2",
            f"{stage}.eval_freq=2"]
    if weights in ("precomputed_full", "full"):
        args += [f"{stage}.lora_rank=0", f"{stage}.optim.lr=1e-4"]
    if weights == "precomputed_full":
        args += ["dpo.precompute_ref_log_probs=true"]
    script = f"{stage}.py"
    run_stage(script, stage, workdir, tmp_path / "a", f"{stage}.total_steps=4", *args)
    run_stage(script, stage, workdir, tmp_path / "b", f"{stage}.total_steps=2", *args)
    proc = run_stage(script, stage, workdir, tmp_path / "b", f"{stage}.total_steps=4", *args)
    assert "resumed from" in proc.stdout and "step_2" in proc.stdout
    strip = [{k: v for k, v in m.items() if not k.startswith("time/")} for m in read_metrics(tmp_path / "a")]
    resumed = [{k: v for k, v in m.items() if not k.startswith("time/")} for m in read_metrics(tmp_path / "b")]
    assert [m["step"] for m in resumed] == [0, 1, 2, 3, 4]
    assert resumed == strip
    assert strip[3]["loss"] != strip[1]["loss"]


def test_precomputed_reference_equals_the_live_one(workdir, tmp_path):
    """The reference's log-probs computed once before training (departure 1) give the same steps as computing them
    at every step, under LoRA (the adapter switched off) and with a frozen full copy."""
    args = ["dpo.total_steps=2", "dpo.eval_freq=0", "dpo.val_before_train=false", "dpo.val_prompts=null",
            "dpo.save_freq=0"]
    for rank in ("8", "0"):
        live, once = tmp_path / f"live{rank}", tmp_path / f"once{rank}"
        run_stage("dpo.py", "dpo", workdir, live, *args, f"dpo.lora_rank={rank}")
        proc = run_stage("dpo.py", "dpo", workdir, once, *args, f"dpo.lora_rank={rank}",
                         "dpo.precompute_ref_log_probs=true")
        assert "computed once" in proc.stdout
        for a, b in zip(trained(live), trained(once)):
            for key in SAME:
                assert a[key] == pytest.approx(b[key], rel=1e-4, abs=1e-6), (rank, a["step"], key)
