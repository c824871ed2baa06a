"""Merge a LoRA adapter into its base model: one plain folder that transformers and `vllm serve` load.

    python merge_lora.py outputs/ppo/final outputs/ppo/merged
    vllm serve outputs/ppo/merged
"""
import argparse
import os
import shutil

import torch


def merge_lora(adapter_dir: str, output_dir: str) -> str:
    from peft import AutoPeftModelForCausalLM
    from transformers import AutoTokenizer

    if not os.path.exists(os.path.join(adapter_dir, "adapter_config.json")):
        raise SystemExit(f"merge_lora.py: {adapter_dir} has no adapter_config.json; is it a LoRA run's final/ folder?")
    model = AutoPeftModelForCausalLM.from_pretrained(adapter_dir, dtype=torch.float32).merge_and_unload()
    tmp = output_dir + ".tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    AutoTokenizer.from_pretrained(adapter_dir).save_pretrained(tmp)
    shutil.rmtree(output_dir, ignore_errors=True)
    os.replace(tmp, output_dir)
    return output_dir


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("adapter_dir", help="folder with adapter_model.safetensors + adapter_config.json")
    parser.add_argument("output_dir", help="where the merged model goes")
    args = parser.parse_args()
    print(merge_lora(args.adapter_dir, args.output_dir))
