"""Export a checkpoint of ppo.py — any step_<N>/ or best/ — as an HF folder, in one command: the adapter for a LoRA
run (as final/ is), the whole model for a full fine-tune, or with --merge the adapter merged into its base (in the
base's dtype, as tools/merge_lora.py does).

    python tools/export.py outputs/ppo/step_30 outputs/ppo/step_30_hf
    python tools/export.py outputs/ppo/best outputs/ppo/best_merged --merge
    python tools/export.py outputs/ppo/best outputs/ppo/best_hf --overwrite     # replace what is there

How the policy was built (model.path, the LoRA fields) comes from the run's config.yaml beside the checkpoint; its
trained weights from the checkpoint's tensors/ (written on any process count). A relative model.path is looked up
from the current directory, then from the checkpoint's parent folders (ppo.py runs from the repository root). An
output folder that exists and is not empty is refused unless --overwrite; the folder is written under a temporary
name and renamed. It may not lie in a checkpoint, best/, final/ or abandoned/ of a run (which the run replaces or
prunes later). The checkpoint is checked as resume checks it, before anything loads: every file against its
manifest, and the base model against the fingerprint the manifest recorded.
"""
import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repository root, for infra/

import torch

from infra import cli
from infra.config import ConfigError
from infra.distributed import load_training_state
from infra.manifests import changed_base, check_outside_runs, checkpoint_problem, fingerprint
from infra.models import load_policy, load_tokenizer, save_pretrained_atomic


def find_folder(path: str, checkpoint: str) -> str:
    """`path` from the current directory, else from one of the checkpoint's parent folders, else as given (a hub
    id)."""
    folder, roots = os.path.abspath(checkpoint), [os.getcwd()]
    while os.path.dirname(folder) != folder:
        folder = os.path.dirname(folder)
        roots.append(folder)
    return next((os.path.join(root, path) for root in roots if os.path.isdir(os.path.join(root, path))), path)


def export(checkpoint: str, output_dir: str, merge: bool = False, overwrite: bool = False) -> str:
    """The policy of `checkpoint` (step_<N>/ or best/ of a ppo.py run) saved as an HF folder in output_dir."""
    if not all(os.path.exists(os.path.join(checkpoint, name)) for name in ("state.json", "tensors")):
        raise ConfigError(f"{checkpoint} is not a checkpoint (a step_<N>/ or best/ folder of a ppo.py run, with "
                          f"state.json and tensors/); final/ needs no export, it is an HF folder already")
    check_outside_runs(output_dir)
    problem = checkpoint_problem(checkpoint)
    if problem:
        raise ConfigError(f"the checkpoint {checkpoint} is damaged: {problem}; export another checkpoint")
    saved_config = os.path.join(os.path.dirname(os.path.abspath(checkpoint)), "config.yaml")
    if not os.path.isfile(saved_config):
        raise ConfigError(f"{saved_config} is missing: the run's config.yaml says how its policy was built; copy it "
                          f"beside the checkpoint folder")
    cfg = cli.load_config(saved_config)
    cfg.model.path = find_folder(cfg.model.path, checkpoint)
    changed = changed_base(checkpoint, {"model.path": {"path": cfg.model.path,
                                                       "fingerprint": fingerprint(cfg.model.path)}})
    if changed:
        raise ConfigError(f"{changed}, so its adapter or weights would be put on other weights; put that model back "
                          f"at {cfg.model.path}")
    cfg.model.gradient_checkpointing = False  # a training setting; nothing here trains
    tokenizer_path = find_folder(cfg.model.tokenizer_path or cfg.model.path, checkpoint)
    if merge and not cfg.model.lora_rank:
        raise ConfigError("--merge merges a LoRA adapter, and this run trained every weight (model.lora_rank=0); "
                          "export it without --merge")
    policy = load_policy(cfg.model)  # the base in fp32, with fresh adapters when the run had LoRA
    load_training_state(checkpoint, {"policy": (policy, None)})  # its trained weights: the adapters, or all
    if merge:
        from transformers import AutoConfig

        stored = AutoConfig.from_pretrained(cfg.model.path)
        dtype = getattr(stored, "dtype", None) or getattr(stored, "torch_dtype", None) or torch.float32
        policy = policy.merge_and_unload().to(getattr(torch, dtype) if isinstance(dtype, str) else dtype)
    save_pretrained_atomic(policy, load_tokenizer(tokenizer_path), output_dir, overwrite=overwrite,
                           inputs=(cfg.model.path, checkpoint))  # never the base or the checkpoint itself
    return output_dir


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("checkpoint", help="a step_<N>/ or best/ folder written by ppo.py")
    parser.add_argument("output_dir", help="where the HF folder goes")
    parser.add_argument("--merge", action="store_true", help="merge a LoRA adapter into its base (one plain folder)")
    parser.add_argument("--overwrite", action="store_true", help="replace output_dir when it is not empty")
    args = parser.parse_args()
    try:
        print(export(args.checkpoint, args.output_dir, args.merge, args.overwrite))
    except ConfigError as e:
        sys.exit(f"tools/export.py: {e}")
