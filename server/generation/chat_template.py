"""Chat templates: checked messages -> the prompt text, by the checkpoint's own jinja2 template.

Owns: finding the template (a `--chat-template FILE`, else the checkpoint's
chat_template.jinja, else tokenizer_config.json's `chat_template`) and
rendering it in a sandbox.
Must not know: HTTP framing, tokens, the engine, the shape of a message
(chat_messages.py checks those).
How: Hugging Face templates are jinja2 with trim_blocks and lstrip_blocks,
the variables `messages`, `tools`, `add_generation_prompt`, `bos_token` and
`eos_token`, the helpers `raise_exception(message)` and
`strftime_now(format)`, and a `tojson` filter that is plain json.dumps
(jinja2's own escapes <, > and & for HTML, which would change the tool
schemas a model reads); they are rendered the same way here, in an
ImmutableSandboxedEnvironment so a template cannot reach Python internals.
"""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment

from server.http.errors import ApiError

TEMPLATE_FILE = "chat_template.jinja"


def _raise_exception(message: str) -> None:
    raise jinja2.TemplateError(message)


def _strftime_now(format: str) -> str:
    return datetime.now().strftime(format)


def _tojson(value: object, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


class ChatTemplate:
    def __init__(self, source: str):
        """ValueError when `source` is not valid jinja2."""
        environment = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                                    extensions=["jinja2.ext.loopcontrols"])
        environment.globals.update(raise_exception=_raise_exception, strftime_now=_strftime_now)
        environment.filters["tojson"] = _tojson
        self.source = source
        try:
            self._template = environment.from_string(source)
        except jinja2.TemplateSyntaxError as exc:
            raise ValueError(f"the chat template is not valid jinja2 (line {exc.lineno}): {exc.message}") from None

    def render(self, messages: list[dict], *, tools: list[dict] | None = None, add_generation_prompt: bool = True,
               bos_token: str | None = None, eos_token: str | None = None) -> str:
        """The prompt for `messages` (checked by chat_messages.check_messages); ApiError 400 if the template refuses.

        tools: the request's tool list as given ({"type": "function", "function": {...}} objects), or None.
        """
        try:
            return self._template.render(messages=messages, tools=tools, add_generation_prompt=add_generation_prompt,
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
