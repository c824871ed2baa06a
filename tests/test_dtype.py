"""model.dtype=auto: bf16 only where bf16 is fast (issue 29). The probes torch offers are faked, one machine each."""
import pytest
import torch

from infra import batches
from infra.batches import auto_dtype, autocast_dtype, resolve_dtype
from infra.cli import load_config

# machine → (CUDA with native bf16, AVX-512 BF16, AMX tiles, what oneDNN says of bf16)
MACHINES = {"cuda": (True, False, False, True), "avx512_bf16": (False, True, False, True),
            "amx": (False, False, True, True), "avx512_without_bf16": (False, False, False, True),
            "avx2": (False, False, False, False)}


def fake_machine(monkeypatch, machine: str) -> None:
    cuda, avx512_bf16, amx, mkldnn_bf16 = MACHINES[machine]
    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True: cuda)
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: avx512_bf16)
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: amx)
    monkeypatch.setattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", lambda: mkldnn_bf16, raising=False)


@pytest.mark.parametrize("machine, expected", [("cuda", "bf16"), ("avx512_bf16", "bf16"), ("amx", "bf16"),
                                               ("avx512_without_bf16", "fp32"), ("avx2", "fp32")])
def test_auto_is_bf16_only_where_bf16_is_native(monkeypatch, machine, expected):
    """CUDA, AVX-512 BF16 or AMX: bf16; an AVX-512 CPU without either, where oneDNN says it supports bf16 but
    emulates it (3–5× slower than fp32, issue 29), and an AVX2 CPU: fp32."""
    fake_machine(monkeypatch, machine)
    device = "cuda" if machine == "cuda" else "cpu"
    assert auto_dtype(device).name == expected
    assert autocast_dtype("auto") == {"bf16": torch.bfloat16, "fp32": None}[expected]


def test_a_gpu_without_native_bf16_and_the_cpu_of_a_gpu_machine_get_their_own_answer(monkeypatch):
    """A GPU before Ampere (bf16 only emulated): fp32. A run on the CPU of a GPU machine (accelerate launch --cpu)
    is decided by the CPU's probes, not by CUDA's."""
    fake_machine(monkeypatch, "avx2")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert auto_dtype("cuda").name == "fp32" and "no native bf16" in auto_dtype("cuda").why
    fake_machine(monkeypatch, "cuda")
    assert auto_dtype("cpu").name == "fp32"


def test_auto_on_a_cpu_without_native_bf16_is_exactly_the_fp32_config(monkeypatch):
    """On the Xeon of issue 29 (AVX-512, no AVX-512 BF16, no AMX), the config ppo.py runs with model.dtype=auto is
    the very config of model.dtype=fp32 (so its step time is the fp32 one), vLLM's rollout.dtype=auto included; the
    start-up line says what was chosen and why. An explicit dtype is left as written, and nothing is said."""
    fake_machine(monkeypatch, "avx512_without_bf16")
    said = []
    resolved = resolve_dtype(load_config(None, []), torch.device("cpu"), said.append)
    assert resolved == load_config(None, ["model.dtype=fp32"])
    assert said == ["model.dtype=auto: fp32, since this CPU has neither AVX-512 BF16 nor AMX, so bf16 would be "
                    "emulated, slower than fp32"]
    bf16 = load_config(None, ["model.dtype=bf16"])
    assert resolve_dtype(bf16, torch.device("cpu"), said.append) is bf16 and len(said) == 1
    fake_machine(monkeypatch, "avx512_bf16")
    assert resolve_dtype(load_config(None, []), torch.device("cpu"), said.append) == bf16
    assert said[-1] == "model.dtype=auto: bf16, since this CPU has AVX-512 BF16"


def test_this_machine_still_picks_bf16_where_it_has_avx512_bf16():
    """The probes themselves, unfaked: a CPU with AVX-512 BF16 or AMX (the 2-core EPYC this was written on) gets
    bf16; one without, fp32."""
    native = torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported()
    assert auto_dtype("cpu").name == ("bf16" if native else "fp32")
    assert batches.autocast_dtype("auto") == (torch.bfloat16 if native or torch.cuda.is_available() else None)
