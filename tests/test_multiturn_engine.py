"""Multi-turn tool calling on the real TorchEngine (CPU, tiny Qwen3): token in, token out, and true on-policy.

The model is the tiny preset taught one 3-turn transcript (call tool `f`, read "a", call tool `g`, read "b", answer),
so that the real engine writes real Hermes tool calls. The tokenizer is the char tokenizer with one BPE merge, "\\n<":
an observation ends with "assistant\\n" and the next turn starts with "<tool_call>", so the observation's last token
merges with the model's next one when the transcript's text is tokenized in one piece. The trainer must see the
engine's ids (the observation tokenized alone, the model's sampled ids), never such a re-tokenization.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from tokenizers import Tokenizer, decoders, models
from transformers import PreTrainedTokenizerFast

from rlbench.configs import RolloutConfig
from rlbench.configs.multiturn import MultiTurnConfig
from rlbench.data import DataConfig, PromptDataset, write_jsonl
from rlbench.data import tokenizer as chars
from rlbench.engine import TorchEngine, TorchEngineConfig
from rlbench.models import build_model, load_model, save_pretrained
from rlbench.packing import pack_samples, unpack_response, unpack_tokens
from rlbench.rollout.manager import RolloutManager
from rlbench.rollout.multiturn import format_call, observation_text
from rlbench.rollout.multiturn.warm_start import collate, encode
from rlbench.sft import train_step

pytestmark = pytest.mark.usefixtures("one_thread")
TOOLS = ("test_multiturn_engine:f", "test_multiturn_engine:g")
PROMPT = "hi"


def f() -> str:
    return "a"


def g() -> str:
    return "b"


def merge_tokenizer() -> PreTrainedTokenizerFast:
    """`rlbench.data.build_tokenizer()` with one merge, "\\n" + "<" -> "\\n<" (id 97; still 128 ids)."""
    vocab = {c: i for i, c in enumerate(chars.alphabet())}
    vocab["\n<"] = len(vocab)
    vocab[chars.UNK_TOKEN] = len(vocab)
    core = Tokenizer(models.BPE(vocab=vocab, merges=[("\n", "<")], unk_token=chars.UNK_TOKEN))
    core.decoder = decoders.Fuse()
    core.add_special_tokens(list(chars.SPECIAL_TOKENS) + [f"<|reserved_{k}|>" for k in range(128 - len(vocab) - 3)])
    tok = PreTrainedTokenizerFast(tokenizer_object=core, unk_token=chars.UNK_TOKEN, pad_token=chars.PAD_TOKEN,
                                  eos_token=chars.IM_END, bos_token=None, chat_template=chars.CHAT_TEMPLATE,
                                  clean_up_tokenization_spaces=False)
    assert len(tok) == 128
    return tok


SEGMENTS = [(format_call("f", {}), 1), (observation_text("a"), 0), (format_call("g", {}), 1),
            (observation_text("b"), 0), ("ok<|im_end|>", 1)]


@pytest.fixture(scope="module")
def taught(tmp_path_factory):
    """(HF dir, tokenizer): the tiny model after 100 AdamW steps on the one transcript (~2 s)."""
    torch.manual_seed(0)
    tok = merge_tokenizer()
    model = build_model("tiny", seed=0, vocab_size=128, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
                        bos_token_id=None)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    batch = collate([encode(PROMPT, SEGMENTS, tok)], tok.pad_token_id)
    for _ in range(100):
        train_step(model, opt, batch)
    out = str(tmp_path_factory.mktemp("taught"))
    save_pretrained(model.eval(), tok, out)
    return out, tok


def _dataset(tmp_path, tok, n=4):
    path = str(tmp_path / "hi.jsonl")
    write_jsonl([{"prompt": PROMPT, "label": "ok", "metadata": {"k": i}} for i in range(n)], path)
    return PromptDataset(DataConfig(path=path, metadata_key="metadata"), tok)


class Spy:
    """Wraps an engine and keeps every turn's Generation and every released session."""

    def __init__(self, engine):
        self.engine, self.turns, self.released = engine, [], []

    def __getattr__(self, name):
        return getattr(self.engine, name)

    def generate(self, *a, **k):
        self.turns.append(self.engine.generate(*a, **k))
        return self.turns[-1]

    def continue_(self, *a, **k):
        self.turns.append(self.engine.continue_(*a, **k))
        return self.turns[-1]

    def release(self, sessions):
        sessions = list(sessions)
        self.released += sessions
        self.engine.release(sessions)


def test_three_turn_samples_reach_the_trainer_as_the_engine_ids(tmp_path, taught):
    """The packed token ids of each sample == its session's ids (prompt, sampled turns, observations tokenized
    alone); the packed loss mask == the session's, 0 exactly on the observations of its tool calls; the rollout
    log-probs are the turns' own. The observation's last token would merge with the next turn's first one if the
    text were tokenized in context, so a re-tokenization would train on other ids."""
    path, tok = taught
    model = load_model(path, device="cpu", dtype=torch.float32)
    engine = Spy(TorchEngine(model, TorchEngineConfig(max_seq_len=512, num_slots=8, steps_per_sync=4), tokenizer=tok))
    cfg = RolloutConfig(rollout_batch_size=2, n_samples_per_prompt=4, max_response_len=300, temperature=0.7,
                        rm_type="exact", custom_generate_function_path="rlbench.rollout.multiturn:generate",
                        multiturn=MultiTurnConfig(tools=TOOLS))
    batch = RolloutManager(cfg, engine, _dataset(tmp_path, tok), tok).generate(0)
    samples = batch.samples
    three = [i for i, s in enumerate(samples) if s.metadata["turns"] == 3]
    assert len(three) >= 4, [s.metadata["turns"] for s in samples]  # the taught model does call both tools
    pack = pack_samples(samples)
    packed_ids = unpack_tokens(pack, pack.tokens)
    packed_mask = unpack_response(pack, pack.loss_mask)
    packed_lp = unpack_response(pack, pack.rollout_log_probs)
    assert len(engine.released) == len(samples)
    for i, (s, session) in enumerate(zip(samples, engine.released)):
        assert packed_ids[i].tolist() == s.tokens == session.token_ids  # byte for byte: the engine's ids
        assert packed_mask[i].tolist() == session.loss_mask
        assert packed_lp[i].tolist() == pytest.approx(session.log_probs, abs=0)
    obs_ids = {out: tok(observation_text(out), add_special_tokens=False)["input_ids"] for out in ("a", "b")}
    for i in three:
        s, session = samples[i], engine.released[i]
        turns = [t[k].token_ids for t in engine.turns for k in range(len(t)) if t[k].session is session]
        assert len(turns) == 3
        assert s.response_tokens == turns[0] + obs_ids["a"] + turns[1] + obs_ids["b"] + turns[2]
        assert s.loss_mask == ([1] * len(turns[0]) + [0] * len(obs_ids["a"]) + [1] * len(turns[1])
                               + [0] * len(obs_ids["b"]) + [1] * len(turns[2]))
        assert [c["output"] for c in s.metadata["tool_calls"]] == ["a", "b"]
        # in context, the observation's last "\n" and the next turn's "<" are one token: the text would re-tokenize
        # to other ids, at exactly this boundary
        assert tok.convert_ids_to_tokens(obs_ids["a"][-1:] + turns[1][:1]) == ["\n", "<"]
        boundary = tok(observation_text("a") + tok.decode(turns[1]), add_special_tokens=False)["input_ids"]
        assert boundary != obs_ids["a"] + turns[1] and tok.convert_tokens_to_ids("\n<") in boundary
        assert tok(tok.decode(s.tokens), add_special_tokens=False)["input_ids"] != s.tokens


def _char_reward(response: str, label) -> float:
    """Differs between the samples of a group, so advantages, gradients and weights move."""
    return (sum(map(ord, response)) % 7) / 6


def test_true_on_policy_holds_across_turns_through_trainer_step(tmp_path, taught, monkeypatch):
    """`Trainer.step()` in true on-policy mode on multi-turn samples: the trainer's recompute equals the rollout
    log-probs on every sampled token (`train_rollout_logprob_abs_diff == 0.0`, observations excluded by the loss
    mask) at every step; on the observation tokens the two differ (the rollout records 0.0 there), so the metric
    would show them if the mask let them in."""
    from rlbench import Trainer, presets
    from rlbench.configs import EvalConfig
    from rlbench.rewards import REWARDS

    monkeypatch.setitem(REWARDS, "chars", _char_reward)
    path, tok = taught
    cfg = presets.cpu_test(model=path, workdir=str(tmp_path))
    data = _dataset(tmp_path, tok).cfg
    cfg = cfg.replace(
        true_on_policy_mode=True, task=None, eval=EvalConfig(), data=data,
        rollout=dataclasses.replace(cfg.rollout, rm_type="chars", rollout_batch_size=2, n_samples_per_prompt=4,
                                    max_response_len=300, custom_generate_function_path=(
                                        "rlbench.rollout.multiturn:generate"), multiturn=MultiTurnConfig(tools=TOOLS)),
        batch=dataclasses.replace(cfg.batch, global_batch_size=8, num_rollout=2, max_tokens_per_gpu=2048),
        engine=dataclasses.replace(cfg.engine, max_seq_len=512, num_slots=8))
    trainer = Trainer(cfg)
    weights = [p.detach().clone() for p in trainer.engine.model.parameters()]
    for _ in range(2):
        m = trainer.step()
        batch = trainer.last_rollout
        assert any(s.metadata["turns"] == 3 for s in batch.samples)
        assert m["train/train_rollout_logprob_abs_diff"] == 0.0 and m["train/mismatch_k3_kl"] == 0.0
        pack, old = batch.packs[0][0], batch.old_log_probs[0][0]
        observed = pack.loss_mask == 0
        assert observed.sum() > 0 and torch.equal(old[~observed], pack.rollout_log_probs[~observed].to(old.dtype))
        assert (old[observed] - pack.rollout_log_probs[observed]).abs().max() > 0.1
    assert m["train/grad_norm"] > 0
    assert any(not torch.equal(w, p) for w, p in zip(weights, trainer.engine.model.parameters()))
    trainer.close()
