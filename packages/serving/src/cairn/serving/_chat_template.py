"""Chat templates: the jinja2 program in a tokenizer folder that turns a list of messages
into the prompt text a chat model was trained on.

Rendered the way transformers renders them, so a prompt is the same string whichever library
builds it: a sandboxed, immutable jinja2 environment with ``trim_blocks`` and
``lstrip_blocks``; the ``loopcontrols`` extension; a ``{% generation %}`` block tag (it marks
assistant text; rendered as its body); the globals ``raise_exception(message)`` and
``strftime_now(format)``; a ``tojson`` filter that writes plain JSON (no HTML escaping, keys
in insertion order, non-ASCII kept); ``messages``, ``tools``, ``documents`` and
``add_generation_prompt`` plus the tokenizer's named special tokens (``bos_token``,
``eos_token``, ...) and any extra keyword arguments as variables.

Messages are normalized first, as transformers does: keys whose value is ``None`` are dropped
(``{"content": None}`` renders as if absent), and a message's reasoning under
``reasoning_content``, ``thinking`` or ``reasoning`` is visible under the first two names.
"""

from __future__ import annotations

import contextvars
import dataclasses
import datetime
import functools
import json
from collections.abc import Mapping, Sequence
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.sandbox
import jinja2.utils

__all__ = ["ChatTemplateError", "compile_chat_template", "render_chat", "render_chat_with_spans"]

_REASONING_KEYS = ("reasoning_content", "thinking", "reasoning")
_CONTINUE_TAG = "CAIRN_CONTINUE_FINAL_MESSAGE "


class ChatTemplateError(ValueError):
    """A chat template that is missing, does not compile, fails while rendering, or calls
    ``raise_exception`` (the message is the template's own)."""


class _Raised(jinja2.exceptions.TemplateError):
    """What ``raise_exception`` throws inside the template; turned into ChatTemplateError."""


# while a render tracks assistant text: (the output pieces so far, the [start, end) spans found)
_TRACKING: contextvars.ContextVar[tuple[list[str], list[tuple[int, int]]] | None] = contextvars.ContextVar(
    "cairn_serving_generation_spans", default=None)


class _GenerationTag(jinja2.ext.Extension):
    """``{% generation %}...{% endgeneration %}``: marks the assistant's text in a template.
    Rendered as its body; while a render tracks it (`render_chat_with_spans`), the body's
    character span in the output is recorded (the start is the length of the output
    streamed so far, as transformers measures it)."""

    tags = {"generation"}

    def parse(self, parser: Any) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller: Any) -> str:
        text = caller()
        tracking = _TRACKING.get()
        if tracking is not None:
            start = sum(len(piece) for piece in tracking[0])
            tracking[1].append((start, start + len(text)))
        return text


def _raise_exception(message: str) -> None:
    raise _Raised(str(message))


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    # jinja2's own tojson escapes <, >, & and ' for HTML and sorts keys; prompts want plain JSON
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.datetime.now().strftime(fmt)


class _SafeNamespace(jinja2.utils.Namespace):
    """``namespace(...)`` that refuses underscore names, so a template cannot reach Python
    internals through attribute assignment."""

    def __init__(*args: Any, **kwargs: Any) -> None:  # same calling trick as jinja2.utils.Namespace
        self, rest = args[0], args[1:]
        attrs = dict(*rest, **kwargs)
        for name in attrs:
            _SafeNamespace._check(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _SafeNamespace._check(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name: Any) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(f"a chat template may not set {name!r} on a namespace "
                                                  "(names starting with '_' are refused)")


class _DictMaker:
    """``dict(...)`` inside templates, without exposing the ``dict`` type itself."""

    def __call__(self, *args: Any, **kwargs: Any) -> dict:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any, **kwargs: Any) -> dict:
        return dict.fromkeys(*args, **kwargs)


@functools.lru_cache(maxsize=32)
def compile_chat_template(source: str) -> jinja2.Template:
    """Compile a chat template (cached by its text).

    >>> compile_chat_template("{{ messages[0]['content'] | tojson }}").render(messages=[{"content": "<é>"}])
    '"<é>"'
    """
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["dict"] = _DictMaker()
    env.globals["namespace"] = _SafeNamespace
    return env.from_string(source)


def _plain(value: Any) -> Any:
    """A copy of ``value`` made only of JSON types (str, int, float, bool, None, dict, list,
    tuple): the template sees data, never objects with methods. Dataclasses and objects with
    ``model_dump`` (pydantic) become dicts; anything else becomes ``"<TypeName>"``."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    for base in (bool, str, int, float):
        if isinstance(value, base):
            return base(value)
    if isinstance(value, Mapping):
        return {_plain(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    if isinstance(value, tuple):
        return tuple(_plain(v) for v in value)
    if hasattr(value, "item") and callable(value.item) and getattr(value, "shape", None) == ():
        return _plain(value.item())  # numpy scalar
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if callable(getattr(value, "model_dump", None)):
        return _plain(value.model_dump())
    return f"<{type(value).__name__}>"


def _normalize(messages: Sequence[Any]) -> list[dict]:
    out = []
    for i, message in enumerate(_plain(list(messages))):
        if not isinstance(message, dict):
            raise TypeError(f"message {i} is a {type(message).__name__}; chat messages are dicts "
                            "with 'role' and 'content'")
        message = {k: v for k, v in message.items() if v is not None}
        reasoning = next((message[k] for k in _REASONING_KEYS if k in message), None)
        if reasoning is not None:
            message = {"thinking": reasoning, **message, "reasoning_content": reasoning}
        out.append(message)
    return out


def _mark_final(messages: list[dict], field: str, source: str) -> str:
    """Append a tag to the final message's ``field`` (continue_final_message); returns the
    original text, which must reappear in the rendered prompt."""
    if not messages:
        raise ValueError("continue_final_message needs at least one message")
    final = messages[-1].get(field)
    if final is None:
        raise ValueError(f"continue_final_message: the final message has no {field!r} to continue")
    fields = [field] if field not in _REASONING_KEYS else [k for k in _REASONING_KEYS
                                                           if messages[-1].get(k) == final]
    if not any(f in source for f in fields):
        raise ValueError(f"continue_final_message: the chat template never reads {field!r}")
    if isinstance(final, (list, tuple)):
        for block in reversed(final):
            if isinstance(block, dict) and "text" in block:
                text, block["text"] = block["text"], block["text"] + _CONTINUE_TAG
                return text
        raise ValueError("continue_final_message: the final message has no text block to continue")
    for f in fields:
        messages[-1][f] = messages[-1][f] + _CONTINUE_TAG
    return final


def _cut_after_final(rendered: str, final: str) -> str:
    tag = _CONTINUE_TAG.strip()
    if final.strip() not in rendered or tag not in rendered:
        raise ValueError("continue_final_message: the chat template dropped part of the final message, so "
                         f"the prompt cannot end inside it. Final message: {final.strip()!r}")
    at = rendered.rindex(tag)
    if rendered[at:at + len(_CONTINUE_TAG)] == _CONTINUE_TAG:
        return rendered[:at]
    return rendered[:at].rstrip()  # the template trimmed the message's trailing space


def render_chat(source: str, messages: Sequence[Any], *, origin: str = "the chat template",
                tools: Sequence[Any] | None = None, documents: Sequence[Any] | None = None,
                add_generation_prompt: bool = False, continue_final_message: bool | str = False,
                variables: Mapping[str, Any] | None = None, spans: list[tuple[int, int]] | None = None) -> str:
    """Render one conversation with the template text ``source``.

    ``origin`` names where the template came from (a file) in error messages. ``tools`` are
    JSON-schema dicts; ``variables`` are extra template variables (special tokens, user
    keyword arguments). ``continue_final_message`` (True for ``content``, or a field name)
    ends the prompt inside the final message so the model continues it. A ``spans`` list
    receives the ``[start, end)`` character spans of the ``{% generation %}`` blocks.

    >>> render_chat("{% for m in messages %}{{ m.role }}: {{ m.content }}\\n{% endfor %}"
    ...             "{% if add_generation_prompt %}assistant:{% endif %}",
    ...             [{"role": "user", "content": "hi"}], add_generation_prompt=True)
    'user: hi\\nassistant:'
    """
    template = _compile(source, origin)
    chat = _normalize(messages)
    if tools is not None:
        for tool in tools:
            if not isinstance(tool, Mapping):
                raise TypeError(f"each tool is a JSON-schema dict ({{'type': 'function', 'function': ...}}), "
                                f"got a {type(tool).__name__}")
    if documents is not None and not all(isinstance(d, Mapping) for d in documents):
        raise TypeError("documents are dicts with 'title' and 'text'")
    final = None
    if continue_final_message:
        if spans is not None:
            raise ValueError("continue_final_message cannot be combined with assistant masks")
        if add_generation_prompt:
            raise ValueError("continue_final_message and add_generation_prompt exclude each other: the first "
                             "continues the last message, the second opens a new assistant turn")
        field = continue_final_message if isinstance(continue_final_message, str) else "content"
        final = _mark_final(chat, field, source)
    context = dict(_plain(dict(variables or {})))
    context.update(messages=chat, tools=_plain(tools), documents=_plain(documents),
                   add_generation_prompt=add_generation_prompt)
    try:
        if spans is None:
            rendered = template.render(**context)
        else:
            pieces: list[str] = []
            token = _TRACKING.set((pieces, spans))
            try:
                for piece in template.generate(**context):
                    pieces.append(piece)
            finally:
                _TRACKING.reset(token)
            rendered = "".join(pieces)
    except _Raised as err:
        raise ChatTemplateError(str(err)) from None
    except (jinja2.exceptions.TemplateError, TypeError) as err:
        raise ChatTemplateError(f"{origin} failed to render: {type(err).__name__}: {err}") from err
    return rendered if final is None else _cut_after_final(rendered, final)


def _compile(source: str, origin: str) -> jinja2.Template:
    if not isinstance(source, str):
        raise TypeError(f"a chat template is a jinja2 string, got a {type(source).__name__} (from {origin})")
    try:
        return compile_chat_template(source)
    except jinja2.exceptions.TemplateSyntaxError as err:
        raise ChatTemplateError(f"{origin} is not a valid jinja2 template (line {err.lineno}): {err.message}") from err


def render_chat_with_spans(source: str, messages: Sequence[Any], **kwargs: Any) -> tuple[str, list[tuple[int, int]]]:
    """`render_chat`, plus the character spans of the template's ``{% generation %}`` blocks
    (the assistant's text, for training masks).

    >>> render_chat_with_spans("{% for m in messages %}{{ m.role }}: {% generation %}{{ m.content }}"
    ...                        "{% endgeneration %}; {% endfor %}", [{"role": "assistant", "content": "ok"}])
    ('assistant: ok; ', [(11, 13)])
    """
    spans: list[tuple[int, int]] = []
    return render_chat(source, messages, spans=spans, **kwargs), spans
