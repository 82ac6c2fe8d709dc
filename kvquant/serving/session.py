"""A multi-turn conversation on an `Engine` (`kvquant.serving.engine`): one cache across turns."""

from __future__ import annotations

from collections.abc import Sequence

from .engine import Engine, Prefill

__all__ = ["Session"]


class Session:
    """A multi-turn conversation: one cache across turns, so each turn computes only its new tokens.

    `send` appends a user message (token ids), runs it, and decodes a greedy reply; the reply's last token
    is fed at the start of the next turn. `ids` is the whole conversation. The transformers way works too:
    pass the same `QuantizedCache` to `model.generate` again with the whole conversation's ids."""

    def __init__(self, engine: Engine, name: str | None = None):
        self.engine = engine
        self.cache = engine.open(name)
        self.ids: list[int] = []
        self.turns: list[Prefill] = []

    def send(
        self, message: Sequence[int], max_new_tokens: int = 32, eos_token_id: int | None = None
    ) -> list[int]:
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be at least 1, got {max_new_tokens}")
        self.ids += [int(t) for t in message]
        pre = self.engine.prefill(self.cache, self.ids)
        self.turns.append(pre)
        reply = [int(pre.logits.argmax())]
        while len(reply) < max_new_tokens and reply[-1] != eos_token_id:
            reply.append(int(self.engine.step(self.cache, reply[-1]).argmax()))
        self.ids += reply
        self.engine.register(self.cache, self.ids)  # the last reply token is not fed yet: ids run one past
        return reply

    def close(self) -> None:
        """End the conversation; its pages stay in the prefix cache (if any) for later requests."""
        self.engine.close(self.cache, self.ids)
