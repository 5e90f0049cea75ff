"""The FSDP critic, one process on the CPU: what a value is (the head over the last hidden state at the position
predicting each response token, checked against a plain HF token-classification forward per sequence), where the
critic starts from (a causal-LM directory: backbone loaded, head at zero; a saved critic or an `rlbench rm` reward
model: head loaded too), its state in sleep / wake, the memory plan and the checkpoint, and the refusals."""

from __future__ import annotations

import os

import pytest
import torch
from dist_utils import free_port
from torch.distributed.tensor import distribute_tensor

from rlbench.configs import CriticConfig, OptimConfig, TrainConfig
from rlbench.models import build_model, save_pretrained
from rlbench.models.value_head import read_stamp, weights_version
from rlbench.packing.pack import pack_samples
from rlbench.types import Sample

pytestmark = pytest.mark.usefixtures("one_thread")


def make_samples() -> list[Sample]:
    g = torch.Generator().manual_seed(5)
    return [Sample(tokens=torch.randint(0, 120, (n,), generator=g).tolist(), response_length=r, index=i)
            for i, (n, r) in enumerate([(9, 4), (12, 7), (6, 2)])]


@pytest.fixture(scope="module")
def env():
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), RANK="0", WORLD_SIZE="1")
    from rlbench.distributed.mesh import init_distributed

    yield init_distributed("cpu")
    if dist.is_initialized():
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def lm_dir(tmp_path_factory):
    """A causal-LM directory (the actor's warm start)."""
    path = str(tmp_path_factory.mktemp("lm"))
    from rlbench.data import build_tokenizer

    model = build_model("tiny", seed=7)
    save_pretrained(model, build_tokenizer(model.config.vocab_size), path)
    return path


def _backend(env, lm_dir, tmp_path, **critic):
    from rlbench.backends.fsdp.critic import FSDPActorCritic

    cfg = TrainConfig(model=lm_dir, device="cpu", param_dtype="fp32", checkpoint_dir=str(tmp_path / "ckpt"),
                      optim=OptimConfig(lr=1e-3), critic=CriticConfig(**critic))
    backend = FSDPActorCritic(cfg, env=env)
    backend.init()
    return backend


def test_values_are_the_head_at_the_positions_predicting_the_response(env, lm_dir, tmp_path):
    from transformers import AutoModelForTokenClassification

    backend = _backend(env, lm_dir, tmp_path)
    samples = make_samples()
    pack = pack_samples(samples, [0, 1, 2], pad_multiple=4)
    # the backbone came from the causal LM, the head starts at zero (rlbench.models.value_head's rule): V = 0
    lm = build_model("tiny", seed=7)
    params = dict(backend.critic.model.named_parameters())
    assert torch.equal(params["model.embed_tokens.weight"].full_tensor(), lm.model.embed_tokens.weight)
    head = params["score.weight"]
    assert head.shape == (1, lm.config.hidden_size) and not head.full_tensor().any()
    assert not params["score.bias"].full_tensor().any() and not backend.compute_values([pack])[0].any()
    with torch.no_grad():  # a head that reads the hidden state, for the comparison below
        head.copy_(distribute_tensor(torch.randn(head.shape, generator=torch.Generator().manual_seed(1)),
                                     head.device_mesh, head.placements))
    values = backend.compute_values([pack])[0]  # [R]
    assert values.shape == (sum(s.response_length for s in samples),) and values.dtype == torch.float32
    # the reference: HF's own token-classification model on each sequence alone, the critic's weights loaded
    export = str(tmp_path / "critic_hf")
    backend.critic.export_hf(export)
    ref = AutoModelForTokenClassification.from_pretrained(export, dtype=torch.float32).eval()
    assert ref.config.num_labels == 1 and ref.config.architectures == ["Qwen3ForTokenClassification"]
    assert read_stamp(export) == {"kind": "critic", "format": 2, "version": weights_version(export)}
    expected = []
    for s in samples:
        with torch.no_grad():
            v = ref(torch.tensor([s.tokens])).logits[0, :, 0]  # [T]
        prompt = len(s.tokens) - s.response_length
        expected.append(v[prompt - 1 : len(s.tokens) - 1])  # V of the state before each response token
    torch.testing.assert_close(values, torch.cat(expected), rtol=1e-5, atol=1e-6)


def test_critic_load_of_a_saved_critic_loads_its_head(env, lm_dir, tmp_path):
    first = _backend(env, lm_dir, tmp_path)
    pack = pack_samples(make_samples(), [0, 1, 2])

    def loss(values, _entropy, inputs):  # pull the values to 1: the head and the backbone move
        out = ((values - 1.0) ** 2).sum() / values.numel()
        return out, {"vf_loss": out.detach()}

    metrics = first.train_critic([pack], [{}], loss)
    assert metrics["critic/step"] == 1.0 and metrics["critic/grad_norm"] > 0 and metrics["critic/lr"] == 1e-3
    trained = first.compute_values([pack])[0]
    saved = str(tmp_path / "critic_dir")
    first.critic.export_hf(saved)
    second = _backend(env, lm_dir, tmp_path / "second", load=saved)
    assert torch.equal(second.compute_values([pack])[0], trained)
    # the critic's training left the actor alone: both actors are the causal LM
    assert torch.equal(second.compute_log_prob([pack])[0].log_probs, first.compute_log_prob([pack])[0].log_probs)


def test_a_reward_model_directory_starts_the_critic(env, lm_dir, tmp_path):
    """`--critic-load RM_DIR`: the critic's values are the reward model's per-position values (its scoring path)."""
    from rlbench.configs.reward_model import RMTrainConfig
    from rlbench.data.preferences import make_arithmetic_preferences
    from rlbench.data.tasks import write_jsonl
    from rlbench.models.value_head import token_values
    from rlbench.reward_model.serve import RewardModel
    from rlbench.reward_model.train import run_rm

    write_jsonl(make_arithmetic_preferences(64, level=1, seed=0), tmp_path / "prefs.jsonl")
    rm_dir = str(tmp_path / "rm")
    run_rm(RMTrainConfig(data=str(tmp_path / "prefs.jsonl"), model="tiny", out=rm_dir, lr=1e-3, num_threads=1))
    backend = _backend(env, lm_dir, tmp_path, load=rm_dir)
    pack = pack_samples(make_samples(), [0, 1, 2])
    values = backend.compute_values([pack])[0]  # [R]
    rm = RewardModel(rm_dir)
    with torch.no_grad():
        ref = token_values(rm.model, pack.tokens[None], pack.position_ids[None])[0]  # [T], what rm.score reads
    torch.testing.assert_close(values, ref[pack.response_index], rtol=1e-5, atol=1e-6)
    assert float(values.std()) > 1e-3  # the trained head, not a zero one
    # and the critic's own export serves as a reward model (its tokenizer came from the RM's directory)
    backend.critic.export_hf(str(tmp_path / "critic"))
    texts = (["1+2=?", "3+4=?"], ["\\boxed{3}", "so \\boxed{7}"])
    assert RewardModel(tmp_path / "critic").score(*texts) == rm.score(*texts)


def test_sleep_parks_the_critic_with_the_actor_and_the_plan_counts_it(env, lm_dir, tmp_path):
    from rlbench.memory_plan import tensor_bytes

    backend = _backend(env, lm_dir, tmp_path)
    pack = pack_samples(make_samples(), [0, 1, 2])
    before = backend.compute_values([pack])[0]
    actor = tensor_bytes(backend.model.parameters())
    critic = tensor_bytes(backend.critic.model.parameters())
    assert tensor_bytes(backend.state_tensors()) >= actor + critic  # what the memory plan measures
    metrics = backend.sleep()
    assert metrics["memory/freed_bytes"] >= actor + critic
    with pytest.raises(ValueError, match="asleep"):
        backend.compute_values([pack])
    backend.wake_up()
    assert torch.equal(backend.compute_values([pack])[0], before)


def test_a_checkpoint_without_the_critic_is_refused(env, lm_dir, tmp_path):
    from rlbench.backends.fsdp.actor import FSDPBackend

    plain = FSDPBackend(TrainConfig(model=lm_dir, device="cpu", param_dtype="fp32",
                                    checkpoint_dir=str(tmp_path / "ckpt")), env=env)
    plain.init()
    plain.save(3)
    backend = _backend(env, lm_dir, tmp_path)
    with pytest.raises(ValueError, match=r"has no critic/ \(saved by a run without it\)"):
        backend.load(3)
    with pytest.raises(ValueError, match=r"TrainConfig.critic is set: build the backend with a critic"):
        FSDPBackend(backend.cfg, env=env).init()
