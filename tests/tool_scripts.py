"""Scripted model outputs with tool calls, in each chat format (Qwen3.5's XML calls, harmony), that the
serving tests substitute for sampled tokens."""
QWEN_CALL = ("Need the weather.\n</think>\n\n<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n"
             "</parameter>\n<parameter=days>\n2\n</parameter>\n</function>\n</tool_call><|im_end|>")
QWEN_TWO = ("Two calls.\n</think>\n\nChecking both.\n\n<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n"
            "</parameter>\n</function>\n</tool_call>\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": "
            "{\"city\": \"Rome\"}}\n</tool_call><|im_end|>")
QWEN_AFTER = "It is sunny.\n</think>\n\nSunny in Paris.<|im_end|>"
HARMONY_CALL = ("<|channel|>analysis<|message|>Need the weather.<|end|><|start|>assistant<|channel|>commentary "
                "to=functions.get_weather <|constrain|>json<|message|>{\"city\": \"Paris\", \"days\": 2}<|call|>")
HARMONY_AFTER = "<|channel|>final<|message|>Sunny in Paris.<|return|>"
