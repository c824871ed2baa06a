"""Peak memory and time of one training forward+backward through batches.forward_logprobs (log-probs and entropy of
every response token, the entropy in the loss), three ways, each in a fresh subprocess:

    whole     autograd through log_softmax and the entropy formula over the whole (B·Tr, V) fp32 tensor
    gpu       batches.LogprobsEntropy, LOGITS_CHUNK positions at a time (a GPU's chunk)
    cpu       batches.LogprobsEntropy, logits_chunk's CPU chunk (fp32 temporaries within CPU_CHUNK_ELEMENTS)

    python bench/logits_memory.py [--model models/SmolLM2-135M-Instruct] [--batch 8] [--response 32] [--dtype bf16]

Only the final norm trains, so that the backward runs through the head and the log-softmax (as under LoRA) and not
into every weight's gradient. Prints, per way, the peak RSS above the loaded model (MB) and the median seconds of
--repeat forwards+backwards.
"""
import argparse
import os
import resource
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WAYS = ("whole", "gpu", "cpu")


def whole_logprobs_entropy(logits, tokens, temperature, with_entropy, chunk):
    """The plain path: autograd through the whole fp32 tensor, nothing chunked or recomputed."""
    log_p = (logits.float() / temperature).log_softmax(-1)
    return log_p.gather(-1, tokens[..., None])[..., 0], -(log_p.exp() * log_p).sum(-1)


def one_run(a):
    import torch
    sys.path.insert(0, ROOT)
    from infra import batches
    from transformers import AutoModelForCausalLM

    if a.way == "whole":
        batches.chunked_logprobs_entropy = whole_logprobs_entropy
    elif a.way == "gpu":
        batches.logits_chunk = lambda device, vocab: batches.LOGITS_CHUNK
    model = AutoModelForCausalLM.from_pretrained(a.model, dtype=torch.float32)
    model.requires_grad_(False).model.norm.requires_grad_(True)  # the backward through the head, not 135 M weights
    V, B = model.config.vocab_size, a.batch
    mb = dict(queries=torch.randint(3, V, (B, a.prompt)), query_mask=torch.ones(B, a.prompt, dtype=torch.long),
              responses=torch.randint(3, V, (B, a.response)), response_mask=torch.ones(B, a.response, dtype=torch.long))
    dtype = {"bf16": torch.bfloat16, "fp32": None}[a.dtype]
    base, seconds = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, []
    for _ in range(a.repeat):
        t0 = time.perf_counter()
        logprobs, entropy = batches.forward_logprobs(model, mb, 1.0, dtype, True)
        (logprobs.mean() + 0.01 * entropy.mean()).backward()
        seconds.append(time.perf_counter() - t0)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    print(f"{(peak - base) / 1024:.0f} {statistics.median(seconds):.3f}")


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--model", default=os.path.join(ROOT, "models/SmolLM2-135M-Instruct"))
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--prompt", type=int, default=40)
    p.add_argument("--response", type=int, default=32)
    p.add_argument("--dtype", choices=["bf16", "fp32"], default="bf16", help="autocast dtype (bf16 is slow on a CPU "
                   "without native bf16; fp32 there)")
    p.add_argument("--repeat", type=int, default=5, help="forward+backward passes timed (their median)")
    p.add_argument("--way", choices=WAYS, default=None, help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.way is not None:
        one_run(a)
        sys.exit()
    print(f"forward+backward above the loaded model, {a.dtype}, B={a.batch} Tq={a.prompt} Tr={a.response}:")
    for way in WAYS:
        out = subprocess.run([sys.executable, __file__, *sys.argv[1:], "--way", way], capture_output=True, text=True,
                             check=True).stdout.split()
        print(f"  {way:6s} peak {float(out[-2]):6.0f} MB  {float(out[-1]):.3f} s")
