"""The audit's global batch, ragged on purpose, and who gets which sequence at each layout (N ranks,
K micro-batches)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from gradscale.audit.contract import IGNORE_INDEX, trained_tokens

SEQ_LEN = 24
MIN_SEQUENCES = 8


def global_batch(vocab_size: int, sequences: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """input_ids and labels, [sequences, SEQ_LEN]: the first half trained over the last t positions, t from
    SEQ_LEN - 1 down to 1 (ragged), the second half with no trained token (a prompt cut off before its answer).
    The first sequence also has a label at position 0, which no position predicts: a count of labels != -100 on
    unshifted labels counts it, the right count (labels[:, 1:]) does not."""
    gen = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(0, vocab_size, (sequences, SEQ_LEN), generator=gen)
    half = sequences // 2
    top = SEQ_LEN - 1
    counts = [1 + round((top - 1) * ((half - 1 - i) / max(half - 1, 1)) ** 2) for i in range(half)] + [0] * half
    trained = torch.arange(SEQ_LEN)[None, :] >= SEQ_LEN - torch.tensor(counts)[:, None]
    trained[0, 0] = True
    return input_ids, torch.where(trained, input_ids, IGNORE_INDEX)


def layout(counts: Sequence[int], world_size: int, accumulation: int) -> list[list[list[int]]]:
    """Sequence indices per rank per micro-batch. Where K > 1 the last rank's last micro-batch holds only
    sequences with no trained token, and so does the whole second rank at N = 2, K = 1 (a rank that trains
    nothing); at K = 1 and N > 2 every rank trains, so a bug confined to one rank shows without accumulation. The
    trained sequences go round the other micro-batches, largest first, rank by rank, so ranks and micro-batches
    differ in trained tokens and in trained sequences."""
    slots = world_size * accumulation
    per_slot = len(counts) // slots
    empty = [i for i, n in enumerate(counts) if n == 0]
    trained = sorted((i for i, n in enumerate(counts) if n > 0), key=lambda i: -counts[i])
    held: dict[tuple[int, int], list[int]] = {(r, k): [] for r in range(world_size) for k in range(accumulation)}
    reserved = (world_size - 1, accumulation - 1) if accumulation > 1 or world_size == 2 else None
    if reserved:
        held[reserved] = [empty.pop() for _ in range(per_slot)]
    open_slots = [(r, k) for k in range(accumulation) for r in range(world_size) if (r, k) != reserved]
    turn = 0
    for i in trained:
        while len(held[open_slots[turn % len(open_slots)]]) == per_slot:
            turn += 1
        held[open_slots[turn % len(open_slots)]].append(i)
        turn += 1
    for slot in open_slots:
        while len(held[slot]) < per_slot:
            held[slot].append(empty.pop())
    _unequal_trained_sequences(held, counts, open_slots, world_size)
    return [[sorted(held[(r, k)]) for k in range(accumulation)] for r in range(world_size)]


def _unequal_trained_sequences(held: dict[tuple[int, int], list[int]], counts: Sequence[int],
                               open_slots: list[tuple[int, int]], world_size: int) -> None:
    """Where every rank holds as many trained sequences as the next, swap the last rank's smallest trained one
    with an untrained one of rank 0's: a per-rank sequence count then differs from the global one's share."""
    def trained_in(rank: int) -> int:
        return sum(counts[i] > 0 for (r, _), seqs in held.items() if r == rank for i in seqs)

    if world_size == 1 or len({trained_in(r) for r in range(world_size)}) > 1:
        return
    last = [(counts[i], slot, i) for slot in open_slots if slot[0] == world_size - 1 for i in held[slot] if counts[i]]
    free = [(slot, i) for slot in open_slots if slot[0] == 0 for i in held[slot] if counts[i] == 0]
    if last and free:
        _, src, i = min(last)
        dst, j = free[0]
        held[src][held[src].index(i)], held[dst][held[dst].index(j)] = j, i
        held[src].sort(), held[dst].sort()


def batch_size_for(world_sizes: Sequence[int], accumulations: Sequence[int]) -> int:
    """Sequences in the global batch: at least one per micro-batch of the finest layout (sizes are powers of
    two, so it divides into every layout) and at least MIN_SEQUENCES."""
    return max(MIN_SEQUENCES, max(world_sizes) * max(accumulations))


def counts_of(labels: torch.Tensor) -> list[int]:
    return [trained_tokens(row) for row in labels]
