"""What the config's files and this machine hold, probed before any work starts: a data file's records, a
checkpoint directory, the model's position limit, CUDA, a compiler, the weights' source. Apart from the value
checks (config.validate judges values alone), these look at files and the machine; each answers in one line.
"""

from __future__ import annotations

import functools
import json
import os
import sys
from typing import Any

from gradscale.checks import ConfigError, check

CHECKPOINT_WEIGHTS = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin",
                      "pytorch_model.bin.index.json")
CHECKPOINT_TOKENIZER = ("tokenizer.json", "tokenizer.model")


def jsonl_problem(path: str, prompt_field: str, response_field: str) -> str | None:
    """The first thing wrong with a JSONL file of {prompt, response} records, or None. One pass over the
    file in plain Python, so a bad line is named before any work starts."""
    records = 0
    with open(path, "rb") as f:
        for number, raw in enumerate(f, start=1):
            try:
                line = raw.decode("utf-8").strip()
            except UnicodeDecodeError as e:
                return f"line {number} is not UTF-8 ({e.reason} at byte {e.start})"
            if not line:
                continue
            try:
                record = json.loads(line)
            except ValueError as e:
                return f"line {number} is not JSON ({e})"
            if not isinstance(record, dict):
                return f"line {number} is not a JSON object"
            for key in (prompt_field, response_field):
                if not isinstance(record.get(key), str):
                    return f"line {number} has no text field {key!r}"
            records += 1
    return None if records else "it holds no records"


def model_max_positions(model: Any) -> int:
    """The model's position limit: from the checkpoint's config.json when model.path is set (a GGUF's is
    known only once converted: the config's value stands for it)."""
    if model.path:
        with open(os.path.join(model.path, "config.json")) as f:
            return int(json.load(f).get("max_position_embeddings", 0))
    return int(model.max_position_embeddings)


def check_files(cfg: Any) -> None:
    """What the files the config names must hold: model.path a checkpoint, model.gguf_file a file, data.path
    JSONL records; and seq_len within the checkpoint's positions. Each file is read once per process
    (file_problem), so a sweep of many jobs on one data file reads it once."""
    model, data = cfg.model, cfg.data
    if model.gguf_file and not model.gguf_package:
        check(os.path.isfile(model.gguf_file), "model.gguf_file", model.gguf_file,
               "must be an existing GGUF file (or name the file inside model.gguf_package)")
    if model.path:
        check(os.path.isdir(model.path), "model.path", model.path, "must be an existing directory")
        for files, what in ((("config.json",), "no config.json"), (CHECKPOINT_WEIGHTS, "no weights"),
                            (CHECKPOINT_TOKENIZER, "no tokenizer")):
            check(
                any(os.path.isfile(os.path.join(model.path, f)) for f in files),
                "model.path",
                model.path,
                f"must be a Hugging Face checkpoint directory; it has {what} ({', '.join(files)})",
            )
    max_positions = model_max_positions(model)
    check(
        cfg.seq_len <= max_positions,
        "seq_len",
        cfg.seq_len,
        f"must be <= the model's max_position_embeddings ({max_positions})",
    )
    if data.name == "jsonl":
        check(os.path.isfile(data.path), "data.path", data.path, "must be an existing JSONL file")
        problem = file_problem(jsonl_problem, data.path, data.prompt_field, data.response_field)
        check(problem is None, "data.path", data.path, f"must be a JSONL file of records: {problem}")


_FILE_PROBLEMS: dict[tuple, str | None] = {}


def file_problem(probe, path: str, *args) -> str | None:
    """probe(path, *args), remembered while the file stays as it was (size and modification time)."""
    stat = os.stat(path)
    key = (probe.__name__, os.path.abspath(path), stat.st_size, stat.st_mtime_ns, *args)
    if key not in _FILE_PROBLEMS:
        _FILE_PROBLEMS[key] = probe(path, *args)
    return _FILE_PROBLEMS[key]


def installed_torch_cuda() -> bool | None:
    """Whether the installed torch is a CUDA build, read from torch/version.py without importing torch
    (the import alone takes seconds); None when the file does not say."""
    import importlib.util
    import re

    spec = importlib.util.find_spec("torch")
    if spec is None or not spec.origin:
        return None
    try:
        text = open(os.path.join(os.path.dirname(spec.origin), "version.py")).read()
    except OSError:
        return None
    found = re.search(r"^cuda\s*(?::[^=\n]*)?=\s*(None|'[^']*'|\"[^\"]*\")", text, re.MULTILINE)
    return None if found is None else found.group(1) != "None"


def cuda_problem() -> str | None:
    """Why CUDA cannot be used here, or None. A CPU build of torch is told without importing it."""
    if "torch" not in sys.modules and installed_torch_cuda() is False:
        return "this torch is a CPU-only build (install a CUDA build of torch, or use device=cpu or auto)"
    import torch

    if not torch.cuda.is_available():
        return "torch sees no CUDA device here (use device=cpu or auto)"
    return None


def compiler_problem(on_cuda: bool) -> str | None:
    """Why torch.compile cannot build kernels here, or None: Inductor compiles C++ on CPU, and Triton
    kernels (with a C compiler for their launchers) on CUDA."""
    import importlib.util
    import shutil

    if on_cuda:
        if importlib.util.find_spec("triton") is None:
            return "torch.compile on CUDA needs triton, which is not installed (pip install triton, or compile=false)"
        compilers = (os.environ.get("CC"), "cc", "gcc", "clang")
    else:
        compilers = (os.environ.get("CXX"), "c++", "g++", "clang++")
    if not any(c and shutil.which(c) for c in compilers):
        kind = "C" if on_cuda else "C++"
        return f"torch.compile needs a {kind} compiler and none is on PATH (install one, or compile=false)"
    return None


@functools.cache  # once per process: a sweep's jobs share the CPU it measures
def bf16_slowdown(size: int = 256, repeats: int = 5) -> float:
    """How many times longer a bf16 matmul takes than an fp32 one on this CPU (the best of a few size^3
    products each, both warmed up first): below 1 where AVX-512 BF16 or AMX runs it, tens on a CPU with
    neither, where a bf16-autocast run crawls."""
    import time

    import torch

    operands = {dtype: (torch.randn(size, size).to(dtype), torch.randn(size, size).to(dtype))
                for dtype in (torch.float32, torch.bfloat16)}
    for a, b in operands.values():
        for _ in range(3):  # the first products of a dtype pay for its kernels' set-up
            a @ b

    def best(a, b) -> float:
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            a @ b
            times.append(time.perf_counter() - start)
        return min(times)

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # one thread: a busy machine cannot stall a product at a barrier between threads
    try:
        return best(*operands[torch.bfloat16]) / best(*operands[torch.float32])
    finally:
        torch.set_num_threads(threads)


def check_environment(cfg: Any) -> None:
    """Refuse values this machine cannot run, before any work starts; one line naming the value and why.
    Apart from `validate`, which judges values alone: these look at the machine (and the weights' source)."""
    on_cuda = cfg.device == "cuda"
    if on_cuda:
        problem = cuda_problem()
        check(problem is None, "device", cfg.device, str(problem))
    elif cfg.device == "auto" and (cfg.precision == "bf16" or cfg.compile):  # auto means CUDA when it is here
        on_cuda = cuda_problem() is None
    if cfg.precision == "bf16" and on_cuda:
        import torch

        check(torch.cuda.is_bf16_supported(), "precision", cfg.precision,
               f"{torch.cuda.get_device_name()} has no bf16 (use precision=fp32)")
    if cfg.compile:
        problem = compiler_problem(on_cuda)
        check(problem is None, "compile", cfg.compile, str(problem))
    from gradscale.weights import WeightsError, ensure_source

    try:
        ensure_source(cfg.model)
    except WeightsError as e:
        raise ConfigError(str(e)) from None
