"""The CLI's flags, generated from the config dataclasses: one flag per field, slime's name where slime has the
setting (`FLAG_NAMES`), help from the field's docstring (`field_docs`). `rlbench.cli.build_parser` builds the
parser from `config_flags()`; parsing imports no torch."""

from __future__ import annotations

import argparse
import ast
import dataclasses
import functools
import json
import sys
import types
import typing
from typing import Any

# (section path, field) -> flag. Sections: data, backend, backend.optim, backend.fsdp, loss, rollout, batch, engine,
# weights, eval, logging, checkpoint, task, and "" for RunConfig's own scalar fields.
FLAG_NAMES: dict[tuple[str, str], str] = {
    ("backend", "model"): "--hf-checkpoint",
    ("backend", "ref_model"): "--ref-load",
    ("backend", "seed"): "--model-seed",
    ("backend", "cp_size"): "--context-parallel-size",
    ("backend.fsdp", "cpu_offload"): "--fsdp-cpu-offload",
    ("backend", "checkpoint_dir"): "--backend-checkpoint-dir",
    ("backend.optim", "lr_schedule"): "--lr-decay-style",
    ("backend.optim", "warmup_steps"): "--lr-warmup-iters",
    ("backend.optim", "warmup_init_lr"): "--lr-warmup-init",
    ("backend.optim", "decay_steps"): "--lr-decay-iters",
    ("backend.optim", "eps"): "--adam-eps",
    ("data", "path"): "--prompt-data",
    ("data", "max_prompt_length"): "--rollout-max-prompt-len",
    ("data", "shuffle"): "--rollout-shuffle",
    ("data", "seed"): "--rollout-seed",
    ("rollout", "max_response_len"): "--rollout-max-response-len",
    ("rollout", "temperature"): "--rollout-temperature",
    ("rollout", "top_p"): "--rollout-top-p",
    ("rollout", "top_k"): "--rollout-top-k",
    ("rollout", "seed"): "--sampling-seed",
    ("eval", "interval"): "--eval-interval",
    ("eval", "data_path"): "--eval-prompt-data",
    ("eval", "n_samples_per_prompt"): "--n-samples-per-eval-prompt",
    ("eval", "skip_before_train"): "--skip-eval-before-train",
    ("eval", "max_prompts"): "--eval-max-prompts",
    ("weights", "bucket_bytes"): "--update-weight-buffer-size",
    ("weights", "verify"): "--check-weight-update-equal",
    ("checkpoint", "save_dir"): "--save",
    ("checkpoint", "load_dir"): "--load",
    ("checkpoint", "save_interval"): "--save-interval",
    ("logging", "tensorboard_dir"): "--tensorboard-dir",
    ("logging", "wandb_run_name"): "--wandb-run-name",
    ("logging", "console"): "--console",
    ("logging", "jsonl_path"): "--metrics-jsonl",
    ("logging", "wandb_project"): "--wandb-project",
    ("task", "name"): "--task",
    ("cluster", "colocate"): "--colocate",
    ("engine.megakernel", "enabled"): "--engine-megakernel",
    ("megatron", "attention"): "--megatron-attention",
    ("backend.critic", "load"): "--critic-load",
    ("backend.critic", "lr"): "--critic-lr",
    ("backend.critic", "lr_warmup_iters"): "--critic-lr-warmup-iters",
    ("backend.critic", "num_critic_only_steps"): "--num-critic-only-steps",
}


# Sections whose field names are used bare (`--eps-clip`, `--global-batch-size`, `--lr`).
BARE_SECTIONS = ("loss", "batch", "backend.optim", "backend.fsdp", "rollout", "rollout.multiturn", "backend", "data",
                 "cluster", "megatron", "")


SKIP = {("loss", "mis"), ("backend", "model_overrides"), ("backend", "optim"), ("backend", "fsdp"), ("backend", "critic"),
        ("backend", "batch_invariant"), ("engine", "batch_invariant"),  # both follow --true-on-policy-mode
        ("logging", "console_keys"), ("backend.optim", "betas"), ("", "task"), ("engine", "megakernel"),
        ("engine.megakernel", "sync"), ("engine.megakernel", "gluon"), ("engine.megakernel", "head"),
        ("rollout", "multiturn")}


# Nested sections: "parent.field" -> the dataclass held in that field.
NESTED = ("backend.optim", "backend.fsdp", "backend.critic", "engine.megakernel", "rollout.multiturn")


def section_types() -> dict[str, type]:
    from rlbench.configs import RunConfig

    hints = typing.get_type_hints(RunConfig)
    out = {"": RunConfig}
    for f in dataclasses.fields(RunConfig):
        cls = _dataclass_of(hints[f.name])
        if cls is not None:
            out[f.name] = cls
    for nested in NESTED:
        parent, name = nested.split(".")
        out[nested] = _dataclass_of(typing.get_type_hints(out[parent])[name])
    return out


def _dataclass_of(tp) -> type | None:
    """The dataclass in `tp` (unwrapping `X | None`), or None."""
    if dataclasses.is_dataclass(tp):
        return tp
    args = [a for a in typing.get_args(tp) if a is not type(None)]
    return args[0] if len(args) == 1 and dataclasses.is_dataclass(args[0]) else None


@functools.lru_cache(maxsize=1)
def config_flags() -> dict[str, tuple[str, str, Any, str]]:
    """flag -> (section, field, type, help) for every configurable field."""
    sections = section_types()
    raw: list[tuple[str, str, Any, str]] = []
    for section, cls in sections.items():
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            if (section, f.name) in SKIP or (section == "" and _dataclass_of(hints[f.name])):
                continue
            raw.append((section, f.name, hints[f.name], field_doc(cls, f.name)))
    bare_count: dict[str, int] = {}
    for section, name, _, _ in raw:
        if section in BARE_SECTIONS and (section, name) not in FLAG_NAMES:
            bare_count[name] = bare_count.get(name, 0) + 1
    flags = {}
    for section, name, tp, doc in raw:
        flag = FLAG_NAMES.get((section, name))
        if flag is None:
            bare = section in BARE_SECTIONS and bare_count.get(name) == 1
            flag = "--" + (name if bare else f"{section.replace('.', '-')}-{name}").replace("_", "-")
        assert flag not in flags, f"duplicate flag {flag} for {section}.{name} and {flags[flag][:2]}"
        flags[flag] = (section, name, tp, doc)
    return flags


@functools.cache
def _module_classes(path: str) -> dict[str, ast.ClassDef]:
    """Top-level classes of a source file, parsed once."""
    with open(path, encoding="utf-8") as f:
        tree = ast.parse(f.read(), filename=path)
    return {node.name: node for node in tree.body if isinstance(node, ast.ClassDef)}


@functools.cache
def field_docs(cls) -> dict[str, str]:
    """field -> the docstring under it in `cls`'s source, whitespace folded to one line ('' when missing)."""
    path = getattr(sys.modules.get(cls.__module__), "__file__", None)
    node = _module_classes(path).get(cls.__name__) if path else None
    if node is None:
        return {}
    docs = {}
    for stmt, nxt in zip(node.body, node.body[1:]):
        if (isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name)
                and isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant)
                and isinstance(nxt.value.value, str)):
            docs[stmt.target.id] = " ".join(nxt.value.value.split())
    return docs


def field_doc(cls, name: str) -> str:
    """The docstring under a dataclass field, '%'-escaped for argparse, or ''."""
    return field_docs(cls).get(name, "").replace("%", "%%")


def _reward_weights(text: str) -> dict:
    """argparse type of --reward-weights: `math:1,rm:0.5` or a JSON object."""
    from rlbench.configs.rollout import parse_reward_weights

    try:
        return parse_reward_weights(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


FLAG_TYPES = {"--reward-weights": {"type": _reward_weights}}
"""Flags whose argparse options are not those of their field's type (a dict written as name:weight,...)."""


def argparse_kwargs(tp) -> dict:
    """argparse options for a field type: bools get --x/--no-x, tuples take several values."""
    args = [a for a in typing.get_args(tp) if a is not type(None)]
    base = args[0] if typing.get_origin(tp) in (typing.Union, types.UnionType) and len(args) == 1 else tp
    optional = base is not tp  # `X | None`: the word none unsets it (`--label-key none`: rows without labels)
    if base is bool:
        return {"action": argparse.BooleanOptionalAction}
    if typing.get_origin(base) is tuple:
        return {"nargs": "+", "type": typing.get_args(base)[0]}
    if base in (int, float, str):
        return {"type": _or_none(base) if optional else base}
    return {"type": json.loads}  # dicts and anything else: JSON (null unsets an optional one)


def _or_none(base: type):
    """An argparse type: `none` (any case) -> None, anything else -> `base(text)`."""
    def parse(text: str):
        return None if text.lower() == "none" else base(text)

    parse.__name__ = base.__name__  # argparse names the type in its "invalid int value" message
    return parse


class Parser(argparse.ArgumentParser):
    """An ArgumentParser whose errors are one line (the sub-commands' usage lists hundreds of flags)."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (`{self.prog} --help` lists every flag)\n")
