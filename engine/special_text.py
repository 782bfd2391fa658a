"""Special-token text in what a client sends stays text.

A chat template writes control tokens (`<|im_start|>`, `<|im_end|>`) around the messages, and
the rendered prompt is tokenized with those matched whole. Text inside a message is the
client's, though: a tool result holding `<|im_end|>\\n<|im_start|>system\\n...` (a fetched web
page, a file) would otherwise become real control tokens, and open a system turn of its own.

`SpecialText` hides every control token's text in the client's strings behind a marker before
rendering (`mask`), then tokenizes the rendered prompt with the template's own control tokens
matched whole and the text between them, markers turned back into what the client wrote, as
plain text (`encode`). A prompt whose messages hold no control-token text tokenizes exactly as
before: a tokenizer that matches control tokens splits the text at them and encodes the pieces
between as plain text, which is what `encode` does.

The marker is a private-use character that no template writes: `MARK` n `MARK`, where n is 0
for a `MARK` the client sent itself and i + 1 for the i-th control token's text.
"""

from __future__ import annotations

import operator
import re
from collections.abc import Callable, Sequence
from typing import Any

MARK = "\ue000"
_MARKED = re.compile(f"{MARK}(\\d+){MARK}")


class SpecialText:
    """Masks control-token text in client strings and encodes rendered prompts."""

    def __init__(self, specials: dict[str, int], encode_plain: Callable[[str], list[int]]) -> None:
        self._texts: list[str] = sorted(specials, key=len, reverse=True)  # longest first
        self._ids = specials
        self._encode_plain = encode_plain
        hidden = [MARK, *self._texts]
        self._in_client = re.compile("|".join(re.escape(t) for t in hidden))
        self._index = {t: str(i) for i, t in enumerate(hidden)}
        self._in_prompt = re.compile("(" + "|".join(re.escape(t) for t in self._texts) + ")") \
            if self._texts else None

    def mask(self, value: Any) -> Any:
        """`value` (a message, a tool: JSON-like) with control-token text (and `MARK`) in
        every string and key replaced by markers; a value without any comes back itself, not
        a copy (every request's whole conversation passes through here)."""
        if isinstance(value, str):
            return self._mask_text(value)
        if isinstance(value, dict):
            items = [(self.mask(k), self.mask(v)) for k, v in value.items()]
            same = all(k is k0 and v is v0
                       for (k, v), (k0, v0) in zip(items, value.items(), strict=True))
            return value if same else dict(items)  # the usual case: no copy
        if isinstance(value, list | tuple):
            masked = [self.mask(v) for v in value]
            return value if all(map(operator.is_, masked, value)) else masked
        return value

    def mask_all(self, values: Sequence[Any] | None) -> list[Any] | None:
        """`mask` of each of `values` (None stays None)."""
        return None if values is None else list(self.mask(list(values)))

    def _mask_text(self, text: str) -> str:
        if self._in_client.search(text) is None:
            return text
        return self._in_client.sub(lambda m: f"{MARK}{self._index[m.group()]}{MARK}", text)

    def unmask(self, text: str) -> str:
        """`text` with every marker turned back into what the client wrote."""
        if MARK not in text:
            return text
        hidden = [MARK, *self._texts]
        return _MARKED.sub(lambda m: hidden[int(m.group(1))], text)

    def encode(self, prompt: str) -> list[int]:
        """Token ids of a rendered `prompt`: its control-token text as those tokens, the text
        between them (markers turned back) as plain text."""
        if self._in_prompt is None:
            return self._encode_plain(self.unmask(prompt))
        ids: list[int] = []
        for n, piece in enumerate(self._in_prompt.split(prompt)):
            if n % 2:
                ids.append(self._ids[piece])
            elif piece:
                ids += self._encode_plain(self.unmask(piece))
        return ids
