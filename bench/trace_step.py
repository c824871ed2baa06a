"""How much of the library one default training step of ppo.py reads, measured with sys.settrace.

    .venv/bin/python bench/trace_step.py [--tree DIR] [--json OUT]

DIR (default: the repository holding this script) is the repository root whose ppo.py is traced: the script changes
to it, puts it first on sys.path and imports `ppo` from it, and nothing else of the library (the model and the data
are made here, the config is read by the tree's own infra/cli.py), so an older checkout works the same way:

    git archive 16e774a | tar -x -C /tmp/base && .venv/bin/python bench/trace_step.py --tree /tmp/base

The run is the default job of DIR/configs.yaml (PPO with a critic, LoRA, rollout.name=vllm) on a tiny Llama (2 layers,
hidden 128, 2 heads of 64) with a byte-level BPE tokenizer trained here, 32 train and 8 val arithmetic prompts, on
the CPU in fp32, for trainer.total_steps=2 with no validation before training, no plot and no periodic checkpoint.
Only step 2 is traced (step 1 has the one-time start-up work): ppo.tqdm is replaced by a bar whose iterator turns
tracing on right before it yields step 2 and off when the loop asks for the next item. Step 2 is then the last step,
so it holds the end's checkpoint and (test_freq=0: only at the end) validation; --total-steps 3 traces a step with
neither, --set data.val_files=null one with the checkpoint only. A library file is a .py file under DIR, not under
tests/, bench/, examples/, .venv/ or a site-packages folder.

Figures printed (and written to OUT as JSON with the lists behind them):
  files opened in one step    library files with at least one line executed in step 2, and their lines (wc -l)
  function lines that run     the spans (first line to last line) of the distinct library functions called in step
                              2, summed; the functions already running when it starts (ppo.main) count too
  distinct lines executed     distinct (file, line) pairs of 'line' events in library files
  modules ppo.py imports      library modules in sys.modules right after `import ppo`
"""
import argparse
import importlib.util
import json
import os
import random
import sys
import tempfile
import threading
import time

# before torch, transformers or vLLM are imported: the CPU, vLLM's engine in this process (so its Python is traced,
# and it closes with the run)
os.environ["CUDA_VISIBLE_DEVICES"] = ""
os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
os.environ.setdefault("OMP_NUM_THREADS", "2")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXCLUDED_DIRS = ("tests", "bench", "examples", ".venv")

# ---- the tiny model and data, made without the library: tests/conftest.py's make_tiny_model, loaded from its file
# (not through sys.path, which --tree gives to the traced tree)

ARITHMETIC_SYSTEM = "Add the numbers."  # data.py's, as data.make_arithmetic writes its rows
ARITHMETIC_SHOT = ("6 + 7", "6 + 7 = 13")


def make_tiny_model(path):
    spec = importlib.util.spec_from_file_location("trace_step_conftest", os.path.join(HERE, "tests", "conftest.py"))
    conftest = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(conftest)
    return conftest.make_tiny_model(path)


def arithmetic_rows(n: int, seed: int) -> list[dict]:
    """n rows as data.make_arithmetic writes them: the chat asking for a + b (system line, one worked example, the
    question), the sum as ground_truth, data_source arithmetic."""
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        a, b = rng.randint(10, 19), rng.randint(0, 9)
        a, b = (a, b) if rng.random() < 0.5 else (b, a)
        prompt = [{"role": "system", "content": ARITHMETIC_SYSTEM}, {"role": "user", "content": ARITHMETIC_SHOT[0]},
                  {"role": "assistant", "content": ARITHMETIC_SHOT[1]}, {"role": "user", "content": f"{a} + {b}"}]
        rows.append({"prompt": prompt, "ground_truth": str(a + b), "data_source": "arithmetic",
                     "extra_info": {"index": i, "a": a, "b": b}})
    return rows


def write_parquet(rows: list[dict], path: str) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist(rows), path)


# ---- which files are the library's

class Library:
    """The .py files of the tree at `root` that count as the library, decided once per file name."""

    def __init__(self, root: str):
        self.root = os.path.realpath(root)
        self.known = {}  # co_filename → its path relative to root, or None

    def relpath(self, filename):
        try:
            return self.known[filename]
        except KeyError:
            pass
        rel = None
        if filename and filename.endswith(".py") and os.path.isabs(filename) and os.path.isfile(filename):
            path = os.path.realpath(filename)
            if path.startswith(self.root + os.sep) and "site-packages" not in path and "dist-packages" not in path:
                rel = os.path.relpath(path, self.root)
                if rel.split(os.sep)[0] in EXCLUDED_DIRS:
                    rel = None
        self.known[filename] = rel
        return rel


def count_lines(path: str) -> int:
    """wc -l: the newlines in the file."""
    with open(path, "rb") as f:
        return f.read().count(b"\n")


def code_span(code) -> int:
    """Lines from the code object's first line (its def, or its first decorator) to the last line of its body."""
    last = max((line for _, _, line in code.co_lines() if line is not None), default=code.co_firstlineno)
    return max(last, code.co_firstlineno) - code.co_firstlineno + 1


# ---- the tracer

class Tracer:
    """Records, for library frames only, each (file, line) executed and each distinct code object called."""

    def __init__(self, library: Library):
        self.library = library
        self.lines = set()  # (rel, line)
        self.calls = {}  # (rel, co_firstlineno, co_name) → span
        self.running_at_start = []  # library functions already on the stack when tracing starts
        self.on = False

    def global_trace(self, frame, event, arg):
        rel = self.library.relpath(frame.f_code.co_filename)
        if rel is None:
            return None
        code = frame.f_code
        key = (rel, code.co_firstlineno, code.co_name)
        if key not in self.calls:
            self.calls[key] = code_span(code)
        return self.local_trace

    def local_trace(self, frame, event, arg):
        if event == "line":
            rel = self.library.relpath(frame.f_code.co_filename)
            if rel is not None:
                self.lines.add((rel, frame.f_lineno))
        return self.local_trace

    def start(self, frame):
        """Trace from now on, in this thread and in threads started from now; `frame` and its callers already run:
        the library's among them get a local tracer too (sys.settrace alone sees only frames entered later)."""
        self.on = True
        threading.settrace(self.global_trace)
        sys.settrace(self.global_trace)
        while frame is not None:
            code = frame.f_code
            rel = self.library.relpath(code.co_filename)
            if rel is not None:
                frame.f_trace = self.local_trace
                key = (rel, code.co_firstlineno, code.co_name)
                self.running_at_start.append(key)
                self.calls.setdefault(key, code_span(code))
            frame = frame.f_back

    def stop(self):
        if self.on:
            sys.settrace(None)
            threading.settrace(None)
            self.on = False


class TracedBar:
    """Stands in for a tqdm bar: iterating it iterates the real bar, tracing while the loop body of item
    `traced_index` (0-based) runs; anything else (set_postfix, write, close) goes to the real bar."""

    def __init__(self, real_bar, tracer: Tracer, traced_index: int):
        self.real_bar, self.tracer, self.traced_index = real_bar, tracer, traced_index

    def __getattr__(self, name):
        return getattr(self.real_bar, name)

    def __iter__(self):
        tracer = self.tracer
        try:
            for i, item in enumerate(self.real_bar):
                if i == self.traced_index:
                    tracer.start(sys._getframe(1))  # the frame whose loop resumes this generator (ppo.main)
                try:
                    yield item
                finally:
                    if i == self.traced_index:
                        tracer.stop()  # the loop asks for the next item, or leaves
        finally:
            tracer.stop()


def traced_bar(real_tqdm, tracer: Tracer, traced_index: int):
    """A stand-in for tqdm(...) whose bar traces the loop body of item `traced_index`."""

    def bar(*args, **kwargs):
        return TracedBar(real_tqdm(*args, **kwargs), tracer, traced_index)

    return bar


# ---- the run

def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tree", default=HERE, help="repository root whose ppo.py is traced (default: %(default)s)")
    parser.add_argument("--json", help="write the figures and lists here as JSON")
    parser.add_argument("--total-steps", type=int, default=2,
                        help="trainer.total_steps (default %(default)s: step 2, the one traced, is then the last, with "
                             "the end's validation and checkpoint; 3 traces a step with neither)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="a further config override, after the script's own (repeatable)")
    args = parser.parse_args()
    tree = os.path.realpath(args.tree)
    json_out = os.path.abspath(args.json) if args.json else None
    if not os.path.isfile(os.path.join(tree, "ppo.py")):
        sys.exit(f"{tree} holds no ppo.py")
    os.chdir(tree)
    sys.path[:] = [tree] + [p for p in sys.path if os.path.realpath(p or ".") not in (tree, HERE)]
    library = Library(tree)

    with tempfile.TemporaryDirectory(prefix="trace_step-") as tmp:
        t0 = time.perf_counter()
        model = make_tiny_model(os.path.join(tmp, "model"))
        rows = arithmetic_rows(40, seed=0)
        train, val = os.path.join(tmp, "train.parquet"), os.path.join(tmp, "val.parquet")
        write_parquet(rows[:32], train)
        write_parquet(rows[32:], val)

        import ppo  # the tree's, and through it the rest of its library
        if library.relpath(ppo.__file__) != "ppo.py":
            sys.exit(f"imported ppo from {ppo.__file__}, not from {tree}")
        modules = sorted({rel for m in list(sys.modules.values())
                          if (rel := library.relpath(getattr(m, "__file__", None) or "")) is not None})
        from infra.cli import load_config
        import yaml

        overrides = {"model.path": model, "data.train_files": train, "data.val_files": val,
                     "trainer.output_dir": os.path.join(tmp, "out"), "trainer.total_steps": args.total_steps,
                     "trainer.test_freq": 0, "trainer.val_before_train": "false", "trainer.save_freq": 0,
                     "trainer.plot_curves": "false", "model.dtype": "fp32", "rollout.dtype": "fp32",
                     "rollout.max_response_length": 16, "rollout.enforce_eager": "true"}
        with open(os.path.join(tree, "configs.yaml")) as f:
            defaults = yaml.safe_load(f)

        def has(key):
            node = defaults
            for part in key.split("."):
                if not isinstance(node, dict) or part not in node:
                    return False
                node = node[part]
            return True

        dropped = [k for k in overrides if not has(k)]
        for key in dropped:
            print(f"note: {key} is not a key of {tree}/configs.yaml; not set", flush=True)
        cfg = load_config(os.path.join(tree, "configs.yaml"), [f"{k}={v}" for k, v in overrides.items()
                                                                if k not in dropped] + args.set)
        tracer = Tracer(library)
        ppo.tqdm = traced_bar(ppo.tqdm, tracer, traced_index=1)  # the second step
        t1 = time.perf_counter()
        try:
            ppo.main(cfg)
        finally:
            tracer.stop()
        t2 = time.perf_counter()

    if not tracer.lines:
        sys.exit("nothing was traced: did the run reach step 2?")
    files = {}
    for rel, _ in tracer.lines:
        files.setdefault(rel, count_lines(os.path.join(tree, rel)))
    files = dict(sorted(files.items()))
    functions = {k: v for k, v in tracer.calls.items() if k[2] != "<module>"}
    spans = set()  # the same spans as lines, each line once (a lambda or comprehension inside a function counts once)
    for (rel, first, _), span in functions.items():
        spans.update((rel, line) for line in range(first, first + span))
    result = {
        "tree": tree,
        "total_steps": args.total_steps,
        "traced_step": 2,
        "files_opened": len(files),
        "files_opened_lines": sum(files.values()),
        "function_lines": sum(functions.values()),
        "function_lines_union": len(spans),
        "functions_called": len(functions),
        "distinct_lines_executed": len(tracer.lines),
        "modules_imported": len(modules),
        "modules_imported_lines": sum(count_lines(os.path.join(tree, m)) for m in modules),
        "files": files,
        "executed_per_file": {rel: sum(1 for r, _ in tracer.lines if r == rel) for rel in files},
        "modules": modules,
        "functions": [{"file": rel, "line": first, "name": name, "span": span}
                      for (rel, first, name), span in sorted(functions.items())],
        "running_at_start": [f"{rel}:{first} {name}" for rel, first, name in tracer.running_at_start],
        "overrides_dropped": dropped,
        "overrides_added": args.set,
        "seconds": {"setup": round(t1 - t0, 1), "run": round(t2 - t1, 1)},
    }
    print()
    print(f"tree: {tree}")
    print(f"files opened in one step: {result['files_opened']} ({result['files_opened_lines']:,} lines)")
    print(f"function lines that run: {result['function_lines']:,} ({result['functions_called']} distinct functions; "
          f"{result['function_lines_union']:,} lines counting nested ones once)")
    print(f"distinct lines executed: {result['distinct_lines_executed']:,}")
    print(f"library modules ppo.py imports: {result['modules_imported']} "
          f"({result['modules_imported_lines']:,} lines)")
    print(f"  {' '.join(modules)}")
    print("files opened:")
    for rel, n in files.items():
        print(f"  {n:6,}  {rel}")
    print(f"(set-up {result['seconds']['setup']} s, run {result['seconds']['run']} s)")
    if json_out:
        with open(json_out, "w") as f:
            json.dump(result, f, indent=1)
        print(f"written to {json_out}")


if __name__ == "__main__":
    main()
