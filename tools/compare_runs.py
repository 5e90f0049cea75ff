"""Old vs new, side by side: run named short RL configs, write their metrics and weights, compare two such files.

    python tools/compare_runs.py list                                   # the configs and what each exercises
    python tools/compare_runs.py record /tmp/before.json                # the default set, 3 steps each
    python tools/compare_runs.py record /tmp/after.json --configs grpo,rpp,megatron
    python tools/compare_runs.py compare /tmp/before.json /tmp/after.json   # exit 1 on any difference

Run `record` on the code before a change and after it (same machine, same torch), then `compare`. Each config
runs in its own child process (fresh RNGs, process groups, megatron parallel state and dynamo caches; one
torch thread) on the tiny random model with a reward that varies across its samples, so advantages, gradients
and weights move. A config is `Trainer.step()` `--steps` times (`rlbench.build_trainer`, which builds the local
or the Ray trainer on the code before and after a restructuring); recorded per step: the metric dict (`perf/*`
and `memory/*` timings dropped) and a fingerprint of the sampled tokens; after the run: the bit fingerprint
(`rlbench.weights.checksum`) of every weight the engine holds (the last sync pushed the trainer's).

`compare` holds every metric both files have to exact float equality (NaN equals NaN) and every weight to equal
bits; a key present on one side only is listed (a renamed metric), not failed. The Ray configs (`ray`, `cp2`)
start a local Ray cluster with the tests' helper (tests/dist_utils.py) and take minutes on 2 CPU cores.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
from dataclasses import replace

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DROP = ("perf/", "memory/")


def digit_reward(response: str, label) -> float:
    """Varies across the random tiny model's samples, so advantages and gradients are not zero."""
    return sum(c.isdigit() for c in response) / max(1, len(response))


def _configs():
    """The config classes, from the layout of the code being measured: `rlbench.configs` (since the
    restructuring of issue 45), or the modules they lived in before it."""
    try:
        import rlbench.configs as configs

        return configs
    except ImportError:
        from types import SimpleNamespace

        from rlbench.backends.fsdp.config import OptimConfig
        from rlbench.config import EvalConfig, WeightSyncConfig
        from rlbench.orchestration.ray_config import ClusterConfig

        from rlbench.algorithms import MISConfig
        from rlbench.backends.megatron import MegatronConfig
        from rlbench.metrics import LoggingConfig

        return SimpleNamespace(MISConfig=MISConfig, OptimConfig=OptimConfig, MegatronConfig=MegatronConfig,
                               EvalConfig=EvalConfig, WeightSyncConfig=WeightSyncConfig, LoggingConfig=LoggingConfig,
                               ClusterConfig=ClusterConfig)


def _base(workdir: str):
    from rlbench import presets
    from rlbench.rewards import REWARDS

    c = _configs()
    EvalConfig, WeightSyncConfig, LoggingConfig = c.EvalConfig, c.WeightSyncConfig, c.LoggingConfig  # noqa: N806

    REWARDS["compare_digits"] = digit_reward
    cfg = presets.cpu_test(model="tiny", workdir=workdir, level=1, n_eval=8)
    task = replace(cfg.task, n_train=64, n_eval=8)
    return cfg.replace(
        task=task, data=replace(cfg.data, path=task.train_path, metadata_key=None),
        rollout=replace(cfg.rollout, rollout_batch_size=4, n_samples_per_prompt=4, max_response_len=8,
                        rm_type="compare_digits"),
        batch=replace(cfg.batch, global_batch_size=8, max_tokens_per_gpu=256),  # 2 optimizer steps per rollout
        engine=replace(cfg.engine, max_seq_len=48, num_slots=16),
        eval=EvalConfig(), weights=WeightSyncConfig(verify=True), logging=LoggingConfig(console=False),
    )


def _loss(**kw):
    return lambda cfg: cfg.replace(loss=replace(cfg.loss, **kw))


def _eval_and_save(cfg):
    EvalConfig = _configs().EvalConfig  # noqa: N806
    ckpt = os.path.join(cfg.task.out_dir, "checkpoints")
    return cfg.replace(eval=EvalConfig(interval=2, max_prompts=4, n_samples_per_prompt=2, pass_k=(1, 2)),
                       checkpoint=replace(cfg.checkpoint, save_dir=ckpt, save_interval=2))


def _mis(cfg):
    return cfg.replace(loss=replace(cfg.loss, use_tis=True, mis=_configs().MISConfig()))


def _kl_loss(cfg):
    return cfg.replace(loss=replace(cfg.loss, use_kl_loss=True, kl_loss_coef=0.1, kl_loss_type="low_var_kl"),
                       backend=replace(cfg.backend, ref_model="tiny", ref_update_interval=2))


def _megatron(cfg):
    return cfg.replace(train_backend="megatron", megatron=_configs().MegatronConfig())


def _ray(cp: int):
    def make(cfg):
        c = _configs()
        OptimConfig, ClusterConfig = c.OptimConfig, c.ClusterConfig  # noqa: N806
        backend = replace(cfg.backend, cp_size=cp, optim=OptimConfig(lr=0.5, eps=1.0, betas=(0.9, 0.98))) if cp > 1 \
            else cfg.backend
        return cfg.replace(backend=backend, loss=replace(cfg.loss, use_tis=True),
                           batch=replace(cfg.batch, max_tokens_per_gpu=64 if cp > 1 else 256, balance_data=True),
                           cluster=ClusterConfig(backend="ray", actor_num_gpus_per_node=2, timeout_s=180))
    return make


CONFIGS = {
    "grpo": (lambda cfg: cfg, "GRPO, std-normalised, two optimizer steps per rollout"),
    "grpo_eval_save": (_eval_and_save, "GRPO with the eval stages (before training and every 2nd step) and a save"),
    "grpo_whiten": (_loss(normalize_advantages=True), "GRPO advantages whitened over the global batch"),
    "dr_grpo": (_loss(advantage_estimator="dr_grpo"), "Dr.GRPO (no std division)"),
    "rloo": (_loss(advantage_estimator="rloo"), "RLOO leave-one-out baseline"),
    "rpp": (_loss(advantage_estimator="reinforce_plus_plus", normalize_advantages=True, gamma=0.9),
            "REINFORCE++: discounted returns (gamma 0.9), whitened"),
    "rpp_baseline": (_loss(advantage_estimator="reinforce_plus_plus_baseline", normalize_advantages=True),
                     "REINFORCE++-baseline, whitened"),
    "mis": (_mis, "decoupled PPO with batch-normalised MIS (old log-probs recomputed for every step)"),
    "bypass": (_loss(use_rollout_logprobs=True), "bypass: the rollout's log-probs are pi_old"),
    "kl_loss": (_kl_loss, "KL loss against a reference model, ref updated every 2nd rollout"),
    "true_on_policy": (lambda cfg: cfg.replace(true_on_policy_mode=True), "true on-policy mode"),
    "megatron": (_megatron, "megatron-core backend, TP1, one process"),
    "ray": (_ray(1), "Ray: 2 trainer ranks (DP 2, gloo) + 2 engines, colocated, TIS"),
    "cp2": (_ray(2), "Ray: 2 trainer ranks as one CP=2 group, TIS"),
}
DEFAULT = ("grpo", "grpo_eval_save", "grpo_whiten", "dr_grpo", "rloo", "rpp", "rpp_baseline", "mis", "bypass",
           "kl_loss", "true_on_policy", "megatron")


def _weights(trainer, workdir: str) -> dict[str, list[int]]:
    """Bit fingerprint of every weight the engine(s) hold after the run."""
    from rlbench.weights import checksum, engine_named_weights

    cluster = getattr(trainer, "cluster", None)
    if cluster is None:
        return {n: list(checksum(t)) for n, t in engine_named_weights(trainer.engine)}
    from safetensors.torch import load_file

    out = os.path.join(workdir, "hf")
    cluster.call_trainers("export_hf", out, "float32")  # for the names: the engines hold the weights
    names = sorted(n for f in os.listdir(out) if f.endswith(".safetensors") for n in load_file(os.path.join(out, f)))
    per_engine = cluster.call_engines("checksums", names)
    assert all(e == per_engine[0] for e in per_engine), "the engines hold different weights"
    return {n: list(v) for n, v in per_engine[0].items()}


def _tokens_fingerprint(samples) -> list[int]:
    import torch

    from rlbench.weights import checksum

    flat = torch.tensor([t for s in samples for t in s.tokens] + [len(s.tokens) for s in samples], dtype=torch.int64)
    return list(checksum(flat))


def run_one(name: str, steps: int, workdir: str) -> dict:
    """`steps` steps of config `name` in this process; the record `record` collects."""
    import torch

    torch.set_num_threads(1)
    import rlbench

    cfg = CONFIGS[name][0](_base(workdir))
    cfg = cfg.replace(batch=replace(cfg.batch, num_rollout=steps))
    ray_ctx = None
    if cfg.cluster.backend == "ray":
        sys.path.insert(0, os.path.join(ROOT, "tests"))
        from dist_utils import local_ray

        os.makedirs(os.path.join(workdir, "raystub"), exist_ok=True)
        import pathlib

        ray_ctx = local_ray(pathlib.Path(workdir, "raystub"))
        ray_ctx.__enter__()
    try:
        trainer = rlbench.build_trainer(cfg)
        history, tokens = [], []
        for _ in range(steps):
            history.append({k: v for k, v in trainer.step().items() if not k.startswith(DROP)})
            tokens.append(_tokens_fingerprint(trainer.last_rollout.samples))
        weights = _weights(trainer, workdir)
        if cfg.checkpoint.save_dir:  # resume from the last save: one more step, compared too
            again = rlbench.build_trainer(cfg.replace(checkpoint=replace(cfg.checkpoint, load_dir=cfg.checkpoint.save_dir),
                                                      batch=replace(cfg.batch, num_rollout=steps + 1)))
            history.append({k: v for k, v in again.step().items() if not k.startswith(DROP)})
            tokens.append(_tokens_fingerprint(again.last_rollout.samples))
        trainer.close()
    finally:
        if ray_ctx is not None:
            ray_ctx.__exit__(None, None, None)
    return {"history": history, "tokens": tokens, "weights": weights}


def record(out: str, names: list[str], steps: int) -> None:
    """Run each config in a child process; the file is rewritten after each (a failed config is reported and
    left out, the others still run)."""
    results, failed = {}, []
    for name in names:
        with tempfile.TemporaryDirectory(prefix=f"compare-{name}-") as work:
            env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p))
            file = os.path.join(work, "result.json")
            cmd = [sys.executable, os.path.abspath(__file__), "one", name, "--steps", str(steps), "--workdir", work,
                   "--out", file]
            done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
            if done.returncode != 0:
                print(f"config {name!r} FAILED:\n{done.stderr[-4000:]}", flush=True)
                failed.append(name)
                continue
            with open(file) as f:
                results[name] = json.load(f)
        print(f"recorded {name}: {len(results[name]['history'])} steps, {len(results[name]['weights'])} weights",
              flush=True)
        with open(out, "w") as f:
            json.dump({"steps": steps, "configs": results}, f)
    if failed:
        raise SystemExit(f"failed: {failed}")


def _same(a, b) -> bool:
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return True
    return a == b


def compare(old_file: str, new_file: str) -> int:
    """Print a side-by-side report; returns the number of differences (metrics, tokens, weights)."""
    with open(old_file) as f:
        old = json.load(f)["configs"]
    with open(new_file) as f:
        new = json.load(f)["configs"]
    bad = 0
    for name in [n for n in old if n in new]:
        a, b = old[name], new[name]
        diffs, only_old, only_new, same = [], set(), set(), 0
        for step, (ha, hb) in enumerate(zip(a["history"], b["history"])):
            only_old |= ha.keys() - hb.keys()
            only_new |= hb.keys() - ha.keys()
            for k in sorted(ha.keys() & hb.keys()):
                if _same(ha[k], hb[k]):
                    same += 1
                else:
                    diffs.append(f"step {step} {k}: {ha[k]!r} -> {hb[k]!r}")
        if len(a["history"]) != len(b["history"]):
            diffs.append(f"steps: {len(a['history'])} -> {len(b['history'])}")
        if a["tokens"] != b["tokens"]:
            diffs.append("sampled tokens differ")
        w_diff = sorted(n for n in a["weights"].keys() | b["weights"].keys() if a["weights"].get(n) != b["weights"].get(n))
        if w_diff:
            diffs.append(f"{len(w_diff)} weights differ, e.g. {w_diff[:3]}")
        status = "IDENTICAL" if not diffs else f"{len(diffs)} DIFFERENCES"
        print(f"{name:16s} {status}: {same} metric values equal over {len(a['history'])} steps, tokens "
              f"{'equal' if a['tokens'] == b['tokens'] else 'differ'}, {len(a['weights']) - len(w_diff)}/"
              f"{len(a['weights'])} weights bit-equal")
        for line in diffs[:20]:
            print(f"    {line}")
        if only_old or only_new:
            print(f"    only before: {sorted(only_old)}; only after: {sorted(only_new)}")
        bad += len(diffs)
    for name in sorted(old.keys() ^ new.keys()):
        print(f"{name:16s} in one file only")
    return bad


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    sub.add_parser("list")
    r = sub.add_parser("record")
    r.add_argument("out")
    r.add_argument("--configs", default=",".join(DEFAULT), help=f"comma-separated, from {sorted(CONFIGS)}")
    r.add_argument("--steps", type=int, default=3)
    c = sub.add_parser("compare")
    c.add_argument("old")
    c.add_argument("new")
    o = sub.add_parser("one")
    o.add_argument("name", choices=sorted(CONFIGS))
    o.add_argument("--steps", type=int, default=3)
    o.add_argument("--workdir", required=True)
    o.add_argument("--out", required=True)
    args = p.parse_args()
    if args.cmd == "list":
        for name, (_, what) in CONFIGS.items():
            print(f"{name:16s} {what}{'' if name in DEFAULT else '  (not in the default set)'}")
    elif args.cmd == "record":
        names = [n for n in args.configs.split(",") if n]
        unknown = [n for n in names if n not in CONFIGS]
        if unknown:
            raise SystemExit(f"unknown configs {unknown}; choose from {sorted(CONFIGS)}")
        record(args.out, names, args.steps)
    elif args.cmd == "compare":
        sys.exit(1 if compare(args.old, args.new) else 0)
    else:
        with open(args.out, "w") as f:
            json.dump(run_one(args.name, args.steps, args.workdir), f)


if __name__ == "__main__":
    main()
