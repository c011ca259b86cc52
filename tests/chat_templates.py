"""Chat templates written for the tests that produce the released models' formats (the tiny models'
own templates, tools/tiny_tokenizer.py, are simplified): written here, not copied.

QWEN35: ChatML as Qwen3.5 renders it. An assistant turn after the last user message shows its
reasoning (`reasoning_content`, or a `<think>` block inside its content) as `<think>\\n...\\n</think>\\n\\n`
before the answer; earlier turns keep only their answer. The generation prompt opens a think block,
or holds an empty one when enable_thinking is false. Tools: listed as JSON lines inside `<tools></tools>`
in the system turn (the user's system message first), with the call format; an assistant's tool calls
follow its answer (after a blank line when it has one, one a line) as
`<tool_call>\\n<function=NAME>\\n<parameter=ARG>\\nVALUE\\n</parameter>\\n</function>\\n</tool_call>`, a value
as text when it is a string, else as JSON; tool results (role `tool`) go in a user turn, each inside
`<tool_response></tool_response>`.

GPTOSS: harmony as gpt-oss renders it: a system message with the reasoning effort (reasoning_effort,
default medium) and the valid channels; the user's system message as the developer's instructions;
answers on the final channel; an assistant turn after the last user message shows its reasoning
(`thinking`, which the renderer fills from reasoning_content) on the analysis channel; the last
assistant turn without a generation prompt ends in <|return|>. Tools: the system message says calls go
to the commentary channel; the developer message lists them as TypeScript-like types in
`namespace functions { ... }`; an assistant's content beside tool calls is a commentary preamble, each
call `<|start|>assistant<|channel|>commentary to=functions.NAME <|constrain|>json<|message|>ARGS<|call|>`;
a tool result `<|start|>functions.NAME to=assistant<|channel|>commentary<|message|>...<|end|>`, NAME
found by its tool_call_id (or its `name`).
"""

QWEN35 = r"""{%- set ns = namespace(last_user=-1) %}
{%- for message in messages %}
    {%- if message.role == 'user' %}
        {%- set ns.last_user = loop.index0 %}
    {%- endif %}
{%- endfor %}
{%- if tools %}
    {{- '<|im_start|>system\n' }}
    {%- if messages[0].role == 'system' %}
        {{- messages[0].content + '\n\n' }}
    {%- endif %}
    {{- '# Tools\n\nYou have access to the following functions:\n\n<tools>' }}
    {%- for tool in tools %}
        {{- '\n' + (tool | tojson) }}
    {%- endfor %}
    {{- '\n</tools>\n\nIf you choose to call a function ONLY reply in the following format with NO suffix:\n\n'
        '<tool_call>\n<function=example_function_name>\n<parameter=example_parameter_1>\nvalue_1\n</parameter>\n'
        '</function>\n</tool_call><|im_end|>\n' }}
{%- endif %}
{%- for message in messages %}
    {%- if message.role == 'system' %}
        {%- if not loop.first %}
            {{- raise_exception('System message must be at the beginning.') }}
        {%- endif %}
        {%- if not tools %}
            {{- '<|im_start|>system\n' + message.content + '<|im_end|>\n' }}
        {%- endif %}
    {%- elif message.role == 'user' %}
        {{- '<|im_start|>user\n' + message.content + '<|im_end|>\n' }}
    {%- elif message.role == 'assistant' %}
        {%- set content = message.content %}
        {%- set reasoning = '' %}
        {%- if message.reasoning_content is string %}
            {%- set reasoning = message.reasoning_content %}
        {%- elif '</think>' in content %}
            {%- set reasoning = content.split('</think>')[0].split('<think>')[-1] %}
            {%- set content = content.split('</think>')[-1] %}
        {%- endif %}
        {%- if loop.index0 > ns.last_user %}
            {{- '<|im_start|>assistant\n<think>\n' + reasoning.strip('\n') + '\n</think>\n\n' + content.lstrip('\n') }}
        {%- else %}
            {{- '<|im_start|>assistant\n' + content.lstrip('\n') }}
        {%- endif %}
        {%- for tool_call in message.tool_calls or [] %}
            {%- set call = tool_call.function if tool_call.function is defined else tool_call %}
            {%- if not loop.first %}
                {{- '\n' }}
            {%- elif content | trim %}
                {{- '\n\n' }}
            {%- endif %}
            {{- '<tool_call>\n<function=' + call.name + '>\n' }}
            {%- for name, value in call.arguments | items %}
                {{- '<parameter=' + name + '>\n' + (value if value is string else value | tojson) + '\n</parameter>\n' }}
            {%- endfor %}
            {{- '</function>\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\n' }}
    {%- elif message.role == 'tool' %}
        {%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\n<tool_response>\n' + message.content + '\n</tool_response>' }}
        {%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}
            {{- '<|im_end|>\n' }}
        {%- endif %}
    {%- else %}
        {{- raise_exception('Unexpected message role: ' + message.role) }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}
        {{- '<think>\n\n</think>\n\n' }}
    {%- else %}
        {{- '<think>\n' }}
    {%- endif %}
{%- endif %}
"""

GPTOSS = r"""{%- macro ts_type(s) -%}
    {%- if s.enum is defined -%}
        {{- s.enum | map('tojson') | join(' | ') -}}
    {%- elif s.type == 'string' -%}
        {{- 'string' -}}
    {%- elif s.type == 'number' or s.type == 'integer' -%}
        {{- 'number' -}}
    {%- elif s.type == 'boolean' -%}
        {{- 'boolean' -}}
    {%- elif s.type == 'array' -%}
        {{- (ts_type(s['items']) if 'items' in s else 'any') + '[]' -}}
    {%- else -%}
        {{- 'any' -}}
    {%- endif -%}
{%- endmacro -%}
{%- set effort = reasoning_effort if reasoning_effort is defined else 'medium' %}
{{- '<|start|>system<|message|>You are ChatGPT, a large language model trained by OpenAI.\nKnowledge cutoff: 2024-06\n\nReasoning: ' + effort + '\n\n# Valid channels: analysis, commentary, final. Channel must be included for every message.' }}
{%- if tools %}
    {{- "\nCalls to these tools must go to the commentary channel: 'functions'." }}
{%- endif %}
{{- '<|end|>' }}
{%- set has_system = messages[0].role in ['system', 'developer'] %}
{%- if has_system or tools %}
    {{- '<|start|>developer<|message|>' }}
    {%- if has_system %}
        {{- '# Instructions\n\n' + messages[0].content }}
        {%- if tools %}
            {{- '\n\n' }}
        {%- endif %}
    {%- endif %}
    {%- if tools %}
        {{- '# Tools\n\n## functions\n\nnamespace functions {\n\n' }}
        {%- for tool in tools %}
            {%- set fn = tool.function if tool.function is defined else tool %}
            {%- if fn.description %}
                {{- '// ' + fn.description + '\n' }}
            {%- endif %}
            {{- 'type ' + fn.name + ' = ' }}
            {%- if fn.parameters is defined and fn.parameters.properties %}
                {{- '(_: {\n' }}
                {%- for name, param in fn.parameters.properties | items %}
                    {%- if param.description %}
                        {{- '// ' + param.description + '\n' }}
                    {%- endif %}
                    {{- name + ('' if name in (fn.parameters.required or []) else '?') + ': ' + ts_type(param) + ',\n' }}
                {%- endfor %}
                {{- '}) => any;\n\n' }}
            {%- else %}
                {{- '() => any;\n\n' }}
            {%- endif %}
        {%- endfor %}
        {{- '} // namespace functions' }}
    {%- endif %}
    {{- '<|end|>' }}
{%- endif %}
{%- set ns = namespace(last_user=-1) %}
{%- for message in messages %}
    {%- if message.role == 'user' %}
        {%- set ns.last_user = loop.index0 %}
    {%- endif %}
{%- endfor %}
{%- for message in messages %}
    {%- if message.role in ['system', 'developer'] %}
        {%- if not loop.first %}
            {{- raise_exception('The system or developer message must be the first.') }}
        {%- endif %}
    {%- elif message.role == 'user' %}
        {{- '<|start|>user<|message|>' + message.content + '<|end|>' }}
    {%- elif message.role == 'assistant' %}
        {%- if '<|channel|>' in message.content %}
            {{- raise_exception('Put reasoning in the thinking field, not <|channel|> tags in the content.') }}
        {%- endif %}
        {%- if message.thinking and loop.index0 > ns.last_user %}
            {{- '<|start|>assistant<|channel|>analysis<|message|>' + message.thinking + '<|end|>' }}
        {%- endif %}
        {%- if message.tool_calls %}
            {%- if message.content %}
                {{- '<|start|>assistant<|channel|>commentary<|message|>' + message.content + '<|end|>' }}
            {%- endif %}
            {%- for tool_call in message.tool_calls %}
                {%- set call = tool_call.function if tool_call.function is defined else tool_call %}
                {{- '<|start|>assistant<|channel|>commentary to=functions.' + call.name + ' <|constrain|>json<|message|>'
                    + (call.arguments | tojson) + '<|call|>' }}
            {%- endfor %}
        {%- else %}
            {{- '<|start|>assistant<|channel|>final<|message|>' + message.content }}
            {{- '<|return|>' if loop.last and not add_generation_prompt else '<|end|>' }}
        {%- endif %}
    {%- elif message.role == 'tool' %}
        {%- set found = namespace(name=message.name if message.name is defined else none) %}
        {%- for earlier in messages[:loop.index0] %}
            {%- for tool_call in earlier.tool_calls or [] %}
                {%- if tool_call.id is defined and tool_call.id == message.tool_call_id %}
                    {%- set found.name = (tool_call.function if tool_call.function is defined else tool_call).name %}
                {%- endif %}
            {%- endfor %}
        {%- endfor %}
        {%- if found.name is none %}
            {{- raise_exception('A tool message must answer a tool call (tool_call_id) or name its function.') }}
        {%- endif %}
        {{- '<|start|>functions.' + found.name + ' to=assistant<|channel|>commentary<|message|>' + message.content + '<|end|>' }}
    {%- else %}
        {{- raise_exception('Unexpected message role: ' + message.role) }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|start|>assistant' }}
{%- endif %}
"""
