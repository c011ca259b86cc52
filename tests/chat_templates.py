"""Chat templates written for the tests that produce the released models' formats (the tiny models'
own templates, tools/tiny_tokenizer.py, are simplified): written here, not copied, and without tools.

QWEN35: ChatML as Qwen3.5 renders it. An assistant turn after the last user message shows its
reasoning (`reasoning_content`, or a `<think>` block inside its content) as `<think>\\n...\\n</think>\\n\\n`
before the answer; earlier turns keep only their answer. The generation prompt opens a think block,
or holds an empty one when enable_thinking is false.

GPTOSS: harmony as gpt-oss renders it: a system message with the reasoning effort (reasoning_effort,
default medium) and the valid channels; the user's system message as the developer's instructions;
answers on the final channel; an assistant turn after the last user message shows its reasoning
(`thinking`, which the renderer fills from reasoning_content) on the analysis channel; the last
assistant turn without a generation prompt ends in <|return|>.
"""

QWEN35 = r"""{%- set ns = namespace(last_user=-1) %}
{%- for message in messages %}
    {%- if message.role == 'user' %}
        {%- set ns.last_user = loop.index0 %}
    {%- endif %}
{%- endfor %}
{%- for message in messages %}
    {%- if message.role == 'system' %}
        {%- if not loop.first %}
            {{- raise_exception('System message must be at the beginning.') }}
        {%- endif %}
        {{- '<|im_start|>system\n' + message.content + '<|im_end|>\n' }}
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
        {{- '<|im_end|>\n' }}
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

GPTOSS = r"""{%- set effort = reasoning_effort if reasoning_effort is defined else 'medium' %}
{{- '<|start|>system<|message|>You are ChatGPT, a large language model trained by OpenAI.\nKnowledge cutoff: 2024-06\n\nReasoning: ' + effort + '\n\n# Valid channels: analysis, commentary, final. Channel must be included for every message.<|end|>' }}
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
        {{- '<|start|>developer<|message|># Instructions\n\n' + message.content + '<|end|>' }}
    {%- elif message.role == 'user' %}
        {{- '<|start|>user<|message|>' + message.content + '<|end|>' }}
    {%- elif message.role == 'assistant' %}
        {%- if '<|channel|>' in message.content %}
            {{- raise_exception('Put reasoning in the thinking field, not <|channel|> tags in the content.') }}
        {%- endif %}
        {%- if message.thinking and loop.index0 > ns.last_user %}
            {{- '<|start|>assistant<|channel|>analysis<|message|>' + message.thinking + '<|end|>' }}
        {%- endif %}
        {{- '<|start|>assistant<|channel|>final<|message|>' + message.content }}
        {{- '<|return|>' if loop.last and not add_generation_prompt else '<|end|>' }}
    {%- else %}
        {{- raise_exception('Unexpected message role: ' + message.role) }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|start|>assistant' }}
{%- endif %}
"""
