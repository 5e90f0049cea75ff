"""The generation seam: how one round of prompts becomes groups of samples (slime's `--custom-generate-function-path`).

    def generate(args: GenerateArgs, items: list[PromptItem], sampling: SamplingParams, seeds: list[int])
        -> list[list[Sample]]

`RolloutManager` calls the configured function once per generate round (training rounds and eval) with every
prompt of the round, so an embedded engine can batch all of them; around it the manager keeps dataset rounds,
dynamic sampling, rewards and eval. The function returns one group per item, `sampling.n` samples each, in item
order; each `Sample` carries the token ids the engine conditioned on and sampled (prompt first), the per-token
rollout log-probs, and a loss mask (0 on tokens the model did not sample, e.g. tool output). Sample j of item i
is seeded from `seeds[i] + j` (`engine.protocol.expand_seeds`), so a resumed run draws what the uninterrupted one
drew. Rewards are not the function's business: the manager scores every returned sample with the configured reward
(`Sample.response` is what it reads). `Sample.metadata` is free for per-sample records (turns, tool calls, why a
sample was truncated).

`single_turn` is the default (one `engine.generate` call); `rlbench.rollout.multiturn:generate` is the built-in
tool-calling one, on engine sessions. `load_generate_fn(path)` resolves `"module.path:function"` at start.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from rlbench.configs.checks import import_callable
from rlbench.engine.protocol import Generation, RolloutEngine, SamplingParams
from rlbench.types import Sample, Status

FINISH_STATUS = {"stop": Status.COMPLETED, "length": Status.TRUNCATED, "abort": Status.ABORTED}
"""`Generation.finish_reason` -> `Sample.status`."""


@dataclass
class GenerateArgs:
    """What a generate function gets besides the round's prompts (slime's `args`)."""

    engine: RolloutEngine
    """The rollout engine (use it through `rlbench.engine.protocol`; `supports_sessions(engine)` for multi-turn)."""
    tokenizer: Any
    """Decodes responses (`Sample.response`) and tokenizes what a function appends (tool observations)."""
    cfg: Any
    """The run's `RolloutConfig` (`cfg.multiturn` for tool calling)."""
    on_sample: Callable[[int, Sample], None] | None = None
    """When set, call it with `(i * n + j, sample)` as soon as a sample is final (the object returned for it): the
    manager scores it while the rest generate. Optional: a sample never reported is scored after the call."""


GenerateFn = Callable[[GenerateArgs, Sequence[Any], SamplingParams, Sequence[int]], list[list[Sample]]]


def cut_at(gen: Generation, token_id: int | None) -> Generation:
    """`gen` ending before its first `token_id` (finish reason "length"), or `gen` itself when it has none.

    A VLM's response must not hold its image placeholder: the training forward would take it for an image's place
    (the HF forward scatters the images into every placeholder of the row). The kept prefix is exactly what the engine
    sampled, with its log-probs."""
    if token_id is None or token_id not in gen.token_ids:
        return gen
    k = gen.token_ids.index(token_id)
    return Generation(gen.prompt_index, gen.token_ids[:k], gen.log_probs[:k], "length", gen.weight_version,
                      gen.sample_index, gen.session)


def to_sample(item, gen: Generation, tokenizer, image_token_id: int | None = None) -> Sample:
    """A Sample from a prompt item and one single-turn generation (response decoded for the reward); with
    `image_token_id` (a round with images) the response ends before a sampled image placeholder (`cut_at`)."""
    gen = cut_at(gen, image_token_id)
    return Sample(
        tokens=list(item.prompt_token_ids) + list(gen.token_ids),
        response_length=len(gen.token_ids),
        rollout_log_probs=[float(x) for x in gen.log_probs],
        weight_version=gen.weight_version,
        status=FINISH_STATUS[gen.finish_reason],
        prompt=item.prompt,
        label=item.label,
        response=tokenizer.decode(gen.token_ids, skip_special_tokens=True),
        metadata=dict(item.metadata),
        images=getattr(item, "images", None),
    )


def single_turn(args: GenerateArgs, items: Sequence[Any], sampling: SamplingParams,
                seeds: Sequence[int]) -> list[list[Sample]]:
    """The default: one `engine.generate` call, `sampling.n` completions per prompt. An engine whose `generate`
    takes `on_finish` (the torch engine) reports each sample as it stops, which goes on to `args.on_sample`."""
    n, engine = sampling.n, args.engine
    early: dict[int, Sample] = {}

    def on_finish(g: Generation) -> None:
        index = g.prompt_index * n + g.sample_index
        early[index] = to_sample(items[g.prompt_index], g, args.tokenizer, image_id)
        args.on_sample(index, early[index])

    params = inspect.signature(engine.generate).parameters
    reports = args.on_sample is not None and "on_finish" in params
    kwargs = {"on_finish": on_finish} if reports else {}
    images = [getattr(it, "images", None) for it in items]
    image_id = None
    if any(im is not None for im in images):
        from rlbench.data.images import IMAGE_TOKEN

        image_id = args.tokenizer.convert_tokens_to_ids(IMAGE_TOKEN)
        if "images" not in params:
            raise ValueError(f"the prompts have images but {type(engine).__name__}.generate takes token ids only; "
                             "use --rollout-engine torch for a vision-language model")
        kwargs["images"] = images
    gens = engine.generate([it.prompt_token_ids for it in items], sampling, seeds=seeds, **kwargs)
    if len(gens) != len(items) * n:
        raise RuntimeError(f"engine returned {len(gens)} generations for {len(items)} prompts x n={n}")
    flat = [early.get(g.prompt_index * n + g.sample_index)
            or to_sample(items[g.prompt_index], g, args.tokenizer, image_id) for g in gens]
    return [flat[i * n : (i + 1) * n] for i in range(len(items))]


def load_generate_fn(path: str | None) -> GenerateFn:
    """The generate function of `rollout.custom_generate_function_path` (None: `single_turn`).

    Raises ValueError naming the problem and the fix: a module that does not import, a missing attribute (with "did
    you mean"), something not callable, an `async def` (the engines here are called synchronously), or a function
    that cannot take `(args, items, sampling, seeds)`.
    """
    if path is None:
        return single_turn
    where = f"custom_generate_function_path={path!r}"
    fn = import_callable(path, where)
    if inspect.iscoroutinefunction(fn):
        raise ValueError(f"{where} is an async function; define it with plain `def` (rlbench's engines are called "
                         "synchronously, and one call covers a whole round of prompts)")
    try:
        inspect.signature(fn).bind(None, None, None, None)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"{where} must take (args, items, sampling, seeds) and return a list of sample groups "
                         f"(rlbench.rollout.generate.GenerateFn): {exc}") from exc
    return fn


def check_groups(groups, n_items: int, n: int, name: str) -> list[Sample]:
    """The generate function's result flattened (group by group), after checking its shape and types."""
    fix = f"return one list of n={n} Samples per prompt item, in item order"
    if not isinstance(groups, list) or len(groups) != n_items:
        got = f"{len(groups)} groups" if isinstance(groups, list) else type(groups).__name__
        raise RuntimeError(f"generate function {name} returned {got} for {n_items} prompt items; {fix}")
    flat = []
    for i, group in enumerate(groups):
        if not isinstance(group, list) or len(group) != n:
            got = f"{len(group)} samples" if isinstance(group, list) else type(group).__name__
            raise RuntimeError(f"generate function {name} returned {got} for prompt item {i}; {fix}")
        for j, s in enumerate(group):
            if not isinstance(s, Sample):
                raise RuntimeError(f"generate function {name} returned a {type(s).__name__} as sample {j} of item {i}; "
                                   f"{fix} (rlbench.types.Sample)")
            if s.rollout_log_probs is None:
                raise RuntimeError(f"generate function {name}: sample {j} of item {i} has no rollout_log_probs; set "
                                   "one per response token (0.0 where loss_mask is 0)")
        flat += group
    return flat
