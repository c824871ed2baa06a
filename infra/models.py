"""Every model the library builds, in one place: the actor (policy), the reference, the critic (value model) and the
reward model's classifier, loaded from HF folders in fp32 (the master weights; frozen linear layers in the compute
dtype: frozen_linears_in), with LoRA where asked and spread over the processes (infra/distributed.py); the
tokenizer; and saving a model as an HF folder.

    policy, ref, critic = load_models(cfg, accelerator, fsdp, fwd, with_critic=True)      # ppo.py

transformers and peft are imported inside the functions that use them: `--help` and a mistake in the config
then answer in about 2 s, without their 3 s import.

Nothing here runs code from a model folder or unpickles weights: every from_pretrained passes trust_remote_code
from the config (model.trust_remote_code, reward_model.trust_remote_code; false by default) and models load from
safetensors only. infra/checks.check_model_path refuses, in one sentence and before anything loads, a folder that
would need either, and a LoRA adapter given where a model is expected.
"""
import json
import os
import shutil
import tempfile

import torch

from infra.batches import autocast_dtype
from infra.checks import check_model_path, needs_reference
from infra.config import ConfigError, SaveError
from infra.layouts import use_varlen_attention
from infra.distributed import describe, distribute, write_error
from infra.trunk import describe_trunk, NoEmbedding, Replay


def policy_tokenizer(cfg_model):
    """The policy's tokenizer: model.tokenizer_path, else model.path's (load_tokenizer)."""
    key = "model.tokenizer_path" if cfg_model.tokenizer_path else "model.path"
    return load_tokenizer(cfg_model.tokenizer_path or cfg_model.path, key, trust_remote_code=cfg_model.trust_remote_code)


def load_tokenizer(path: str, key: str = "model.path", *, trust_remote_code: bool = False):
    """The tokenizer at `path` (a folder, or a hub id), with pad = EOS where it has no pad token. A hub id the hub
    does not give (no network, or no such model) fails in one sentence naming `key`."""
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
    except OSError as e:
        reason = str(e).splitlines()[0]
        raise ConfigError(f"{key}: {path} is not a local folder, and the hub did not give it ({reason}); give a model "
                          f"folder (the demo's: make prepare)") from None
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def load_policy(cfg_model, path: str = ""):
    """The actor: a causal LM in fp32 (master weights), with LoRA adapters when lora_rank > 0; from `path` (sft.py's
    and dpo.py's model_path), else cfg_model.path."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path or cfg_model.path, dtype=torch.float32, use_safetensors=True,
                                                 trust_remote_code=cfg_model.trust_remote_code)
    if cfg_model.gradient_checkpointing:
        use_gradient_checkpointing(model)
    if cfg_model.lora_rank > 0:
        model = add_lora(model, cfg_model.lora_rank, cfg_model.lora_alpha, cfg_model, "CAUSAL_LM")
        if cfg_model.gradient_checkpointing:
            model.enable_input_require_grads()
    return model


def add_lora(model, rank: int, alpha: int, cfg_model, task_type: str):
    """PEFT LoRA adapters of rank `rank` on model.target_modules of the top model.lora_top_layers decoder
    layers (every layer when 0). task_type TOKEN_CLS (a critic) also trains the new value head whole."""
    from peft import LoraConfig, get_peft_model

    n_layers, top = model.config.get_text_config().num_hidden_layers, cfg_model.lora_top_layers
    lora = LoraConfig(r=rank, lora_alpha=alpha, lora_dropout=cfg_model.lora_dropout, task_type=task_type,
                      target_modules=list(cfg_model.target_modules),
                      layers_to_transform=list(range(n_layers - top, n_layers)) if 0 < top < n_layers else None)
    return get_peft_model(model, lora)


def use_gradient_checkpointing(model) -> None:
    """Keep only each decoder layer's input in the forward pass and recompute the rest in the backward.
    transformers does so only while model.training: ppo.py switches models to train mode for updates."""
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})


def reference_dtype(device: torch.device, compute_dtype) -> torch.dtype:
    """The frozen reference's weights: the compute dtype (model.dtype) on a GPU, half the memory of fp32, as verl loads
    every model it does not train; fp32 on a CPU, where bf16 is slow and the tests compare fp32 runs. It only runs
    forwards, so the one difference is rounding: under bf16 its residual stream is bf16 too, while the policy's fp32
    master weights keep it fp32 under autocast, so kl/mean starts a little above 0."""
    return compute_dtype if device.type == "cuda" and compute_dtype is not None else torch.float32


def load_reference(path: str, dtype: torch.dtype = torch.float32, *, trust_remote_code: bool = False):
    """The frozen reference policy (eval mode, no gradients), in `dtype` (reference_dtype)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, use_safetensors=True,
                                                 trust_remote_code=trust_remote_code)
    return model.eval().requires_grad_(False)


def load_critic(path: str, trunk_layers: int = 0, *, trust_remote_code: bool = False) -> torch.nn.Module:
    """A token-level value model (fp32 weights) from a policy or reward-model folder: a causal-LM backbone with a
    scalar head on every token (`AutoModelForTokenClassification`, num_labels=1, as verl). From a policy the head
    starts random; from a reward model (reward_model.py's `AutoModelForSequenceClassification`, whose head is also
    called `score`) it starts as the reward model's head, so values begin on the scale of the scores.

    trunk_layers = L > 0: the critic shares the actor's frozen trunk (infra/trunk.py) and holds only decoder layers
    L … n−1, the final norm and the head (`without_trunk`); it is then run from the trunk's hidden states."""
    import transformers
    from transformers import AutoConfig, AutoModelForTokenClassification

    config = AutoConfig.from_pretrained(path, num_labels=1, trust_remote_code=trust_remote_code)
    config.classifier_dropout = 0.0  # dropout would make values differ between rollout and update
    model_class = without_trunk(config, trunk_layers) if trunk_layers else AutoModelForTokenClassification
    # From a policy, transformers reports lm_head as unused and the head as new: expected, so quiet.
    verbosity = transformers.logging.get_verbosity()
    transformers.logging.set_verbosity_error()
    model = model_class.from_pretrained(path, config=config, dtype=torch.float32, use_safetensors=True,
                                        trust_remote_code=trust_remote_code)
    transformers.logging.set_verbosity(verbosity)
    if model.config.pad_token_id is None:
        model.config.pad_token_id = model.config.eos_token_id
    return model


def without_trunk(config, layers: int):
    """The token-classification class of `config`'s model, holding no token embedding and no decoder layer below
    `layers` (the frozen trunk, infra/trunk.py): the slots hold `Replay` and `NoEmbedding`, without weights.

    The slots are emptied in __init__, which from_pretrained runs on the meta device before it allocates and loads
    anything: so the trunk's weights (of a 30-layer SmolLM2 with 8 top layers, 4/5 of the model) are never in memory
    twice, even while loading. What remains keeps the whole critic's names (model.layers.22.…), so a checkpoint is
    the same with or without sharing, and its new head draws the same random numbers as the whole critic's."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_TOKEN_CLASSIFICATION_MAPPING

    if type(config) not in MODEL_FOR_TOKEN_CLASSIFICATION_MAPPING:
        raise ConfigError(f"model.share_trunk: transformers has no token classifier for {type(config).__name__}, so "
                          f"the critic cannot be built on the actor's trunk; set model.share_trunk=false")
    whole = MODEL_FOR_TOKEN_CLASSIFICATION_MAPPING[type(config)]

    class TopLayers(whole):
        def __init__(self, config, *args, **kwargs):
            super().__init__(config, *args, **kwargs)
            replay, slots = Replay(), self.base_model.layers
            for i in range(layers):
                slots[i] = replay
            self.set_input_embeddings(NoEmbedding(config.get_text_config().hidden_size))

    TopLayers.__name__ = TopLayers.__qualname__ = f"{whole.__name__}AboveLayer{layers}"
    return TopLayers


def load_reward_classifier(path: str, pad_id: int, lora=None, *, trust_remote_code: bool = False):
    """A 1-output sequence classifier (from a backbone: a fresh `score` head) in fp32, the master weights; with
    `lora` (the reward_model config, lora_rank > 0), LoRA adapters, the `score` head trained in full.
    reward_model.RewardModel reads it at the last real token."""
    from transformers import AutoModelForSequenceClassification

    model = AutoModelForSequenceClassification.from_pretrained(path, num_labels=1, pad_token_id=pad_id,
                                                               dtype=torch.float32, use_safetensors=True,
                                                               trust_remote_code=trust_remote_code)
    if lora is not None and lora.lora_rank > 0:
        model = add_lora(model, lora.lora_rank, lora.lora_alpha, lora, "SEQ_CLS")  # SEQ_CLS: `score` saved too
    return model


def frozen_linears_in(model, dtype) -> None:
    """Hold `model`'s frozen linear layers (LoRA's base, a reference's) in the compute dtype `dtype`, not fp32.

    Under autocast a linear layer casts its fp32 weight to `dtype` at every call: for a frozen one that cast is pure
    waste (a third of an update's forward on a 2-core CPU, measured) and the fp32 copy a second base in memory. Held
    in `dtype` the layer computes the very same products. A weight tied to the token embedding stays fp32 (the
    embedding's output is not cast, so the residual stream keeps its dtype), as do norms and every trained weight.
    dtype None (fp32 compute): nothing changes."""
    if dtype is None:
        return
    tied = getattr(model.get_input_embeddings(), "weight", None)
    for module in model.modules():
        if isinstance(module, torch.nn.Linear) and not module.weight.requires_grad and module.weight is not tied:
            module.to(dtype)


def load_models(cfg, accelerator, fsdp, fwd, with_critic: bool):
    """ppo.py's models: the actor, the frozen reference (None where none is needed: needs_reference, or with LoRA: the
    actor with its adapter disabled is the reference) and the critic (None unless with_critic), each sharded under FSDP2, else
    replicated (distributed.distribute). fwd: the run's batches.Forward — its layout, and its trunk (the critic
    then holds only the layers above it: load_critic)."""
    compute = autocast_dtype(cfg.model.dtype) if fsdp is None else None  # FSDP2 gathers in its own param_dtype
    policy = load_policy(cfg.model)
    frozen_linears_in(policy, compute)
    policy = distribute(policy, accelerator, fsdp, trainable=True)
    ref = critic = None
    if needs_reference(cfg) and cfg.model.lora_rank == 0:
        dtype = reference_dtype(accelerator.device, autocast_dtype(cfg.model.dtype))
        ref = load_reference(cfg.model.path, dtype, trust_remote_code=cfg.model.trust_remote_code)
        frozen_linears_in(ref, compute)
        ref = distribute(ref, accelerator, fsdp, trainable=False)
    if with_critic:
        critic = load_critic(cfg.critic.model_path or cfg.model.path,
                             fwd.trunk.layers if fwd.trunk and fwd.trunk.critic else 0,
                             trust_remote_code=cfg.model.trust_remote_code)
        if cfg.critic.lora_rank > 0:
            critic = add_lora(critic, cfg.critic.lora_rank, cfg.critic.lora_alpha, cfg.model, "TOKEN_CLS")
        if cfg.model.gradient_checkpointing:
            use_gradient_checkpointing(critic)
        frozen_linears_in(critic, compute)
        critic = distribute(critic, accelerator, fsdp, trainable=True)
    named = [(name, m) for name, m in (("policy", policy), ("critic", critic), ("reference", ref)) if m is not None]
    accelerator.print(describe(fsdp, accelerator, [name for name, _ in named]))
    if fwd.trunk is not None:
        accelerator.print(describe_trunk(fwd.trunk))
    if fwd.layout == "packed":  # attention within each prompt / prompt+response group of the packed row
        for _, model in named:
            use_varlen_attention(accelerator.unwrap_model(model))
    return policy, ref, critic


def check_teacher(cfg_teacher, cfg_model) -> None:
    """Before any model loads: algorithm.teacher.path holds a model and a tokenizer whose vocabulary is the policy's,
    and a config.json vocab_size no smaller than the policy's (the teacher's log-probabilities are read at the
    policy's token ids); mode=loss has an estimator with a gradient (not k1, as TeacherConfig.kl_estimator says)."""
    if not cfg_teacher.path:
        return
    if cfg_teacher.mode == "loss" and cfg_teacher.kl_estimator == "k1":
        raise ConfigError("algorithm.teacher.mode=loss with algorithm.teacher.kl_estimator=k1: k1's gradient is zero "
                          "in expectation, so the loss would not pull the policy towards the teacher; set "
                          "algorithm.teacher.kl_estimator=k3 (or mode=reward, where k1 is the usual choice)")
    trust = cfg_model.trust_remote_code
    check_model_path(cfg_teacher.path, "algorithm.teacher.path", trust_remote_code=trust)
    check_model_path(cfg_teacher.path, "algorithm.teacher.path", need="tokenizer", trust_remote_code=trust)
    theirs = load_tokenizer(cfg_teacher.path, "algorithm.teacher.path", trust_remote_code=trust).get_vocab()
    ours = policy_tokenizer(cfg_model).get_vocab()
    if theirs != ours:
        differ = sorted(set(theirs.items()) ^ set(ours.items()), key=str)[:3]
        raise ConfigError(f"algorithm.teacher.path={cfg_teacher.path}: its tokenizer's vocabulary is not the "
                          f"policy's ({len(theirs)} tokens against {len(ours)}; (token, id) pairs in one only: "
                          f"{differ}), so its log-probabilities would be of other tokens; distil from a teacher with "
                          f"the policy's tokenizer")
    theirs, ours = vocab_size(cfg_teacher.path), vocab_size(cfg_model.path)
    if theirs is not None and ours is not None and theirs < ours:
        raise ConfigError(f"algorithm.teacher.path={cfg_teacher.path}: its config.json's vocab_size {theirs} is "
                          f"smaller than the policy's {ours}, so the policy can sample token ids the teacher has no "
                          f"log-probability for; distil from a teacher with at least the policy's vocab_size")


def vocab_size(path: str):
    """config.json's vocab_size of the model folder `path` (its text config's for a multimodal one), or None."""
    try:
        with open(os.path.join(path, "config.json")) as f:
            config = json.load(f)
    except (OSError, ValueError):
        return None
    found = config.get("vocab_size", (config.get("text_config") or {}).get("vocab_size"))
    return found if isinstance(found, int) else None


def load_teacher(cfg, accelerator, fsdp, fwd):
    """On-policy distillation's frozen teacher (algorithm.teacher.path), loaded and placed as the reference is; None
    without one. It never runs from the policy's trunk (ppo.teacher_logprobs): its layers are its own."""
    if not cfg.algorithm.teacher.path:
        return None
    compute = autocast_dtype(cfg.model.dtype) if fsdp is None else None
    dtype = reference_dtype(accelerator.device, autocast_dtype(cfg.model.dtype))
    teacher = load_reference(cfg.algorithm.teacher.path, dtype, trust_remote_code=cfg.model.trust_remote_code)
    frozen_linears_in(teacher, compute)
    teacher = distribute(teacher, accelerator, fsdp, trainable=False)
    if fwd.layout == "packed":
        use_varlen_attention(accelerator.unwrap_model(teacher))
    accelerator.print(f"teacher: {cfg.algorithm.teacher.path} (algorithm.teacher.mode={cfg.algorithm.teacher.mode})")
    return teacher


def check_output_folder(path: str, overwrite: bool, inputs: tuple = ()) -> None:
    """Before an export writes the folder `path`: one that exists and holds anything is refused unless `overwrite`
    (the user said to replace it), and one that is, or holds, a folder of `inputs` (what the export reads: a base
    model, an adapter) is refused always. Nothing a tool did not write is deleted by surprise."""
    target = os.path.realpath(path)
    for given in inputs:
        source = os.path.realpath(given)
        if source == target or source.startswith(target + os.sep):
            what = "is the input" if source == target else "holds the input"
            raise ConfigError(f"the output folder {path} {what} {given}, which writing it would delete; choose "
                              f"another output folder")
    if os.path.exists(path) and not os.path.isdir(path):
        raise ConfigError(f"the output folder {path} is a file; choose another output folder")
    entries = sorted(os.listdir(path)) if os.path.isdir(path) else []
    if entries and not overwrite:
        count = f"{len(entries)} {'entry' if len(entries) == 1 else 'entries'}"
        raise ConfigError(f"the output folder {path} exists and is not empty ({count}, e.g. {entries[0]}); choose a "
                          f"new or empty folder, or pass --overwrite to replace it")


def save_pretrained_atomic(model, tokenizer, path: str, state_dict=None, *, overwrite: bool, inputs: tuple = ()):
    """The model in HF format (a LoRA model writes adapter_model.safetensors + adapter_config.json), written to a
    temporary sibling folder and renamed to `path`: a reader never sees half a model, and a failed write leaves
    `path` as it was. check_output_folder(path, overwrite, inputs) first.

    `state_dict`: the full weights when the model is sharded (accelerator.get_state_dict)."""
    check_output_folder(path, overwrite, inputs)
    for adapter in getattr(model, "peft_config", {}).values():  # a local base as an absolute path: the adapter
        if os.path.isdir(adapter.base_model_name_or_path or ""):  # then loads from any directory
            adapter.base_model_name_or_path = os.path.abspath(adapter.base_model_name_or_path)
    parent, name = os.path.split(os.path.abspath(path))
    try:
        os.makedirs(parent, exist_ok=True)
        tmp = tempfile.mkdtemp(prefix=f".{name}.", suffix=".tmp", dir=parent)
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o777 & ~umask)  # mkdtemp's 0700 would hide the model from other users (a serving account)
    except OSError as e:
        raise SaveError(f"cannot write {path} ({e.strerror}); nothing was written") from None
    from safetensors import SafetensorError

    try:
        model.save_pretrained(tmp, state_dict=state_dict)
        tokenizer.save_pretrained(tmp)
        replace_folder(tmp, path)
    except (OSError, SafetensorError) as e:  # safetensors' writer reports a full disk as a SafetensorError
        shutil.rmtree(tmp, ignore_errors=True)
        raise SaveError(f"cannot write {path} ({write_error(e)}); it is as it was before (the model went to a "
                        f"temporary folder, now removed): free space or fix the permissions, then run the same "
                        f"command again") from None
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def replace_folder(new: str, path: str) -> None:
    """Rename the folder `new` to `path`; a folder already at `path` is moved aside first and deleted only after."""
    if not os.path.isdir(path):
        os.replace(new, path)
        return
    old = tempfile.mkdtemp(prefix=f".{os.path.basename(path)}.", suffix=".old", dir=os.path.dirname(new))
    os.replace(path, old)  # (over the empty folder mkdtemp made)
    os.replace(new, path)
    shutil.rmtree(old, ignore_errors=True)
