"""Qwen3.5 chat template: the official Jinja text (as data) and a plain-Python renderer.

The engine never runs Jinja at request time: `render_chat` below reproduces the official
template's output byte for byte (tests/test_chat_template.py checks it against transformers'
own Jinja renderer over many message shapes).  The Jinja text is kept verbatim because it is
needed for tokenizer_config.json (HF-compatible checkpoints) and as the test oracle.

Source of the text: the Qwen3.5 `chat_template.jinja` as mirrored in public repositories
(identical to the Qwen3.6 template except that 3.6 adds a `preserve_thinking` switch to the
history gate `loop.index0 > ns.last_query_index`).
"""

from __future__ import annotations

import functools
import json
from typing import Any, Iterable, Mapping, Sequence

# Official Qwen3.5 chat template (Jinja).  Data, not code: do not reformat.
QWEN35_CHAT_TEMPLATE = r"""{%- set image_count = namespace(value=0) %}
{%- set video_count = namespace(value=0) %}
{%- macro render_content(content, do_vision_count, is_system_content=false) %}
    {%- if content is string %}
        {{- content }}
    {%- elif content is iterable and content is not mapping %}
        {%- for item in content %}
            {%- if 'image' in item or 'image_url' in item or item.type == 'image' %}
                {%- if is_system_content %}
                    {{- raise_exception('System message cannot contain images.') }}
                {%- endif %}
                {%- if do_vision_count %}
                    {%- set image_count.value = image_count.value + 1 %}
                {%- endif %}
                {%- if add_vision_id %}
                    {{- 'Picture ' ~ image_count.value ~ ': ' }}
                {%- endif %}
                {{- '<|vision_start|><|image_pad|><|vision_end|>' }}
            {%- elif 'video' in item or item.type == 'video' %}
                {%- if is_system_content %}
                    {{- raise_exception('System message cannot contain videos.') }}
                {%- endif %}
                {%- if do_vision_count %}
                    {%- set video_count.value = video_count.value + 1 %}
                {%- endif %}
                {%- if add_vision_id %}
                    {{- 'Video ' ~ video_count.value ~ ': ' }}
                {%- endif %}
                {{- '<|vision_start|><|video_pad|><|vision_end|>' }}
            {%- elif 'text' in item %}
                {{- item.text }}
            {%- else %}
                {{- raise_exception('Unexpected item type in content.') }}
            {%- endif %}
        {%- endfor %}
    {%- elif content is none or content is undefined %}
        {{- '' }}
    {%- else %}
        {{- raise_exception('Unexpected content type.') }}
    {%- endif %}
{%- endmacro %}
{%- if not messages %}
    {{- raise_exception('No messages provided.') }}
{%- endif %}
{%- if tools and tools is iterable and tools is not mapping %}
    {{- '<|im_start|>system\n' }}
    {{- "# Tools\n\nYou have access to the following functions:\n\n<tools>" }}
    {%- for tool in tools %}
        {{- "\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\n</tools>" }}
    {{- '\n\nIf you choose to call a function ONLY reply in the following format with NO suffix:\n\n<tool_call>\n<function=example_function_name>\n<parameter=example_parameter_1>\nvalue_1\n</parameter>\n<parameter=example_parameter_2>\nThis is the value for the second parameter\nthat can span\nmultiple lines\n</parameter>\n</function>\n</tool_call>\n\n<IMPORTANT>\nReminder:\n- Function calls MUST follow the specified format: an inner <function=...></function> block must be nested within <tool_call></tool_call> XML tags\n- Required parameters MUST be specified\n- You may provide optional reasoning for your function call in natural language BEFORE the function call, but NOT after\n- If there is no function call available, answer the question like normal with your current knowledge and do not tell the user about function calls\n</IMPORTANT>' }}
    {%- if messages[0].role == 'system' %}
        {%- set content = render_content(messages[0].content, false, true)|trim %}
        {%- if content %}
            {{- '\n\n' + content }}
        {%- endif %}
    {%- endif %}
    {{- '<|im_end|>\n' }}
{%- else %}
    {%- if messages[0].role == 'system' %}
        {%- set content = render_content(messages[0].content, false, true)|trim %}
        {{- '<|im_start|>system\n' + content + '<|im_end|>\n' }}
    {%- endif %}
{%- endif %}
{%- set ns = namespace(multi_step_tool=true, last_query_index=messages|length - 1) %}
{%- for message in messages[::-1] %}
    {%- set index = (messages|length - 1) - loop.index0 %}
    {%- if ns.multi_step_tool and message.role == "user" %}
        {%- set content = render_content(message.content, false)|trim %}
        {%- if not(content.startswith('<tool_response>') and content.endswith('</tool_response>')) %}
            {%- set ns.multi_step_tool = false %}
            {%- set ns.last_query_index = index %}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if ns.multi_step_tool %}
    {{- raise_exception('No user query found in messages.') }}
{%- endif %}
{%- for message in messages %}
    {%- set content = render_content(message.content, true)|trim %}
    {%- if message.role == "system" %}
        {%- if not loop.first %}
            {{- raise_exception('System message must be at the beginning.') }}
        {%- endif %}
    {%- elif message.role == "user" %}
        {{- '<|im_start|>' + message.role + '\n' + content + '<|im_end|>' + '\n' }}
    {%- elif message.role == "assistant" %}
        {%- set reasoning_content = '' %}
        {%- if message.reasoning_content is string %}
            {%- set reasoning_content = message.reasoning_content %}
        {%- else %}
            {%- if '</think>' in content %}
                {%- set reasoning_content = content.split('</think>')[0].rstrip('\n').split('<think>')[-1].lstrip('\n') %}
                {%- set content = content.split('</think>')[-1].lstrip('\n') %}
            {%- endif %}
        {%- endif %}
        {%- set reasoning_content = reasoning_content|trim %}
        {%- if loop.index0 > ns.last_query_index %}
            {{- '<|im_start|>' + message.role + '\n<think>\n' + reasoning_content + '\n</think>\n\n' + content }}
        {%- else %}
            {{- '<|im_start|>' + message.role + '\n' + content }}
        {%- endif %}
        {%- if message.tool_calls and message.tool_calls is iterable and message.tool_calls is not mapping %}
            {%- for tool_call in message.tool_calls %}
                {%- if tool_call.function is defined %}
                    {%- set tool_call = tool_call.function %}
                {%- endif %}
                {%- if loop.first %}
                    {%- if content|trim %}
                        {{- '\n\n<tool_call>\n<function=' + tool_call.name + '>\n' }}
                    {%- else %}
                        {{- '<tool_call>\n<function=' + tool_call.name + '>\n' }}
                    {%- endif %}
                {%- else %}
                    {{- '\n<tool_call>\n<function=' + tool_call.name + '>\n' }}
                {%- endif %}
                {%- if tool_call.arguments is defined %}
                    {%- for args_name, args_value in tool_call.arguments|items %}
                        {{- '<parameter=' + args_name + '>\n' }}
                        {%- set args_value = args_value | string if args_value is string else args_value | tojson | safe %}
                        {{- args_value }}
                        {{- '\n</parameter>\n' }}
                    {%- endfor %}
                {%- endif %}
                {{- '</function>\n</tool_call>' }}
            {%- endfor %}
        {%- endif %}
        {{- '<|im_end|>\n' }}
    {%- elif message.role == "tool" %}
        {%- if loop.previtem and loop.previtem.role != "tool" %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\n<tool_response>\n' }}
        {{- content }}
        {{- '\n</tool_response>' }}
        {%- if not loop.last and loop.nextitem.role != "tool" %}
            {{- '<|im_end|>\n' }}
        {%- elif loop.last %}
            {{- '<|im_end|>\n' }}
        {%- endif %}
    {%- else %}
        {{- raise_exception('Unexpected message role.') }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}
        {{- '<think>\n\n</think>\n\n' }}
    {%- else %}
        {{- '<think>\n' }}
    {%- endif %}
{%- endif %}"""

_TOOLS_HEADER = "# Tools\n\nYou have access to the following functions:\n\n<tools>"
_TOOLS_FOOTER = (
    "\n</tools>"
    "\n\nIf you choose to call a function ONLY reply in the following format with NO suffix:\n\n"
    "<tool_call>\n<function=example_function_name>\n<parameter=example_parameter_1>\nvalue_1\n"
    "</parameter>\n<parameter=example_parameter_2>\nThis is the value for the second parameter\n"
    "that can span\nmultiple lines\n</parameter>\n</function>\n</tool_call>\n\n<IMPORTANT>\n"
    "Reminder:\n- Function calls MUST follow the specified format: an inner <function=...></function>"
    " block must be nested within <tool_call></tool_call> XML tags\n"
    "- Required parameters MUST be specified\n"
    "- You may provide optional reasoning for your function call in natural language BEFORE the"
    " function call, but NOT after\n"
    "- If there is no function call available, answer the question like normal with your current"
    " knowledge and do not tell the user about function calls\n</IMPORTANT>"
)


def _tojson(value: Any) -> str:
    # transformers replaces Jinja's `tojson` with json.dumps(ensure_ascii=False) and default
    # separators; matching it keeps non-ASCII tool schemas/arguments identical to the HF render.
    return json.dumps(value, ensure_ascii=False)


def _content_text(content: Any) -> str:
    """The template's `render_content` macro, text-only.

    Image/video parts would render vision placeholders that this text-only engine cannot feed,
    so they are rejected instead of silently producing pad tokens without pixels.
    """
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, Mapping) or not isinstance(content, Iterable):
        raise ValueError("Unexpected content type.")
    parts = []
    for item in content:
        if not isinstance(item, Mapping):
            raise ValueError("Unexpected item type in content.")
        kind = item.get("type")
        if kind in ("image", "video") or {"image", "image_url", "video"} & item.keys():
            raise ValueError("image/video content is not supported by this text-only engine")
        if "text" not in item:
            raise ValueError("Unexpected item type in content.")
        parts.append(item["text"])
    return "".join(parts)


def _text(message: Mapping) -> str:
    # Every message's content goes through `render_content(...)|trim` in the template;
    # Jinja's trim is Python's str.strip().
    return _content_text(message.get("content")).strip()


def _last_query_index(messages: Sequence[Mapping]) -> int:
    """Index of the last user turn that is a real query (not a wrapped tool response).

    Assistant turns after it keep their <think> block; earlier ones lose it.
    """
    for index in range(len(messages) - 1, -1, -1):
        message = messages[index]
        if message.get("role") != "user":
            continue
        text = _text(message)
        if not (text.startswith("<tool_response>") and text.endswith("</tool_response>")):
            return index
    raise ValueError("No user query found in messages.")


def _system_block(messages: Sequence[Mapping], tools: Sequence[Mapping] | None) -> str:
    system = _text(messages[0]) if messages[0].get("role") == "system" else None
    if tools and not isinstance(tools, Mapping):
        out = "<|im_start|>system\n" + _TOOLS_HEADER
        out += "".join("\n" + _tojson(tool) for tool in tools) + _TOOLS_FOOTER
        if system:
            out += "\n\n" + system
        return out + "<|im_end|>\n"
    if system is None:
        return ""
    return "<|im_start|>system\n" + system + "<|im_end|>\n"


def _split_reasoning(message: Mapping, content: str) -> tuple[str, str]:
    """(reasoning, content): explicit `reasoning_content` wins, else parse an inline <think>."""
    reasoning = message.get("reasoning_content")
    if isinstance(reasoning, str):
        return reasoning.strip(), content
    if "</think>" not in content:
        return "", content
    reasoning = content.split("</think>")[0].rstrip("\n").split("<think>")[-1].lstrip("\n")
    return reasoning.strip(), content.split("</think>")[-1].lstrip("\n")


def _tool_call_arguments(arguments: Any) -> Mapping:
    # The template iterates `arguments|items`, i.e. it needs a mapping.  OpenAI-style clients
    # send a JSON string; parse it here (the Jinja template would raise on a string).
    if arguments is None:
        return {}
    if isinstance(arguments, str):
        arguments = json.loads(arguments) if arguments.strip() else {}
    if not isinstance(arguments, Mapping):
        raise ValueError(f"tool call arguments must be a mapping, got {type(arguments).__name__}")
    return arguments


def _tool_calls(tool_calls: Sequence[Mapping], content: str) -> str:
    out = []
    for i, call in enumerate(tool_calls):
        call = call.get("function", call)
        if "name" not in call:
            raise ValueError("tool call without a function name")
        if i > 0:
            prefix = "\n"
        else:
            prefix = "\n\n" if content.strip() else ""
        out.append(prefix + "<tool_call>\n<function=" + call["name"] + ">\n")
        for name, value in _tool_call_arguments(call.get("arguments")).items():
            rendered = value if isinstance(value, str) else _tojson(value)
            out.append("<parameter=" + name + ">\n" + rendered + "\n</parameter>\n")
        out.append("</function>\n</tool_call>")
    return "".join(out)


def _assistant(message: Mapping, content: str, keep_reasoning: bool) -> str:
    reasoning, content = _split_reasoning(message, content)
    if keep_reasoning:
        out = "<|im_start|>assistant\n<think>\n" + reasoning + "\n</think>\n\n" + content
    else:
        out = "<|im_start|>assistant\n" + content
    tool_calls = message.get("tool_calls")
    if tool_calls and not isinstance(tool_calls, Mapping):
        out += _tool_calls(tool_calls, content)
    return out + "<|im_end|>\n"


def _tool(messages: Sequence[Mapping], index: int, content: str) -> str:
    # Consecutive tool results share one user turn.  (Like the template, a tool message at
    # index 0 gets no opening "<|im_start|>user": `loop.previtem` is undefined there.)
    opens = index > 0 and messages[index - 1].get("role") != "tool"
    is_last = index == len(messages) - 1
    closes = is_last or messages[index + 1].get("role") != "tool"
    out = "<|im_start|>user" if opens else ""
    out += "\n<tool_response>\n" + content + "\n</tool_response>"
    return out + ("<|im_end|>\n" if closes else "")


def render_chat(
    messages: Sequence[Mapping],
    add_generation_prompt: bool = True,
    enable_thinking: bool | None = None,
    tools: Sequence[Mapping] | None = None,
) -> str:
    """Render `messages` exactly as QWEN35_CHAT_TEMPLATE does.

    `enable_thinking` follows the template's semantics: only `False` disables thinking
    (None == not passed == thinking on).  Extra keys on messages are ignored.
    """
    if not messages:
        raise ValueError("No messages provided.")
    out = [_system_block(messages, tools)]
    last_query = _last_query_index(messages)
    for index, message in enumerate(messages):
        role = message.get("role")
        content = _text(message)
        if role == "system":
            if index != 0:
                raise ValueError("System message must be at the beginning.")
        elif role == "user":
            out.append("<|im_start|>user\n" + content + "<|im_end|>\n")
        elif role == "assistant":
            out.append(_assistant(message, content, keep_reasoning=index > last_query))
        elif role == "tool":
            out.append(_tool(messages, index, content))
        else:
            raise ValueError(f"Unexpected message role: {role!r}")
    if add_generation_prompt:
        out.append("<|im_start|>assistant\n")
        out.append("<think>\n\n</think>\n\n" if enable_thinking is False else "<think>\n")
    return "".join(out)


# ---------------------------------------------------------------------------------------------------------------
# Other models (the dense LLaMA-likes): their own Jinja chat template, rendered as transformers renders it

class ChatTemplateUnavailable(ValueError):
    """The model has no chat template we can render (none in its files, or jinja2 missing): chat requests get a 400
    telling the client to send prompts to /v1/completions."""


def render_jinja(template: str, messages: Sequence[Mapping], add_generation_prompt: bool = True,
                 tools: Sequence[Mapping] | None = None, **variables: Any) -> str:
    """Render a model's own chat template (from its tokenizer_config.json / chat_template.jinja) the way
    transformers does: a sandboxed Jinja environment with trim_blocks and lstrip_blocks, loop controls, `tojson`
    as json.dumps(ensure_ascii=False), `raise_exception` and `strftime_now`. `variables`: bos_token, eos_token,
    enable_thinking, ... (templates read what they know and ignore the rest)."""
    compiled = _compile_jinja(template)
    return compiled.render(messages=list(messages), add_generation_prompt=add_generation_prompt, tools=tools,
                           **variables)


@functools.lru_cache(maxsize=8)
def _compile_jinja(template: str):
    try:
        import jinja2
        from jinja2.ext import loopcontrols
        from jinja2.sandbox import ImmutableSandboxedEnvironment
    except ImportError as e:
        raise ChatTemplateUnavailable("this model's chat template needs the jinja2 package, which is not "
                                      "installed on the server: send the prompt as text to /v1/completions") from e
    from datetime import datetime

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                          sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(template)
