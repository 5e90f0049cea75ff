"""Where the decode step's time goes: step time (graph replay) vs the HBM floor for each engine variant, the
first-use (compile + capture) seconds, and optionally the kernel table.

    python benchmarks/decode_profile.py --preset qwen3-0.6b-shape --kv 256 1024 --fused 0 1 \\
        --decode-attention sdpa split
    python benchmarks/decode_profile.py --preset qwen3-4b-shape --kv 1024 --batch 1 --gemv-batch1 0 1 --profile
    python benchmarks/decode_profile.py --kv 256 1024 --batch 1 --megakernel 0 1   # compiled batch 1 vs the megakernel
    python benchmarks/decode_profile.py --batch 64 --group 8 --prompt-len 510 --kv 1024 2048 --steps 20 \
        --decode-attention sdpa split_kv --profile      # the RL rollout's grouped layout (8 prompts x 8 samples)

Every variant (fused weights x decode attention x batch-1 GEMV graph x megakernel) gets a fresh engine on the same model;
`first use` is the wall time of the first decode of a bucket (the compile, if any, plus the CUDA-graph capture).
`--group k` times the grouped layout (`TorchEngineConfig.shared_prefix`: k samples per prompt share its K/V): `--kv`
is then the group row's window, which holds the `--prompt-len` prompt and k interleaved samples; the floor adds the
K/V bytes a step reads (one prompt per group row plus every sample's own tokens).
"""

from __future__ import annotations

import argparse
import gc
import itertools
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from rollout import profile_step, weight_bytes  # noqa: E402

from rlbench.configs.engine import MegakernelConfig, TorchEngineConfig  # noqa: E402
from rlbench.engine.torch_engine import TorchEngine, bucket  # noqa: E402
from rlbench.models import build_model  # noqa: E402


def start_position(kv: int, steps: int, group: int, prompt_len: int) -> int:
    """The position the timed steps start from, so that the last one still writes inside the kv window: the slot
    layout writes position p at index p; the grouped one at P + (p - P) k + lane."""
    if group == 1:
        return max(0, kv - 1 - steps)
    generated = (kv - prompt_len) // group - 1 - steps
    if generated < 0:
        raise ValueError(f"kv {kv} holds the {prompt_len}-token prompt and {(kv - prompt_len) // group} tokens of each "
                         f"of {group} samples, fewer than --steps {steps} + 1; raise --kv or lower --steps")
    return prompt_len + generated


def step_ms(engine: TorchEngine, b: int, kv: int, mode: str, steps: int = 200, group: int = 1,
            prompt_len: int = 0) -> tuple[float, float]:
    """(ms per replayed step, seconds of the first use of this bucket)."""
    runner = engine.runner
    start_pos = start_position(kv, steps, group, prompt_len)
    if group > 1:
        engine.cache.reset(group)
        runner.state.prefix_len[:b].fill_(prompt_len)
    runner.state.positions[:b].fill_(start_pos)
    t0 = time.perf_counter()
    runner.decode(b, kv, mode, group)
    torch.cuda.synchronize()
    first = time.perf_counter() - t0
    for _ in range(3):
        runner.decode(b, kv, mode, group)
    # The compiled step reads all kv positions (masked); the megakernel reads up to each slot's position, so
    # the timed steps run positions up to kv - 1 (the last `steps` positions below the bucket's length).
    runner.state.positions[:b].fill_(start_pos)
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(steps):
        runner.decode(b, kv, mode, group)
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / steps, first


def kv_floor_ms(model, args, b: int, kv: int) -> float:
    """HBM time of the K/V a step reads at the middle of the timed positions: every slot's own window (slot layout)
    or, grouped, one prompt per group row plus each sample's tokens."""
    c = model.config
    per_position = 2 * c.num_hidden_layers * c.num_key_value_heads * c.head_dim * 2  # K and V, bf16
    if args.group == 1:
        positions = b * (kv - args.steps // 2)
    else:
        generated = (kv - args.prompt_len) // args.group - args.steps // 2
        positions = (b // args.group) * (args.prompt_len + args.group * generated)
    return positions * per_position / (args.bandwidth_tbs * 1e12) * 1e3


def run_variant(model, args, fused: bool, attention: str, gemv: bool, mk: bool, floor: float,
                sync: str = "auto", gluon: bool | None = None, head: bool = True) -> list[dict]:
    cfg = TorchEngineConfig(max_seq_len=args.max_seq_len, num_slots=max(args.batch), fused_weights=fused,
                            decode_attention=attention, gemv_batch1=gemv, megakernel=MegakernelConfig(
                                enabled=mk, sync=sync, gluon=gluon, head=head))
    engine = TorchEngine(model, cfg)
    decoder = engine.runner.megakernel
    if mk and decoder is None:
        print("megakernel requested but unsupported here; this variant runs the compiled path", flush=True)
    mk_sync = decoder.layers.stage_sync if decoder is not None else ""
    if decoder is not None and decoder.layers.gluon_active():
        mk_sync += " gluon " + "".join(map(str, sorted(decoder.layers.gluon_active())))
        mk_sync += "1" if decoder.layers.gluon_attention_active() else ""
    if decoder is not None and decoder.head is not None:
        mk_sync += " head"
    name = f"fused={int(engine.runner.fused)} attn={attention} gemv1={int(gemv)} mk={int(mk)} {mk_sync}"
    rows = []
    for b, kv, mode in itertools.product(args.batch, args.kv, args.modes):
        bb = bucket(b, engine.cache.shape.num_slots, engine.runner.min_batch)
        ms, first = step_ms(engine, bb, kv, mode, args.steps, args.group, args.prompt_len)
        step_floor = floor + kv_floor_ms(model, args, bb, kv)
        rows.append(dict(variant=name, batch=b, bucket=bb, kv=kv, mode=mode, ms=ms, x_floor=ms / step_floor,
                         first_s=first))
        print(f"{name:45} batch {b} (bucket {bb}) kv {kv:5} {mode:7}: {ms:7.3f} ms/step "
              f"({ms / step_floor:5.2f}x floor {step_floor:.3f} ms); first use {first:6.1f} s", flush=True)
        if args.profile:
            print(profile_step(engine, bb, kv, group=args.group), flush=True)
    if not (engine.runner.compiled and engine.runner.cuda_graphs):
        print(f"{name}: compile or capture FELL BACK (see warnings); its times are not the variant's", flush=True)
    del engine
    gc.collect()
    torch.cuda.empty_cache()
    return rows


def parse_args() -> argparse.Namespace:
    """The flags, with the checks that need several of them (tests/test_gpu_paths.py parses the suite's lines)."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="qwen3-0.6b-shape")
    ap.add_argument("--kv", type=int, nargs="+", default=[256, 1024])
    ap.add_argument("--batch", type=int, nargs="+", default=[1])
    ap.add_argument("--modes", nargs="+", default=["sample"], choices=["greedy", "sample", "truncate"])
    ap.add_argument("--fused", type=int, nargs="+", default=[1], choices=[0, 1])
    ap.add_argument("--decode-attention", nargs="+", default=["auto"], choices=["auto", "sdpa", "split", "split_kv"])
    ap.add_argument("--gemv-batch1", type=int, nargs="+", default=[1], choices=[0, 1])
    ap.add_argument("--megakernel", type=int, nargs="+", default=[0], choices=[0, 1])
    ap.add_argument("--megakernel-sync", nargs="+", default=["auto"], choices=["auto", "pdl", "barrier", "launch"])
    ap.add_argument("--megakernel-gluon", type=int, nargs="+", default=[-1], choices=[-1, 0, 1],
                    help="the megakernel's GEMV and attention stages as Gluon kernels (MegakernelConfig.gluon; -1: "
                         "the default)")
    ap.add_argument("--megakernel-head", type=int, nargs="+", default=[1], choices=[0, 1],
                    help="the megakernel step's head as two Triton kernels (MegakernelConfig.head)")
    ap.add_argument("--max-seq-len", type=int, default=1536)
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--bandwidth-tbs", type=float, default=4.3, help="HBM bandwidth for the floor (H200: 4.3)")
    ap.add_argument("--profile", action="store_true", help="print the kernel table of each measured bucket")
    ap.add_argument("--group", type=int, default=1, help="samples per prompt in the grouped KV layout (1: slots)")
    ap.add_argument("--prompt-len", type=int, default=510, help="the grouped layout's prompt length")
    args = ap.parse_args()
    if any(b % args.group for b in args.batch):
        ap.error(f"--batch {args.batch}: every batch must be a multiple of --group {args.group}")
    if args.steps >= min(args.kv):
        ap.error(f"--steps {args.steps} must be below every --kv (the timed steps run the positions just below the "
                 f"kv bucket's length; kv {min(args.kv)} leaves room for {min(args.kv) - 1})")
    return args


def main() -> None:
    args = parse_args()
    model = build_model(args.preset, device="cuda", dtype=torch.bfloat16)
    floor = weight_bytes(model) / (args.bandwidth_tbs * 1e12) * 1e3
    print(f"{args.preset}: weights {weight_bytes(model) / 2**30:.2f} GiB, floor {floor:.3f} ms "
          f"({torch.__version__}, {torch.cuda.get_device_name()})", flush=True)
    rows = []
    variants = itertools.product(args.fused, args.decode_attention, args.gemv_batch1, args.megakernel)
    variants = [(*v, sync, g, h) for v in variants for sync in (args.megakernel_sync if v[-1] else ["auto"])
                for g in (args.megakernel_gluon if v[-1] else [-1]) for h in (args.megakernel_head if v[-1] else [1])]
    for fused, attention, gemv, mk, sync, gluon, head in variants:
        t0 = time.perf_counter()
        rows += run_variant(model, args, bool(fused), attention, bool(gemv), bool(mk), floor, sync,
                            None if gluon < 0 else bool(gluon), bool(head))
        print(f"  variant total {time.perf_counter() - t0:.1f} s", flush=True)
    print(f"\n{'variant':45} {'batch':>5} {'kv':>5} {'mode':>7} {'ms/step':>8} {'x floor':>8} {'first use s':>11}")
    for r in rows:
        print(f"{r['variant']:45} {r['batch']:>5} {r['kv']:>5} {r['mode']:>7} {r['ms']:>8.3f} {r['x_floor']:>8.2f} "
              f"{r['first_s']:>11.1f}")


if __name__ == "__main__":
    main()
