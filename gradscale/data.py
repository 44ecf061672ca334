"""Tokenizer, datasets, loss masking, packing, and the batch order.

Every example is a (prompt, response) pair rendered in the tokenizer's own chat format when it carries
one (an instruct model: `data.template=auto` or `chat`), otherwise (`alpaca`) as

    <bos>### Instruction:\\n{prompt}\\n\\n### Response:\\n{response}<eos>

and only response tokens are trained on unless `train_on_input`, so the number of trained tokens
differs from sequence to sequence: that count is what token normalization divides by.

Sequences are stored as `inputs` and `targets` of shape [num_sequences, seq_len], with targets
already shifted (targets[:, t] is the token after inputs[:, t], or IGNORE_INDEX when not trained).

The batch at a step is a pure function of (seed, step, batch_size): it never depends on the
world size, the optimizer, the scale or the fix, so every run in a comparison sees the same tokens.
"""

from __future__ import annotations

import ast
import functools
import hashlib
import logging
import os
import random
import sysconfig
from dataclasses import dataclass, field
from pathlib import Path

import torch

log = logging.getLogger(__name__)

IGNORE_INDEX = -100
BOS, EOS, PAD = "<|begin_of_text|>", "<|end_of_text|>", "<|pad|>"
PROMPT_TEMPLATE = "### Instruction:\n{prompt}\n\n### Response:\n"

# Instructions for the embedded pydoc dataset; the passage index picks one, so prompts vary in length.
PYDOC_PROMPTS = (
    "Explain the Python topic '{topic}' (part {part}).",
    "What does the Python language reference say about '{topic}'? Continue from part {part}.",
    "Describe '{topic}' in Python, part {part}.",
    "Quote part {part} of the documentation for the Python topic '{topic}'.",
    "I am learning Python. Teach me about '{topic}', section {part}, with the details the reference gives.",
)
PYDOC_PASSAGE_CHARS = 300  # passages are whole paragraphs, joined until at least this long


class DataError(ValueError):
    """Unusable data: the message names the file or field and what was expected."""


# ---------------------------------------------------------------------------------------------
# Examples


def pydoc_examples() -> list[dict[str, str]]:
    """(prompt, response) pairs from CPython's reference text: 79 topics, about 465k characters."""
    from pydoc_data.topics import topics

    examples = []
    for topic in sorted(topics):
        passage: list[str] = []
        paragraphs = [p.strip() for p in topics[topic].split("\n\n") if p.strip()]
        for i, paragraph in enumerate(paragraphs):
            passage.append(paragraph)
            if sum(len(p) for p in passage) >= PYDOC_PASSAGE_CHARS or i == len(paragraphs) - 1:
                part = len(examples)
                template = PYDOC_PROMPTS[part % len(PYDOC_PROMPTS)]
                examples.append(
                    {"prompt": template.format(topic=topic, part=part), "response": "\n\n".join(passage)}
                )
                passage = []
    return examples


# The standard library's docstrings: the tiny base's pretraining corpus (gradscale/pretrain.py) and the
# long fine-tune's data (data=docstrings). Not in it: tests and demos (code rather than prose), the GUI
# toolkits, vendored installers, and pydoc_data, which holds the default fine-tune's text.
SKIPPED_DIRS = {"test", "tests", "idlelib", "lib2to3", "site-packages", "dist-packages", "pydoc_data", "turtledemo",
                "tkinter", "ensurepip", "__pycache__"}
MIN_DOCSTRING_CHARS = 40  # one-liners like "Return self." teach nothing


@functools.lru_cache(maxsize=1)  # walking the library takes about a second; a sweep's jobs ask for it often
def stdlib_files() -> tuple[Path, ...]:
    root = Path(sysconfig.get_paths()["stdlib"])
    return tuple(p for p in sorted(root.rglob("*.py"))
                 if not any(part in SKIPPED_DIRS or part.startswith("config-") for part in p.relative_to(root).parts))


@dataclass(frozen=True)
class Docstring:
    module: str  # dotted, from the file's path under the library
    name: str  # qualified within the module (Class.method, outer.inner); "" for the module's own docstring
    kind: str  # module | class | function
    text: str


@functools.lru_cache(maxsize=1)  # parsing the library takes seconds; a sweep's jobs need it once
def stdlib_docstrings(files: tuple[Path, ...]) -> tuple[Docstring, ...]:
    """Every module, class and function docstring of at least MIN_DOCSTRING_CHARS, in file order."""
    root = Path(sysconfig.get_paths()["stdlib"])
    found = []
    for path in files:
        try:
            tree = ast.parse(path.read_bytes())
        except (SyntaxError, ValueError):  # a file of another Python version's syntax
            continue
        module = ".".join(path.relative_to(root).with_suffix("").parts).removesuffix(".__init__")
        qualified = {tree: ""}  # each node's qualified name, known before ast.walk reaches its children
        for node in ast.walk(tree):
            for child in ast.iter_child_nodes(node):
                if isinstance(child, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                    qualified[child] = f"{qualified[node]}.{child.name}".lstrip(".")
                elif node in qualified:
                    qualified.setdefault(child, qualified[node])
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                text = ast.get_docstring(node)
                if text and len(text) >= MIN_DOCSTRING_CHARS:
                    kind = {ast.Module: "module", ast.ClassDef: "class"}.get(type(node), "function")
                    found.append(Docstring(module, qualified[node], kind, text))
    return tuple(found)


def docstring_examples() -> list[dict[str, str]]:
    """(prompt, response) pairs from the standard library's docstrings: write the docstring of this module,
    class or function (methods named Class.method). 5824 examples, 1.89M characters on CPython 3.11: a
    fine-tune of hundreds of steps that sees no example twice."""
    examples = []
    for d in stdlib_docstrings(stdlib_files()):
        what = f"the module {d.module}" if d.kind == "module" else f"the {d.kind} {d.name} in the module {d.module}"
        examples.append({"prompt": f"Write the docstring of {what}.", "response": d.text})
    return examples


def records_examples(records, prompt_field: str, response_field: str, source: str) -> list[dict[str, str]]:
    examples = []
    for i, record in enumerate(records):
        for key in (prompt_field, response_field):
            if not isinstance(record.get(key), str):
                raise DataError(f"error: {source}: record {i} has no text field {key!r}")
        examples.append({"prompt": record[prompt_field], "response": record[response_field]})
    if not examples:
        raise DataError(f"error: {source}: no records")
    return examples


def load_examples(data_cfg) -> list[dict[str, str]]:
    if data_cfg.name == "pydoc":
        return pydoc_examples()
    if data_cfg.name == "docstrings":
        return docstring_examples()
    import datasets  # slow import, only for file and hub data

    datasets.disable_progress_bars()
    if data_cfg.name == "jsonl":
        source = f"data.path={data_cfg.path}"
        try:
            records = datasets.load_dataset("json", data_files=data_cfg.path, split="train")
        except Exception as e:  # datasets raises several types for unreadable JSON
            raise DataError(f"error: {source} is not readable JSONL: {type(e).__name__}: {e}") from e
    else:
        source = f"data.hf_name={data_cfg.hf_name}"
        records = datasets.load_dataset(data_cfg.hf_name, split=data_cfg.hf_split)
    return records_examples(records, data_cfg.prompt_field, data_cfg.response_field, source)


# ---------------------------------------------------------------------------------------------
# Tokenizer


def content_digest(parts) -> str:
    """sha256 over the strings, each ended by a NUL so that no two lists of parts run together."""
    digest = hashlib.sha256()
    for part in parts:
        digest.update(part.encode())
        digest.update(b"\0")
    return digest.hexdigest()


def build_tokenizer(examples: list[dict[str, str]], vocab_size: int, cache_dir: str | None):
    """Random init: a byte-level BPE trained on the fine-tune examples themselves."""
    return train_bpe([PROMPT_TEMPLATE.format(prompt=e["prompt"]) + e["response"] for e in examples], vocab_size,
                     cache_dir)


def train_bpe(texts: list[str], vocab_size: int, cache_dir: str | None):
    """Byte-level BPE trained on the texts, cached by content; wrapped as PreTrainedTokenizerFast."""
    import tokenizers
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from gradscale.cache import cache_root

    digest = content_digest([str(vocab_size), tokenizers.__version__, *texts])
    path = cache_root(cache_dir) / f"tokenizer-bpe{vocab_size}-{digest[:16]}.json"
    if path.exists():
        tok = Tokenizer.from_file(str(path))
    else:
        tok = Tokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(
            vocab_size=vocab_size,
            special_tokens=[BOS, EOS, PAD],
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
            show_progress=False,
        )
        tok.train_from_iterator(texts, trainer)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".tmp{os.getpid()}")
        tok.save(str(tmp))
        os.replace(tmp, path)  # atomic: a concurrent job never reads a half-written file
        log.info("built BPE tokenizer (vocab %d) -> %s", vocab_size, path)
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=BOS, eos_token=EOS, pad_token=PAD)


# ---------------------------------------------------------------------------------------------
# Tokenized splits


@dataclass
class TokenizedSplit:
    inputs: torch.Tensor  # [n, seq_len] int64
    targets: torch.Tensor  # [n, seq_len] int64, IGNORE_INDEX where not trained

    def __len__(self) -> int:
        return self.inputs.shape[0]


def resolve_template(template: str, tokenizer) -> str:
    """auto: the tokenizer's own chat format when it carries one (an instruct model), else alpaca."""
    has_chat = bool(getattr(tokenizer, "chat_template", None))
    if template == "chat" and not has_chat:
        raise DataError("error: data.template='chat' is not allowed: this tokenizer has no chat template "
                        "(use data.template=alpaca or auto)")
    return "chat" if template == "chat" or (template == "auto" and has_chat) else "alpaca"


def render(example: dict[str, str], tokenizer, template: str) -> tuple[str, str]:
    """(prompt text, response text): concatenated they are the whole example as the model reads it.

    alpaca: PROMPT_TEMPLATE around the prompt; bos and eos are added as tokens. chat: the tokenizer's chat
    template renders the user turn with the assistant header (the prompt) and the whole conversation; the
    response is the rest (the reply and its end-of-turn marker), as fine-tuning recipes mask it."""
    if template == "alpaca":
        return PROMPT_TEMPLATE.format(prompt=example["prompt"]), example["response"]
    user = [{"role": "user", "content": example["prompt"]}]
    prompt = tokenizer.apply_chat_template(user, tokenize=False, add_generation_prompt=True)
    whole = tokenizer.apply_chat_template([*user, {"role": "assistant", "content": example["response"]}],
                                          tokenize=False)
    if not whole.startswith(prompt):
        raise DataError("error: data.template='chat': the tokenizer's chat template does not render the prompt "
                        "as a prefix of the conversation, so the prompt cannot be masked (use data.template=alpaca)")
    return prompt, whole[len(prompt):]


def encode_examples(examples, tokenizer, train_on_input: bool, template: str = "alpaca"
                    ) -> list[tuple[list[int], list[bool]]]:
    """Token ids and a per-token 'is trained' mask for each example (bos never is; prompt tokens only with
    train_on_input)."""
    prompts, responses = zip(*(render(e, tokenizer, template) for e in examples))
    prompt_ids = tokenizer(list(prompts), add_special_tokens=False)["input_ids"]
    response_ids = tokenizer(list(responses), add_special_tokens=False)["input_ids"]
    # the chat template writes its own turn markers; the alpaca format is framed by bos and eos
    bos = [tokenizer.bos_token_id] if template == "alpaca" and tokenizer.bos_token_id is not None else []
    eos = [tokenizer.eos_token_id] if template == "alpaca" else []
    encoded = []
    for p, r in zip(prompt_ids, response_ids):
        ids = bos + p + r + eos
        trained = [False] * len(bos) + [train_on_input] * len(p) + [True] * (len(r) + len(eos))
        encoded.append((ids, trained))
    return encoded


def to_sequences(encoded, seq_len: int, packed: bool, pad_id: int) -> TokenizedSplit:
    """Fixed-length (inputs, targets). Unpacked: one example per row, truncated and padded.
    Packed: examples concatenated and cut into full rows (the remainder is dropped)."""
    rows_in, rows_tgt = [], []
    if packed:
        ids = [t for e, _ in encoded for t in e]
        trained = [m for _, e in encoded for m in e]
        for start in range(0, len(ids) - seq_len, seq_len):
            window = slice(start, start + seq_len + 1)
            rows_in.append(ids[window][:-1])
            rows_tgt.append([t if m else IGNORE_INDEX for t, m in zip(ids[window][1:], trained[window][1:])])
    else:
        for ids, trained in encoded:
            ids, trained = ids[: seq_len + 1], trained[: seq_len + 1]
            target = [t if m else IGNORE_INDEX for t, m in zip(ids[1:], trained[1:])]
            if not any(t != IGNORE_INDEX for t in target):
                continue  # the prompt alone fills seq_len: nothing to train on
            pad = seq_len - len(target)
            rows_in.append(ids[:-1] + [pad_id] * pad)
            rows_tgt.append(target + [IGNORE_INDEX] * pad)
    if not rows_in:
        raise DataError(
            f"error: seq_len={seq_len} leaves no sequence with a trained token: "
            "every example's prompt is longer (raise seq_len or set data.packed=true)"
        )
    return TokenizedSplit(torch.tensor(rows_in, dtype=torch.long), torch.tensor(rows_tgt, dtype=torch.long))


EVAL_SPLIT_SEED = 1234  # fixed: the held-out examples are the same for every run and seed


def split_examples(examples: list, eval_fraction: float) -> tuple[list, list]:
    order = list(range(len(examples)))
    random.Random(EVAL_SPLIT_SEED).shuffle(order)
    n_eval = max(1, round(eval_fraction * len(examples)))
    if n_eval >= len(examples):
        raise DataError(f"error: {len(examples)} examples are too few to hold out data.eval_fraction={eval_fraction}")
    held_out = set(order[:n_eval])
    train = [e for i, e in enumerate(examples) if i not in held_out]
    return train, [examples[i] for i in sorted(held_out)]


@dataclass
class Batches:
    """The global batch for each step: a pure function of (seed, step, batch_size)."""

    train: TokenizedSplit
    eval: TokenizedSplit
    batch_size: int
    seed: int
    _epoch_order: tuple[int, torch.Tensor] | None = field(default=None, repr=False)  # the latest epoch's

    def permutation(self, epoch: int) -> torch.Tensor:
        """The epoch's order, seeded by (seed, epoch); built once per epoch, not once per step."""
        if self._epoch_order is None or self._epoch_order[0] != epoch:
            gen = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
            self._epoch_order = (epoch, torch.randperm(len(self.train), generator=gen))
        return self._epoch_order[1]

    def indices(self, step: int) -> torch.Tensor:
        """Sequence indices of the step's global batch: epoch-wise permutations seeded by (seed, epoch)."""
        n = len(self.train)
        first = step * self.batch_size
        out, position = [], first
        while position < first + self.batch_size:
            epoch, offset = divmod(position, n)
            perm = self.permutation(epoch)
            take = min(n - offset, first + self.batch_size - position)
            out.append(perm[offset : offset + take])
            position += take
        return torch.cat(out)

    def train_batch(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        idx = self.indices(step)
        return self.train.inputs[idx], self.train.targets[idx]

    def eval_size(self, max_batches: int) -> tuple[int, int]:
        """(sequences, tokens per sequence) of an eval of at most max_batches batches."""
        return min(len(self.eval), max_batches * self.batch_size), self.eval.inputs.shape[1]

    def eval_batches(self, max_batches: int):
        """The held-out split in order, the same batches at every eval."""
        for start in range(0, self.eval_size(max_batches)[0], self.batch_size):
            yield self.eval.inputs[start : start + self.batch_size], self.eval.targets[start : start + self.batch_size]


# Tokenized splits by content, in this process: the jobs of a sweep run one after another in one process
# and tokenize the same data (a sixth of a smoke preset's time before). Read only: batches copy rows out.
_TOKENIZED: dict[str, TokenizedSplit] = {}
_TOKENIZED_MAX = 4  # a train and an eval split of two settings; a sweep over data settings starts afresh


def tokenize_split(examples, tokenizer, train_on_input: bool, seq_len: int, packed: bool, template: str
                   ) -> TokenizedSplit:
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    backend = getattr(tokenizer, "backend_tokenizer", None)  # a slow (Python) tokenizer is not cached
    key = None if backend is None else content_digest([
        *map(str, (backend.to_str(), tokenizer.bos_token_id, tokenizer.eos_token_id, pad_id, train_on_input,
                   seq_len, packed, template, getattr(tokenizer, "chat_template", None))),
        *(f"{e['prompt']}\0{e['response']}" for e in examples),
    ])
    if key in _TOKENIZED:
        return _TOKENIZED[key]
    split = to_sequences(encode_examples(examples, tokenizer, train_on_input, template), seq_len, packed, pad_id)
    if key is not None:
        if len(_TOKENIZED) >= _TOKENIZED_MAX:
            _TOKENIZED.clear()
        _TOKENIZED[key] = split
    return split


def build_batches(examples, data_cfg, tokenizer, seq_len: int, batch_size: int, seed: int) -> Batches:
    train_examples, eval_examples = split_examples(examples, data_cfg.eval_fraction)
    template = resolve_template(data_cfg.template, tokenizer)
    batches = Batches(
        *(tokenize_split(split, tokenizer, data_cfg.train_on_input, seq_len, data_cfg.packed, template)
          for split in (train_examples, eval_examples)),
        batch_size, seed,
    )
    trained = (batches.train.targets != IGNORE_INDEX).sum().item()
    log.info(
        "data %s (%s template): %d train / %d eval sequences of %d tokens, %.1f%% of train tokens trained",
        data_cfg.name, template, len(batches.train), len(batches.eval), seq_len,
        100 * trained / batches.train.targets.numel(),
    )
    return batches

