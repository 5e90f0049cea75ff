"""What each training backend (FSDP, Megatron) supports, one row per feature, every cell backed by named evidence.

    rows = feature_table()                      # {feature, FSDP, Megatron, evidence}
    rows = feature_table(live=True)             # + rows measured now on both backends built side by side (tiny)

A cell has one of three forms, decided by code, never typed in:

- "no (<reason>)": the backend's config or constructor refuses the setting; the reason is its own `ValueError`
  message (or the missing config field).
- "yes ([<what>; ]ran: <evidence>)": the constructor accepts it AND `EVIDENCE` names a test of this repository or
  a stored result file under `benchmarks/results/` that exercised it, and that test / file exists. A constructor
  accepting a config is not evidence that the feature works.
- "unverified ([<what>] accepted; no test or stored run exercises it)": accepted, with no evidence named (or the
  named evidence is gone: the cell says which).

A feature gains its "yes" by adding the test id (`tests/FILE.py::test_name[param]`) or the result file to
`EVIDENCE`; `tests/test_fsdp_vs_megatron.py` checks that every id there exists. The rows marked "(measured)"
come from `live_checks`: both backends built and run in this process.
"""

from __future__ import annotations

import ast
import contextlib
import dataclasses
import gc
import importlib.metadata
import importlib.util
import os
import re
import tempfile
import warnings
from collections.abc import Callable, Iterable, Mapping
from functools import cache
from pathlib import Path
from typing import Any

from rlbench.configs.backend import (
    ATTN_IMPLEMENTATIONS,
    CP_ATTENTIONS,
    PARAM_DTYPES,
    FSDPOptions,
    TrainConfig,
)
from rlbench.configs.megatron import CORE_ATTENTIONS, RECOMPUTE_GRANULARITIES, MegatronConfig
from rlbench.configs.run import TRAIN_BACKENDS

ROOT = Path(__file__).resolve().parents[1]
"""The repository root: evidence ids are paths relative to it."""
FEATURE_COLUMNS = ("feature", "FSDP", "Megatron", "evidence")
"""The keys of a `feature_table` row, in order."""

_MB = "tests/test_megatron_backend.py"
EVIDENCE: dict[tuple[str, str], tuple[str, ...]] = {
    # (feature, backend) -> tests (CPU: `make test` runs them) or stored GPU results that exercised the feature.
    ("tensor parallel (TP)", "megatron"): (f"{_MB}::test_tensor_parallel_training_matches_tp1[tp2]",),
    ("sequence parallel (SP)", "megatron"): (f"{_MB}::test_tensor_parallel_training_matches_tp1[tp2_sp]",),
    # pipeline parallel (1F1B) and the distributed optimizer: run on 2 gloo CPU ranks in fp32 (not yet on GPUs,
    # bf16: the GPU test is TP1 without them)
    ("pipeline parallel (PP)", "megatron"): (f"{_MB}::test_pipeline_parallel_pp2_matches_tp1",),
    ("optimizer-state sharding (ZeRO-1)", "megatron"): (f"{_MB}::test_distributed_optimizer_matches_the_plain_optimizer",),
    ("optimizer-state sharding (ZeRO-1)", "fsdp"): ("tests/test_fsdp_dist.py::test_fsdp_step_matches_single_process",),
    ("parameter + gradient sharding (ZeRO-3)", "fsdp"): (
        "tests/test_fsdp_dist.py::test_fsdp_step_matches_single_process",),
    ("context parallel (CP)", "fsdp"): ("tests/test_cp_train.py::test_params_match_cp1_and_cp_peers_agree",),
    ("activation recompute", "fsdp"): ("tests/test_fsdp_unit.py::test_compiled_layers_compile_once_regardless_of_depth",),
    ("activation recompute", "megatron"): (),
    ("CPU offload of the training state (cpu_offload)", "fsdp"): (
        "tests/test_fsdp_dist.py::test_cpu_offload_actor_same_step",),
    ("sleep / wake_up (colocated: state parked in host memory)", "fsdp"): (
        "tests/test_fsdp_dist.py::test_sleep_wake_up_exact",),
    ("sleep / wake_up (colocated: state parked in host memory)", "megatron"): (
        f"{_MB}::test_checkpoint_round_trip_is_exact",),
    ("batch-invariant numerics (true on-policy mode)", "fsdp"): (
        "tests/test_true_on_policy.py::test_trainer_steps_log_exactly_zero_mismatch",),
    ("reference model (+ update_ref)", "fsdp"): ("tests/test_fsdp_dist.py::test_update_ref_copies_actor_exactly",),
    ("reference model (+ update_ref)", "megatron"): (f"{_MB}::test_tp1_reference_model_and_update_ref",),
    ("HF weights in / out (load an HF dir, export_hf, sync HF-named buckets)", "fsdp"): (
        "tests/test_fsdp_dist.py::test_weight_buckets_and_hf_export",),
    ("HF weights in / out (load an HF dir, export_hf, sync HF-named buckets)", "megatron"): (
        "tests/test_megatron_convert.py::test_streaming_weight_sync_path",),
    ("rlbench train / Trainer (one process)", "fsdp"): (
        "tests/test_trainer.py::test_step_history_versions_and_engine_weights",),
    ("rlbench train / Trainer (one process)", "megatron"): (
        "tests/test_fsdp_vs_megatron.py::test_convergence_agrees_at_step_0",
        "benchmarks/results/fsdp_vs_megatron_2026-12-02_sft500.json"),
    ("Ray cluster (several trainer ranks)", "fsdp"): ("tests/test_ray.py::test_colocated_matches_single_process",),
    ("Ray cluster (several trainer ranks)", "megatron"): ("tests/test_ray.py::test_megatron_on_ray_matches_single_process",),
}
"""The named evidence behind each "yes" (module docstring). A feature missing here is "unverified" when accepted."""


# ============================================================================================== evidence
@cache
def _test_names(path: Path) -> frozenset[str]:
    tree = ast.parse(path.read_text())
    return frozenset(n.name for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)))


def evidence_exists(ref: str) -> bool:
    """Whether `ref` names something in this checkout: `tests/F.py::test_x[param]` (the file defines `test_x`, and
    the parameter id appears in the file) or a path under the repository root (a stored result)."""
    if "::" not in ref:
        return (ROOT / ref).exists()
    path, _, test = ref.partition("::")
    name, _, param = test.partition("[")
    file = ROOT / path
    if not file.is_file() or name not in _test_names(file):
        return False
    return not param or f'"{param.rstrip("]")}"' in file.read_text()


def status(feature: str, backend: str, accepted: tuple[bool, str], what: str) -> str:
    """One cell: "no (refusal)", "yes (what; ran: evidence)" or "unverified (...)" (module docstring)."""
    ok, why = accepted
    if not ok:
        return f"no ({why})" if why else "no"
    refs = EVIDENCE.get((feature, backend), ())
    found = [r for r in refs if evidence_exists(r)]
    if found:
        return f"yes ({what + '; ' if what else ''}ran: {', '.join(found)})"
    gone = f"; named evidence not found: {', '.join(refs)}" if refs else ""
    return f"unverified ({what + ' ' if what else ''}accepted; no test or stored run exercises it{gone})"


# ============================================================================================== probes
def _try(build: Callable[[], Any]) -> tuple[bool, str]:
    """`(True, "")` when `build()` returns, `(False, the first line of its refusal)` when it raises a user error."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            build()
    except (ValueError, ImportError, TypeError) as exc:
        return False, (str(exc).strip().splitlines() or [type(exc).__name__])[0]
    return True, ""


def package_version(dist: str) -> str | None:
    """The installed version of the distribution `dist`, or None."""
    with contextlib.suppress(importlib.metadata.PackageNotFoundError):
        return importlib.metadata.version(dist)
    return None


def train_config(**settings: Any) -> TrainConfig:
    """`TrainConfig` from flat settings: the FSDP-only ones go into its nested `fsdp=FSDPOptions(...)`."""
    own = {f.name for f in dataclasses.fields(FSDPOptions)}
    nested = {k: v for k, v in settings.items() if k in own}
    return TrainConfig(**{k: v for k, v in settings.items() if k not in own}, fsdp=FSDPOptions(**nested))


def fsdp_accepts(**fsdp: Any) -> tuple[bool, str]:
    """Does the FSDP backend take these `TrainConfig` settings (validation + `FSDPBackend(cfg)`)? CPU fp32 unless
    given."""
    from rlbench.backends.fsdp.actor import FSDPBackend

    return _try(lambda: FSDPBackend(train_config(**({"device": "cpu", "param_dtype": "fp32"} | fsdp))))


def megatron_accepts(fsdp: Mapping[str, Any] | None = None, **megatron: Any) -> tuple[bool, str]:
    """Does the megatron backend take these settings (`MegatronConfig(**megatron)` and
    `MegatronBackend(TrainConfig(**fsdp), ...)`, whose constructor refuses the FSDP-only settings)?"""
    from rlbench.backends.megatron.backend import MegatronBackend

    fsdp = {"device": "cpu", "param_dtype": "fp32"} | dict(fsdp or {})
    return _try(lambda: MegatronBackend(train_config(**fsdp), MegatronConfig(**megatron)))


def run_accepts(train_backend: str, **changes: Any) -> tuple[bool, str]:
    """Does `RunConfig` (the CPU test preset, `train_backend`, `changes`) validate?"""
    from rlbench import presets

    cfg = presets.cpu_test(model="tiny", workdir=tempfile.gettempdir())  # nothing is written
    return _try(lambda: cfg.replace(train_backend=train_backend, **changes))


def _field(cls: type, name: str) -> tuple[bool, str]:
    """Whether the dataclass `cls` has the field `name`; the reason names it."""
    ok = name in {f.name for f in dataclasses.fields(cls)}
    return ok, "" if ok else f"{cls.__name__} has no {name} field"


def _method(cls: type, *names: str) -> tuple[bool, str]:
    ok = all(callable(getattr(cls, m, None)) for m in names)
    return ok, "" if ok else f"{cls.__name__} has no {' / '.join(names)}"


def _accepted(probe: Callable[[Any], tuple[bool, str]], options: Iterable[Any]) -> tuple[list, dict]:
    """`(options probe accepted, {refused option: reason})`."""
    answers = {opt: probe(opt) for opt in options}
    return [o for o, (ok, _) in answers.items() if ok], {o: why for o, (ok, why) in answers.items() if not ok}


def _by_device(feature: str, what: str, **megatron: Any) -> str:
    """The megatron cell for `megatron` settings probed on CUDA (bf16) and on the CPU (fp32)."""
    gpu = megatron_accepts({"device": "cuda", "param_dtype": "bf16"}, **megatron)
    cpu = megatron_accepts(**megatron)
    if gpu[0] and cpu[0]:
        return status(feature, "megatron", gpu, what)
    return f"{status(feature, 'megatron', gpu, what)} on CUDA; CPU: {status(feature, 'megatron', cpu, what)}"


# ============================================================================================== feature table
def feature_table(*, live: bool = False, device: str = "cpu") -> list[dict[str, str]]:
    """The FSDP / Megatron comparison: one row per feature, each cell decided by a probe and `EVIDENCE`.

    Args:
        live: also build both backends (the `tiny` model) and measure what they do (`live_checks`, ~5 s).
        device: where the live checks run: "cpu" (fp32) or "cuda" (bf16). megatron in a process runs on one device
            (`backends/megatron/cpu.py`): on a GPU machine pass "cuda".
    """
    from rlbench.backends.fsdp.actor import FSDPBackend
    from rlbench.backends.megatron.backend import MegatronBackend
    from rlbench.configs.cluster import ClusterConfig

    rows: list[dict[str, str]] = []

    def row(feature: str, fsdp: str, megatron: str, evidence: str) -> None:
        rows.append(dict(zip(FEATURE_COLUMNS, (feature, fsdp, megatron, evidence))))

    def both(feature: str, fsdp: tuple[bool, str], megatron: tuple[bool, str], evidence: str,
             what: tuple[str, str] = ("", "")) -> None:
        row(feature, status(feature, "fsdp", fsdp, what[0]), status(feature, "megatron", megatron, what[1]),
            evidence)

    te = importlib.util.find_spec("transformer_engine") is not None
    mcore = package_version("megatron-core")
    row("installed", f"torch {package_version('torch')}",
        f"megatron-core {mcore}" if mcore else "no (pip install 'rlbench[megatron]')",
        f"importlib.metadata; transformer_engine importable: {te}")

    # --- parallelism
    for feature, name, what, probe in (
            ("tensor parallel (TP)", "tensor_model_parallel_size", "TP=2", dict(tensor_model_parallel_size=2)),
            ("sequence parallel (SP)", "sequence_parallel", "SP with TP=2",
             dict(tensor_model_parallel_size=2, sequence_parallel=True))):
        both(feature, _field(TrainConfig, name), megatron_accepts(**probe),
             f"TrainConfig fields; MegatronBackend(TrainConfig(), MegatronConfig(**{probe}))", ("", what))
    sp1 = _try(lambda: MegatronConfig(sequence_parallel=True))
    rows[-1]["Megatron"] += "" if sp1[0] else f"; TP=1: no ({sp1[1]})"
    row("pipeline parallel (PP)", status("pipeline parallel (PP)", "fsdp", _field(TrainConfig, "pipeline_model_parallel_size"), ""),
        _by_device("pipeline parallel (PP)", "PP=2, 1F1B", pipeline_model_parallel_size=2),
        "MegatronConfig(pipeline_model_parallel_size=2) with TrainConfig(device='cuda', bf16) and device='cpu'")
    kernels, _ = _accepted(lambda k: _try(lambda: TrainConfig(device="cuda", cp_size=2, fsdp=FSDPOptions(cp_attention=k))),
                           CP_ATTENTIONS)
    cp = "context parallel (CP)"
    row(cp, status(cp, "fsdp", fsdp_accepts(cp_size=2), f"cp=2; kernels: {', '.join(kernels)}"),
        status(cp, "megatron", megatron_accepts({"cp_size": 2}), "cp=2")
        + ("" if te else "; transformer_engine not importable"),
        "FSDPBackend(TrainConfig(cp_size=2)), TrainConfig(fsdp=FSDPOptions(cp_attention=each)); MegatronBackend(TrainConfig(cp_size=2))")
    zero3 = _field(FSDPOptions, "reshard_after_forward")
    both("parameter + gradient sharding (ZeRO-3)", zero3, _field(MegatronConfig, "use_megatron_fsdp"),
         "config fields (megatron-core's own FSDP is not wired)", ("fully_shard per block", ""))
    z1 = "optimizer-state sharding (ZeRO-1)"
    row(z1, status(z1, "fsdp", zero3, "sharded with the params"),
        _by_device(z1, "use_distributed_optimizer", use_distributed_optimizer=True),
        "MegatronBackend(TrainConfig(device=cuda / cpu), MegatronConfig(use_distributed_optimizer=True))")

    # --- memory
    gran, gran_no = _accepted(lambda g: megatron_accepts(recompute_granularity=g),
                              [g for g in RECOMPUTE_GRANULARITIES if g])
    m_gc, m_gc_why = megatron_accepts({"gradient_checkpointing": True})
    ac = "activation recompute"
    row(ac, status(ac, "fsdp", fsdp_accepts(gradient_checkpointing=True, checkpoint_every=2),
                   "gradient_checkpointing, every k-th layer"),
        status(ac, "megatron", (bool(gran), str(gran_no)), f"recompute_granularity: {', '.join(gran)}")
        + ("" if m_gc else f"; gradient_checkpointing: no ({m_gc_why})"),
        "FSDPBackend(gradient_checkpointing=True, checkpoint_every=2); MegatronConfig(recompute_granularity=each); "
        "MegatronBackend(TrainConfig(fsdp=FSDPOptions(gradient_checkpointing=True)))")
    both("CPU offload of the training state (cpu_offload)", fsdp_accepts(cpu_offload=True),
         megatron_accepts({"cpu_offload": True}), "both constructors with TrainConfig(fsdp=FSDPOptions(cpu_offload=True))")
    both("sleep / wake_up (colocated: state parked in host memory)", _method(FSDPBackend, "sleep", "wake_up"),
         _method(MegatronBackend, "sleep", "wake_up"), "methods of both classes")

    # --- precision, kernels: the settings each constructor accepts (lists, not verdicts)
    for dev in ("cpu", "cuda"):
        f_dt, _ = _accepted(lambda d, dev=dev: fsdp_accepts(device=dev, param_dtype=d), PARAM_DTYPES)
        m_dt, m_no = _accepted(lambda d, dev=dev: megatron_accepts({"device": dev, "param_dtype": d}), PARAM_DTYPES)
        why = f"; not {', '.join(m_no)} ({next(iter(m_no.values()))})" if m_no else ""
        row(f"param dtypes accepted on {dev.upper()}", ", ".join(f_dt), ", ".join(m_dt) + why,
            f"TrainConfig(device={dev!r}, param_dtype=each) through both constructors")
    m_fp8, m_fp8_why = _field(MegatronConfig, "fp8")
    fp8_why = [m_fp8_why] if not m_fp8 else []
    if not te:
        fp8_why.append("transformer_engine not importable")
    both("FP8 training", _field(TrainConfig, "fp8"), (not fp8_why, "; ".join(fp8_why)),
         "config fields; import system (megatron-core's FP8 runs in TransformerEngine layers)")
    both("batch-invariant numerics (true on-policy mode)", fsdp_accepts(batch_invariant=True, compile=False),
         run_accepts("megatron", true_on_policy_mode=True),
         "FSDPBackend(TrainConfig(batch_invariant=True)); RunConfig(train_backend='megatron', true_on_policy_mode=True)")
    attn = {dev: (_accepted(lambda a, dev=dev: _try(lambda: TrainConfig(device=dev, fsdp=FSDPOptions(attn_implementation=a))),
                            ATTN_IMPLEMENTATIONS)[0],
                  _accepted(lambda a, dev=dev: _try(lambda: MegatronConfig(attention=a).core_attention(dev)),
                            CORE_ATTENTIONS)[0]) for dev in ("cuda", "cpu")}
    row("attention kernels accepted (packed, no padding)",
        *("; ".join(f"{dev.upper()}: {', '.join(attn[dev][i])}" for dev in attn) for i in (0, 1)),
        "TrainConfig(fsdp=FSDPOptions(attn_implementation=each)); MegatronConfig(attention=each).core_attention(device)")

    # --- model, weights, checkpoints, the loop
    both("reference model (+ update_ref)", _method(FSDPBackend, "update_ref"), _method(MegatronBackend, "update_ref"),
         "TrainConfig.ref_model (shared); each class's update_ref()")
    fmts, _ = _accepted(lambda f: _try(lambda: TrainConfig(fsdp=FSDPOptions(checkpoint_format=f))), ("sharded", "full", "torch_dist"))
    row("checkpoint formats accepted", f"{', '.join(fmts)} (TrainConfig.fsdp.checkpoint_format)",
        "per-rank model + optimizer state (rank<N>.pt; checkpoint_format has no effect)",
        "TrainConfig(fsdp=FSDPOptions(checkpoint_format=each)); MegatronBackend.save (live rows: the files written)")
    both("HF weights in / out (load an HF dir, export_hf, sync HF-named buckets)",
         _method(FSDPBackend, "export_hf", "named_weights_for_sync"),
         _method(MegatronBackend, "export_hf", "named_weights_for_sync"), "methods of both classes",
         ("the HF model itself", "converted: fused QKV / gate-up, TP / PP split"))
    both("rlbench train / Trainer (one process)", run_accepts("fsdp"), run_accepts("megatron"),
         "RunConfig(train_backend=each) on the CPU test preset")
    tp_run = "TP / PP through the Trainer (one process)"
    row(tp_run, "— (no TP / PP)",
        status(tp_run, "megatron", run_accepts("megatron", megatron=MegatronConfig(tensor_model_parallel_size=2)),
               "TP=2"),
        "RunConfig(train_backend='megatron', megatron=MegatronConfig(tensor_model_parallel_size=2))")
    ray = ClusterConfig(backend="ray")
    both("Ray cluster (several trainer ranks)", run_accepts("fsdp", cluster=ray), run_accepts("megatron", cluster=ray),
         "RunConfig(train_backend=each, cluster=ClusterConfig(backend='ray'))")
    if live:
        rows.extend(live_checks(device))
    return rows


# ============================================================================================== measured rows
def training_step_cell(metrics: Mapping[str, float], moved: float, loss_gap: float, tol: float) -> str:
    """The "one training step (measured)" cell of one backend: "yes" only when the step was taken (not skipped),
    moved the weights (its log-probs after the step differ from those before: `moved` = max |after − before|),
    and its loss equals the other backend's on the same pack and weights (`loss_gap` ≤ `tol`)."""
    if metrics.get("train/skipped", 0) != 0:
        return "no (step skipped)"
    if not moved > 0:
        return "no (the weights did not move: log-probs after the step equal those before)"
    if not loss_gap <= tol:
        return f"no (|Δ loss| {loss_gap:.1e} vs the other backend > {tol:g})"
    return "yes"


def live_checks(device: str = "cpu", model: str = "tiny") -> list[dict[str, str]]:
    """Rows measured on both backends built side by side (`model`; CPU fp32 or CUDA bf16; temperature 0.7):
    log-probs of one packed micro-batch, one training step on it, checkpoint save -> train -> load, sleep -> wake_up.

    A failure is the measurement: its cell says "no (the error)"."""
    import torch

    from rlbench.backends.fsdp.actor import FSDPBackend
    from rlbench.backends.megatron.backend import MegatronBackend
    from rlbench.packing.pack import pack_samples
    from rlbench.types import Sample

    g = torch.Generator().manual_seed(0)
    samples = [Sample(tokens=torch.randint(0, 100, (n,), generator=g).tolist(), response_length=r, advantage=1.0)
               for n, r in ((12, 5), (20, 9), (9, 4))]
    pack = pack_samples(samples, pad_multiple=8)
    inputs = [{"w": torch.full((pack.response_index.numel(),), 0.1)}]

    def loss_fn(logp, ent, inp):  # [R] log-probs of the pack's response tokens
        return -(logp * inp["w"]).sum(), {}

    def logp(b):
        return b.compute_log_prob([pack])[0].log_probs

    dtype, tol = ("fp32", 1e-5) if device == "cpu" else ("bf16", 2e-2)
    rows = []
    with tempfile.TemporaryDirectory() as tmp, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cfgs = {n: TrainConfig(model=model, device=device, param_dtype=dtype, checkpoint_dir=os.path.join(tmp, n), fsdp=FSDPOptions(compile=False)) for n in TRAIN_BACKENDS}
        mb = MegatronBackend(cfgs["megatron"], MegatronConfig(), temperature=0.7)
        mb.init()
        fb = FSDPBackend(cfgs["fsdp"], env=mb.env, temperature=0.7)
        fb.init()
        backends = {"fsdp": fb, "megatron": mb}
        out = {n: b.compute_log_prob([pack], with_entropy=True)[0] for n, b in backends.items()}
        d_lp = float((out["fsdp"].log_probs - out["megatron"].log_probs).abs().max())
        d_ent = float((out["fsdp"].entropy - out["megatron"].entropy).abs().max())
        ok = "yes" if d_lp <= tol else "no (see evidence)"
        rows.append({"feature": "log-probs of one packed micro-batch (measured)", "FSDP": ok, "Megatron": ok,
                     "evidence": f"max |Δ log-prob| {d_lp:.1e}, |Δ entropy| {d_ent:.1e} (tolerance {tol:g}); 3 "
                                 f"sequences in one pack ({pack.num_tokens} tokens), {model}, {device} {dtype}, T 0.7"})
        step = {n: b.train([pack], inputs, loss_fn=loss_fn) for n, b in backends.items()}
        after = {n: logp(b) for n, b in backends.items()}
        moved = {n: float((after[n] - out[n].log_probs).abs().max()) for n in backends}
        loss_gap = abs(step["fsdp"]["train/loss"] - step["megatron"]["train/loss"])
        cells = {n: training_step_cell(step[n], moved[n], loss_gap, tol) for n in backends}
        rows.append({"feature": "one training step (measured)", "FSDP": cells["fsdp"], "Megatron": cells["megatron"],
                     "evidence": f"|Δ loss| {loss_gap:.1e} (tolerance {tol:g}), "
                                 f"|Δ grad norm| {abs(step['fsdp']['train/grad_norm'] - step['megatron']['train/grad_norm']):.1e}, "
                                 f"log-probs moved by the step: max {moved['fsdp']:.1e} (FSDP) / "
                                 f"{moved['megatron']:.1e} (Megatron); max |Δ log-prob| between the backends after it "
                                 f"{float((after['fsdp'] - after['megatron']).abs().max()):.1e}"})

        def round_trip(b, ref):
            path = b.save()
            files = sorted(os.listdir(path))
            b.train([pack], inputs, loss_fn=loss_fn)  # move away, then back
            b.load()
            return torch.equal(logp(b), ref), f"yes ({', '.join(files)})"

        def sleep_wake(b, ref):
            moved = b.sleep()["memory/sleep_moved_bytes"]
            b.wake_up()
            return torch.equal(logp(b), ref), f"yes ({moved / 2**20:.2f} MiB parked)"

        for feature, check, evidence in (
                ("checkpoint save -> train -> load (measured)", round_trip,
                 "save(), one more step, load(): log-probs bit-identical to those at the save"),
                ("sleep -> wake_up after the load (measured)", sleep_wake,
                 "sleep(), wake_up() on the loaded backend: log-probs bit-identical")):
            cells = {n: _measure(lambda c=check, b=b, ref=after[n]: c(b, ref)) for n, b in backends.items()}
            rows.append({"feature": feature, "FSDP": cells["fsdp"], "Megatron": cells["megatron"],
                         "evidence": evidence})
        del fb, mb, backends
        gc.collect()
    return rows


def _measure(check: Callable[[], tuple[bool, str]]) -> str:
    """A measured cell: the check's "yes ..." text, "no (differs)" when it returned False, or "no (the error)"."""
    try:
        ok, yes = check()
    except Exception as exc:  # noqa: BLE001  (the failure is the measurement, shown in its cell)
        return f"no ({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''})"
    return yes if ok else "no (log-probs differ)"


def cells_by_verdict(rows: Iterable[Mapping[str, str]]) -> dict[str, list[tuple[str, str]]]:
    """`{"yes" | "no" | "unverified" | other: [(feature, backend column)]}`: what the table claims, at a glance."""
    out: dict[str, list[tuple[str, str]]] = {}
    for r in rows:
        for col in ("FSDP", "Megatron"):
            verdict = re.match(r"(yes|no|unverified)\b", r[col])
            out.setdefault(verdict.group(1) if verdict else "other", []).append((r["feature"], col))
    return out
