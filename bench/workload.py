"""What bench/ppo_bench.py and bench/trl_bench.py share: the workload built from a size, the options,
the child process whose peak memory is measured, and the result line.

    build_workload(root, size)  →  root/model      a random LlamaForCausalLM and its tokenizer (policy, reference)
                                   root/rm         a random LlamaForSequenceClassification, 1 label (reward, TRL's value)
                                   root/train.parquet   512 arithmetic prompts (data.make_arithmetic)
                                   root/reward.py  a rule reward with verl's signature (ours, with --reward rule)
"""
import argparse
import os
import shutil
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PRESETS = {  # sequences per step = prompts × samples; 2 mini-batches
    "default": dict(hidden=128, layers=2, heads=2, response_length=32, sequences=16),
    "large": dict(hidden=256, layers=4, heads=2, response_length=64, sequences=32),
}
CHAT_TEMPLATE = (  # as tests/conftest.py
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
REWARD_FILE = '''
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    return sum(c.isdigit() for c in solution_str) / 8.0
'''


# ---------------------------------------------------------------------------------------
# The workload: tokenizer, policy, reward model and prompts, made from the size alone


def make_tokenizer(texts: list[str], vocab: int):
    """Byte-level BPE trained on `texts`, filled up to exactly `vocab` ids with <x…> tokens.

    EOS is <|im_end|>, pad is <|endoftext|>: distinct, because TRL treats every pad id in a sequence
    as padding, and the chat template writes <|im_end|> inside each prompt.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=min(vocab, 400), special_tokens=["<|endoftext|>", "<|im_start|>",
                                  "<|im_end|>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|im_start|>", eos_token="<|im_end|>",
                                        pad_token="<|endoftext|>", unk_token="<|endoftext|>",
                                        chat_template=CHAT_TEMPLATE)
    if len(tokenizer) > vocab:
        sys.exit(f"--vocab {vocab} is below the {len(tokenizer)} tokens the byte-level BPE needs")
    tokenizer.add_tokens([f"<x{i}>" for i in range(vocab - len(tokenizer))])
    return tokenizer


def build_workload(root: str, size: dict) -> str:
    """root/model (causal LM), root/rm (sequence classifier, 1 label), root/train.parquet, root/reward.py."""
    if os.path.exists(os.path.join(root, "READY")):
        return root
    import torch
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, LlamaConfig

    sys.path.insert(0, REPO)
    import data

    rows = data.make_arithmetic(512, seed=0)
    texts = [m["content"] for r in rows for m in r["prompt"]] + ["system user assistant The answer is"] * 8
    tokenizer = make_tokenizer(texts, size["vocab"])
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=size["hidden"],
                         intermediate_size=size["intermediate"], num_hidden_layers=size["layers"],
                         num_attention_heads=size["heads"], num_key_value_heads=size["kv_heads"],
                         max_position_embeddings=1024, bos_token_id=tokenizer.bos_token_id,
                         eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
                         tie_word_embeddings=False, num_labels=1)
    tmp = root + ".tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    for name, cls, seed in [("model", AutoModelForCausalLM, 0), ("rm", AutoModelForSequenceClassification, 1)]:
        torch.manual_seed(seed)
        cls.from_config(config, dtype=torch.float32).save_pretrained(os.path.join(tmp, name))
        tokenizer.save_pretrained(os.path.join(tmp, name))
    data.write_parquet(rows, os.path.join(tmp, "train.parquet"))
    with open(os.path.join(tmp, "reward.py"), "w") as f:
        f.write(REWARD_FILE)
    open(os.path.join(tmp, "READY"), "w").close()
    shutil.rmtree(root, ignore_errors=True)
    os.replace(tmp, root)
    return root


def size_of(args) -> dict:
    preset = PRESETS[args.preset]
    hidden = args.hidden or preset["hidden"]
    heads = args.heads or preset["heads"]
    return dict(hidden=hidden, layers=args.layers or preset["layers"], heads=heads,
                kv_heads=args.kv_heads or heads, vocab=args.vocab, intermediate=args.intermediate or 2 * hidden,
                response_length=args.response_length or preset["response_length"],
                sequences=args.sequences or preset["sequences"])


def workdir_of(args, size: dict) -> str:
    key = "h{hidden}_l{layers}_a{heads}_kv{kv_heads}_v{vocab}_i{intermediate}".format(**size)
    return os.path.join(args.workdir, key)


def common_args(parser: argparse.ArgumentParser) -> None:
    """The options ppo_bench.py and trl_bench.py share."""
    parser.add_argument("--preset", choices=sorted(PRESETS), default="default")
    parser.add_argument("--steps", type=int, default=20, help="PPO steps; step 1 is warm-up, not timed")
    parser.add_argument("--hidden", type=int, help="override the preset's hidden size")
    parser.add_argument("--layers", type=int, help="override the preset's number of layers")
    parser.add_argument("--heads", type=int, help="attention heads (head_dim = hidden / heads)")
    parser.add_argument("--kv-heads", type=int, help="key/value heads (default: --heads)")
    parser.add_argument("--vocab", type=int, default=1024, help="vocabulary size")
    parser.add_argument("--intermediate", type=int, help="MLP width (default 2 × hidden, as tests/conftest.py)")
    parser.add_argument("--response-length", type=int, help="override the preset's fixed response length")
    parser.add_argument("--sequences", type=int, help="override the preset's sequences per step")
    parser.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32", help="compute dtype")
    parser.add_argument("--gc-freeze", action="store_true", help="gc.freeze(); gc.disable() for the training loop")
    parser.add_argument("--threads", type=int, default=0,
                        help="torch/OpenMP threads in the run (0: torch's default, one per core); on a busy "
                             "machine 1 avoids OpenMP threads spinning against other processes")
    parser.add_argument("--workdir", default="/tmp/ppo_bench", help="where models, data and runs go")


def run_child(cmd: list[str], log_path: str, threads: int = 0) -> float:
    """Run cmd with its output in log_path; return its peak RSS in MB, or exit with the log's tail."""
    env = dict(os.environ, **({"OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads)} if threads else {}))
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)
        _, status, usage = os.wait4(proc.pid, 0)  # this child's own rusage, not the max over all children
        proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode != 0:
        with open(log_path) as f:
            sys.exit(f"{cmd[1]}: the run failed (exit {proc.returncode}); the end of {log_path}:\n" + f.read()[-4000:])
    return usage.ru_maxrss / 1024  # Linux reports KB


def result_line(name: str, steps: int, step_seconds: list, step_tokens: list, rss: float, **tags) -> str:
    sps = sum(step_seconds) / len(step_seconds)
    tps = sum(step_tokens) / sum(step_seconds)
    extra = "".join(f" {k}={v}" for k, v in tags.items())
    return f"{name} steps={steps} seconds_per_step={sps:.4f} peak_rss_mb={rss:.0f} tokens_per_s={tps:.1f}{extra}"
