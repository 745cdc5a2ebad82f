"""Chat templates: checked messages -> the prompt text, by the checkpoint's own jinja2 template.

Owns: finding the template (`--chat-template`, a file or the template
itself; else the checkpoint's chat_template.jinja; else tokenizer_config.json's
`chat_template`), rendering it in a sandbox, and continuing a final message.
Must not know: HTTP framing, tokens, the engine, the shape of a message
(chat_messages.py checks those).
How: Hugging Face templates are jinja2 with trim_blocks and lstrip_blocks,
the variables `messages`, `tools`, `add_generation_prompt`, `bos_token`,
`eos_token` and any the request adds (`chat_template_kwargs`), the helpers
`raise_exception(message)` and `strftime_now(format)`, and a `tojson` filter
that is plain json.dumps (jinja2's own escapes <, > and & for HTML, which
would change the tool schemas a model reads); they are rendered the same way
here, in an ImmutableSandboxedEnvironment so a template cannot reach Python
internals. To continue the final message, it is rendered with a marker
appended to its content and the text is cut where the marker starts, as
transformers' apply_chat_template does: whatever the template writes after a
message (end-of-turn tokens) is left out, and the model goes on writing it.
"""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment

from server.http.errors import ApiError

TEMPLATE_FILE = "chat_template.jinja"
JINJA_MARKERS = ("{%", "{{")  # an --chat-template value with one of these, and no such file, is the template itself
CONTINUE_MARKER = "CONTINUE_FINAL_MESSAGE_TAG "  # transformers' marker: its trailing space shows a template's trim


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
               continue_final_message: bool = False, bos_token: str | None = None, eos_token: str | None = None,
               template_kwargs: dict | None = None) -> str:
        """The prompt for `messages` (checked by chat_messages.check_messages); ApiError 400 if the template refuses.

        tools: the request's tool list as given ({"type": "function", "function": {...}} objects), or None.
        continue_final_message: leave the final message (an assistant's) open for the model to continue; the
        caller makes sure add_generation_prompt is then false.
        template_kwargs: more variables for the template; they may replace bos_token and eos_token, not the rest.
        """
        variables = {"bos_token": bos_token or "", "eos_token": eos_token or "", **(template_kwargs or {}),
                     "tools": tools, "add_generation_prompt": add_generation_prompt}
        if not continue_final_message:
            return self._render({**variables, "messages": messages})
        final = _final_assistant_message(messages)
        marked = [*messages[:-1], {**final, "content": final["content"] + CONTINUE_MARKER}]
        return _cut_at_marker(self._render({**variables, "messages": marked}), final["content"])

    def _render(self, variables: dict) -> str:
        try:
            return self._template.render(variables)
        except Exception as exc:  # a template is code, fed the request's values: whatever it raises is the request's
            raise ApiError(400, f"the chat template could not render these messages: {type(exc).__name__}: {exc}",
                           param="messages") from exc


def _final_assistant_message(messages: list[dict]) -> dict:
    final = messages[-1]
    if final["role"] != "assistant":
        raise ApiError(400, f"continue_final_message needs the final message to be an assistant message, got "
                            f"messages[{len(messages) - 1}].role {final['role']!r}", param="continue_final_message")
    return final


def _cut_at_marker(rendered: str, content: str) -> str:
    """`rendered` up to the end of the final message's content (transformers' rule)."""
    marker_at = rendered.rfind(CONTINUE_MARKER.strip())
    if marker_at < 0 or content.strip() not in rendered:
        raise ApiError(400, "continue_final_message: the chat template does not render the final message's content "
                            "as given, so it cannot be continued", param="continue_final_message")
    if rendered.startswith(CONTINUE_MARKER, marker_at):
        return rendered[:marker_at]
    return rendered[:marker_at].rstrip()  # the template trimmed the content, and with it the content's own spaces


def chat_template_source(value: str) -> str:
    """The template a `--chat-template` value stands for (vLLM's rule): the text of the file it names if there is
    one, else the value itself when it looks like jinja2; ValueError otherwise (a file that is missing)."""
    try:  # read, not checked first: a long inline template is no possible file name, and stat() raises on it
        return Path(value).read_text(encoding="utf-8")
    except (OSError, ValueError) as exc:
        if any(marker in value for marker in JINJA_MARKERS):
            return value
        reason = "does not exist" if isinstance(exc, FileNotFoundError) else f"cannot be read ({exc})"
        raise ValueError(f"--chat-template: the file {value!r} {reason}, and the value is no jinja2 template either "
                         f"(it has none of {' '.join(JINJA_MARKERS)})") from None


def load_chat_template(model_dir: str | Path, tokenizer_config_template: str | list | None = None,
                       override: str | None = None) -> ChatTemplate | None:
    """The template to use, or None when neither the override (template text), the checkpoint, nor its tokenizer
    config has one."""
    if override is not None:
        return _template(override, "--chat-template")
    file = Path(model_dir) / TEMPLATE_FILE
    if file.is_file():
        return _template(file.read_text(encoding="utf-8"), str(file))
    if isinstance(tokenizer_config_template, list):  # [{"name": "default", "template": ...}, ...]
        named = {t.get("name"): t.get("template") for t in tokenizer_config_template if isinstance(t, dict)}
        tokenizer_config_template = named.get("default")
    if isinstance(tokenizer_config_template, str) and tokenizer_config_template:
        return _template(tokenizer_config_template, f"{Path(model_dir) / 'tokenizer_config.json'}: chat_template")
    return None


def _template(source: str, origin: str) -> ChatTemplate:
    """The template of `source`; a ValueError naming where it came from (`origin`) when it is not valid jinja2."""
    try:
        return ChatTemplate(source)
    except ValueError as exc:
        raise ValueError(f"{origin}: {exc}") from None


def request_template(source: str) -> ChatTemplate:
    """A request's own `chat_template`; 400 naming it when it is not valid jinja2."""
    try:
        return ChatTemplate(source)
    except ValueError as exc:
        raise ApiError(400, f"chat_template: {exc}", param="chat_template") from None


def require_template(template: ChatTemplate | None, model_name: str) -> ChatTemplate:
    if template is None:
        raise ApiError(400, f"the model {model_name!r} has no chat template (expected chat_template.jinja or "
                            "tokenizer_config.json's chat_template); start the server with --chat-template, or with "
                            "--trust-request-chat-template and send chat_template, or use /v1/completions",
                       param="messages")
    return template
