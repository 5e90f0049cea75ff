"""`rlbench.models.value_head.ScalarHeadModel`: packed == per-sequence values, the on-disk layout round-trips
bit for bit, an actor directory starts a zero head, the version follows the weights."""

from __future__ import annotations

import json
import os

import pytest
import torch

from rlbench.models import build_model, save_pretrained
from rlbench.models.value_head import HEAD_FILE, META_FILE, ScalarHeadModel, read_stamp, weights_version


def _model(seed: int = 0) -> ScalarHeadModel:
    model = ScalarHeadModel(build_model("tiny", seed=seed))
    with torch.no_grad():
        torch.manual_seed(seed + 1)
        model.head.weight.normal_()
        model.head.bias.fill_(0.25)
    return model.eval()


def test_packed_values_equal_each_sequence_alone():
    model = _model()
    seqs = [torch.randint(0, 128, (n,), generator=torch.Generator().manual_seed(n)) for n in (5, 9, 3)]
    tokens = torch.cat(seqs)[None]  # [1, T]
    positions = torch.cat([torch.arange(len(s)) for s in seqs])[None]  # [1, T]
    with torch.no_grad():
        packed = model(tokens, position_ids=positions)[0]  # [T]
        alone = torch.cat([model(s[None])[0] for s in seqs])
    assert packed.dtype == torch.float32 and packed.shape == (17,)
    torch.testing.assert_close(packed, alone, rtol=1e-5, atol=1e-5)
    # the head really reads the hidden state: w . h + b, in float64
    h = model.hidden_states(seqs[0][None])[0].double()
    ref = h @ model.head.weight.double()[0] + model.head.bias.double()
    torch.testing.assert_close(packed[:5].double(), ref, rtol=1e-5, atol=1e-6)


def test_save_load_round_trip_is_bit_exact(tmp_path):
    model = _model()
    version = model.save_pretrained(tmp_path, meta={"kind": "reward"})
    assert sorted(os.listdir(tmp_path)) == sorted(["config.json", "generation_config.json", "model.safetensors",
                                                   HEAD_FILE, META_FILE])
    stamp = read_stamp(tmp_path)
    assert stamp == {"kind": "reward", "format": 1, "hidden_size": 64, "version": version} and len(version) == 16
    loaded = ScalarHeadModel.from_pretrained(tmp_path, require_head=True).eval()
    ids = torch.randint(0, 128, (2, 7), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        assert torch.equal(model(ids), loaded(ids))
    assert weights_version(tmp_path) == version


def test_version_follows_the_weights(tmp_path):
    a, b = _model(), _model()
    va = a.save_pretrained(tmp_path / "a")
    assert b.save_pretrained(tmp_path / "b") == va  # same weights, same version
    with torch.no_grad():
        b.head.bias.add_(1.0)
    assert b.save_pretrained(tmp_path / "b") != va


def test_an_actor_directory_starts_a_zero_head(tmp_path):
    save_pretrained(build_model("tiny"), None, tmp_path)
    model = ScalarHeadModel.from_pretrained(tmp_path)
    with torch.no_grad():
        assert torch.equal(model(torch.arange(6)[None]), torch.zeros(1, 6))
    with pytest.raises(ValueError, match="no scalar_head.safetensors.*rlbench rm"):
        ScalarHeadModel.from_pretrained(tmp_path, require_head=True)


def test_a_head_of_the_wrong_shape_is_refused(tmp_path):
    _model().save_pretrained(tmp_path)
    from safetensors.torch import save_file

    save_file({"weight": torch.zeros(1, 32), "bias": torch.zeros(1)}, os.path.join(tmp_path, HEAD_FILE))
    with pytest.raises(ValueError, match=r"expected weight \(1, 64\)"):
        ScalarHeadModel.from_pretrained(tmp_path)
    with pytest.raises(ValueError, match="must be nn.Linear"):
        ScalarHeadModel(build_model("tiny"), torch.nn.Linear(32, 1))
    json.loads((tmp_path / META_FILE).read_text())  # the stamp stays readable
