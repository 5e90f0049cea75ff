"""The torch engine's sessions: samples kept in their KV-cache slot between turns (multi-turn rollouts).

`TorchEngine.generate(keep=True)` opens one `Session` per finished sample; `continue_` appends an observation's
tokens and samples the next turn. The engine keeps, per open session, the slot, the context length and the
context's uncached tail: decode writes a token's K/V on the step that consumes it, so the last sampled token of a
turn has none yet. A continuation prefills exactly that tail plus the observation (`ModelRunner.extend`), at
their positions, and samples from there: the prefix is never run again.

Budgets: a context never exceeds `max_seq_len` tokens (`plan_turn`); kept slots count against `num_slots`.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from rlbench.engine.protocol import Session


@dataclass
class Kept:
    """The engine's side of one open session."""

    session: Session
    slot: int
    """The cache slot (slot layout) holding the session's K/V."""
    length: int
    """Tokens in the context (prompt + response)."""
    tail: list[int]
    """The context's last tokens whose K/V the slot does not hold yet (positions `[length - len(tail), length)`)."""


def plan_turn(length: int, appended: Sequence[int], max_seq_len: int, max_new_tokens: int) -> tuple[list[int], int]:
    """Which appended tokens a context of `length` tokens takes, and how many it may then sample.

    Returns `(taken, max_new)`: all of `appended` and `min(max_new_tokens, room)` while at least one position is
    left after them; otherwise as many appended tokens as fit in `max_seq_len` and 0 (the turn ends "length").
    """
    room = max_seq_len - length - len(appended)
    if room >= 1:
        return list(appended), min(max_new_tokens, room)
    return list(appended[: max(0, max_seq_len - length)]), 0


def check_slots(total: int, held: int, n_prompts: int, n: int, n_turns: int, keep: bool) -> None:
    """Raise unless a call fits beside the `held` slots of open sessions: with `keep` all its `n_prompts * n` samples
    hold a slot at once; otherwise one prompt's n at a time, and its `n_turns` continued sessions give their slots
    back as their turns end."""
    freed = 0 if keep else n_turns
    need = n_prompts * n if keep else (n if n_prompts else 0)
    if need > total - held + freed:
        kept = ", every sample kept" if keep else ""
        raise RuntimeError(
            f"{n_prompts} prompts x n={n}{kept} need {need} KV slots at once; {total - held} of num_slots={total} "
            f"are free ({held} held by open sessions): release() the sessions you are done with (or continue_ "
            "them with keep=False), or raise TorchEngineConfig.num_slots")


class SessionTable:
    """Open sessions by id: their slots (busy across calls) and what the cache holds of each."""

    def __init__(self):
        self._kept: dict[int, Kept] = {}
        self._ids = itertools.count()

    def __len__(self) -> int:
        return len(self._kept)

    def slots(self) -> list[int]:
        """The slots open sessions hold."""
        return [k.slot for k in self._kept.values()]

    def open(self, prompt: Sequence[int], slot: int) -> Session:
        """A new session for a sample of `prompt` in `slot` (its turn is recorded by `record`)."""
        session = Session(next(self._ids), list(prompt))
        self._kept[session.id] = Kept(session, slot, len(prompt), [])
        return session

    def lookup(self, sessions: Sequence[Session]) -> list[Kept]:
        """The open sessions' records, in order; raises for a closed, foreign or repeated session."""
        out = []
        for i, session in enumerate(sessions):
            kept = self._kept.get(getattr(session, "id", None))
            if kept is None or kept.session is not session:
                state = "was closed (release(), flush_cache(), an aborted turn or keep=False)" \
                    if isinstance(session, Session) and not session.open else "is not a session of this engine"
                raise ValueError(f"sessions[{i}] (id {getattr(session, 'id', session)!r}) {state}; continue only "
                                 "open sessions returned by this engine's generate(keep=True) / continue_")
            if any(k is kept for k in out):
                raise ValueError(f"sessions[{i}] (id {session.id}) appears twice; continue a session once per call")
            out.append(kept)
        return out

    @staticmethod
    def append(kept: Kept, tokens: list[int]) -> None:
        """Appended (observation) tokens join the context and its uncached tail (loss mask 0)."""
        kept.session.append(tokens)
        kept.length += len(tokens)
        kept.tail += tokens

    def record(self, session: Session, tokens: list[int], log_probs: list[float], context: int) -> None:
        """A turn of `session` sampled `tokens` after a context of `context` tokens (appended tokens included)."""
        session.append(tokens, log_probs)
        session.turns += 1
        kept = self._kept.get(session.id)
        if kept is not None and tokens:  # decode wrote the K/V of every sampled token but the last
            kept.length, kept.tail = context + len(tokens), tokens[-1:]

    def close(self, session: Session) -> int | None:
        """Close `session`; returns the slot it held (None if it was closed already)."""
        kept = self._kept.pop(session.id, None)
        session.open = False
        return None if kept is None else kept.slot

    def close_all(self) -> None:
        for kept in list(self._kept.values()):
            self.close(kept.session)

    def release(self, sessions: Iterable[Session]) -> None:
        """Close each session of this table (closed ones are skipped); raises for another engine's session."""
        for session in sessions:
            kept = self._kept.get(session.id)
            if kept is None and not session.open:
                continue
            if kept is None or kept.session is not session:
                raise ValueError(f"session id {session.id} is not a session of this engine; release it on its own")
            self.close(session)
