"""Chat templates: a list of messages -> the prompt text, by the checkpoint's own jinja2 template.

Owns: finding the template (a `--chat-template FILE`, else the checkpoint's
chat_template.jinja, else tokenizer_config.json's `chat_template`), rendering
it in a sandbox, and checking the messages it is given.
Must not know: HTTP framing, tokens, the engine.
How: Hugging Face templates are jinja2 with trim_blocks and lstrip_blocks,
the variables `messages`, `add_generation_prompt`, `bos_token`, `eos_token`,
and a `raise_exception(message)` helper; they are rendered the same way here,
in an ImmutableSandboxedEnvironment so a template cannot reach Python
internals. Content given as a list of {"type": "text"} parts is joined into
one string first, which every text-only template understands.
"""

from __future__ import annotations

from datetime import datetime
from pathlib import Path

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment

from server.http.errors import ApiError, describe_value

TEMPLATE_FILE = "chat_template.jinja"
PART_SEPARATOR = "\n"
ROLES = ("system", "developer", "user", "assistant", "tool")  # OpenAI's chat roles
NULL_CONTENT_ROLES = ("assistant",)  # an assistant turn may carry tool calls instead of text


def _raise_exception(message: str) -> None:
    raise jinja2.TemplateError(message)


def _strftime_now(format: str) -> str:
    return datetime.now().strftime(format)


class ChatTemplate:
    def __init__(self, source: str):
        environment = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                                    extensions=["jinja2.ext.loopcontrols"])
        environment.globals.update(raise_exception=_raise_exception, strftime_now=_strftime_now)
        self.source = source
        try:
            self._template = environment.from_string(source)
        except jinja2.TemplateSyntaxError as exc:
            raise ValueError(f"the chat template is not valid jinja2 (line {exc.lineno}): {exc.message}") from None

    def render(self, messages: list[dict], *, bos_token: str | None = None, eos_token: str | None = None,
               add_generation_prompt: bool = True) -> str:
        """The prompt for `messages` (already checked by `check_messages`); ApiError 400 if the template refuses."""
        try:
            return self._template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                         bos_token=bos_token or "", eos_token=eos_token or "")
        except jinja2.TemplateError as exc:
            raise ApiError(400, f"the chat template could not render these messages: {exc}", param="messages") from exc


def load_chat_template(model_dir: str | Path, tokenizer_config_template: str | list | None = None,
                       override_path: str | Path | None = None) -> ChatTemplate | None:
    """The template to use, or None when neither the override, the checkpoint, nor its tokenizer config has one."""
    if override_path is not None:
        return ChatTemplate(Path(override_path).read_text(encoding="utf-8"))
    file = Path(model_dir) / TEMPLATE_FILE
    if file.is_file():
        return ChatTemplate(file.read_text(encoding="utf-8"))
    if isinstance(tokenizer_config_template, list):  # [{"name": "default", "template": ...}, ...]
        named = {t.get("name"): t.get("template") for t in tokenizer_config_template if isinstance(t, dict)}
        tokenizer_config_template = named.get("default")
    if isinstance(tokenizer_config_template, str) and tokenizer_config_template:
        return ChatTemplate(tokenizer_config_template)
    return None


def require_template(template: ChatTemplate | None, model_name: str) -> ChatTemplate:
    if template is None:
        raise ApiError(400, f"the model {model_name!r} has no chat template (expected chat_template.jinja or "
                            "tokenizer_config.json's chat_template); start the server with --chat-template FILE, "
                            "or use /v1/completions", param="messages")
    return template


def check_messages(messages: object) -> list[dict]:
    """Messages as the template wants them: role and string content; ApiError 400 naming the bad field."""
    if not isinstance(messages, list) or not messages:
        raise ApiError(400, f"messages must be a non-empty list, got {_describe(messages)}", param="messages")
    return [_check_message(i, m) for i, m in enumerate(messages)]


def _check_message(index: int, message: object) -> dict:
    where = f"messages[{index}]"
    if not isinstance(message, dict):
        raise ApiError(400, f"{where} must be an object, got {_describe(message)}", param=where)
    role = message.get("role")
    if role not in ROLES:
        raise ApiError(400, f"{where}.role must be one of {', '.join(ROLES)}, got {_describe(role)}",
                       param=f"{where}.role")
    content = message.get("content")
    if content is None and role not in NULL_CONTENT_ROLES:
        raise ApiError(400, f"{where}.content is required for a {role} message, got null", param=f"{where}.content")
    return {**message, "content": _content_text(content, f"{where}.content")}


def _content_text(content: object, where: str) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    if not isinstance(content, list):
        raise ApiError(400, f"{where} must be a string or a list of parts, got {_describe(content)}", param=where)
    texts = []
    for i, part in enumerate(content):
        if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
            raise ApiError(400, f"{where}[{i}] must be {{\"type\": \"text\", \"text\": string}} (only text parts are "
                                f"supported), got {_describe(part)}", param=f"{where}[{i}]")
        texts.append(part["text"])
    return PART_SEPARATOR.join(texts)


def _describe(value: object) -> str:
    return f"{type(value).__name__} {describe_value(value)}"
