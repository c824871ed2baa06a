"""The device a run computes on, how models are spread over processes, and how a run's training state is saved and
restored.

    accelerator = make_accelerator()      # ppo.py, reward_model.py: GPUs torch cannot use stop the run

    accelerate launch ppo.py ...                                          1 process
    accelerate launch --num_processes 2 ppo.py ...                        DDP: a replica per process
    accelerate launch --config_file accelerate_configs/fsdp2.yaml ...     FSDP2: every model sharded

FSDP2 is torch's own `fully_shard`, called here for every model (actor, critic, reference), the same way on
CPU (gloo) and GPUs (nccl). Accelerate 1.15 only launches the processes: its FSDP2 `prepare` takes one model
per call and refuses a model without an optimiser, and on a CPU it never selects FSDP at all. So the launcher's
FSDP_* variables (written from the yaml) are read here, as verl and TRL shard optimiser-less models directly.

Checkpoints hold tensors in safetensors files (one per process, read back on any process count) and
everything else as JSON: nothing in a checkpoint is unpickled, so a planted file cannot run code.
"""
import json
import os
import random
import re
import subprocess
from dataclasses import dataclass
from typing import Optional

import torch
from accelerate.utils import extract_model_from_parallel as unwrap_model
import torch.distributed.checkpoint as dcp
from safetensors import SafetensorError
from torch.distributed.checkpoint import HuggingFaceStorageReader, HuggingFaceStorageWriter
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import (get_model_state_dict, get_optimizer_state_dict, set_model_state_dict,
                                                     set_optimizer_state_dict, StateDictOptions)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard, MixedPrecisionPolicy
from torch.distributed.tensor import DTensor

from infra.config import ConfigError


# ---------------------------------------------------------------------------------------
# The device, and what every process must agree on


def visible_gpus() -> list[str]:
    """The GPUs nvidia-smi lists ("GPU 0: NVIDIA H200 (UUID: …)"), none where CUDA_VISIBLE_DEVICES hides them all."""
    if os.environ.get("CUDA_VISIBLE_DEVICES", "0").strip() in ("", "-1"):
        return []
    try:
        listing = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=60).stdout
    except (OSError, subprocess.TimeoutExpired):
        return []
    return [line for line in listing.splitlines() if line.startswith("GPU ")]


def use_cpu() -> bool:
    """Does this run compute on the CPU? Yes without a GPU; where torch can use CUDA, only when asked (`accelerate
    launch --cpu`). GPUs that nvidia-smi lists but torch cannot use (a CPU build of torch, or a driver older than its
    CUDA) stop the run here, in one sentence, rather than training every process on the CPU over gloo without a word;
    hiding them (CUDA_VISIBLE_DEVICES="") is how to ask for the CPU on purpose."""
    if os.environ.get("ACCELERATE_USE_CPU", "false").lower() in ("1", "true", "yes"):
        return True
    if torch.cuda.is_available():
        return False
    if gpus := visible_gpus():
        why = ("it is a CPU build" if torch.version.cuda is None else
               f"it is built for CUDA {torch.version.cuda}, which needs a newer driver or access to /dev/nvidia*")
        raise ConfigError(f"nvidia-smi lists {len(gpus)} GPU(s) but torch {torch.__version__} cannot use them ({why}): "
                          f"install the CUDA build on this machine (make install DEVICE=cuda), or hide the GPUs to run "
                          f"on the CPU on purpose (CUDA_VISIBLE_DEVICES= accelerate launch …)")
    return True  # no GPU here


def process_group_backend(cuda: bool) -> str:
    """The process group's backends: on GPUs NCCL for device tensors and gloo for host ones. Under FSDP2's CPU offload
    the gradients are host DTensors, and clip_grad_norm's full_tensor() all-reduces them: over NCCL alone, "No backend
    type associated with device type cpu" at the first optimiser step (pytorch#148532; torchtune creates its group
    the same way). On a CPU, gloo."""
    return "cpu:gloo,cuda:nccl" if cuda else "cpu:gloo"


def make_accelerator():
    """accelerate's Accelerator on the device use_cpu() picks. Launched on GPUs, the process group is created here
    first, with process_group_backend's two backends, and Accelerator joins it (accelerate 1.15 adds gloo itself only
    when the launcher's FSDP_* variables ask for offload, not for a config that sets it otherwise). On a CPU
    accelerate joins the launched processes over gloo itself."""
    from accelerate import Accelerator

    cpu = use_cpu()
    if not cpu and "LOCAL_RANK" in os.environ and not torch.distributed.is_initialized():
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
        torch.distributed.init_process_group(process_group_backend(cuda=True))
    return Accelerator(cpu=cpu)


def max_over_processes(count: int) -> int:
    """The largest `count` of all processes (a collective: every process calls it); `count` itself on one."""
    if not torch.distributed.is_initialized() or torch.distributed.get_world_size() == 1:
        return count
    nccl = "nccl" in torch.distributed.get_backend()  # NCCL reduces device tensors only
    t = torch.tensor([count], device=torch.device("cuda", torch.cuda.current_device()) if nccl else "cpu")
    torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MAX)
    return int(t.item())


def whole(t: torch.Tensor) -> torch.Tensor:
    """A tensor whole: an FSDP2 shard (a DTensor) all-gathered, a collective that every process calls in the same
    order. Under CPU offload the shards live in host memory, and NCCL gathers device tensors: they move first."""
    if not isinstance(t, DTensor):
        return t
    if t.device.type != t.device_mesh.device_type:
        t = t.to(t.device_mesh.device_type)
    return t.full_tensor()


@dataclass
class FSDP:
    """The FSDP2 settings of an accelerate config file (the launcher passes them as FSDP_* variables)."""
    reshard_after_forward: bool  # free each gathered layer after its forward (ZeRO-3) or keep it (ZeRO-2)
    offload_params: bool  # sharded parameters, gradients and optimiser state live in host memory
    param_dtype: Optional[torch.dtype]  # bf16: gathers and compute in bf16, fp32 master weights and reduction


def fsdp_from_launcher(compute_dtype: Optional[torch.dtype] = None) -> Optional[FSDP]:
    """FSDP settings when launched with an FSDP config (ACCELERATE_USE_FSDP=true), else None.
    The compute dtype is the library's one key for it (model.dtype), not accelerate's mixed_precision."""
    env = os.environ.get
    if env("ACCELERATE_USE_FSDP", "false").lower() != "true":
        return None
    if env("FSDP_VERSION", "1") != "2":
        raise ConfigError("the accelerate config asks for FSDP version 1; this library shards with FSDP2: set "
                          "fsdp_version: 2 (see accelerate_configs/fsdp2.yaml)")
    if env("ACCELERATE_MIXED_PRECISION", "no") != "no":
        raise ConfigError(f"mixed_precision: {env('ACCELERATE_MIXED_PRECISION')} in the accelerate config: set it "
                          "to 'no' and choose the compute dtype with model.dtype (bf16, fp32, or auto)")
    if env("FSDP_CPU_RAM_EFFICIENT_LOADING", "false").lower() == "true":  # accelerate's default when the key is absent
        raise ConfigError("fsdp_cpu_ram_efficient_loading must be false in the accelerate config: every process "
                          "loads the weights itself (with true, transformers leaves a new value head at 0 on all "
                          "processes but the first)")
    if env("FSDP_ACTIVATION_CHECKPOINTING", "false").lower() == "true":
        raise ConfigError("fsdp_activation_checkpointing: true in the accelerate config: remove it and set "
                          "model.gradient_checkpointing=true (one key, for actor and critic)")
    return FSDP(reshard_after_forward=env("FSDP_RESHARD_AFTER_FORWARD", "true").lower() == "true",
                offload_params=env("FSDP_OFFLOAD_PARAMS", "false").lower() == "true", param_dtype=compute_dtype)


def shard(model, fsdp: FSDP, device):
    """fully_shard each decoder layer (the model's `_no_split_modules`), then the whole model, in place."""

    # decoder-layer classes: the config's fsdp_transformer_layer_cls_to_wrap, else transformers' _no_split_modules
    named = os.environ.get("FSDP_TRANSFORMER_CLS_TO_WRAP")
    layer_classes = set(named.split(",")) if named else {
        name for m in model.modules() for name in getattr(m, "_no_split_modules", None) or []}
    kwargs = dict(mesh=init_device_mesh(device.type, (torch.distributed.get_world_size(),)),
                  reshard_after_forward=fsdp.reshard_after_forward)
    if fsdp.param_dtype is not None:
        kwargs["mp_policy"] = MixedPrecisionPolicy(param_dtype=fsdp.param_dtype, reduce_dtype=torch.float32)
    if fsdp.offload_params:
        kwargs["offload_policy"] = CPUOffloadPolicy(pin_memory=device.type == "cuda")
    else:
        model.to(device)
    for module in model.modules():
        if type(module).__name__ in layer_classes:
            fully_shard(module, **kwargs)
    # The root is the transformers model, inside a PEFT wrapper if any: PEFT's generate() and disable_adapter()
    # call it directly, and only a call to the root gathers the weights outside the layers (embeddings, head).
    fully_shard(model.get_base_model() if hasattr(model, "get_base_model") else model, **kwargs)
    return model


def distribute(model, accelerator, fsdp: Optional[FSDP], trainable: bool):
    """FSDP2 shards the model; DDP wraps a trainable one; otherwise it is one copy on this device."""
    if fsdp is not None:
        return shard(model, fsdp, accelerator.device)
    if trainable and accelerator.num_processes > 1:
        return accelerator.prepare_model(model)
    return model.to(accelerator.device)


def describe(fsdp: Optional[FSDP], accelerator, names: list) -> str:
    """One line for the log: the strategy, the process count, and what became of the models `names`."""
    world = accelerator.num_processes
    backend = torch.distributed.get_backend() if torch.distributed.is_initialized() else "none"
    if fsdp is not None:
        return (f"parallel: fsdp2 over {world} processes ({backend}); sharded: {', '.join(names)} "
                f"(reshard_after_forward={fsdp.reshard_after_forward}, offload_params={fsdp.offload_params}, "
                f"param_dtype={fsdp.param_dtype or torch.float32}); a reward model is replicated")
    if world > 1:
        return f"parallel: ddp over {world} processes ({backend}); replicated: {', '.join(names)}"
    return f"parallel: 1 process; {', '.join(names)} whole"


def write_error(e: BaseException) -> str:
    """Why a write failed, in a few words: the OS's reason (No space left on device, Permission denied …), also
    from inside safetensors' error ("… I/O error: No space left on device (os error 28)") or torch's checkpoint
    writer (a CheckpointException holding each process's error)."""
    failures = getattr(e, "failures", None)  # torch.distributed.checkpoint.api.CheckpointException
    if failures:
        e = next(iter(failures.values()))[0]
    if isinstance(e, OSError) and e.strerror:
        return e.strerror
    found = re.search(r"I/O error: ([^(]+)", str(e))
    return found.group(1).strip() if found else str(e)[:200]


def full_state_dict(model) -> dict:
    """Every weight whole, on the CPU (a collective under FSDP2: every process calls it); a weight the model holds
    under several names (a head tied to the token embedding, as SmolLM2's) one tensor under each again: gathering
    copies it per name, and save_pretrained saves a tied weight once only where its names share one tensor."""
    state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    first = {}  # id of a parameter → the first name it has
    for name, param in unwrap_model(model).named_parameters(remove_duplicate=False):
        if name in state:
            state[name] = state[first.setdefault(id(param), name)]
    return state


# ---------------------------------------------------------------------------------------
# Checkpoints: tensors/ (safetensors, one file per process), state.json, rng_<rank>.json


def _tensors(models: dict) -> dict:
    """{name: (model, optimizer or None)} → one flat dict of every tensor to save: trainable weights, and the
    optimiser's state under `<name>.optim.`. Non-tensor optimiser entries (lr, betas …) come from the config."""

    def where(t):  # a tensor's memory: tied weights share it
        local = t.to_local() if isinstance(t, DTensor) else t
        return (local.untyped_storage().data_ptr(), local.storage_offset(), tuple(local.shape)) if local.numel() else id(t)

    options = StateDictOptions(ignore_frozen_params=True, flatten_optimizer_state_dict=True)
    out = {}
    for name, (model, optimizer) in models.items():
        tensors = {f"{name}.{k}": v for k, v in get_model_state_dict(model, options=options).items()}
        if optimizer is not None:
            state = get_optimizer_state_dict(model, optimizer, options=options)
            tensors.update({f"{name}.optim.{k}": v for k, v in state.items() if isinstance(v, torch.Tensor)})
        # A tied weight (Qwen2.5's and SmolLM2's lm_head is their embed_tokens) comes under two names, the second one
        # unfiltered by ignore_frozen_params: safetensors refuses one storage twice (a full fine-tune's first save
        # failed), and a LoRA run saved its frozen embedding (bench/save_time.py). Loading fills both.
        seen = {where(p) for p in model.parameters() if not p.requires_grad}
        for key, value in tensors.items():
            if where(value) not in seen:
                out[key] = value
                seen.add(where(value))
    return out


def rng_state() -> dict:
    """This process's generators: Python's, torch's CPU one and, on a GPU, that of its own device only. Each process
    drives one device; saving every visible device's (get_rng_state_all) made a resume that sees fewer GPUs fail
    restoring the ones it lacks."""
    state = {"python": random.getstate(), "torch": torch.get_rng_state().tolist()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state().tolist()  # the current device's
    return state


def set_rng_state(state: dict) -> None:
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    torch.set_rng_state(torch.tensor(state["torch"], dtype=torch.uint8))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(torch.tensor(state["cuda"], dtype=torch.uint8))  # into the current device


def save_training_state(path: str, models: dict, state: dict) -> None:
    """Write models' trainable weights and optimiser states (every process its shard), `state` (rank 0,
    plain data) and each process's RNG state into the folder `path`."""

    rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
    dcp.save(_tensors(models), storage_writer=HuggingFaceStorageWriter(os.path.join(path, "tensors"),
                                                                       save_distributed=True))
    with open(os.path.join(path, f"rng_{rank}.json"), "w") as f:
        json.dump(rng_state(), f)
    if rank == 0:
        with open(os.path.join(path, "state.json"), "w") as f:
            json.dump(state, f, indent=1)


def check_tensor_files(path: str) -> None:
    """Each safetensors file of the checkpoint `path` opens (its header is whole and covers the file), or a
    ConfigError naming it: torch's reader would log a traceback and raise `AssertionError: metadata is None`.
    (runs.checkpoint_problem checks the sizes and checksums first; this also covers checkpoints without them.)"""
    from safetensors import safe_open

    folder = os.path.join(path, "tensors")
    for name in sorted(os.listdir(folder)) if os.path.isdir(folder) else []:
        if name.endswith(".safetensors"):
            try:
                with safe_open(os.path.join(folder, name), framework="pt"):
                    pass
            except (SafetensorError, OSError) as e:
                raise ConfigError(f"the checkpoint {path} cannot be read: {folder}/{name} is damaged ({e}); resume "
                                  f"from an earlier checkpoint, or start over with resume=off") from None


def load_training_state(path: str, models: dict) -> dict:
    """Restore what `save_training_state` wrote, on this run's process count; returns the plain-data state."""

    tensors = _tensors(models)  # the layout to fill, sharded as this run's models are
    check_tensor_files(path)
    try:
        dcp.load(tensors, storage_reader=HuggingFaceStorageReader(os.path.join(path, "tensors")))
    except (AssertionError, CheckpointException, OSError, SafetensorError) as e:  # torch's reader asserts on damage
        if isinstance(e, CheckpointException):  # it wraps each process's error
            e = next(iter(e.failures.values()))[0]
        raise ConfigError(f"the checkpoint {path} cannot be read ({type(e).__name__}: {' '.join(str(e).split())[:200]}"
                          f"): a file in {path}/tensors is damaged or missing; resume from an earlier checkpoint, or "
                          f"start over with resume=off") from None
    options = StateDictOptions(ignore_frozen_params=True, flatten_optimizer_state_dict=True, strict=False)
    for name, (model, optimizer) in models.items():
        mine = {k[len(name) + 1:]: v for k, v in tensors.items() if k.startswith(name + ".")}
        set_model_state_dict(model, {k: v for k, v in mine.items() if not k.startswith("optim.")}, options=options)
        if optimizer is not None:
            state = get_optimizer_state_dict(model, optimizer, options=options)  # param_groups from the config
            state.update({k[len("optim."):]: v for k, v in mine.items() if k.startswith("optim.")})
            set_optimizer_state_dict(model, optimizer, state, options=options)
    rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
    rng_file = os.path.join(path, f"rng_{rank}.json")
    if os.path.exists(rng_file):  # absent for a process that the saving run did not have
        with open(rng_file) as f:
            set_rng_state(json.load(f))
    try:
        with open(os.path.join(path, "state.json")) as f:
            return json.load(f)
    except (OSError, ValueError) as e:
        raise ConfigError(f"the checkpoint {path} cannot be read: {path}/state.json is damaged ({type(e).__name__}); "
                          f"resume from an earlier checkpoint, or start over with resume=off") from None
