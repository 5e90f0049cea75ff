"""Bucketed weight sync into the real torch engine: bitwise equality, versions, bucket bound, streaming, verify."""

from __future__ import annotations

import pytest
import torch

from rlbench.backends.export import named_weight_buckets
from rlbench.engine import TorchEngine, TorchEngineConfig
from rlbench.engine.protocol import SamplingParams
from rlbench.models import build_model
from rlbench.weights import WeightSync, WeightSyncConfig, checksum


class PlainBackend:
    """The backend side of the protocol over an unsharded model; logs when each bucket is produced."""

    def __init__(self, model, events=None):
        self.model, self.events = model, events if events is not None else []

    def named_weights_for_sync(self, bucket_bytes, dtype=None):
        for i, bucket in enumerate(named_weight_buckets(self.model, bucket_bytes, dtype)):
            self.events.append(("yield", i))
            yield bucket


class LoggingEngine(TorchEngine):
    def update_weights(self, buckets, version):
        def logged():
            for i, b in enumerate(buckets):
                yield b
                self.events.append(("loaded", i))
        super().update_weights(logged(), version)


@pytest.fixture(scope="module")
def models():
    torch.manual_seed(0)
    return build_model("tiny", seed=1), build_model("tiny", seed=2)


def _engine(model, cls=TorchEngine):
    return cls(model, TorchEngineConfig(max_seq_len=32, num_slots=4))


def test_sync_makes_engine_bitwise_equal_and_stamps_version(models):
    trainer_model, engine_model = models
    engine = _engine(build_model("tiny", seed=2))
    assert not torch.equal(engine.model.model.embed_tokens.weight, trainer_model.model.embed_tokens.weight)
    m = WeightSync(WeightSyncConfig(verify=True, bucket_bytes=64 << 10), PlainBackend(trainer_model), engine).push(version=3)
    for name, p in trainer_model.state_dict().items():
        assert torch.equal(engine.model.state_dict()[name], p), name
    assert engine.weight_version == 3 and m["weights/version"] == 3.0 and m["weights/verified"] == 1.0
    n_bytes = sum(p.numel() * p.element_size() for p in trainer_model.parameters())
    assert m["weights/bytes"] >= n_bytes
    gens = engine.generate([[1, 2, 3]], SamplingParams(max_new_tokens=3, n=2, seed=0))
    assert [g.weight_version for g in gens] == [3, 3]


@pytest.mark.parametrize("bucket_kib", [4, 16, 64, 1024])
def test_buckets_respect_the_bound_and_stream(models, bucket_kib):
    trainer_model, _ = models
    events: list = []
    engine = _engine(build_model("tiny", seed=2), LoggingEngine)
    engine.events = events
    m = WeightSync(WeightSyncConfig(bucket_bytes=bucket_kib << 10), PlainBackend(trainer_model, events), engine).push(1)
    largest = max(p.numel() * p.element_size() for p in trainer_model.parameters())
    assert m["weights/max_bucket_bytes"] <= max(bucket_kib << 10, largest)
    n = int(m["weights/num_buckets"])
    # Streaming: bucket i+1 is produced only after bucket i was loaded (one bucket alive at a time).
    assert events == [e for i in range(n) for e in (("yield", i), ("loaded", i))]
    if bucket_kib == 1024:
        assert n == 1
    if bucket_kib == 4:
        assert n > 10


def test_dtype_cast_halves_bytes(models):
    trainer_model, _ = models
    engine = _engine(build_model("tiny", seed=2, dtype=torch.bfloat16))
    m32 = WeightSync(WeightSyncConfig(), PlainBackend(trainer_model), _engine(build_model("tiny", seed=2))).push(1)
    m16 = WeightSync(WeightSyncConfig(dtype="bfloat16", verify=True), PlainBackend(trainer_model), engine).push(1)
    assert m16["weights/bytes"] * 2 == m32["weights/bytes"]
    w = trainer_model.model.embed_tokens.weight
    assert torch.equal(engine.model.model.embed_tokens.weight, w.to(torch.bfloat16))


class DroppingEngine(TorchEngine):
    """Loses the first tensor of every bucket (the embedding): verify must notice."""

    def update_weights(self, buckets, version):
        super().update_weights((b[1:] for b in buckets), version)


def test_verify_detects_a_missed_tensor(models):
    trainer_model, _ = models
    sync = WeightSync(WeightSyncConfig(verify=True), PlainBackend(trainer_model), _engine(build_model("tiny", seed=2), DroppingEngine))
    with pytest.raises(RuntimeError, match="tensors differ after sync"):
        sync.push(1)


def test_weight_sync_dtype_names_torch_dtypes():
    assert WeightSyncConfig(dtype="bfloat16").torch_dtype is torch.bfloat16 and WeightSyncConfig().torch_dtype is None


def test_checksum_sees_every_bit():
    x = torch.randn(1000)
    ref = checksum(x)
    for i in (0, 17, 999):
        y = x.clone()
        y.view(torch.int32)[i] ^= 1  # flip the lowest mantissa bit
        assert checksum(y) != ref
    swapped = x.clone()
    swapped[[3, 4]] = swapped[[4, 3]]
    assert checksum(swapped) != ref  # position-weighted: a permutation changes it
    assert checksum(x.to(torch.bfloat16)) == checksum(x.to(torch.bfloat16).clone())
