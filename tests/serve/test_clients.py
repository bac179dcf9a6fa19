#!/usr/bin/env python3
"""`sluice serve` through the official `openai` and `anthropic` Python clients.

Run by tests/serve_clients.rs against a server it started on the built-in model:
    python3 tests/serve/test_clients.py --base http://127.0.0.1:PORT --key KEY --model ID \
        --ctx CTX --max-body BYTES
Each check is a function; the script prints one line per check and a closing
'N passed, M failed' line, and exits 1 if any failed.
"""

import argparse
import http.client
import json
import re
import socket
import sys
import time
import traceback
import urllib.parse

try:
    import anthropic
    import openai
except ImportError as e:  # the Rust test checks this first, but say it plainly here too
    print(f"missing Python package: {e}; run .ci/run (it pip-installs openai and anthropic)")
    sys.exit(2)

ARGS = None
CHECKS = []


def check(fn):
    CHECKS.append(fn)
    return fn


def oai(key=None):
    return openai.OpenAI(base_url=ARGS.base + "/v1", api_key=key or ARGS.key, max_retries=0, timeout=60)


def anth(key=None):
    return anthropic.Anthropic(base_url=ARGS.base, api_key=key or ARGS.key, max_retries=0, timeout=60)


def raw(method, path, body=b"", headers=None, auth=True):
    """One request over a fresh connection: (status, parsed JSON or text)."""
    u = urllib.parse.urlparse(ARGS.base)
    c = http.client.HTTPConnection(u.hostname, u.port, timeout=60)
    h = {"Content-Type": "application/json"}
    if auth:
        h["Authorization"] = "Bearer " + ARGS.key
    h.update(headers or {})
    c.request(method, path, body=body, headers=h)
    r = c.getresponse()
    data = r.read()
    c.close()
    try:
        return r.status, json.loads(data)
    except ValueError:
        return r.status, data.decode("utf-8", "replace")


def metric(name):
    _, text = raw("GET", "/metrics", auth=False)
    m = re.search(r"^" + re.escape(name) + r"\{[^}]*\} (\S+)$", text, re.M)
    assert m, f"{name} not in /metrics:\n{text}"
    return float(m.group(1))


def chat_msgs(text="Tell me about rivers."):
    return [{"role": "system", "content": "You are terse."}, {"role": "user", "content": text}]


def openai_error(e):
    """The error object of an openai APIStatusError."""
    body = e.body if isinstance(e.body, dict) else {}
    return body.get("error", body)


# --- OpenAI: the good paths ---------------------------------------------------------------


@check
def models_list():
    ids = [m.id for m in oai().models.list().data]
    assert ids == [ARGS.model], ids
    assert oai().models.retrieve(ARGS.model).id == ARGS.model


@check
def chat_non_stream_and_stream_agree():
    c = oai()
    r = c.chat.completions.create(model=ARGS.model, messages=chat_msgs(), max_tokens=12, temperature=0,
                                  extra_body={"ignore_eos": True})
    ch = r.choices[0]
    assert ch.message.role == "assistant" and isinstance(ch.message.content, str) and ch.message.content
    assert ch.finish_reason == "length", ch.finish_reason
    u = r.usage
    assert u.completion_tokens == 12 and u.prompt_tokens > 5, u
    extra = u.model_extra
    assert extra["reused_tokens"] + extra["prefilled_tokens"] == u.prompt_tokens, u
    assert u.prompt_tokens_details.cached_tokens == extra["reused_tokens"]

    chunks = list(c.chat.completions.create(model=ARGS.model, messages=chat_msgs(), max_tokens=12, temperature=0,
                                            stream=True, stream_options={"include_usage": True},
                                            extra_body={"ignore_eos": True}))
    text = "".join(k.choices[0].delta.content or "" for k in chunks if k.choices)
    assert text == ch.message.content, (text, ch.message.content)
    assert chunks[0].choices[0].delta.role == "assistant"
    finals = [k.choices[0].finish_reason for k in chunks if k.choices and k.choices[0].finish_reason]
    assert finals == ["length"], finals
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 12
    # The same prompt again: everything but the last prompt token comes from the KV cache.
    assert chunks[-1].usage.model_extra["reused_tokens"] == u.prompt_tokens - 1, chunks[-1].usage


@check
def second_turn_reuses_the_prefix():
    c = oai()
    first = c.chat.completions.create(model=ARGS.model, messages=chat_msgs("Name a colour."), max_tokens=8,
                                      temperature=0, extra_body={"ignore_eos": True})
    msgs = chat_msgs("Name a colour.") + [
        {"role": "assistant", "content": first.choices[0].message.content},
        {"role": "user", "content": "Another one."},
    ]
    second = c.chat.completions.create(model=ARGS.model, messages=msgs, max_tokens=8, temperature=0)
    u = second.usage.model_extra
    assert u["reused_tokens"] >= first.usage.prompt_tokens - 1, (u, first.usage)
    assert u["prefilled_tokens"] < second.usage.prompt_tokens


@check
def completions_non_stream_and_stream():
    c = oai()
    r = c.completions.create(model=ARGS.model, prompt="Once upon a time", max_tokens=10, temperature=0,
                             extra_body={"ignore_eos": True})
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 10
    text = "".join(k.choices[0].text for k in c.completions.create(
        model=ARGS.model, prompt="Once upon a time", max_tokens=10, temperature=0, stream=True,
        extra_body={"ignore_eos": True}) if k.choices)
    assert text == r.choices[0].text, (text, r.choices[0].text)
    # Token ids are a prompt too.
    r2 = c.completions.create(model=ARGS.model, prompt=[1, 2, 3], max_tokens=3, temperature=0)
    assert r2.usage.prompt_tokens == 3


@check
def stop_sequences_are_cut():
    c = oai()
    full = c.completions.create(model=ARGS.model, prompt="The river", max_tokens=24, temperature=0,
                                extra_body={"ignore_eos": True}).choices[0].text
    assert len(full) >= 6, full
    stop = full[4:6]
    want = full[: full.find(stop)]
    r = c.completions.create(model=ARGS.model, prompt="The river", max_tokens=24, temperature=0, stop=[stop, "\x00never"],
                             extra_body={"ignore_eos": True})
    assert r.choices[0].text == want and r.choices[0].finish_reason == "stop", (r.choices[0], stop, full)
    streamed = "".join(k.choices[0].text for k in c.completions.create(
        model=ARGS.model, prompt="The river", max_tokens=24, temperature=0, stop=stop, stream=True,
        extra_body={"ignore_eos": True}))
    assert streamed == want, (streamed, want)


@check
def seed_repeats_and_sampling_params_accepted():
    c = oai()
    kw = dict(model=ARGS.model, prompt="Seeds", max_tokens=16, temperature=1.0, top_p=0.9, seed=42,
              extra_body={"top_k": 20, "min_p": 0.01, "ignore_eos": True})
    a = c.completions.create(**kw).choices[0].text
    b = c.completions.create(**kw).choices[0].text
    assert a == b, (a, b)


@check
def tools_are_accepted():
    tools = [{"type": "function", "function": {"name": "get_weather", "description": "Weather of a city",
                                               "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]
    r = oai().chat.completions.create(model=ARGS.model, messages=chat_msgs("Weather in Paris?"), tools=tools,
                                      max_tokens=4, temperature=0)
    assert r.choices[0].finish_reason in ("stop", "length", "tool_calls")


@check
def disconnect_mid_stream_cancels():
    c = oai()
    before = metric("sluice_generated_tokens_total")
    cancelled = metric("sluice_generations_cancelled_total")
    big = 3000
    s = c.chat.completions.create(model=ARGS.model, messages=chat_msgs("Go on forever."), max_tokens=big,
                                  temperature=0, stream=True, extra_body={"ignore_eos": True})
    seen = 0
    for k in s:
        if k.choices and k.choices[0].delta.content:
            seen += 1
        if seen >= 3:
            break
    s.response.close()
    t = time.time()
    r = c.chat.completions.create(model=ARGS.model, messages=chat_msgs("Short."), max_tokens=4, temperature=0,
                                  extra_body={"ignore_eos": True})
    waited = time.time() - t
    assert r.choices[0].message.content is not None
    after = metric("sluice_generated_tokens_total")
    assert metric("sluice_generations_cancelled_total") == cancelled + 1
    # The cancelled generation stopped long before its max_tokens.
    assert after - before - 4 < big / 2, (before, after)
    print(f"    (next request answered {waited:.2f}s after the disconnect; cancelled after {after - before - 4:.0f} tokens)")


def generous_wait_for_idle(limit=30.0):
    """Wait until nothing runs or waits (a cancelled generation has stopped)."""
    t = time.time()
    while time.time() - t < limit:
        _, body = raw("GET", "/health", auth=False)
        if not body["busy"] and body["queue"] == 0:
            return
        time.sleep(0.02)
    raise AssertionError(f"server still busy {limit}s later")


@check
def disconnect_non_stream_cancels():
    # A whole-response request writes nothing until the end: the server must notice the closed
    # socket by itself. The client gives up after 1 s of a generation that would run for the
    # whole context (~10x longer even on an idle machine).
    big = ARGS.ctx - 64
    before = metric("sluice_generated_tokens_total")
    cancelled = metric("sluice_generations_cancelled_total")
    impatient = openai.OpenAI(base_url=ARGS.base + "/v1", api_key=ARGS.key, max_retries=0, timeout=1.0)
    t = time.time()
    try:
        impatient.chat.completions.create(model=ARGS.model, messages=chat_msgs("Go on forever."), max_tokens=big,
                                          temperature=0, extra_body={"ignore_eos": True})
        raise AssertionError("the request finished within the client's 1 s timeout: the test needs a longer generation")
    except openai.APITimeoutError:
        pass
    gave_up = time.time() - t
    r = oai().chat.completions.create(model=ARGS.model, messages=chat_msgs("Short."), max_tokens=4, temperature=0,
                                      extra_body={"ignore_eos": True})
    waited = time.time() - t - gave_up
    assert r.usage.completion_tokens == 4
    assert metric("sluice_generations_cancelled_total") == cancelled + 1
    spent = metric("sluice_generated_tokens_total") - before - 4
    assert spent < big / 2, (spent, big)
    # Cancelled within a token or so of the client leaving, the next reply takes milliseconds;
    # 3 s is generous, yet well under what finishing the abandoned generation would take.
    assert waited < 3.0, waited
    print(f"    (next request answered {waited:.2f}s after the client gave up; cancelled after {spent:.0f} of {big} tokens)")


@check
def half_close_non_stream_cancels():
    # A client that sends its request and shuts its write side (FIN) is taken as gone too.
    big = ARGS.ctx - 64
    before = metric("sluice_generated_tokens_total")
    cancelled = metric("sluice_generations_cancelled_total")
    u = urllib.parse.urlparse(ARGS.base)
    body = json.dumps({"model": ARGS.model, "messages": chat_msgs("Go on forever."), "max_tokens": big,
                       "temperature": 0, "ignore_eos": True}).encode()
    s = socket.create_connection((u.hostname, u.port), timeout=30)
    s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
              + b"Authorization: Bearer " + ARGS.key.encode() + b"\r\n"
              + b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
    time.sleep(0.3)
    s.shutdown(socket.SHUT_WR)
    t = time.time()
    reply = s.recv(65536)  # the server closes without a reply: b""
    s.close()
    assert reply == b"", reply[:200]
    generous_wait_for_idle(3.0)
    print(f"    (generator idle {time.time() - t:.2f}s after the half-close)")
    assert metric("sluice_generations_cancelled_total") == cancelled + 1
    spent = metric("sluice_generated_tokens_total") - before
    assert spent < big / 2, (spent, big)


# --- Anthropic ----------------------------------------------------------------------------


@check
def messages_non_stream_and_stream_agree():
    c = anth()
    # Sampling fields go in extra_body: recent anthropic clients no longer take `temperature`.
    kw = dict(model=ARGS.model, max_tokens=10, system="Be brief.",
              messages=[{"role": "user", "content": "Hello there"}], extra_body={"ignore_eos": True, "temperature": 0})
    m = c.messages.create(**kw)
    assert m.type == "message" and m.role == "assistant" and m.stop_reason == "max_tokens", m
    assert m.content[0].type == "text" and m.content[0].text
    assert m.usage.output_tokens == 10 and m.usage.input_tokens + (m.usage.cache_read_input_tokens or 0) > 5
    with c.messages.stream(**kw) as s:
        events = [e.type for e in s]
        final = s.get_final_message()
    assert final.content[0].text == m.content[0].text, (final.content, m.content)
    assert final.stop_reason == "max_tokens"
    for want in ("message_start", "content_block_start", "content_block_stop", "message_delta", "message_stop"):
        assert want in events, (want, events)
    n = c.messages.count_tokens(model=ARGS.model, system="Be brief.", messages=[{"role": "user", "content": "Hello there"}])
    assert n.input_tokens == m.usage.input_tokens + (m.usage.cache_read_input_tokens or 0), (n, m.usage)


@check
def messages_stop_sequence_and_blocks():
    c = anth()
    base = dict(model=ARGS.model, max_tokens=20, extra_body={"ignore_eos": True, "temperature": 0},
                messages=[{"role": "user", "content": [{"type": "text", "text": "Count"}]}])
    full = c.messages.create(**base).content[0].text
    stop = full[3:5]
    m = c.messages.create(stop_sequences=[stop], **base)
    assert m.stop_reason == "stop_sequence" and m.stop_sequence == stop, m
    assert m.content[0].text == full[: full.find(stop)]
    # Tool use and tool result blocks go through the template.
    tools = [{"name": "lookup", "description": "Look up", "input_schema": {"type": "object", "properties": {}}}]
    msgs = [
        {"role": "user", "content": "Look it up"},
        {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_1", "name": "lookup", "input": {"q": "x"}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "found"}]},
    ]
    r = c.messages.create(model=ARGS.model, max_tokens=3, tools=tools, messages=msgs, extra_body={"temperature": 0})
    assert r.stop_reason in ("end_turn", "max_tokens", "tool_use")


@check
def reasoning_is_split_off_alike_everywhere():
    """The built-in model's template (DeepSeek-V3.1's) opens `<think>` when thinking is on: the
    reply's text up to `</think>` is reasoning (`reasoning_content`, Anthropic `thinking`
    blocks), the rest content, as llama-server splits it; `reasoning_format: none` gives the
    raw text; streamed and whole replies and both APIs agree."""
    c = oai()
    msgs = chat_msgs("Why is the sky blue?")
    kw = dict(model=ARGS.model, messages=msgs, max_tokens=16, temperature=0)
    think = {"ignore_eos": True, "chat_template_kwargs": {"thinking": True}}
    raw = c.chat.completions.create(**kw, extra_body=dict(think, reasoning_format="none")).choices[0].message
    text = raw.content
    assert not (raw.model_extra or {}).get("reasoning_content"), raw
    m = c.chat.completions.create(**kw, extra_body=think).choices[0].message
    r, content = (m.model_extra or {}).get("reasoning_content", ""), m.content or ""
    if "</think>" in text:
        want_r, want_c = text.split("</think>", 1)[0].strip(), text.split("</think>", 1)[1].lstrip()
    else:
        want_r, want_c = text.strip(), ""
    assert (r, content) == (want_r, want_c), (r, content, text)
    assert r, "the reply starts inside the opened block"
    chunks = list(c.chat.completions.create(**kw, stream=True, extra_body=think))
    deltas = [k.choices[0].delta for k in chunks if k.choices]
    sr = "".join((d.model_extra or {}).get("reasoning_content") or "" for d in deltas)
    sc = "".join(d.content or "" for d in deltas)
    assert (sr, sc) == (r, content), (sr, sc, r, content)
    # Thinking off: the template closes the block, everything is content.
    off = c.chat.completions.create(**kw, extra_body={"ignore_eos": True}).choices[0].message
    assert not (off.model_extra or {}).get("reasoning_content") and off.content, off

    a = anth()
    system = [m["content"] for m in msgs if m["role"] == "system"]
    turns = [m for m in msgs if m["role"] != "system"]
    akw = dict(model=ARGS.model, max_tokens=16, messages=turns, thinking={"type": "enabled", "budget_tokens": 1024},
               extra_body={"ignore_eos": True, "temperature": 0}, **({"system": system[0]} if system else {}))
    msg = a.messages.create(**akw)
    assert msg.content[0].type == "thinking" and msg.content[0].thinking == r, msg.content
    texts = [b.text for b in msg.content if b.type == "text"]
    assert "".join(texts) == content, (texts, content)
    with a.messages.stream(**akw) as s:
        for _ in s:
            pass
        final = s.get_final_message()
    assert [b.type for b in final.content] == [b.type for b in msg.content], final.content
    assert final.content[0].thinking == r, final.content


# --- Bad input: the right 4xx, the right error shape, and the server keeps serving --------


def expect_openai(exc_type, fn, status, param=None, code=None):
    try:
        fn()
    except exc_type as e:
        assert e.status_code == status, (e.status_code, e)
        err = openai_error(e)
        assert set(err) >= {"message", "type", "param", "code"}, err
        if param:
            assert err["param"] == param, err
        if code:
            assert err["code"] == code, err
        return
    raise AssertionError(f"no {exc_type.__name__}")


@check
def bad_input_openai():
    c = oai()
    ok = dict(model=ARGS.model, messages=chat_msgs(), max_tokens=2)
    # Malformed JSON.
    st, body = raw("POST", "/v1/chat/completions", b'{"model": "x", "messages": [')
    assert st == 400 and body["error"]["type"] == "invalid_request_error" and "JSON" in body["error"]["message"], body
    st, body = raw("POST", "/v1/chat/completions", b"[1, 2]")
    assert st == 400 and "error" in body, body
    # Missing fields.
    expect_openai(openai.BadRequestError, lambda: c.chat.completions.create(model=ARGS.model, messages=[]), 400, "messages")
    st, body = raw("POST", "/v1/chat/completions", json.dumps({"model": ARGS.model}).encode())
    assert st == 400 and body["error"]["param"] == "messages", body
    st, body = raw("POST", "/v1/chat/completions", json.dumps({"messages": chat_msgs()}).encode())
    assert st == 400 and body["error"]["param"] == "model", body
    expect_openai(openai.BadRequestError, lambda: c.completions.create(model=ARGS.model, prompt=None), 400, "prompt")
    # Wrong types and ranges.
    expect_openai(openai.BadRequestError, lambda: c.chat.completions.create(**ok, temperature="hot"), 400, "temperature")
    expect_openai(openai.BadRequestError, lambda: c.chat.completions.create(**{**ok, "max_tokens": -3}), 400, "max_tokens")
    expect_openai(openai.BadRequestError, lambda: c.chat.completions.create(**ok, stop=5), 400, "stop")
    expect_openai(openai.BadRequestError, lambda: c.chat.completions.create(**ok, top_p=7), 400, "top_p")
    expect_openai(openai.BadRequestError, lambda: c.chat.completions.create(model=ARGS.model, messages="hi"), 400, "messages")
    expect_openai(openai.BadRequestError, lambda: c.chat.completions.create(model=ARGS.model, messages=[{"role": "wizard", "content": "x"}]), 400, "messages")
    expect_openai(openai.BadRequestError, lambda: c.chat.completions.create(**ok, stream="yes"), 400, "stream")
    # Unsupported, not ignored.
    expect_openai(openai.BadRequestError, lambda: c.chat.completions.create(**ok, n=2), 400, "n")
    expect_openai(openai.BadRequestError, lambda: c.chat.completions.create(**ok, logprobs=True), 400, "logprobs")
    # Unknown model.
    expect_openai(openai.NotFoundError, lambda: c.chat.completions.create(**{**ok, "model": "gpt-17"}), 404, "model", "model_not_found")
    expect_openai(openai.NotFoundError, lambda: c.models.retrieve("gpt-17"), 404)
    # Prompt over the context.
    long = "river " * (ARGS.ctx + 50)
    expect_openai(openai.BadRequestError, lambda: c.completions.create(model=ARGS.model, prompt=long, max_tokens=2), 400, code="context_length_exceeded")
    expect_openai(openai.BadRequestError, lambda: c.chat.completions.create(model=ARGS.model, messages=chat_msgs(long), max_tokens=2), 400, code="context_length_exceeded")
    # Too-large body.
    huge = "x" * (ARGS.max_body + 1000)
    expect_openai(openai.APIStatusError, lambda: c.chat.completions.create(model=ARGS.model, messages=chat_msgs(huge)), 413)
    # Bad or missing API key.
    expect_openai(openai.AuthenticationError, lambda: oai("wrong-key").models.list(), 401)
    expect_openai(openai.AuthenticationError, lambda: oai("wrong-key").chat.completions.create(**ok), 401)
    st, body = raw("GET", "/v1/models", auth=False)
    assert st == 401 and body["error"]["type"] == "authentication_error", body
    # Routes and methods.
    st, body = raw("GET", "/v1/nothing")
    assert st == 404 and "error" in body, body
    st, body = raw("GET", "/v1/chat/completions")
    assert st == 405 and "error" in body, body
    # Still serving.
    assert c.chat.completions.create(**ok).choices[0].message.content is not None


def expect_anthropic(exc_type, fn, status):
    try:
        fn()
    except exc_type as e:
        assert e.status_code == status, (e.status_code, e)
        assert isinstance(e.body, dict) and e.body.get("type") == "error", e.body
        assert set(e.body["error"]) >= {"type", "message"}, e.body
        return e.body["error"]
    raise AssertionError(f"no {exc_type.__name__}")


@check
def bad_input_anthropic():
    c = anth()
    msgs = [{"role": "user", "content": "hi"}]
    st, body = raw("POST", "/v1/messages", b"{not json", headers={"x-api-key": ARGS.key}, auth=False)
    assert st == 400 and body["type"] == "error" and body["error"]["type"] == "invalid_request_error", body
    err = expect_anthropic(anthropic.BadRequestError, lambda: c.messages.create(model=ARGS.model, messages=msgs, max_tokens=None), 400)
    assert "max_tokens" in err["message"], err
    expect_anthropic(anthropic.BadRequestError, lambda: c.messages.create(model=ARGS.model, messages=[], max_tokens=4), 400)
    expect_anthropic(anthropic.BadRequestError, lambda: c.messages.create(model=ARGS.model, messages=msgs, max_tokens="four"), 400)
    expect_anthropic(anthropic.BadRequestError, lambda: c.messages.create(model=ARGS.model, messages=[{"role": "system", "content": "x"}], max_tokens=4), 400)
    expect_anthropic(anthropic.BadRequestError, lambda: c.messages.create(model=ARGS.model, messages=[{"role": "user", "content": [{"type": "image", "source": {}}]}], max_tokens=4), 400)
    expect_anthropic(anthropic.NotFoundError, lambda: c.messages.create(model="claude-nine", messages=msgs, max_tokens=4), 404)
    long = "river " * (ARGS.ctx + 50)
    expect_anthropic(anthropic.BadRequestError, lambda: c.messages.create(model=ARGS.model, messages=[{"role": "user", "content": long}], max_tokens=4), 400)
    huge = "x" * (ARGS.max_body + 1000)
    err = expect_anthropic(anthropic.APIStatusError, lambda: c.messages.create(model=ARGS.model, messages=[{"role": "user", "content": huge}], max_tokens=4), 413)
    assert err["type"] == "request_too_large", err
    err = expect_anthropic(anthropic.AuthenticationError, lambda: anth("nope").messages.create(model=ARGS.model, messages=msgs, max_tokens=4), 401)
    assert err["type"] == "authentication_error", err
    assert c.messages.create(model=ARGS.model, messages=msgs, max_tokens=2).content


@check
def health_and_metrics():
    st, body = raw("GET", "/health", auth=False)
    assert st == 200 and body["status"] == "ok", body
    for name in ("sluice_generated_tokens_total", "sluice_queue_length", "sluice_decode_tokens_per_second",
                 "sluice_prompt_tokens_reused_total", "sluice_generations_cancelled_total"):
        metric(name)
    _, text = raw("GET", "/metrics", auth=False)
    assert 'sluice_requests_total{route="/v1/chat/completions",status="400"}' in text, text
    assert metric("sluice_queue_length") == 0


def main():
    global ARGS
    ap = argparse.ArgumentParser()
    ap.add_argument("--base", required=True)
    ap.add_argument("--key", required=True)
    ap.add_argument("--model", required=True)
    ap.add_argument("--ctx", type=int, required=True)
    ap.add_argument("--max-body", type=int, required=True)
    ap.add_argument("-k", default="", help="run only checks whose name contains this")
    ARGS = ap.parse_args()
    print(f"openai {openai.__version__}, anthropic {anthropic.__version__}")
    passed = failed = 0
    for fn in CHECKS:
        if ARGS.k not in fn.__name__:
            continue
        t = time.time()
        try:
            fn()
            passed += 1
            print(f"ok   {fn.__name__} ({time.time() - t:.2f}s)")
        except Exception:
            failed += 1
            print(f"FAIL {fn.__name__}")
            traceback.print_exc()
    print(f"{passed} passed, {failed} failed")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
