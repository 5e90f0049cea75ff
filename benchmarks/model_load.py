"""Load time and memory of a preset-shaped HF checkpoint through `rlbench.models.load_model`.

    python benchmarks/model_load.py --preset qwen3-0.6b-shape --device cuda --out model_load.json

Builds the preset with random weights, saves it as a standard HF directory (safetensors), then times
`load_model(dir, device=..., dtype=bf16)` and reports peak device memory and logits of a short prompt.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time

import torch

from rlbench.models import build_model, load_model, save_pretrained


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="qwen3-0.6b-shape")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    dtype = torch.bfloat16
    with tempfile.TemporaryDirectory() as d:
        t0 = time.perf_counter()
        save_pretrained(build_model(args.preset, dtype=dtype), None, d)
        save_s = time.perf_counter() - t0
        if args.device.startswith("cuda"):
            torch.cuda.reset_peak_memory_stats()
        t0 = time.perf_counter()
        model = load_model(d, device=args.device, dtype=dtype)
        if args.device.startswith("cuda"):
            torch.cuda.synchronize()
        load_s = time.perf_counter() - t0
    n_params = sum(p.numel() for p in model.parameters())
    with torch.no_grad():
        logits = model(torch.arange(16, device=args.device)[None], use_cache=False).logits
    res = {"preset": args.preset, "device": args.device, "params": n_params, "build_and_save_s": save_s,
           "load_s": load_s, "finite_logits": bool(torch.isfinite(logits).all())}
    if args.device.startswith("cuda"):
        res["peak_mem_gb"] = torch.cuda.max_memory_allocated() / 1e9
        res["weights_gb"] = sum(p.numel() * p.element_size() for p in model.parameters()) / 1e9
    print(json.dumps(res, indent=1))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
