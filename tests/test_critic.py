"""The FSDP critic, one process on the CPU: what a value is (the head over the last hidden state at the position
predicting each response token, checked against a plain HF token-classification forward per sequence), where the
critic starts from (a causal-LM directory: backbone loaded, head initialised; a saved critic: head loaded too), its
state in sleep / wake, the memory plan and the checkpoint, and the refusals."""

from __future__ import annotations

import os

import pytest
import torch
from dist_utils import free_port

from rlbench.configs import CriticConfig, OptimConfig, TrainConfig
from rlbench.models import build_model, save_pretrained
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
    values = backend.compute_values([pack])[0]  # [R]
    assert values.shape == (sum(s.response_length for s in samples),) and values.dtype == torch.float32
    # the reference: HF's own token-classification model on each sequence alone, the critic's weights loaded
    export = str(tmp_path / "critic_hf")
    backend.critic.export_hf(export)
    ref = AutoModelForTokenClassification.from_pretrained(export, dtype=torch.float32).eval()
    assert ref.config.num_labels == 1 and ref.config.architectures == ["Qwen3ForTokenClassification"]
    expected = []
    for s in samples:
        with torch.no_grad():
            v = ref(torch.tensor([s.tokens])).logits[0, :, 0]  # [T]
        prompt = len(s.tokens) - s.response_length
        expected.append(v[prompt - 1 : len(s.tokens) - 1])  # V of the state before each response token
    torch.testing.assert_close(values, torch.cat(expected), rtol=1e-5, atol=1e-6)
    # the backbone came from the causal LM, the head from the seeded init (not zeros, not the LM head)
    lm = build_model("tiny", seed=7)
    emb = dict(backend.critic.model.named_parameters())["model.embed_tokens.weight"].full_tensor()
    assert torch.equal(emb, lm.model.embed_tokens.weight)
    head = dict(backend.critic.model.named_parameters())["score.weight"].full_tensor().detach()
    assert head.shape == (1, lm.config.hidden_size) and 0.01 < float(head.std()) < 0.03  # normal(0, 0.02)


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
