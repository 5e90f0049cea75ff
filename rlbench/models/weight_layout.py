"""Where each in-memory parameter of a HF model lives in its safetensors checkpoint, read off transformers' own
conversion rules for the model (`transformers.conversion_mapping`), so one mechanism serves every architecture.

transformers (5.x) keeps some weights in another layout in memory than on disk. MoE experts are the case that
matters: on disk one tensor per expert (`mlp.experts.{e}.gate_proj.weight` `[I, D]`, Mixtral's
`block_sparse_moe.experts.{e}.w1.weight`), in memory one fused tensor per layer (`mlp.experts.gate_up_proj`
`[E, 2I, D]`: experts stacked on dim 0, gate and up concatenated on dim 1). A `Piece` says which part of the
in-memory tensor one disk tensor is: `param[piece.index]` is that disk tensor, exactly. The pieces come from the
model's conversion rules: renamings (`WeightRenaming`) and converters made of `MergeModulelist` (stack) and
`Concatenate` (cat); any other conversion op (transposes, permutations, quantization) is refused by name.

- Loading (`checkpoint_layout`): from the checkpoint's names, each rank reads only the rows of each piece that fall in
  its shard (`rlbench.backends.hf_weights.load_hf_weights`).
- Saving and weight sync (`export_layout`): the names `save_pretrained` writes (transformers' own reverse
  rules, run on meta tensors), so an export, a checkpoint read by SGLang or by `from_pretrained`, and the engine's
  `update_weights` all use the on-disk names.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import torch
import torch.nn as nn

Index = tuple[int | slice, ...]
"""An index into a parameter: an int for a stacked dim (the disk tensor has no such dim), a slice otherwise."""


@dataclass(frozen=True)
class Piece:
    """One disk tensor as a part of an in-memory parameter: `param[index]` has the disk tensor's shape and values."""

    disk: str
    """The tensor's name in the safetensors files."""
    index: Index


def full_index(shape: Iterable[int]) -> Index:
    return tuple(slice(0, s) for s in shape)


def overlap(piece: Index, local: Index) -> tuple[Index, Index] | None:
    """Where a piece meets a rank's shard: (index into the local shard, index into the disk tensor), or None.
    `local` is the shard's place in the full parameter (slices)."""
    local_sub: list[int | slice] = []
    disk_sub: list[slice] = []
    for p, lo in zip(piece, local):
        if isinstance(p, int):
            if not lo.start <= p < lo.stop:
                return None
            local_sub.append(p - lo.start)
            continue
        start, stop = max(p.start, lo.start), min(p.stop, lo.stop)
        if start >= stop:
            return None
        local_sub.append(slice(start - lo.start, stop - lo.start))
        disk_sub.append(slice(start - p.start, stop - p.start))
    return tuple(local_sub), tuple(disk_sub)


def _numel(index: Index) -> int:
    n = 1
    for i in index:
        n *= 1 if isinstance(i, int) else i.stop - i.start
    return n


class WeightLayout:
    """In-memory parameter name -> its `Piece`s on disk. A name without an entry is stored as it is."""

    def __init__(self, pieces: dict[str, list[Piece]]):
        self.pieces = {name: sorted(ps, key=lambda p: _sort_key(p.index)) for name, ps in pieces.items()}

    def disk_pieces(self, name: str, shape: Iterable[int]) -> list[Piece]:
        return self.pieces.get(name) or [Piece(name, full_index(shape))]

    def to_disk(self, name: str, tensor: torch.Tensor) -> Iterator[tuple[str, torch.Tensor]]:
        """(disk name, tensor) of one full in-memory tensor: itself, or its pieces (contiguous views or copies)."""
        pieces = self.pieces.get(name)
        if pieces is None:
            yield name, tensor
            return
        for p in pieces:
            yield p.disk, tensor[p.index].contiguous()

    def from_disk(self) -> dict[str, tuple[str, Index | None]]:
        """disk name -> (parameter name, index into it; None: the whole parameter), for names that differ."""
        return {p.disk: (name, p.index) for name, ps in self.pieces.items() for p in ps}

    def check_covers(self, shapes: dict[str, torch.Size]) -> None:
        """Raise unless each parameter's pieces fill it exactly (they are disjoint by construction)."""
        for name, ps in self.pieces.items():
            total = sum(_numel(p.index) for p in ps)
            expected = int(torch.Size(shapes[name]).numel())
            if total != expected:
                raise ValueError(f"the checkpoint's tensors for {name!r} cover {total} of its {expected} elements "
                                 f"(pieces {[p.disk for p in ps][:4]}...); is the checkpoint complete?")


def _sort_key(index: Index) -> tuple:
    return tuple(i if isinstance(i, int) else i.start for i in index)


@contextlib.contextmanager
def _plain_classes(model: nn.Module):
    """transformers looks conversions up by each sub-model's class name first; `fully_shard` renames the classes
    (`FSDPQwen2_5_VLForConditionalGeneration`), and the model-type fallback finds another (an inner model's)
    mapping. Present the original classes for the lookup, then put the FSDP ones back."""
    swapped = []
    for module in model.modules():
        cls = type(module)
        if cls.__name__.startswith("FSDP") and len(cls.__mro__) > 2:
            plain = next(c for c in cls.__mro__[1:] if not c.__name__.startswith("FSDP"))
            swapped.append((module, cls))
            module.__class__ = plain
    try:
        yield
    finally:
        for module, cls in swapped:
            module.__class__ = cls


def _conversions(model: nn.Module, *, add_legacy: bool):
    """(renamings, converters) of transformers' conversion mapping for `model`; ([], []) for other modules."""
    from transformers import PreTrainedModel
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import WeightConverter, WeightRenaming

    if not isinstance(model, PreTrainedModel):
        return [], []
    with _plain_classes(model):
        mapping = get_model_conversion_mapping(model, add_legacy=add_legacy)
    return ([m for m in mapping if isinstance(m, WeightRenaming)], [m for m in mapping if isinstance(m, WeightConverter)])


def _piece_index(converter, pattern: str, key: str, shape: tuple[int, ...]) -> Index:
    """Where the disk tensor `key` (after renamings; matched by `pattern` of `converter`) sits in the target."""
    from transformers.core_model_loading import Concatenate, MergeModulelist

    index: list[int | slice] = list(full_index(shape))
    position = converter.source_patterns.index(pattern)
    for op in converter.operations:
        if isinstance(op, MergeModulelist):
            found = re.search(re.escape(pattern.lstrip("^")).replace(r"\*", r"(\d+)"), key)
            if found is None or not found.groups():
                raise ValueError(f"cannot read the expert number of {key!r} off the pattern {pattern!r}")
            index.insert(op.dim, int(found.group(1)))
        elif isinstance(op, Concatenate):
            block = index[op.dim]
            if isinstance(block, int):
                raise ValueError(f"{converter}: concatenation along a stacked dim is not supported")
            width = block.stop - block.start
            index[op.dim] = slice(position * width, (position + 1) * width)
        else:
            raise ValueError(f"the checkpoint conversion {type(op).__name__} ({converter}) is not supported: rlbench "
                             "loads checkpoints whose transformers conversion only renames, stacks (MergeModulelist) "
                             "or concatenates (Concatenate) tensors; convert the checkpoint with from_pretrained + "
                             "save_pretrained first")
    return tuple(index)


def checkpoint_layout(model: nn.Module, disk_shapes: dict[str, tuple[int, ...]], *,
                      add_legacy: bool = True) -> tuple[WeightLayout, dict[str, str]]:
    """The layout of the checkpoint whose tensors are `disk_shapes` (name -> shape), for `model`'s parameters.

    Returns (layout, renamed): `renamed` maps a disk name stored whole under another in-memory name (a renaming)
    to that name; a disk name in neither is stored under its own name (or is unused by the model)."""
    from transformers.core_model_loading import rename_source_key

    renamings, converters = _conversions(model, add_legacy=add_legacy)
    if not renamings and not converters:
        return WeightLayout({}), {}
    own = {n: True for n, _ in model.named_parameters()} | {n: True for n, _ in model.named_buffers()}
    prefix = getattr(model, "base_model_prefix", None)
    by_pattern = {p: c for c in converters for p in c.source_patterns}
    pieces: dict[str, list[Piece]] = {}
    renamed: dict[str, str] = {}
    for key, shape in disk_shapes.items():
        target, pattern = rename_source_key(key, renamings, converters, prefix, own)
        if pattern is None:
            if target != key and target in own and key not in own:
                renamed[key] = target
            continue
        after_renames, _ = rename_source_key(key, renamings, [])
        pieces.setdefault(target, []).append(Piece(key, _piece_index(by_pattern[pattern], pattern, after_renames,
                                                                      tuple(shape))))
    for key, target in renamed.items():
        pieces[target] = [Piece(key, full_index(disk_shapes[key]))]
    return WeightLayout(pieces), renamed


def export_layout(model: nn.Module) -> WeightLayout:
    """The layout `save_pretrained` writes for `model` (transformers' reverse conversion, run on meta tensors)."""
    from transformers import PreTrainedModel
    from transformers.core_model_loading import revert_weight_conversion

    if not isinstance(model, PreTrainedModel) or not any(_conversions(model, add_legacy=False)):
        return WeightLayout({})
    meta = {n: torch.empty(p.shape, device="meta") for n, p in model.named_parameters()}
    disk = revert_weight_conversion(model, meta)
    if disk.keys() == meta.keys():
        return WeightLayout({})
    layout, _ = checkpoint_layout(model, {n: tuple(t.shape) for n, t in disk.items()}, add_legacy=False)
    layout.check_covers({n: t.shape for n, t in meta.items()})
    # a parameter the reverse rules only renamed (e.g. Mixtral's `mlp.gate` -> `block_sparse_moe.gate`)
    forward = {n for n in meta if n not in disk}
    missing = [n for n in forward if n not in layout.pieces]
    if missing:
        raise ValueError(f"no on-disk name found for {missing[:3]} (transformers' reverse conversion of "
                         f"{type(model).__name__})")
    return layout
