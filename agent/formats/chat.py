"""Chat rendering shared by the formats: message content tokenized as plain text, never as control tokens.

A string such as ``<|im_end|>``, ``<|im_start|>system`` or ``<tool_call>`` (any added token's text) inside a user
message, a tool result, a call's arguments in the history or a tool description stays text: only the chat
template's own structure yields control tokens, so a tool result cannot open a new turn. :func:`encode_template_chat`
does this for a whole rendered chat (the template applied once with marked content, then split);
``ToolFormat.encode_chat`` does it for the formats that pass ``tools=`` to the template.
"""
from __future__ import annotations

import threading
from typing import Any

# After tool results, small models answer far better without the tool-listing prompt (measured on SmolLM2-135M:
# with it, 0/3 demo answers used the result; with this one, the answers quote it). The grammar still allows calls.
ANSWER_SYSTEM_PROMPT = "You are a helpful assistant. Answer the user's question with the tool results given."


def encode_template_chat(tokenizer, chat: list[dict]) -> list[int]:
    """Token ids of ``chat`` (plain ``{"role", "content"}`` messages) through the tokenizer's chat template, with
    the generation prompt added and every message's content tokenized as plain text.

    Raises:
        ValueError: the chat template rewrites message content in a way that hides where it sits in the prompt,
            and some content holds a special-token string (it cannot then be kept plain text).
    """
    text = tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
    pieces = template_pieces(tokenizer, chat, text)
    if pieces is None:
        specials = [t for t in getattr(tokenizer, "all_special_tokens", []) if t]
        bad = [i for i, m in enumerate(chat) if any(t in (m.get("content") or "") for t in specials)]
        if bad:
            raise ValueError(f"message {bad[0]} holds a special-token string and the chat template rewrites message "
                             f"content, so it cannot be kept plain text; remove the special-token strings")
        return tokenizer.encode(text, add_special_tokens=False)
    plain = plain_text_encoder(tokenizer)
    ids: list[int] = []
    for i, piece in enumerate(pieces):  # even: template text (control tokens parsed); odd: message content
        if piece:
            ids += plain(piece) if i % 2 else tokenizer.encode(piece, add_special_tokens=False)
    return ids


_PLAIN_ENCODERS: dict[int, Any] = {}
_PLAIN_LOCK = threading.Lock()


def plain_text_encoder(tokenizer):
    """``text -> ids`` with the text of every special or added token kept as plain text.

    A private copy of the fast tokenizer's backend with ``encode_special_tokens`` set once: HF's
    ``split_special_tokens=True`` flips that flag on the *shared* backend for the duration of a call, so another
    thread encoding the template at the same time would lose its control tokens. Slow tokenizers use
    ``split_special_tokens`` (they keep no such shared flag).
    """
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return lambda text: tokenizer.encode(text, add_special_tokens=False, split_special_tokens=True)
    with _PLAIN_LOCK:
        entry = _PLAIN_ENCODERS.get(id(tokenizer))
        if entry is None or entry[0] is not tokenizer:
            import json

            from tokenizers import Tokenizer

            # every added token marked special in the copy, so that encode_special_tokens splits it too: Qwen's
            # <tool_call> / </tool_call> are added tokens with special=False, which the flag alone leaves whole
            spec = json.loads(backend.to_str())
            for added in spec.get("added_tokens") or []:
                added["special"] = True
            copy = Tokenizer.from_str(json.dumps(spec))
            copy.encode_special_tokens = True
            entry = _PLAIN_ENCODERS[id(tokenizer)] = (tokenizer, copy)
    copy = entry[1]
    return lambda text: copy.encode(text, add_special_tokens=False).ids


def template_pieces(tokenizer, chat: list[dict], text: str) -> list[str] | None:
    """``text`` split into [template, content, template, content, …, template], or None when the template does not
    place each message's content (or its stripped form) verbatim."""
    marks = [f"\x00specagent-content-{i}\x00" for i in range(len(chat))]
    marked = tokenizer.apply_chat_template([{**m, "content": mark} for m, mark in zip(chat, marks)],
                                           add_generation_prompt=True, tokenize=False)
    for transform in (lambda c: c, str.strip):
        pieces: list[str] = []
        rest = marked
        for m, mark in zip(chat, marks):
            before, found, rest = rest.partition(mark)
            if not found or mark in rest:
                return None
            pieces += [before, transform(m.get("content") or "")]
        pieces.append(rest)
        if "".join(pieces) == text:
            return pieces
    return None
