"""Why model.dtype=auto picks bf16 on some CPUs only (issue 29): bf16 against fp32 matmuls of the demo model's shapes
(SmolLM2-135M: hidden 576, MLP 1536, vocabulary 49152; 512 positions), on 1 and 2 threads, with the CPU's name and
the probes infra/batches.auto_dtype reads.

    OMP_NUM_THREADS=2 .venv/bin/python bench/bf16_matmul.py [--repeat 20]

On a CPU with AVX-512 BF16 or AMX, oneDNN multiplies bf16 natively; on one with AVX-512 only it emulates bf16,
though torch.ops.mkldnn._is_mkldnn_bf16_supported() is true there too.
"""
import argparse
import os
import platform
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from infra.batches import auto_dtype  # noqa: E402

SHAPES = [(512, 576, 1536), (512, 1536, 576), (512, 576, 576), (512, 576, 49152)]  # (M, K, N): M×K by K×N


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor() or platform.machine()


def median_ms(fn, repeat: int) -> float:
    fn()  # warm-up: oneDNN builds its kernel on the first call
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return 1000 * sorted(times)[len(times) // 2]


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=20)
    args = parser.parse_args()
    print(f"cpu: {cpu_name()} ({os.cpu_count()} cores); torch {torch.__version__}; "
          f"capability {torch.backends.cpu.get_cpu_capability()}")
    print(f"probes: avx512_bf16={torch.cpu._is_avx512_bf16_supported()} amx_tile={torch.cpu._is_amx_tile_supported()} "
          f"avx512={torch.cpu._is_avx512_supported()} mkldnn_bf16={torch.ops.mkldnn._is_mkldnn_bf16_supported()}")
    choice = auto_dtype("cpu")
    print(f"model.dtype=auto here: {choice.name} ({choice.why})")
    print(f"{'threads':>7} {'M×K by K×N':>20} {'fp32 ms':>9} {'bf16 ms':>9} {'bf16/fp32':>9}")
    g = torch.Generator().manual_seed(0)
    for threads in (1, 2):
        torch.set_num_threads(threads)
        for m, k, n in SHAPES:
            a, b = torch.randn(m, k, generator=g), torch.randn(k, n, generator=g)
            a16, b16 = a.bfloat16(), b.bfloat16()
            fp32 = median_ms(lambda: a @ b, args.repeat)
            bf16 = median_ms(lambda: a16 @ b16, args.repeat)
            print(f"{threads:>7} {f'{m}×{k} by {k}×{n}':>20} {fp32:9.2f} {bf16:9.2f} {bf16 / fp32:9.2f}")


if __name__ == "__main__":
    main()
