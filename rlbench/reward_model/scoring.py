"""Packed sequence scoring with a value model: the one forward both RM training and serving run.

    packs = pack_units(sequences, units=[[0, 1], [2, 3]], max_tokens=4096)   # a pair's two sequences stay together
    scores = sequence_scores(model, pack)                                    # [n]: the head at each last token

Sequences are packed like the trainer's micro-batches (`rlbench.packing`: first-fit count, then the balanced
`partition` under the token budget; one `[1, T]` row, positions restarting per sequence, so packed sequences do
not see each other). A sequence's score is the head's value at its last real token (the eos `encode_pair` ends
it with).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from rlbench.models.value_head import token_values
from rlbench.packing import Pack, first_fit_count, pack_samples, partition


def pack_units(sequences: Sequence[Sequence[int]], units: Sequence[Sequence[int]] | None = None, *,
               max_tokens: int, pad_token_id: int = 0) -> list[Pack]:
    """Pack `sequences` into micro-batches of at most `max_tokens` tokens, keeping each unit in one pack.

    Args:
        sequences: token ids per sequence (each >= 2 tokens).
        units: groups of sequence indices that must share a pack (a preference pair); None: each sequence alone.
        max_tokens: the token budget of one pack.
    Returns:
        packs whose `sample_ids` index `sequences`; every sequence in exactly one pack.
    Raises:
        ValueError: a unit longer than `max_tokens` (naming it), or a sequence shorter than 2 tokens.
    """
    units = [[i] for i in range(len(sequences))] if units is None else [list(u) for u in units]
    if not units:
        return []
    short = [i for i, s in enumerate(sequences) if len(s) < 2]
    if short:
        raise ValueError(f"sequence {short[0]} has {len(sequences[short[0]])} token(s); a scored sequence needs "
                         "a prompt and at least its final eos")
    lengths = [sum(len(sequences[i]) for i in u) for u in units]
    over = [j for j, n in enumerate(lengths) if n > max_tokens]
    if over:
        j = over[0]
        raise ValueError(f"sequence unit {j} (sequences {units[j]}) has {lengths[j]} tokens, more than the pack "
                         f"budget max_tokens={max_tokens}; raise max_tokens or shorten the data")
    parts = partition(lengths, first_fit_count(lengths, max_tokens), max_tokens)
    return [pack_samples(sequences, [i for j in part for i in units[j]], pad_token_id=pad_token_id)
            for part in parts if part]


def last_token_index(pack: Pack) -> torch.Tensor:
    """`[n]` long: the position of each sequence's last real token in the pack."""
    return pack.cu_seqlens[:-1].long() + pack.seq_lengths - 1


def sequence_scores(model, pack: Pack, device: torch.device | str | None = None) -> torch.Tensor:
    """`[n]` float32 scores of the pack's sequences (in `pack.sample_ids` order), with grad when enabled.

    `model`: a value model (`rlbench.models.value_head`, read by `token_values`); `device` None: the model's.
    On CUDA the forward runs under bf16 autocast (fp32 weights stay fp32).
    """
    device = torch.device(device) if device is not None else next(model.parameters()).device
    tokens = pack.tokens.to(device)[None]  # [1, T]
    positions = pack.position_ids.to(device)[None]  # [1, T]
    with torch.autocast(device_type=device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
        values = token_values(model, tokens, positions)[0]  # [T]
    return values[last_token_index(pack).to(device)]  # [n]
