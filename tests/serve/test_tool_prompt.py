#!/usr/bin/env python3
"""Tools reach the chat template as transformers passes them: through `sluice serve
--chat-template T`, a chat request with the fixture conversation and tools must have as many
prompt tokens as transformers' own rendering of it (tests/fixtures/chat/expected.json, made by
scripts/make_chat_fixtures.py) tokenized by the same server as a raw /v1/completions prompt.

Run by tests/serve_tools.rs:
    python3 tests/serve/test_tool_prompt.py --base URL --model ID --template T.jinja --fixtures expected.json
Prints one line per check and exits 1 if one failed.
"""

import argparse
import json
import sys

try:
    import anthropic
    import openai
except ImportError as e:
    print(f"missing Python package: {e}; run .ci/run (it pip-installs openai and anthropic)")
    sys.exit(2)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--base", required=True)
    ap.add_argument("--model", required=True)
    ap.add_argument("--template", required=True)
    ap.add_argument("--fixtures", required=True)
    a = ap.parse_args()
    fx = json.load(open(a.fixtures, encoding="utf-8"))
    case = next(c for c in fx["cases"] if c["template"] == a.template and c["conversation"] == "tools"
                and c["add_generation_prompt"])
    conv = fx["conversations"]["tools"]
    tools = case["extra"]["tools"]
    c = openai.OpenAI(base_url=a.base + "/v1", api_key="unused", max_retries=0, timeout=60)

    # Reference: transformers' rendering, tokenized by the server as a raw prompt.
    want = c.completions.create(model=a.model, prompt=case["rendered"], max_tokens=1, temperature=0).usage.prompt_tokens

    # The conversation as an OpenAI client sends it (arguments as JSON text).
    msgs = []
    for m in conv:
        m = dict(m)
        if "tool_calls" in m:
            m["tool_calls"] = [dict(tc, function=dict(tc["function"], arguments=json.dumps(tc["function"]["arguments"])))
                               for tc in m["tool_calls"]]
        msgs.append(m)
    got = c.chat.completions.create(model=a.model, messages=msgs, tools=tools, max_tokens=1,
                                    temperature=0).usage.prompt_tokens
    without = c.chat.completions.create(model=a.model, messages=msgs, max_tokens=1,
                                        temperature=0).usage.prompt_tokens
    # tool_choice "none" leaves the tools out of the template.
    none = c.chat.completions.create(model=a.model, messages=msgs, tools=tools, tool_choice="none", max_tokens=1,
                                     temperature=0).usage.prompt_tokens
    print(f"{a.template}: chat with tools {got} tokens, transformers' rendering {want}, without tools {without}")
    ok = True
    if got != want:
        print("FAIL the prompt with tools differs from transformers' rendering")
        ok = False
    if without >= got or none != without:
        print(f"FAIL the tools did not change the prompt as expected (without {without}, tool_choice none {none})")
        ok = False

    # The same tools in Anthropic's shape render the same prompt (count_tokens renders it).
    an = anthropic.Anthropic(base_url=a.base, api_key="unused", max_retries=0, timeout=60)
    atools = [{"name": t["function"]["name"], "description": t["function"]["description"],
               "input_schema": t["function"]["parameters"]} for t in tools]
    n = an.messages.count_tokens(model=a.model, system=conv[0]["content"], tools=atools,
                                 messages=[{"role": "user", "content": conv[1]["content"]}]).input_tokens
    n_oai = c.chat.completions.create(model=a.model, messages=msgs[:2], tools=tools, max_tokens=1,
                                      temperature=0).usage.prompt_tokens
    print(f"{a.template}: first turn with tools: anthropic count_tokens {n}, openai {n_oai}")
    if n != n_oai:
        print("FAIL Anthropic tools rendered a different prompt than the same tools through OpenAI's route")
        ok = False
    print("passed" if ok else "failed")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
