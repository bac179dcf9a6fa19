#!/usr/bin/env python3
"""Render real chat templates with transformers' own renderer and record the output, so that
sluice's minijinja rendering can be compared byte for byte (tests/chat_template.rs).

Templates come from vendor-data/templates/ (scripts/fetch-test-data.sh: the templates
llama.cpp collects from the models' tokenizer_config.json); they are not committed, only the
rendered strings: tests/fixtures/chat/expected.json.

Rendering: transformers.utils.chat_template_utils.render_jinja_template, the function
`apply_chat_template` calls, with the model's bos/eos token strings as `apply_chat_template`
passes them, `strftime_now` pinned to NOW (the Rust test pins it the same way).
Messages: dicts with None values dropped, as `apply_chat_template` does.

Run: scripts/fetch-test-data.sh && pip install transformers jinja2 && python3 scripts/make_chat_fixtures.py
(transformers works without torch for this.)
"""
import datetime as _dt
import json
import os
import sys

import jinja2
import transformers
import transformers.utils.chat_template_utils as ctu

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
TEMPLATES = os.path.join(ROOT, "vendor-data", "templates")
OUT = os.path.join(ROOT, "tests", "fixtures", "chat", "expected.json")

# 2024-07-26 13:25:09 UTC
NOW_UNIX = 1722000309


class _PinnedDatetime(_dt.datetime):
    @classmethod
    def now(cls, tz=None):
        return _dt.datetime.fromtimestamp(NOW_UNIX, _dt.timezone.utc).replace(tzinfo=None)


ctu.datetime = _PinnedDatetime

# template file -> (bos_token, eos_token) as the model's tokenizer has them ("" where it has none).
TEMPLATE_TOKENS = {
    "Qwen-Qwen3-0.6B.jinja": ("", "<|im_end|>"),
    "Qwen3-Coder.jinja": ("", "<|im_end|>"),
    "Qwen-Qwen2.5-7B-Instruct.jinja": ("", "<|im_end|>"),
    "Qwen-QwQ-32B.jinja": ("", "<|im_end|>"),
    "deepseek-ai-DeepSeek-V3.1.jinja": ("<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>"),
    "deepseek-ai-DeepSeek-R1-Distill-Qwen-32B.jinja": ("<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>"),
    "llama-cpp-deepseek-r1.jinja": ("<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>"),
    "GLM-4.6.jinja": ("", "<|endoftext|>"),
    "GLM-4.7-Flash.jinja": ("", "<|endoftext|>"),
    "mistralai-Mistral-Nemo-Instruct-2407.jinja": ("<s>", "</s>"),
    "Mistral-Small-3.2-24B-Instruct-2506.jinja": ("<s>", "</s>"),
    "unsloth-mistral-Devstral-Small-2507.jinja": ("<s>", "</s>"),
    "meta-llama-Llama-3.1-8B-Instruct.jinja": ("<|begin_of_text|>", "<|eot_id|>"),
    "meta-llama-Llama-3.3-70B-Instruct.jinja": ("<|begin_of_text|>", "<|eot_id|>"),
    "openai-gpt-oss-120b.jinja": ("<|startoftext|>", "<|return|>"),
    "moonshotai-Kimi-K2.jinja": ("[BOS]", "[EOS]"),
    "MiniMax-M2.jinja": ("]~!b[", "[e~["),
    "google-gemma-2-2b-it.jinja": ("<bos>", "<eos>"),
    "microsoft-Phi-3.5-mini-instruct.jinja": ("<s>", "<|endoftext|>"),
    "ibm-granite-granite-3.3-2B-Instruct.jinja": ("<|end_of_text|>", "<|end_of_text|>"),
    "HuggingFaceTB-SmolLM3-3B.jinja": ("", "<|im_end|>"),
}

SYSTEM = {"role": "system", "content": "You are a helpful assistant."}
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Current weather for a city.",
            "parameters": {
                "type": "object",
                "properties": {
                    "city": {"type": "string", "description": "City name, e.g. \"Paris\""},
                    "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
                },
                "required": ["city"],
            },
        },
    }
]

CONVERSATIONS = {
    "user": [{"role": "user", "content": "Hello! What is 2+2?"}],
    "system_user": [SYSTEM, {"role": "user", "content": "What is a sluice?"}],
    "multi_turn": [
        SYSTEM,
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello! How can I help?"},
        {"role": "user", "content": "Tell me a joke about rivers."},
    ],
    "no_system_multi": [
        {"role": "user", "content": "First question?"},
        {"role": "assistant", "content": "First answer."},
        {"role": "user", "content": "Second question?"},
    ],
    "reasoning": [
        {"role": "user", "content": "What is 7*6?"},
        {"role": "assistant", "content": "<think>\n7 times 6 is 42.\n</think>\n\n42"},
        {"role": "user", "content": "And 7*7?"},
    ],
    "unicode": [
        {"role": "user", "content": "  Ünïcödé 中文 🦙 \"quotes\" 'single' and \\backslash\\\n\nnew lines\t "},
    ],
    "tools": [
        SYSTEM,
        {"role": "user", "content": "What's the weather in Paris?"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "name": "get_weather", "content": "{\"temperature\": 21, \"sky\": \"clear\"}"},
        {"role": "user", "content": "Thanks!"},
    ],
}

# Extra template variables per case (on top of date_string, which Llama 3.x templates read).
EXTRA = {"tools": {"tools": TOOLS}}
THINKING_OFF = {"enable_thinking": False}


def render(template, messages, add_generation_prompt, bos, eos, extra):
    messages = [{k: v for k, v in m.items() if v is not None} for m in messages]
    kwargs = dict(extra)
    tools = kwargs.pop("tools", None)
    documents = kwargs.pop("documents", None)
    out, _ = ctu.render_jinja_template(
        conversations=[messages],
        tools=tools,
        documents=documents,
        chat_template=template,
        add_generation_prompt=add_generation_prompt,
        bos_token=bos,
        eos_token=eos,
        **kwargs,
    )
    return out[0]


def main():
    if not os.path.isdir(TEMPLATES):
        sys.exit(f"{TEMPLATES} is missing: run scripts/fetch-test-data.sh first")
    cases = []
    for name, (bos, eos) in TEMPLATE_TOKENS.items():
        with open(os.path.join(TEMPLATES, name), encoding="utf-8") as f:
            template = f.read()
        variants = [(conv, {}) for conv in CONVERSATIONS]
        if "enable_thinking" in template:
            variants.append(("multi_turn", THINKING_OFF))
        for conv, more in variants:
            extra = {"date_string": "26 Jul 2024", **EXTRA.get(conv, {}), **more}
            for agp in (True, False):
                case = {
                    "template": name,
                    "conversation": conv,
                    "add_generation_prompt": agp,
                    "bos_token": bos,
                    "eos_token": eos,
                    "extra": extra,
                }
                try:
                    case["rendered"] = render(template, CONVERSATIONS[conv], agp, bos, eos, extra)
                except Exception as e:  # noqa: BLE001 - any failure is recorded; sluice must fail too
                    case["error"] = f"{type(e).__name__}: {e}"
                cases.append(case)
    doc = {
        "transformers_version": transformers.__version__,
        "jinja2_version": jinja2.__version__,
        "now_unix": NOW_UNIX,
        "conversations": CONVERSATIONS,
        "cases": cases,
    }
    os.makedirs(os.path.dirname(OUT), exist_ok=True)
    with open(OUT, "w", encoding="utf-8") as f:
        json.dump(doc, f, indent=1, ensure_ascii=False)
        f.write("\n")
    n_err = sum("error" in c for c in cases)
    print(f"{len(cases)} renders ({n_err} raised) of {len(TEMPLATE_TOKENS)} templates -> {OUT}")


if __name__ == "__main__":
    main()
