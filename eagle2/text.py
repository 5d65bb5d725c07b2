"""Incremental detokenization with stop strings, shared by the API and the service."""

from __future__ import annotations


class TextStream:
    """Turns a growing list of token ids into text deltas; cuts at the first stop string.

    A delta never contains half a character (a trailing U+FFFD is held back) nor a text that
    could still turn out to be the start of a stop string.
    """

    def __init__(self, tokenizer, stop: tuple[str, ...] = ()):
        self.tokenizer = tokenizer
        self.stop = stop
        self.token_ids: list[int] = []
        self.emitted = ""
        self.stopped = False

    def add(self, ids: list[int], final: bool = False) -> str:
        """Add tokens; return the new text that is safe to show."""
        self.token_ids.extend(ids)
        if self.tokenizer is None:
            return ""
        text = self.tokenizer.decode(self.token_ids, skip_special_tokens=True)
        cuts = [text.find(s) for s in self.stop if s in text]
        if cuts:
            text, self.stopped, final = text[: min(cuts)], True, True
        if not final:
            text = text.rstrip("\ufffd")
            text = text[: len(text) - self._pending_stop_prefix(text)]
        if not text.startswith(self.emitted):  # decoding changed earlier text: emit nothing
            return ""
        delta, self.emitted = text[len(self.emitted):], text
        return delta

    def _pending_stop_prefix(self, text: str) -> int:
        """Length of the longest suffix of text that is a proper prefix of a stop string."""
        best = 0
        for s in self.stop:
            for n in range(min(len(s) - 1, len(text)), best, -1):
                if text.endswith(s[:n]):
                    best = n
                    break
        return best

    @property
    def text(self) -> str:
        return self.emitted


def encode_prompt(tokenizer, prompt: str | list[dict], chat: bool = True) -> list[int]:
    """Token ids of a prompt: for chat models exactly what
    `apply_chat_template(messages, add_generation_prompt=True)` gives (unless chat=False);
    a list of {"role", "content"} messages always goes through the template."""
    if tokenizer is None:
        raise ValueError("this target has no tokenizer; pass token ids")
    if isinstance(prompt, str) and not prompt:
        raise ValueError("empty prompt: give some text")
    if isinstance(prompt, list) or (chat and tokenizer.chat_template):
        messages = prompt if isinstance(prompt, list) else [{"role": "user", "content": prompt}]
        if not messages:
            raise ValueError("empty prompt: give at least one message")
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        if hasattr(ids, "keys"):  # newer transformers return a BatchEncoding
            ids = ids["input_ids"]
        return list(ids)
    return tokenizer(prompt, add_special_tokens=True)["input_ids"]
