"""The smallest real run (tiny preset, CPU, 16 samples, 2 optimizer steps per rollout) for fault tests."""

from __future__ import annotations

import dataclasses as dc

from rlbench import presets


def small_cfg(workdir, **backend_changes):
    cfg = presets.cpu_test(model="tiny", workdir=str(workdir), level=1, n_eval=16)
    return cfg.replace(
        rollout=dc.replace(cfg.rollout, rollout_batch_size=4, n_samples_per_prompt=4, max_response_len=8),
        batch=dc.replace(cfg.batch, global_batch_size=8, max_tokens_per_gpu=128, num_rollout=2),
        eval=dc.replace(cfg.eval, interval=None),
        backend=dc.replace(cfg.backend, **backend_changes),
    )
