"""Chat prompts of a chosen length in tokens, each one different.

Every prompt ends with a request for a long story, so that the model keeps
talking for hundreds of tokens (the decode scenarios need generations that do
not end on their own). A prompt is padded to its target length with random
common words, each about one token, so no two prompts share more than the chat
template's prefix.
"""

from __future__ import annotations

import random

from stopline.engine.tokenizer import ChatTokenizer, LlamaTokenizer

_WORDS = """time year people way day man thing woman life child world school state family student
group country problem hand part place case week company system program question work government
number night point home water room mother area money story fact month lot right study book eye job
word business issue side kind head house service friend father power hour game line end member law
car city community name president team minute idea kid body information back parent face others
level office door health person art war history party result change morning reason research girl
guy moment air teacher force education river stone garden window bread tower lamp""".split()

_TOPICS = [
    "a dragon who learns to bake bread",
    "a lighthouse keeper and a lost whale",
    "a robot that collects old maps",
    "two sisters who build a flying boat",
    "a village where it never stops snowing",
    "a clockmaker who can pause time",
    "a cat that becomes mayor of a small town",
    "an explorer crossing a desert of glass",
    "a librarian who finds a book that writes itself",
    "a boy who trains a thunderstorm",
]


class PromptMaker:
    def __init__(self, tokenizer: ChatTokenizer | LlamaTokenizer, rng: random.Random):
        self.tokenizer = tokenizer
        self.rng = rng

    def tokens(self, messages: list[dict]) -> int:
        return len(self.tokenizer.encode(self.tokenizer.render_chat(messages)))

    def story(self, target_tokens: int) -> list[dict]:
        """A chat asking for a long story, padded to about ``target_tokens`` prompt tokens."""
        ask = f"Write a very long story about {self.rng.choice(_TOPICS)}."
        words: list[str] = []
        messages = _messages(words, ask)
        # Each word is about one token; a few rounds converge on the target.
        for _ in range(8):
            missing = target_tokens - self.tokens(messages)
            if missing == 0 or (missing < 0 and not words):
                break
            if missing > 0:
                words += self.rng.choices(_WORDS, k=missing)
            else:
                del words[missing:]
            messages = _messages(words, ask)
        return messages

    def edit_tail(self, messages: list[dict], tokens: int) -> list[dict]:
        """``messages`` (one of :meth:`story`'s) with about their last ``tokens`` prompt tokens
        changed, as a user edits the end of a question: its last words and the story asked for."""
        notes, _, ask = messages[-1]["content"].rpartition("\n\n")
        words = notes.removeprefix("Notes: ").removesuffix(".").split()
        topic = self.rng.choice([t for t in _TOPICS if t not in ask])
        before = self.tokenizer.encode(self.tokenizer.render_chat(messages))
        for cut in range(1, len(words) + 1):
            changed = words[:-cut] + self.rng.choices([w for w in _WORDS if w not in words[-cut:]], k=cut)
            edited = messages[:-1] + _messages(changed, f"Write a very long story about {topic}.")
            after = self.tokenizer.encode(self.tokenizer.render_chat(edited))
            same = next((i for i, (a, b) in enumerate(zip(before, after)) if a != b), min(len(before), len(after)))
            if len(after) - same >= tokens:
                break
        return edited


def _messages(words: list[str], ask: str) -> list[dict]:
    notes = f"Notes: {' '.join(words)}.\n\n" if words else ""
    return [{"role": "user", "content": notes + ask}]
