"""One frozen trunk for actor, reference and critic: the layers below the adapters, run once a step.

With LoRA on the top k of n decoder layers (model.lora_top_layers), layers 0 … L−1 (L = n − k) carry no adapter and
no gradient, and the actor, the reference (the actor with its adapter disabled) and a critic built on the same base
give the same hidden states there for the same tokens. So step 4 runs them once per sequence (batches.trunk_states:
per micro-batch, without grad, in the step's layout) and every later forward of the step — reference, old logprobs,
values, both updates — starts at layer L from their output:

    the trunk's output        trunk_prompt (B, Tq, H), trunk_response (B, Tr, H): fp32, in the step's batch (CPU)
    a forward from the trunk  the model's own forward, with `Replay` in layer slots 0 … L−1 (from_trunk)

`Replay` stands in for every trunk layer and returns the trunk's output, so layer L receives what the whole forward
would give it, and the model's own code still builds positions, rotary embeddings and masks from the same inputs: the
top layers see the full forward's positions. The critic (models.load_critic with trunk layers) holds `Replay` in those
slots for good, and no token embedding: only layers L … n−1, the final norm and its head.

Why swap modules for one call instead of copying the top layers into a second model: the actor must stay one
transformers model (generation, weight sync to vLLM, final/, FSDP2's one root that gathers embeddings and head), and
its top layers are the ones being trained. The swap is undone when the call returns, before any backward; gradient
checkpointing recomputes a top layer from its saved input, never through the swapped slots. The trunk's own pass
(trunk_only) runs layers 0 … L−1 by lowering the decoder's `config.num_hidden_layers` for one call (transformers'
decoders loop over `self.layers[: self.config.num_hidden_layers]`) and leaves the module tree alone: under FSDP2 the
first forward through a root registers the sharded layers it finds in the tree, and with vLLM sampling the actor's
first forward is this one.

Memory: the step's trunk output sits on the CPU, H·4 bytes per token of the batch (SmolLM2-135M: 2.3 KB a token; the
main job's 32 sequences of ~70 tokens: ~5 MB), one micro-batch of it on the device during a forward, and it goes with
the step's batch. Off when nothing is frozen (a full fine-tune, or LoRA on every layer: lora_top_layers=0 or ≥ n) and
with model.share_trunk=false.
"""
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Optional

import torch

@dataclass(frozen=True)
class Trunk:
    """Where the frozen trunk ends, and who starts from it (fixed for the run: plan_trunk)."""
    layers: int  # L: decoder layers 0 … L−1 are the trunk; a forward from the trunk starts at layer L
    n_layers: int  # the model's decoder layers
    critic: bool  # the critic holds only layers L … n−1, the final norm and the value head, and is fed the trunk


def plan_trunk(cfg, with_critic: bool, n_layers: Optional[int] = None) -> Optional[Trunk]:
    """The run's trunk, or None when nothing below the adapters is frozen or model.share_trunk is off.

    The actor (and so the reference, its adapter disabled) shares it when LoRA sits on its top model.lora_top_layers
    layers only (0 < lora_top_layers < n); the critic too when it is built on model.path (critic.model_path unset)
    with LoRA on the same layers (critic.lora_rank > 0): critic.lora_rank = 0 trains every layer, so it has no trunk.
    n_layers: the model's decoder layers (read from model.path's config when not given)."""
    m = cfg.model
    if not m.share_trunk or m.lora_rank == 0 or m.lora_top_layers == 0:
        return None
    if n_layers is None:
        from transformers import AutoConfig
        n_layers = AutoConfig.from_pretrained(m.path).get_text_config().num_hidden_layers
    if m.lora_top_layers >= n_layers:
        return None
    critic = with_critic and cfg.critic.model_path is None and cfg.critic.lora_rank > 0
    return Trunk(n_layers - m.lora_top_layers, n_layers, critic)


def describe_trunk(trunk: Optional[Trunk]) -> Optional[str]:
    """One line for the log when the trunk is shared: where it ends, who starts from it."""
    if trunk is None:
        return None
    L, n = trunk.layers, trunk.n_layers
    critic = (f"; the critic holds only layers {L}–{n - 1}, the final norm and its value head" if trunk.critic else
              "; the critic runs its own layers (critic.model_path set, or critic.lora_rank=0)")
    users = "actor, reference and critic" if trunk.critic else "actor and reference"
    return (f"trunk: decoder layers 0–{L - 1} of {n} run once per step, without grad, for {users}; their forwards "
            f"start at layer {L} (model.share_trunk){critic}")


# ---------------------------------------------------------------------------------------
# Forwards that start from the trunk, or stop at its top


class Replay(torch.nn.Module):
    """Stands in for each decoder layer of the trunk: returns the trunk's output, whatever it is given.

    Put in every slot 0 … L−1, so layer L receives `hidden` as the whole forward would give it. Without hidden
    (the critic's slots between forwards) it fails: that model holds no trunk and must be fed one."""

    def __init__(self, hidden: Optional[torch.Tensor] = None):
        super().__init__()
        self.hidden = hidden

    def forward(self, hidden_states, *args, **kwargs):
        if self.hidden is None:
            raise RuntimeError("this model holds no trunk layers: run it from the trunk's hidden states "
                               "(batches.Forward with a Trunk, after batches.trunk_pass)")
        if self.hidden.shape[:2] != hidden_states.shape[:2]:
            raise RuntimeError(f"the trunk's hidden states {tuple(self.hidden.shape)} do not fit these inputs "
                               f"{tuple(hidden_states.shape)}")
        return self.hidden


class NoEmbedding(torch.nn.Module):
    """The critic's token embedding when it shares the actor's trunk: its layers below L are `Replay`, so what this
    returns is only read for its shape and dtype (masks, rotary embeddings); zeros (B, T, H), and no weights."""

    def __init__(self, hidden_size: int):
        super().__init__()
        self.hidden_size = hidden_size

    def forward(self, input_ids):
        return torch.zeros(*input_ids.shape, self.hidden_size, device=input_ids.device)


def decoder_of(model):
    """The transformers module that runs the decoder layers (`.layers`, `.config`), inside any DDP / PEFT wrapper."""
    model = getattr(model, "module", model)  # DDP
    model = model.get_base_model() if hasattr(model, "get_base_model") else model  # PEFT
    return model.base_model  # transformers: the …Model under a …ForCausalLM / …ForTokenClassification


@contextmanager
def from_trunk(model, layers: int, hidden: Optional[torch.Tensor]):
    """Within: a call of `model` starts at decoder layer `layers` from `hidden` (the trunk's output for the call's
    tokens, (B, T, H)); the trunk's slots hold `Replay(hidden)`. layers = 0: the whole model, unchanged."""
    if layers == 0:
        yield
        return
    slots = decoder_of(model).layers
    kept, replay = list(slots[:layers]), Replay(hidden)
    for i in range(layers):
        slots[i] = replay
    try:
        yield
    finally:
        for i, layer in enumerate(kept):
            slots[i] = layer


@contextmanager
def trunk_only(model, layers: int):
    """Within: a call of `model` runs decoder layers 0 … layers−1 only; yields a list that receives the output of
    layer layers−1, (B, T, H), once per call. The final norm and head still run (ask for logits_to_keep=1)."""
    decoder = decoder_of(model)
    outputs, n = [], decoder.config.num_hidden_layers
    hook = decoder.layers[layers - 1].register_forward_hook(lambda module, args, out: outputs.append(
        out[0] if isinstance(out, tuple) else out))
    decoder.config.num_hidden_layers = layers
    try:
        yield outputs
    finally:
        decoder.config.num_hidden_layers = n
        hook.remove()
