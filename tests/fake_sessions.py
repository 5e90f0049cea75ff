"""A scripted `SessionEngine` for the multi-turn rollout tests: each turn's text comes from a script, the session
record (ids, log-probs, loss mask, turns) is kept exactly as `rlbench.engine.protocol.Session` specifies, and
budgets and stops behave as the torch engine's (`max_new_tokens` -> "length", stop ids / stop strings -> "stop")."""

from __future__ import annotations

from rlbench.engine.protocol import Generation, Session


class ScriptedSessions:
    """`script(prompt_text, sample_index, turn, context_text) -> str` gives each turn's text (turn 0 is the first).

    Log-probs are `-0.25 - 0.001 * k` for the k-th token of a turn, so they are distinguishable from the observations'
    0.0. `seeds_seen` records every call's seeds."""

    supports_sessions = True

    def __init__(self, tok, script, num_slots: int = 64, max_seq_len: int = 4096):
        self.tok, self.script, self.num_slots, self.max_seq_len = tok, script, num_slots, max_seq_len
        self.weight_version = 3
        self.open: dict[int, tuple[Session, int]] = {}  # id -> (session, sample index)
        self.next_id = 0
        self.seeds_seen: list[list[int]] = []
        self.calls: list[tuple[str, int]] = []

    @property
    def free_slots(self) -> int:
        return self.num_slots - len(self.open)

    def _turn(self, session: Session, j: int, sampling) -> Generation:
        text = self.script(self.tok.decode(session.prompt_ids), j, session.turns, self.tok.decode(session.token_ids))
        ids = self.tok(text, add_special_tokens=False)["input_ids"]
        room = min(sampling.max_new_tokens, self.max_seq_len - len(session.token_ids))
        reason = "length"
        for k, t in enumerate(ids[:room]):
            if t in sampling.stop_token_ids or any(self.tok.decode(ids[: k + 1]).endswith(s) for s in sampling.stop):
                ids, reason = ids[: k + 1], "stop"
                break
        ids = ids[:room]
        log_probs = [-0.25 - 0.001 * k for k in range(len(ids))]
        session.append(ids, log_probs)
        session.turns += 1
        return Generation(0, ids, log_probs, reason, self.weight_version, j, session)

    def generate(self, prompts, sampling, seeds=None, *, keep=False):
        assert keep and len(prompts) * sampling.n <= self.free_slots, "the loop keeps every sample within free_slots"
        self.calls.append(("generate", len(prompts) * sampling.n))
        self.seeds_seen.append(list(seeds))
        out = []
        for i, prompt in enumerate(prompts):
            for j in range(sampling.n):
                session = Session(self.next_id, list(prompt))
                self.open[self.next_id] = session, j
                self.next_id += 1
                g = self._turn(session, j, sampling)
                g.prompt_index = i
                out.append(g)
        return out

    def continue_(self, sessions, appended, sampling, seeds=None, *, keep=True):
        assert sampling.n == 1 and len(seeds) == len(sessions) == len(appended)
        self.calls.append(("continue", len(sessions)))
        self.seeds_seen.append(list(seeds))
        out = []
        for i, (session, obs) in enumerate(zip(sessions, appended)):
            assert session.open and session.id in self.open
            session.append(obs)
            g = self._turn(session, self.open[session.id][1], sampling)
            g.prompt_index = i
            out.append(g)
        return out

    def release(self, sessions):
        for s in sessions:
            self.open.pop(s.id, None)
            s.open = False

    def update_weights(self, buckets, version):
        self.weight_version = version

    def sleep(self, release_weights=False):
        pass

    def wake_up(self):
        pass

    def flush_cache(self):
        self.release([s for s, _ in list(self.open.values())])
