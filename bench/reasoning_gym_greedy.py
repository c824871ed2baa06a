"""The demo model's greedy score on reasoning-gym tasks, to find one it can learn (issue 33: base score between ~0.1
and ~0.6): each task's rows as tools/prepare_data.py writes them, greedy answers from vLLM, the rule reasoning_gym/*.

    OMP_NUM_THREADS=2 flock /tmp/heavy.lock python bench/reasoning_gym_greedy.py --n 100 --max-tokens 32 \\
        'leg_counting:{"max_animals": 2}' 'basic_arithmetic:{"max_terms": 2, "max_digits": 1}'

Each task is `name` or `name:{json of its keyword arguments}`; prints per task the mean score, the share of answers
in <answer> tags, and one prompt's answer.
"""
import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repository root

from data import render_prompt, tokenize_prompts  # noqa: E402
from agents.reasoning_gym import make_reasoning_gym  # noqa: E402
from rewards import default_compute_score  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("tasks", nargs="+", help="name or name:{json config}")
    parser.add_argument("--model", default="models/SmolLM2-135M-Instruct")
    parser.add_argument("--n", type=int, default=100, help="prompts per task")
    parser.add_argument("--seed", type=int, default=1000, help="reasoning-gym's seed (not the demo data's 0)")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--system-prompt", default="direct")
    parser.add_argument("--shots", type=int, default=1)
    args = parser.parse_args()
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(model=args.model, dtype="bfloat16", seed=0, enforce_eager=True, max_model_len=1024,
              max_num_seqs=128, kv_cache_memory_bytes=2**30)
    tokenizer = llm.get_tokenizer()
    greedy = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)
    for spec in args.tasks:
        name, _, config = spec.partition(":")
        rows = make_reasoning_gym(name, args.n, args.seed, json.loads(config or "{}"), args.system_prompt,
                                  args.shots)
        ids = tokenize_prompts([render_prompt(r["prompt"], tokenizer) for r in rows], tokenizer)
        outputs = llm.generate([TokensPrompt(prompt_token_ids=x) for x in ids], greedy, use_tqdm=False)
        texts = [o.outputs[0].text for o in outputs]
        scored = [default_compute_score(r["data_source"], t, r["ground_truth"]) for r, t in zip(rows, texts)]
        mean = sum(s["score"] for s in scored) / len(rows)
        tagged = sum("<answer>" in t and "</answer>" in t for t in texts) / len(rows)
        print(f"{spec}\tscore {mean:.3f}\ttagged {tagged:.2f}\tprompt tokens ≤ {max(map(len, ids))}\t"
              f"e.g. {json.loads(rows[0]['ground_truth'])['entry']['answer']!r} ← {texts[0][:60]!r}", flush=True)


if __name__ == "__main__":
    main()
