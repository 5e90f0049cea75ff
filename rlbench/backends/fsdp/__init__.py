"""FSDP2 training backend: sharded HF model, packed training step, sleep/wake, weight export (the shared parts,
checkpoint layout, offload, optimizer, HF weights, live one level up in `rlbench.backends`).

Light on import: `FSDPBackend` loads the actor (transformers, torch.distributed) on first access; its config is
`rlbench.configs.TrainConfig` with the FSDP-only `FSDPOptions` nested.
"""

__all__ = ["FSDPBackend"]


def __getattr__(name: str):
    if name == "FSDPBackend":
        from rlbench.backends.fsdp.actor import FSDPBackend

        return FSDPBackend
    raise AttributeError(f"module 'rlbench.backends.fsdp' has no attribute {name!r}")
