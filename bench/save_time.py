"""How long the checkpoint of a preempted run takes (issue 29: torchrun kills its workers 30 s after SIGTERM): a
Qwen2.5-0.5B-shaped model (its config: hidden 896, 24 layers, 14 query / 2 KV heads, MLP 4864, vocabulary 151936,
tied embeddings), random weights built here (no hub), saved through infra/runs.save_checkpoint as ppo.py saves it:
the trainable weights and AdamW's two moments as safetensors, then the manifest of every file's checksum.

    OMP_NUM_THREADS=2 flock /tmp/heavy.lock .venv/bin/python bench/save_time.py --out /tmp/save_bench [--lora 32]

--lora R: a LoRA actor of rank R on every linear layer (the GRPO-LoRA example), whose checkpoint holds the adapter
only. Prints the CPU, the seconds (the tensors, then the whole save with its manifest) and the bytes written.
"""
import argparse
import os
import shutil
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bf16_matmul import cpu_name  # noqa: E402
from infra.distributed import save_training_state  # noqa: E402
from infra.runs import save_checkpoint  # noqa: E402

QWEN25_05B = dict(vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                  num_attention_heads=14, num_key_value_heads=2, tie_word_embeddings=True, max_position_embeddings=4096)


def folder_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(path) for f in files)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="/tmp/save_bench")
    parser.add_argument("--lora", type=int, default=0)
    args = parser.parse_args()
    from accelerate import Accelerator
    from transformers import AutoModelForCausalLM, Qwen2Config

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(Qwen2Config(**QWEN25_05B), dtype=torch.float32)
    if args.lora:
        from peft import get_peft_model, LoraConfig
        model = get_peft_model(model, LoraConfig(r=args.lora, lora_alpha=args.lora, target_modules=[
            "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]))
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=1e-6, fused=True)
    for p in params:  # one step, so that AdamW holds its two moments, as after any step of a run
        p.grad = torch.zeros_like(p)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    trained = sum(p.numel() for p in params)
    accelerator = Accelerator(cpu=True)
    models = {"policy": (model, optimizer)}
    shutil.rmtree(args.out, ignore_errors=True)
    os.makedirs(args.out)
    print(f"cpu: {cpu_name()} ({os.cpu_count()} cores); torch {torch.__version__}; {trained / 1e6:.1f}M trained "
          f"parameters ({'LoRA rank %d' % args.lora if args.lora else 'full fine-tune'}); folder {args.out}")
    t0 = time.perf_counter()
    os.makedirs(os.path.join(args.out, "tensors_only"))
    save_training_state(os.path.join(args.out, "tensors_only"), models, {"step": 1})
    tensors_s = time.perf_counter() - t0
    written = folder_bytes(os.path.join(args.out, "tensors_only"))
    shutil.rmtree(os.path.join(args.out, "tensors_only"))
    t0 = time.perf_counter()
    folder = save_checkpoint(accelerator, args.out, 1, 1, models, {"step": 1})
    whole_s = time.perf_counter() - t0
    print(f"tensors (weights + AdamW moments): {tensors_s:.1f} s; save_checkpoint (with its manifest): {whole_s:.1f} s; "
          f"{written / 2**30:.2f} GiB ({folder_bytes(folder) / 2**30:.2f} GiB in {folder})")


if __name__ == "__main__":
    main()
