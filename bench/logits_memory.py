"""Peak memory of one training forward+backward through batches.forward_logprobs, with and without
chunked log-softmax/entropy (batches.LOGITS_CHUNK). Each setting runs in a fresh subprocess.

    python bench/logits_memory.py [--model models/SmolLM2-135M-Instruct] [--batch 16] [--response 64]
"""
import argparse
import os
import resource
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def one_run(model_path, batch, prompt, response, chunk, dtype):
    import torch
    sys.path.insert(0, ROOT)
    from infra import batches
    from transformers import AutoModelForCausalLM

    batches.LOGITS_CHUNK = chunk
    if chunk == 0:  # the plain path: whole tensors, no recomputation
        batches.chunked_logprobs_entropy = lambda z, t, temp, with_entropy, chunk: batches._logprobs_entropy(z, t, temp, with_entropy)
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    V = model.config.vocab_size
    mb = dict(queries=torch.randint(3, V, (batch, prompt)), query_mask=torch.ones(batch, prompt, dtype=torch.long),
              responses=torch.randint(3, V, (batch, response)), response_mask=torch.ones(batch, response, dtype=torch.long))
    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    logprobs, entropy = batches.forward_logprobs(model, mb, 1.0, {"bf16": torch.bfloat16, "fp32": None}[dtype], True)
    (logprobs.mean() + entropy.mean()).backward()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    print(f"{(peak - base) / 1024:.0f}")


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--model", default=os.path.join(ROOT, "models/SmolLM2-135M-Instruct"))
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--prompt", type=int, default=40)
    p.add_argument("--response", type=int, default=32)
    p.add_argument("--dtype", choices=["bf16", "fp32"], default="bf16", help="autocast dtype (bf16 is slow on a CPU "
                   "without native bf16; fp32 there)")
    p.add_argument("--chunk", type=int, default=None, help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.chunk is not None:
        one_run(a.model, a.batch, a.prompt, a.response, a.chunk, a.dtype)
        sys.exit()
    results = {}
    for chunk in (0, 1024):
        out = subprocess.run([sys.executable, __file__, "--model", a.model, "--batch", str(a.batch), "--prompt",
                              str(a.prompt), "--response", str(a.response), "--chunk", str(chunk), "--dtype", a.dtype],
                             capture_output=True, text=True, check=True).stdout.split()[-1]
        results[chunk] = float(out)
    print(f"forward+backward peak memory above the loaded model, {a.dtype}, B={a.batch} Tq={a.prompt} Tr={a.response}: "
          f"whole {results[0]:.0f} MB, chunked(1024) {results[1024]:.0f} MB, saving {results[0] - results[1024]:.0f} MB")
