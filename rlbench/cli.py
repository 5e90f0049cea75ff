"""`rlbench train|sft|demo|bench|experiment ...`: slime-named flags generated from the config dataclasses.

    python -m rlbench.cli demo                          # SFT warm start (cached) + GRPO on arithmetic (make run)
    python -m rlbench.cli demo --seed 1                 # the same warm start, other rollout draws and prompt order
    rlbench demo --device cuda                          # the same task at the Qwen3-0.6B shape on one GPU (cuda_demo)
    rlbench train --preset cpu_demo --num-rollout 5 --lr 1e-4   # the same warm start, 5 steps
    rlbench train --hf-checkpoint DIR --prompt-data mine.jsonl --eval-prompt-data held_out.jsonl --eval-interval 5
    rlbench train --preset cpu_demo --print-config      # the resolved RunConfig as JSON
    rlbench train --hf-checkpoint DIR --prompt-data mine.jsonl   # no preset: sizes from the device and the data
    rlbench bench --hf-checkpoint DIR                   # qwen3-0.6b-shape loop on one GPU, per-phase times
    rlbench bench e2e [--preset qwen3-4b-shape] [--no-trl]  # the whole loop beside TRL's GRPOTrainer (benchmarks/e2e.py)
    rlbench sft --preset small --task arithmetic --out runs/sft
    rlbench rm --data prefs.jsonl --hf-checkpoint runs/sft --out runs/rm     # a reward model (docs/reward_model.md)
    rlbench train --reward-model runs/rm --reward-weights math:1,rm:0.5      # ... served beside the rule reward
    rlbench experiment cp-oom --preset qwen3-4b-shape --cp 1 2 4 --ac on off --out runs/cp_oom

Every config field has one flag. Its name is slime's where slime has that setting (`rlbench.cli_flags.FLAG_NAMES`), otherwise
`--{field}` (or `--{section}-{field}` when the bare name is ambiguous). Flags only override fields of
the chosen preset; `build_parser()` and `FLAG_NAMES` are the single source, so names never drift.

Parsing imports no torch (`--help` and a bad flag answer in a fraction of a second). A mistake is one line
naming the flag and the fix (an unknown flag gets "did you mean"; config errors are reworded from field
names to flags, `engine.max_seq_len` -> `--engine-max-seq-len`); `--debug` shows the traceback instead.
Each run writes its metrics to a fresh `runs/<preset>-<time>/` (`--run-dir` to choose), and with two evals or
more a `curve.png` of held-out pass@k beside them.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import inspect
import json
import os
import re
import sys
import typing

from rlbench.cli_flags import (
    FLAG_TYPES,
    NESTED,
    Parser,
    argparse_kwargs,
    config_flags,
    field_doc,
    section_types,
)
from rlbench.cli_run import WARM_STARTS, device_sft_dir, ensure_device_sft, ensure_sft, run_train

PRESETS = ("cpu_demo", "cpu_test", "qwen3_0p6b_gpu", "cuda_demo")
MODEL_FLAGS = ("hf_checkpoint", "ref_load", "critic_load")
"""Flags that take a model: an HF directory or a model preset name."""
FILE_FLAGS = ("prompt_data", "eval_prompt_data")
"""Flags that take an existing data file."""
QUICKSTART_ARGS = {"hf_checkpoint": "model", "prompt_data": "data", "eval_prompt_data": "eval_data",
                   "device": "device", "input_key": "input_key", "label_key": "label_key",
                   "rollout_max_prompt_len": "max_prompt_len", "rollout_max_response_len": "max_response_len",
                   "engine_max_seq_len": "max_seq_len"}
"""`rlbench quickstart` flags the config is derived from (flag dest -> `presets.quickstart` argument); the other
flags are applied after, as for `rlbench train`."""


def build_parser() -> argparse.ArgumentParser:
    """The `rlbench` parser with its sub-commands (`.commands`: name -> sub-parser)."""
    parser = argparse.ArgumentParser(prog="rlbench", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True, parser_class=Parser)
    for name, help_ in (("train", "GRPO/PPO training: your --hf-checkpoint DIR + --prompt-data FILE (sizes derived "
                                  "from the device and the data), or a preset + flags"),
                        ("demo", "SFT warm start (cached) then GRPO on arithmetic; what `make run` runs"),
                        ("bench", "a few colocated GRPO steps with per-phase times (GPU); "
                                  "`rlbench bench e2e --help`: the whole loop beside TRL"),
                        ("quickstart", "GRPO on --hf-checkpoint DIR + --prompt-data FILE without a preset: device, "
                                       "dtype, sizes and --engine-max-seq-len chosen for you; any train flag")):
        p = sub.add_parser(name, help=help_, argument_default=argparse.SUPPRESS)
        if name == "quickstart":
            p.set_defaults(preset="quickstart")
        else:
            default_preset = {"bench": "qwen3_0p6b_gpu"}.get(name)
            p.add_argument("--preset", choices=PRESETS, default=default_preset, help="base configuration" + {
                "train": " (default: derived from --hf-checkpoint DIR and --prompt-data FILE, as quickstart does; "
                         "cpu_demo without them)",
                "demo": " (default: cuda_demo with --device cuda, cpu_demo otherwise)"}.get(name, ""))
        p.add_argument("--print-config", action="store_true", default=False, help="print the RunConfig and exit")
        p.add_argument("--debug", action="store_true", default=False,
                       help="on an error, raise it with its traceback instead of the one-line message")
        p.add_argument("--run-dir", default=None,
                       help="where this run writes its metrics (default: a fresh runs/<preset>-<time>/)")
        p.add_argument("--adam-beta1", type=float, help="AdamW beta1")
        p.add_argument("--adam-beta2", type=float, help="AdamW beta2")
        if name == "demo":
            p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: min(2, the cores) "
                           "on the CPU, torch's own on a GPU; the CPU demo's timings are for 2 idle cores)")
        if name != "quickstart":  # quickstart starts from your model: no warm start
            p.add_argument("--sft-steps", type=int, default=None, help="SFT warm-start max steps (when it is "
                           "built: cpu presets without --hf-checkpoint, bench)")
            p.add_argument("--sft-dir", default=None, help="where the SFT warm start is cached (default: the user cache)")
        for flag, (_, _, tp, doc) in config_flags().items():
            p.add_argument(flag, help=doc, **(FLAG_TYPES.get(flag) or argparse_kwargs(tp)))
    rm = sub.add_parser("rm", help="train a reward model on preference pairs (see rlbench rm --help)", add_help=False)
    rm.add_argument("rest", nargs=argparse.REMAINDER)
    sft = sub.add_parser("sft", help="SFT warm start (see python -m rlbench.sft --help)", add_help=False)
    sft.add_argument("rest", nargs=argparse.REMAINDER)
    exp = sub.add_parser("experiment", help="an experiment (cp-oom, fsdp-vs-megatron; see rlbench experiment NAME --help)", add_help=False)
    exp.add_argument("rest", nargs=argparse.REMAINDER)
    parser.commands = sub.choices
    return parser


def unknown_args_errors(command: str, extra: list[str], known: list[str]) -> list[str]:
    """One line per argument the parser did not know: an unknown flag with its closest known flags, or a stray value."""
    lines, after_unknown_flag = [], False
    for arg in extra:
        if arg.startswith("-"):
            name = arg.split("=", 1)[0]
            close = difflib.get_close_matches(name, known, n=3, cutoff=0.6)
            hint = f"; did you mean {' or '.join(close)}?" if close else f"; `rlbench {command} --help` lists every flag"
            lines.append(f"rlbench {command}: error: unknown flag {name}{hint}")
            after_unknown_flag = "=" not in arg
        elif not after_unknown_flag:  # the value of an unknown flag is not a second error
            lines.append(f"rlbench {command}: error: unexpected argument {arg!r} (a boolean flag takes no value: "
                         "--x or --no-x)")
        else:
            after_unknown_flag = False
    return lines


def flag_message(message: str) -> str:
    """`message` with config field names written as the flags that set them: `section.field` always; a bare
    `field=` when one flag sets it, or the word before it names the section, or one candidate is the only one
    outside `eval` (eval's own messages say "eval ...")."""
    flags = config_flags()
    by_path = {f"{sec}.{name}" if sec else name: flag for flag, (sec, name, _, _) in flags.items()}
    by_name: dict[str, list[tuple[str, str]]] = {}
    for flag, (sec, name, _, _) in flags.items():
        by_name.setdefault(name, []).append((sec, flag))
    message = re.sub(r"(?<![\w.-])[a-z_]+(?:\.[a-z_]+)+\b", lambda m: by_path.get(m.group(0), m.group(0)), message)

    def bare(m: re.Match) -> str:
        word, name = m.group(1), m.group(2)
        found = by_name.get(name, [])
        for keep in (lambda sec, flag: sec == word, lambda sec, flag: sec != "eval"):
            if len(found) > 1:
                found = [c for c in found if keep(*c)] or found
        return m.group(0)[: m.start(2) - m.start(0)] + (found[0][1] if len(found) == 1 else name)

    message = re.sub(r"(?<![\w.-])(?:([a-z]+) )?([a-z][a-z0-9_]*)(?==)", bare, message)
    return re.sub(r"(--[\w-]+) \(\1\)", r"\1", message)


def check_paths(args: argparse.Namespace) -> None:
    """Raise ValueError naming the flag when a given model path, data file or reward model does not exist."""
    given = vars(args)
    rm = given.get("reward_model")
    if rm is not None:
        from rlbench.models.value_head import value_dir_problem

        what = value_dir_problem(os.path.expanduser(rm))
        if what:
            raise ValueError(f"--reward-model {rm}: {what} (from {os.getcwd()}); give the directory `rlbench rm "
                             "--out DIR` wrote")
    for dest in MODEL_FLAGS:
        value = given.get(dest)
        flag = "--" + dest.replace("_", "-")
        if value is None:
            continue
        path = os.path.expanduser(value)
        if os.path.isdir(path) and not os.path.isfile(os.path.join(path, "config.json")):
            raise ValueError(f"{flag} {value}: the directory has no config.json, so it is not a Hugging Face model "
                             "directory; give the directory holding config.json and the weights")
        if not os.path.isdir(path) and (os.sep in value or value.startswith((".", "~"))):
            raise ValueError(f"{flag} {value}: no such directory (from {os.getcwd()}); give a Hugging Face model "
                             "directory (config.json + weights) or a model preset such as tiny or small")
    for dest in FILE_FLAGS:
        value = given.get(dest)
        if value is not None and not os.path.isfile(value):
            raise ValueError(f"--{dest.replace('_', '-')} {value}: no such file (from {os.getcwd()}); "
                             "give an existing .jsonl or .parquet file")


def apply_flags(cfg, args: argparse.Namespace):
    """A copy of `cfg` with every given flag applied (sections re-validated); the Adam betas are two flags.

    Your own `--prompt-data` replaces the preset's synthetic task: without `--eval-prompt-data` there is no
    evaluation (`eval.interval` None unless `--eval-interval` asks for it, which then needs the eval file), so
    nothing is evaluated on the preset's data.
    """
    given = vars(args)
    updates: dict[str, dict] = {}
    for flag, (section, name, _, _) in config_flags().items():
        dest = flag[2:].replace("-", "_")
        if dest in given:
            updates.setdefault(section, {})[name] = given[dest]
    if "prompt_data" in given and "task" not in given:
        updates.setdefault("", {})["task"] = None
        if "eval_prompt_data" not in given and "eval_interval" not in given:
            updates.setdefault("eval", {})["interval"] = None
    if "adam_beta1" in given or "adam_beta2" in given:
        b1, b2 = cfg.backend.optim.betas
        updates.setdefault("backend.optim", {})["betas"] = (given.get("adam_beta1", b1), given.get("adam_beta2", b2))
    for nested in NESTED:  # a nested section's update becomes one field of its parent's update
        if nested in updates:
            parent, name = nested.split(".")
            fields = updates.pop(nested)
            current = getattr(getattr(cfg, parent), name)  # None: an optional section (the critic) starts default
            current = section_types()[nested]() if current is None else current
            updates.setdefault(parent, {})[name] = dataclasses.replace(current, **fields)
    sections = {section: dataclasses.replace(getattr(cfg, section), **fields)
                for section, fields in updates.items() if section}
    return dataclasses.replace(cfg, **sections, **updates.get("", {}))


def preset_config(args: argparse.Namespace, model: str | None = None):
    """The preset's RunConfig with the flags applied. The model: `model`, else `--hf-checkpoint`, else the warm
    start directory of a preset that has one (`WARM_STARTS`; not built here) or the Qwen3-0.6B shape; the metrics
    go to `--run-dir` or a fresh `runs/<preset>-<time>/`. An open `--preset` is `resolve_preset`'s (the derived
    config is `quickstart_config`)."""
    from rlbench import presets

    preset_name = resolve_preset(args)
    model = model or getattr(args, "hf_checkpoint", None)
    if model is None:
        warm = WARM_STARTS.get(preset_name)
        model = (args.sft_dir or presets.demo_sft_dir(warm)) if warm else "qwen3-0.6b-shape"
    workdir = getattr(args, "run_dir", None) or presets.new_run_dir(args.preset.replace("_", "-"))
    preset = getattr(presets, args.preset)
    # --seed also seeds a task preset's rollouts (sampling and prompt order), so that it picks another RL run.
    seeded = {"seed": args.seed} if "seed" in vars(args) and "seed" in inspect.signature(preset).parameters else {}
    return apply_flags(preset(model=model, workdir=workdir, **seeded), args)


def resolve_preset(args: argparse.Namespace) -> str:
    """`args.preset`, filled in where it was left open: `demo --device cuda` runs `cuda_demo`, any other `demo`
    or `train` `cpu_demo` (`train` with a model and data derives its config instead: `derives_config`)."""
    if args.preset is None:
        cuda = str(vars(args).get("device", "cpu")).startswith("cuda")
        args.preset = "cuda_demo" if args.command == "demo" and cuda else "cpu_demo"
    return args.preset


def check_device(cfg, args: argparse.Namespace) -> None:
    """Raise ValueError naming the fix when the run is on CUDA and this machine has none (before anything is built:
    the warm start, the model)."""
    if not str(cfg.backend.device).startswith("cuda"):
        return
    import torch

    if torch.cuda.is_available():
        return
    asked = f"--device {cfg.backend.device}" if "device" in vars(args) else f"--preset {args.preset} (a GPU preset)"
    fix = "run `rlbench demo` without --device for the CPU demo" if args.command == "demo" else \
        "give --device cpu with a CPU preset (cpu_demo, cpu_test)"
    raise ValueError(f"{asked}: no CUDA device here (torch {torch.__version__}: torch.cuda.is_available() is False); "
                     f"{fix}, or run on a machine with an NVIDIA GPU and a CUDA build of torch")


def check_quickstart_paths(args: argparse.Namespace) -> None:
    """Raise ValueError naming the flag unless `--hf-checkpoint` is a model directory with a tokenizer and
    `--prompt-data` is given (`check_paths` checks that the files exist)."""
    given = vars(args)
    if "hf_checkpoint" not in given or "prompt_data" not in given:
        raise ValueError("quickstart needs --hf-checkpoint DIR (a Hugging Face model directory) and --prompt-data "
                         "FILE.jsonl (rows with a prompt and a label)")
    model = given["hf_checkpoint"]
    if not os.path.isdir(os.path.expanduser(model)):
        raise ValueError(f"--hf-checkpoint {model}: no such directory (from {os.getcwd()}); quickstart takes a "
                         "Hugging Face model directory (config.json + weights + tokenizer files)")
    if not any(os.path.isfile(os.path.join(os.path.expanduser(model), name))
               for name in ("tokenizer.json", "tokenizer_config.json")):
        raise ValueError(f"--hf-checkpoint {model}: no tokenizer files (tokenizer.json / tokenizer_config.json); "
                         "save the tokenizer beside the model (tokenizer.save_pretrained(DIR))")


def quickstart_config(args: argparse.Namespace):
    """`presets.quickstart` from the flags it derives sizes from (`QUICKSTART_ARGS`), then every flag applied.
    Returns (config, the longest prompt in tokens, measured once here when no flag gives the engine's length,
    else None)."""
    from rlbench import presets

    given = vars(args)
    kwargs = {arg: given[dest] for dest, arg in QUICKSTART_ARGS.items() if dest in given}
    kwargs["model"] = os.path.expanduser(kwargs["model"])
    if "max_seq_len" not in kwargs and "max_prompt_len" not in kwargs:
        measured = ("model", "data", "eval_data", "input_key", "label_key")
        kwargs["prompt_len"] = presets.quickstart_prompt_len(**{k: kwargs[k] for k in measured if k in kwargs})
    cfg = presets.quickstart(**kwargs, workdir=given.get("run_dir") or presets.new_run_dir(args.command))
    return apply_flags(cfg, args), kwargs.get("prompt_len")


def quickstart_summary(cfg, args: argparse.Namespace) -> str:
    """The choices `rlbench quickstart` made, one line each, with the flag that changes each."""
    given = vars(args)
    r, b, e = cfg.rollout, cfg.batch, cfg.eval
    seq_from = "given" if "engine_max_seq_len" in given else "longest prompt + max response, rounded up to 16"
    evaluation = f"{e.data_path} every {e.interval} rollouts (--eval-interval)" if e.interval else \
        "none (--eval-prompt-data FILE)"
    lines = [
        f"model      {cfg.backend.model} on {cfg.backend.device}, {cfg.backend.param_dtype} (--device, --param-dtype)",
        f"data       {cfg.data.path}: prompt key {cfg.data.input_key!r}, label key {cfg.data.label_key!r} "
        "(--input-key, --label-key)",
        f"reward     {r.rm_type} (--rm-type)",
        f"lengths    max response {r.max_response_len} (--rollout-max-response-len), engine max_seq_len "
        f"{cfg.engine.max_seq_len} ({seq_from}; --engine-max-seq-len)",
        f"batch      {r.rollout_batch_size} prompts x {r.n_samples_per_prompt} samples per rollout, global batch "
        f"{b.global_batch_size}, {b.num_rollout} rollouts (--rollout-batch-size, --n-samples-per-prompt, "
        "--global-batch-size, --num-rollout)",
        f"eval       {evaluation}",
        f"metrics    {cfg.logging.jsonl_path}",
    ]
    return "\n".join([f"[rlbench] {args.command}:", *("  " + line for line in lines)])


def derivations(cfg, args: argparse.Namespace, prompt_len: int | None) -> dict[str, str]:
    """How each derived value of a config without a preset was chosen ("given" when a flag set it): the
    `derived` part of `--print-config`. `prompt_len`: the longest prompt `quickstart_config` measured (None when
    a flag gave the engine's length or the prompt limit)."""
    from rlbench.presets import QUICKSTART_MAX_RESPONSE_LEN

    given = vars(args)
    device, r, b = cfg.backend.device, cfg.rollout, cfg.batch

    def why(dest: str, value, reason: str) -> str:
        return f"{value} (given: --{dest.replace('_', '-')})" if dest in given else f"{value} ({reason})"

    if "engine_max_seq_len" in given:
        seq = f"{cfg.engine.max_seq_len} (given: --engine-max-seq-len, rounded up to 16)"
    else:
        if "rollout_max_prompt_len" in given:
            prompt = f"--rollout-max-prompt-len {given['rollout_max_prompt_len']}"
        else:
            files = [f for f in (cfg.data.path, cfg.eval.data_path) if f]
            prompt = f"the longest prompt, {prompt_len} tokens in {' and '.join(files)} with the model's tokenizer"
        seq = f"{cfg.engine.max_seq_len} ({prompt} + max response {r.max_response_len}, rounded up to 16)"
    cuda = "a CUDA device is present" if device == "cuda" else "no CUDA device"
    return {
        "backend.device": why("device", device, cuda),
        "backend.param_dtype": why("param_dtype", cfg.backend.param_dtype, "bf16 on cuda, fp32 on cpu"),
        "rollout.max_response_len": why("rollout_max_response_len", r.max_response_len,
                                        f"the {device} default; cpu {QUICKSTART_MAX_RESPONSE_LEN['cpu']}, "
                                        f"cuda {QUICKSTART_MAX_RESPONSE_LEN['cuda']}"),
        "engine.max_seq_len": seq,
        "engine.num_slots": why("engine_num_slots", cfg.engine.num_slots,
                                "None: sized at start from the free memory x --engine-mem-fraction on a GPU, "
                                "8 on a CPU"),
        "rollout.rollout_batch_size": why("rollout_batch_size", r.rollout_batch_size, f"the {device} default"),
        "rollout.n_samples_per_prompt": why("n_samples_per_prompt", r.n_samples_per_prompt, f"the {device} default"),
        "batch.global_batch_size": why("global_batch_size", b.global_batch_size, f"the {device} default"),
        "batch.max_tokens_per_gpu": why("max_tokens_per_gpu", b.max_tokens_per_gpu,
                                        "the device default, at least the engine's max_seq_len"),
        "eval.interval": why("eval_interval", cfg.eval.interval,
                             "every 5 rollouts with --eval-prompt-data" if cfg.eval.data_path else
                             "no --eval-prompt-data: no evaluation"),
    }


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["sft"]:
        from rlbench.sft import main as sft_main

        sft_main(argv[1:])
        return 0
    if argv[:1] == ["rm"]:
        return run_rm_command(argv[1:])
    if argv[:1] == ["experiment"]:
        from rlbench.experiments import run_experiment

        return run_experiment(argv[1:])
    if argv[:2] == ["bench", "e2e"]:
        return run_bench_e2e(argv[2:])
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra:
        known = [s for a in parser.commands[args.command]._actions for s in a.option_strings]
        print("\n".join(unknown_args_errors(args.command, extra, known)), file=sys.stderr)
        return 2
    try:
        return run_command(args)
    except ValueError as exc:
        if args.debug:
            raise
        print(f"rlbench {args.command}: error: {flag_message(str(exc))} (--debug: the traceback)", file=sys.stderr)
        return 2


def derives_config(args: argparse.Namespace) -> bool:
    """Whether the config is derived from the model and the data (`presets.quickstart`) instead of a preset:
    `quickstart`, and `train` without `--preset` given a model directory and a prompt file. `train` without
    either keeps the `cpu_demo` preset (`args.preset` is set to it here)."""
    if args.command == "quickstart":
        return True
    if args.command != "train" or args.preset is not None:
        return False
    given = vars(args)
    model = given.get("hf_checkpoint")
    if model is not None and os.path.isdir(os.path.expanduser(model)) and "prompt_data" in given:
        return True
    args.preset = "cpu_demo"
    return False


def run_command(args: argparse.Namespace) -> int:
    """`train`, `demo`, `bench` or `quickstart` from parsed flags: check paths, build the config, print it, or check
    the device, build the warm start it starts from when missing, and train."""
    derived = derives_config(args)
    if derived:
        check_quickstart_paths(args)
    check_paths(args)
    given_model = getattr(args, "hf_checkpoint", None)
    warm = not derived and given_model is None and resolve_preset(args) in WARM_STARTS
    bench_sft = not derived and given_model is None and args.command == "bench"
    if args.command == "demo" and args.threads is not None and args.threads < 1:
        raise ValueError(f"--threads {args.threads} must be >= 1")
    model = device_sft_dir(args, "qwen3-0.6b-shape") if bench_sft else given_model  # a warm start: built below
    cfg, prompt_len = quickstart_config(args) if derived else (preset_config(args, model=model), None)
    if args.print_config:
        out = cfg.to_dict() | ({"derived": derivations(cfg, args, prompt_len)} if derived else {})
        print(json.dumps(out, indent=1, default=str))
        return 0
    check_device(cfg, args)
    if args.command == "demo" and (args.threads is not None or cfg.backend.device == "cpu"):
        import torch

        torch.set_num_threads(args.threads or min(2, os.cpu_count() or 1))
    if warm:
        ensure_sft(args)  # into cfg.backend.model: the same directory
    elif bench_sft:
        ensure_device_sft(args, "qwen3-0.6b-shape")
    if derived:
        print(quickstart_summary(cfg, args), flush=True)
    if not derived and "prompt_data" in vars(args) and "eval_prompt_data" not in vars(args):
        print("[rlbench] --prompt-data without --eval-prompt-data: no evaluation "
              "(give --eval-prompt-data FILE --eval-interval N to evaluate)", flush=True)
    if cfg.logging.jsonl_path:
        print(f"[rlbench] metrics -> {cfg.logging.jsonl_path}", flush=True)
    run_train(cfg)
    return 0


RM_FLAG_NAMES = {"model": "--hf-checkpoint"}
"""`rlbench rm` flags that are not `--{field}` of `RMTrainConfig` (slime's name for the starting model)."""


def build_rm_parser() -> argparse.ArgumentParser:
    """`rlbench rm` flags: one per `RMTrainConfig` field (`--{field}`, or `RM_FLAG_NAMES`), help from its docstring."""
    from rlbench.configs.reward_model import RMTrainConfig

    parser = Parser(prog="rlbench rm", description="Train a reward model (HF causal LM + scalar head) on "
                     "preference pairs with the Bradley-Terry loss (docs/reward_model.md)",
                     argument_default=argparse.SUPPRESS)
    parser.add_argument("--debug", action="store_true", default=False,
                        help="on an error, raise it with its traceback instead of the one-line message")
    hints = typing.get_type_hints(RMTrainConfig)
    for f in dataclasses.fields(RMTrainConfig):
        flag = RM_FLAG_NAMES.get(f.name, "--" + f.name.replace("_", "-"))
        parser.add_argument(flag, dest=f.name, help=field_doc(RMTrainConfig, f.name), **argparse_kwargs(hints[f.name]))
    return parser


def run_rm_command(argv: list[str]) -> int:
    """`rlbench rm ...`: build the config from the flags, train, save, print the final metrics as JSON."""
    args = build_rm_parser().parse_args(argv)
    debug = vars(args).pop("debug")
    from rlbench.configs.reward_model import RMTrainConfig

    try:
        cfg = RMTrainConfig(**vars(args))
        from rlbench.reward_model.train import run_rm

        metrics = run_rm(cfg)
    except ValueError as exc:
        if debug:
            raise
        flags = {f.name: RM_FLAG_NAMES.get(f.name, "--" + f.name.replace("_", "-")) for f in dataclasses.fields(RMTrainConfig)}
        message = re.sub(r"(?<![\w.-])([a-z_]+)=", lambda m: f"{flags.get(m.group(1), m.group(1))}=", str(exc))
        print(f"rlbench rm: error: {message} (--debug: the traceback)", file=sys.stderr)
        return 2
    print(json.dumps({k: v for k, v in metrics.items() if k != "history"}), flush=True)
    return 0


def run_bench_e2e(argv: list[str]) -> int:
    """`rlbench bench e2e ...`: `benchmarks/e2e.py` of this source checkout (benchmarks are not in the package)."""
    from rlbench.experiments import load_benchmark

    return load_benchmark("benchmarks/e2e.py", "rlbench_bench_e2e").main(argv)


if __name__ == "__main__":
    sys.exit(main())
