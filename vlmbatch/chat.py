"""OpenAI chat messages → template-ready messages plus the media they reference.

Shared by the server, the batch runner and `LLM.chat`, so a bad message is rejected the
same way everywhere: a `RowError(INVALID_ROW)` whose `param` points at the bad field
(`messages[1].content[0].image_url`), which the server reports and the runner stores.
"""

from __future__ import annotations

from typing import Any

from vlmbatch.errors import ErrorType, RowError

ROLES = ("system", "user", "assistant")

# Part type → (key holding the media, kind it becomes in the template).
_MEDIA_PARTS = {
    "image_url": ("image_url", "image"),
    "video_url": ("video_url", "video"),
    "image_pil": ("image_pil", "image"),
}


def _bad(message: str, param: str) -> RowError:
    return RowError(ErrorType.INVALID_ROW, message, param=param)


def checked_text(text: str, param: str) -> str:
    """`text` if it is valid Unicode: JSON's `\\ud800` escapes decode to lone surrogates,
    which no tokenizer can encode (a row error here, not a processor failure later)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise _bad(f"{param} is not valid Unicode text: a lone surrogate at position {exc.start}", param) from None
    return text


TOOLS_REFUSED = 'tool calling is not supported; send tool_choice "none" to answer without tools'


def refuses_tools(tools: Any, tool_choice: Any) -> bool:
    """Whether a chat request's tools must be refused (`TOOLS_REFUSED`): no tool calls are
    parsed, so only tool_choice "none" can be answered; with any other (OpenAI's default
    is "auto") the tools would be dropped silently."""
    return bool(tools) and tool_choice != "none"


def _media_ref(part: dict[str, Any], part_type: str, param: str) -> Any:
    """The URL/path/data: string (or the PIL image of an `image_pil` part) a media part names."""
    key, _ = _MEDIA_PARTS[part_type]
    value = part.get(key)
    if part_type == "image_pil":
        from PIL import Image

        if not isinstance(value, Image.Image):
            raise _bad(f"{key} must be a PIL image", f"{param}.{key}")
        return value
    if not isinstance(value, dict) or not isinstance(value.get("url"), str) or not value["url"]:
        raise _bad(f'{key} must be an object with a non-empty "url" string', f"{param}.{key}")
    return value["url"]


def parse_chat_messages(messages: Any) -> tuple[list[dict[str, Any]], list[Any], list[Any]]:
    """Validate `messages`; return (messages for the chat template, image refs, video refs).

    In the returned messages every media part is reduced to `{"type": "image"}` or
    `{"type": "video"}`, which is what HF chat templates render as placeholders; the refs
    are returned in prompt order for the caller to load. Parsing the returned messages
    again gives them back unchanged (with no refs), so adapters may take either form.
    """
    if not isinstance(messages, list) or not messages:
        raise _bad("messages must be a non-empty list", "messages")
    template_messages: list[dict[str, Any]] = []
    refs: dict[str, list[Any]] = {"image": [], "video": []}
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(message, dict):
            raise _bad("each message must be an object", where)
        role = message.get("role")
        if role not in ROLES:
            raise _bad(f"role must be one of {', '.join(ROLES)}, got {role!r}", f"{where}.role")
        content = message.get("content")
        if isinstance(content, str):
            template_messages.append({"role": role, "content": checked_text(content, f"{where}.content")})
            continue
        if not isinstance(content, list):
            raise _bad("content must be a string or a list of parts", f"{where}.content")
        if not content:  # as OpenAI refuses it: a turn with nothing in it
            raise _bad("content must not be an empty list", f"{where}.content")
        parts = []
        for j, part in enumerate(content):
            param = f"{where}.content[{j}]"
            if not isinstance(part, dict):
                raise _bad("each content part must be an object", param)
            part_type = part.get("type")
            if part_type == "text":
                if not isinstance(part.get("text"), str):
                    raise _bad('a text part needs a "text" string', f"{param}.text")
                parts.append({"type": "text", "text": checked_text(part["text"], f"{param}.text")})
            elif part_type in ("image", "video"):
                # An already-parsed placeholder (a second pass, or media given beside the
                # messages): rendered as is, its media supplied by the caller.
                parts.append({"type": part_type})
            elif part_type in _MEDIA_PARTS:
                kind = _MEDIA_PARTS[part_type][1]
                refs[kind].append(_media_ref(part, part_type, param))
                parts.append({"type": kind})
            else:
                allowed = ", ".join(["text", *_MEDIA_PARTS, "image", "video"])
                raise _bad(f"unknown content part type {part_type!r}; expected one of {allowed}", f"{param}.type")
        template_messages.append({"role": role, "content": parts})
    return template_messages, refs["image"], refs["video"]
