"""Peak memory of one training forward+backward of the actor and of the critic, with and without
model.gradient_checkpointing, on a model where activations dominate. Each setting runs in a fresh subprocess,
through the library's own loaders (utils.load_policy, critic.load_critic) and forwards (batches).

    python bench/grad_ckpt_memory.py                       # 8 layers, hidden 512, 16 × (40 + 128) tokens, fp32
    python bench/grad_ckpt_memory.py --layers 8 --hidden 512 --batch 16 --prompt 40 --response 128
"""
import argparse
import os
import resource
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def build(path, layers, hidden, vocab):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=4 * hidden, num_hidden_layers=layers,
                         num_attention_heads=hidden // 64, num_key_value_heads=hidden // 64, max_position_embeddings=1024)
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(path)


def one_run(path, which, checkpointing, batch, prompt, response):
    """Prints the peak RSS growth (MB) of one forward+backward, then the loss (to show both settings agree)."""
    import torch
    sys.path.insert(0, ROOT)
    from infra.batches import forward_logprobs, forward_values
    from infra.models import load_critic, load_policy, use_gradient_checkpointing

    torch.manual_seed(0)
    if which == "actor":
        cfg = type("M", (), dict(path=path, gradient_checkpointing=checkpointing, lora_rank=0))
        model = load_policy(cfg)
    else:
        model = load_critic(path)
        if checkpointing:
            use_gradient_checkpointing(model)
    model.train()  # transformers recomputes only in train mode
    V = model.config.vocab_size
    mb = dict(queries=torch.randint(3, V, (batch, prompt)), query_mask=torch.ones(batch, prompt, dtype=torch.long),
              responses=torch.randint(3, V, (batch, response)), response_mask=torch.ones(batch, response, dtype=torch.long))
    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    if which == "actor":
        logprobs, entropy = forward_logprobs(model, mb, 1.0, None, with_entropy=True)
        loss = logprobs.mean() + entropy.mean()
    else:
        loss = forward_values(model, mb, None).square().mean()
    loss.backward()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    print(f"{(peak - base) / 1024:.0f} {loss.item():.6f}")


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--prompt", type=int, default=40)
    p.add_argument("--response", type=int, default=128)
    p.add_argument("--run", nargs=3, help=argparse.SUPPRESS)  # path, actor|critic, 0|1
    a = p.parse_args()
    if a.run:
        one_run(a.run[0], a.run[1], a.run[2] == "1", a.batch, a.prompt, a.response)
        sys.exit()
    with tempfile.TemporaryDirectory() as tmp:
        build(tmp, a.layers, a.hidden, a.vocab)
        for which in ("actor", "critic"):
            results = {}
            for ckpt in ("0", "1"):
                out = subprocess.run([sys.executable, __file__, "--run", tmp, which, ckpt, "--batch", str(a.batch),
                                      "--prompt", str(a.prompt), "--response", str(a.response)],
                                     capture_output=True, text=True, check=True).stdout.split()
                results[ckpt] = (float(out[-2]), out[-1])
            (off, loss_off), (on, loss_on) = results["0"], results["1"]
            print(f"{which}: {a.layers} layers, hidden {a.hidden}, {a.batch} × {a.prompt}+{a.response} tokens, fp32: "
                  f"peak above the loaded model {off:.0f} MB without, {on:.0f} MB with gradient checkpointing "
                  f"(saves {off - on:.0f} MB, {100 * (off - on) / off:.0f} %); loss {loss_off} vs {loss_on}")
