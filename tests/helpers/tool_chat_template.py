"""A tool-calling chat template in the shape of Qwen2.5's, for tests of tools and tool-call history.

    from helpers.tool_chat_template import TOOL_CHAT_TEMPLATE

The shape the tool-calling models use: when `tools` is given, a system turn
lists each as JSON inside <tools></tools>; an assistant's tool calls are
<tool_call>\\n{"name": ..., "arguments": ...}\\n</tool_call> (the arguments
rendered with `tojson`, so they must reach the template parsed); tool
results are <tool_response> blocks, consecutive ones sharing one user turn.
"""

from __future__ import annotations

DEFAULT_SYSTEM = "You are a helpful assistant."

TOOL_CHAT_TEMPLATE = """\
{%- if tools %}
    {{- '<|im_start|>system\\n' }}
    {%- if messages[0].role == 'system' %}
        {{- messages[0].content }}
    {%- else %}
        {{- '""" + DEFAULT_SYSTEM + """' }}
    {%- endif %}
    {{- '\\n\\n# Tools\\n\\nYou are provided with function signatures within <tools></tools> XML tags:\\n<tools>' }}
    {%- for tool in tools %}
        {{- '\\n' }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- '\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments within '
        '<tool_call></tool_call> XML tags:\\n<tool_call>\\n{"name": <function-name>, "arguments": '
        '<args-json-object>}\\n</tool_call><|im_end|>\\n' }}
{%- elif messages[0].role == 'system' %}
    {{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}
{%- else %}
    {{- '<|im_start|>system\\n""" + DEFAULT_SYSTEM + """<|im_end|>\\n' }}
{%- endif %}
{%- for message in messages %}
    {%- if message.role == 'user' or (message.role == 'system' and not loop.first)
          or (message.role == 'assistant' and not message.tool_calls) %}
        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}
    {%- elif message.role == 'assistant' %}
        {{- '<|im_start|>' + message.role }}
        {%- if message.content %}
            {{- '\\n' + message.content }}
        {%- endif %}
        {%- for tool_call in message.tool_calls %}
            {%- if tool_call.function is defined %}
                {%- set tool_call = tool_call.function %}
            {%- endif %}
            {{- '\\n<tool_call>\\n{"name": "' + tool_call.name + '", "arguments": ' }}
            {{- tool_call.arguments | tojson }}
            {{- '}\\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\\n' }}
    {%- elif message.role == 'tool' %}
        {%- if loop.index0 == 0 or messages[loop.index0 - 1].role != 'tool' %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\\n<tool_response>\\n' + message.content + '\\n</tool_response>' }}
        {%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}
            {{- '<|im_end|>\\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
{%- endif %}
"""


def start_tool_server(tmp_path_factory, model: str, tool_call_parser: str):
    """A real server on a Qwen2-shaped tiny checkpoint with TOOL_CHAT_TEMPLATE, auto tool choice on with
    `tool_call_parser`; stop it with helpers.running_server.stop_server."""
    from helpers.running_server import start_server
    from helpers.tiny_tokenizer import make_served_checkpoint

    tmp = tmp_path_factory.mktemp("tools")
    checkpoint = make_served_checkpoint(tmp, arch="qwen2")
    template = tmp / "tool_template.jinja"
    template.write_text(TOOL_CHAT_TEMPLATE)
    return start_server(tmp_path_factory.mktemp("server"), checkpoint, "--served-model-name", model, "--device", "cpu",
                        "--dtype", "float32", "--chat-template", str(template), "--enable-auto-tool-choice",
                        "--tool-call-parser", tool_call_parser)
