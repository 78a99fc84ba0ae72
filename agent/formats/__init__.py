"""Tool-call formats, one per model family, behind one interface (:class:`ToolFormat`: render, turn grammar, parse).

    ``hermes``       Qwen2.5, Qwen3, Hermes: ``<tool_call>\\n{"name", "arguments"}\\n</tool_call>`` per call.
    ``llama3_json``  Llama 3.1/3.2: one bare ``{"name", "parameters"}`` per turn (no parallel calls).
    ``generic``      templates without ``tools=`` (SmolLM2): our system prompt, ``<tool_call>[...]</tool_call>``.

:func:`detect_format` chooses from the chat template's text (never the model's file name).
"""
from __future__ import annotations

from pathlib import Path

from .base import ToolFormat, ToolFormatError
from .generic import GenericFormat
from .hermes import HermesFormat
from .llama3 import Llama3JsonFormat

FORMATS: dict[str, type[ToolFormat]] = {"hermes": HermesFormat, "llama3_json": Llama3JsonFormat,
                                        "generic": GenericFormat}


def detect_format(chat_template: str | None) -> str:
    """The format name for a chat template's text.

    ``hermes`` when the template takes ``tools`` and writes ``<tool_call>``; ``llama3_json`` when it takes ``tools``
    and writes Llama 3's ``"parameters"`` under ``<|start_header_id|>``; otherwise ``generic``.
    """
    t = chat_template or ""
    takes_tools = "tools" in t
    if takes_tools and "<tool_call>" in t:
        return "hermes"
    if takes_tools and "<|start_header_id|>" in t and "parameters" in t:
        return "llama3_json"
    return "generic"


def load_chat_template(template: str | None) -> str | None:
    """``template`` itself (a Jinja text: it holds ``{``), or the text of the file it names.

    Raises:
        ToolFormatError: ``template`` holds no ``{`` and names no file (a mistyped path is never taken as the
            template's text).
    """
    if template and "{" not in template:
        path = Path(template).expanduser()
        if not path.is_file():
            raise ToolFormatError(f"chat template {template!r}: no such file (a template's own text holds Jinja "
                                  f"'{{{{' or '{{%')")
        return path.read_text()
    return template


def make_format(tokenizer, tool_format: str | None = None, chat_template: str | None = None) -> ToolFormat:
    """The format object for ``tokenizer`` (detected from its chat template unless ``tool_format`` names one).

    Raises:
        ToolFormatError: unknown ``tool_format``, no chat template on the tokenizer nor given, or a given one that
            does not parse or fails on one user message.
    """
    template = load_chat_template(chat_template) or getattr(tokenizer, "chat_template", None)
    name = tool_format or detect_format(template)
    if name not in FORMATS:
        raise ToolFormatError(f"unknown tool_format {name!r}; choose one of {', '.join(FORMATS)}")
    if chat_template is not None and tokenizer is not None:
        _check_template(tokenizer, template)
    fmt = FORMATS[name](tokenizer, template)
    fmt.user_template = chat_template is not None  # its errors are the template's: agent.engine says so
    return fmt


def _check_template(tokenizer, template: str) -> None:
    """Raise :class:`ToolFormatError` where a chat template given by the user does not parse, or fails on one user
    message (transformers would raise Jinja's own errors at the first turn)."""
    import jinja2

    try:
        tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}], chat_template=template,
                                      add_generation_prompt=True, tokenize=False)
    except Exception as e:  # noqa: BLE001 - Jinja's errors, and what a template's own expressions raise
        where = f" (line {e.lineno})" if isinstance(e, jinja2.TemplateError) and getattr(e, "lineno", None) else ""
        raise ToolFormatError(f"the chat template cannot render one user message{where}: "
                              f"{type(e).__name__}: {e}") from None


__all__ = ["FORMATS", "GenericFormat", "HermesFormat", "Llama3JsonFormat", "ToolFormat", "ToolFormatError",
           "detect_format", "load_chat_template", "make_format"]
