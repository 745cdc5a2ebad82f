"""Prompt logprobs and echo through a real server and worker, against transformers' log-softmax over the same prompt.

The checkpoint is float32 and random (sharpened, so that logprobs spread), served on the CPU; the reference is
transformers' own model on the same files. Each prompt logprob must be within TOLERANCE of the reference, for a
prompt computed in one prefill, in chunks (a server with a small --max-num-batched-tokens), and with a cached
prefix present (prefix caching is on by default). The log-likelihood requests are shaped as lm-evaluation-harness
sends them through the openai SDK: echo, max_tokens 0, logprobs 1, one prompt or a batch.
"""

from __future__ import annotations

import json
from pathlib import Path

import openai
import pytest
import torch
import transformers

from server.generation.tokenizer import Tokenizer

from helpers.running_server import RunningServer, start_server, stop_server
from helpers.tiny_tokenizer import make_served_checkpoint

MODEL = "tiny"
TOLERANCE = 1e-4
CHUNK_TOKENS = 8  # the chunked server's --max-num-batched-tokens: a prompt of dozens of tokens takes several steps
CHUNKED_MAX_LOGPROBS = 5
PROMPTS = ["O Romeo, Romeo! wherefore art thou Romeo?",
           "The quick brown fox jumps over the lazy dog.",
           "Emoji and other scripts: 😀 你好，世界！ café naïve."]
LONG_PREFIX = ("Once upon a time there was a small model that answered questions. It said hello to the user, "
               "counted one, two, three, four, five, and told a story about the sea. ") * 2


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    return make_served_checkpoint(tmp_path_factory.mktemp("checkpoint"), sharpen=4.0)


@pytest.fixture(scope="module")
def reference(checkpoint):
    """prompt token ids -> [log P(prompt[p] | prompt[:p]) over the vocabulary, for p = 1 .. len - 1], by
    transformers."""
    model = transformers.AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()

    def log_softmax(token_ids: list[int]) -> torch.Tensor:
        with torch.no_grad():
            logits = model(torch.tensor([token_ids])).logits[0, :-1]  # [num_tokens - 1, vocab_size]
        return torch.log_softmax(logits.double(), dim=-1)  # [num_tokens - 1, vocab_size]

    return log_softmax


@pytest.fixture(scope="module")
def tokenizer(checkpoint) -> Tokenizer:
    return Tokenizer.from_dir(checkpoint)


@pytest.fixture(scope="module")
def server(tmp_path_factory, checkpoint) -> RunningServer:
    running = start_server(tmp_path_factory.mktemp("server"), checkpoint, "--served-model-name", MODEL,
                           "--device", "cpu", "--dtype", "float32", "--standby-workers", "0")
    yield running
    stop_server(running)


@pytest.fixture(scope="module")
def chunked_server(tmp_path_factory, checkpoint) -> RunningServer:
    running = start_server(tmp_path_factory.mktemp("chunked"), checkpoint, "--served-model-name", MODEL,
                           "--device", "cpu", "--dtype", "float32", "--standby-workers", "0",
                           "--max-num-batched-tokens", str(CHUNK_TOKENS),
                           "--max-logprobs", str(CHUNKED_MAX_LOGPROBS))
    yield running
    stop_server(running)


def assert_offsets_match_text(tokenizer: Tokenizer, text: str, tokens: list[str], offsets: list[int],
                              token_ids: list[int]) -> None:
    """text_offset never decreases and stays within the text; each token is its stretch of the text (from its offset
    to the next token's), or, where it has none (a BOS, a character's first bytes), the token as spelled alone."""
    assert offsets == sorted(offsets) and offsets[0] == 0 and offsets[-1] <= len(text)
    ends = [*offsets[1:], len(text)]
    assert tokens == [text[start:end] or tokenizer.token_text(token_id)
                      for token_id, start, end in zip(token_ids, offsets, ends)]


def assert_token_logprobs(token_logprobs: list, token_ids: list[int], expected: torch.Tensor) -> None:
    """Completions' token_logprobs of an echoed prompt: null, then each token's logprob as transformers has it."""
    assert token_logprobs[0] is None and len(token_logprobs) == len(token_ids)
    assert None not in token_logprobs[1:], f"prompt positions without a logprob: {token_logprobs}"
    want = expected.gather(1, torch.tensor(token_ids[1:])[:, None])[:, 0].tolist()
    assert max(abs(got - w) for got, w in zip(token_logprobs[1:], want)) < TOLERANCE, (token_logprobs[1:], want)


def assert_vllm_prompt_logprobs(prompt_logprobs: list, token_ids: list[int], k: int, expected: torch.Tensor) -> None:
    """vLLM's prompt_logprobs: null, then per position the prompt token with its rank and the top k, each logprob
    as transformers has it."""
    assert prompt_logprobs[0] is None and len(prompt_logprobs) == len(token_ids)
    for position, entry in enumerate(prompt_logprobs[1:], start=1):
        assert entry is not None, f"prompt position {position} has no prompt logprobs"
        row = expected[position - 1]  # [vocab_size]
        token_id = token_ids[position]
        top_ids = torch.topk(row, k).indices.tolist()
        assert set(entry) == {str(t) for t in [token_id, *top_ids]}, (position, entry, top_ids)
        rank = 1 + int((row > row[token_id]).sum())
        assert entry[str(token_id)]["rank"] == rank
        assert [entry[str(t)]["rank"] for t in top_ids if t != token_id] == [
            r for r, t in enumerate(top_ids, start=1) if t != token_id]
        for key, value in entry.items():
            assert abs(value["logprob"] - row[int(key)].item()) < TOLERANCE, (position, key)


# ---------------------------------------------------------------------------------------------- shapes (no values)

def test_echo_with_max_tokens_0_returns_the_prompt_alone(server, tokenizer):
    client = server.client()
    result = client.completions.create(model=MODEL, prompt=PROMPTS[2], echo=True, max_tokens=0, logprobs=1)
    choice = result.choices[0]
    token_ids = tokenizer.encode(PROMPTS[2])
    assert (choice.text, choice.finish_reason) == (PROMPTS[2], "length")
    assert (result.usage.prompt_tokens, result.usage.completion_tokens) == (len(token_ids), 0)
    assert choice.logprobs is not None and choice.logprobs.tokens is not None and choice.logprobs.text_offset
    assert_offsets_match_text(tokenizer, choice.text, choice.logprobs.tokens, choice.logprobs.text_offset, token_ids)
    plain = client.completions.create(model=MODEL, prompt=PROMPTS[0], echo=True, max_tokens=0)
    assert (plain.choices[0].text, plain.choices[0].logprobs) == (PROMPTS[0], None)
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=0)
    assert info.value.body["param"] == "max_tokens" and "echo" in info.value.body["message"]


def test_a_token_id_prompt_is_echoed_as_its_decode_with_matching_offsets(server, tokenizer):
    token_ids = tokenizer.encode(PROMPTS[2])  # with the BOS
    result = server.post_ok("/v1/completions", {"model": MODEL, "prompt": token_ids, "echo": True, "max_tokens": 3,
                                              "logprobs": 0, "temperature": 0})
    choice = result["choices"][0]
    prompt_text = tokenizer.decode(token_ids)
    assert choice["text"].startswith(prompt_text)
    logprobs = choice["logprobs"]
    num = len(token_ids)
    assert_offsets_match_text(tokenizer, prompt_text, logprobs["tokens"][:num], logprobs["text_offset"][:num],
                              token_ids)
    generated = logprobs["text_offset"][num:]
    assert generated[0] == len(prompt_text) and generated == sorted(generated)  # the output follows the prompt


def test_the_streamed_echo_is_one_chunk_with_the_prompt_then_the_output(server):
    body = {"model": MODEL, "prompt": PROMPTS[0], "echo": True, "logprobs": 1, "temperature": 0, "stream": True}
    whole = server.post_ok("/v1/completions", {**body, "stream": False, "max_tokens": 4})["choices"][0]
    status, _, raw = server.request("POST", "/v1/completions", {**body, "max_tokens": 4})
    assert status == 200
    chunks = [json.loads(line[6:])["choices"][0] for line in raw.decode().splitlines() if line.startswith("data: {")]
    assert chunks[0]["text"] == PROMPTS[0] and chunks[0]["logprobs"]["token_logprobs"][0] is None
    assert "".join(c["text"] for c in chunks) == whole["text"]
    streamed = [x for c in chunks if c["logprobs"] for x in c["logprobs"]["token_logprobs"]]
    assert streamed == whole["logprobs"]["token_logprobs"]
    status, _, raw = server.request("POST", "/v1/completions", {**body, "max_tokens": 0})
    chunks = [json.loads(line[6:])["choices"][0] for line in raw.decode().splitlines() if line.startswith("data: {")]
    assert [(c["text"], c["finish_reason"]) for c in chunks] == [(PROMPTS[0], None), ("", "length")]


def test_max_logprobs_bounds_every_field(chunked_server, server):
    over = CHUNKED_MAX_LOGPROBS + 1
    for path, body, param in [
        ("/v1/completions", {"prompt": "x", "logprobs": over}, "logprobs"),
        ("/v1/completions", {"prompt": "x", "prompt_logprobs": over}, "prompt_logprobs"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "logprobs": True,
                                  "top_logprobs": over}, "top_logprobs"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "prompt_logprobs": over},
         "prompt_logprobs"),
    ]:
        status, _, raw = chunked_server.request("POST", path, {"model": MODEL, "max_tokens": 1, **body})
        error = json.loads(raw)["error"]
        assert (status, error["param"]) == (400, param) and f"at most {CHUNKED_MAX_LOGPROBS}" in error["message"]
    status, _, raw = server.request("POST", "/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 1,
                                                               "logprobs": 20})
    assert status == 200, raw  # the default --max-logprobs, as vLLM's


# ---------------------------------------------------------------------------------------------- values

def test_lm_eval_loglikelihood_request_matches_transformers(server, tokenizer, reference):
    client = server.client()
    result = client.completions.create(model=MODEL, prompt=PROMPTS[0], echo=True, max_tokens=0, logprobs=1,
                                       temperature=0)
    choice = result.choices[0]
    token_ids = tokenizer.encode(PROMPTS[0])
    assert choice.text == PROMPTS[0] and choice.logprobs is not None
    assert choice.logprobs.token_logprobs is not None and choice.logprobs.top_logprobs is not None
    assert_token_logprobs(choice.logprobs.token_logprobs, token_ids, reference(token_ids))
    for position, top in enumerate(choice.logprobs.top_logprobs[1:], start=1):
        assert top is not None and tokenizer.token_text(token_ids[position]) in top and len(top) <= 2


def test_lm_eval_batch_of_prompts_matches_transformers(server, tokenizer, reference):
    """lm-evaluation-harness sends a batch of contexts + continuations in one request, as texts or token ids."""
    client = server.client()
    id_prompts = [tokenizer.encode(p) for p in PROMPTS]
    for prompts in (PROMPTS, id_prompts):
        result = client.completions.create(model=MODEL, prompt=prompts, echo=True, max_tokens=0, logprobs=1,
                                           temperature=0)
        assert len(result.choices) == len(PROMPTS)
        for choice, token_ids in zip(sorted(result.choices, key=lambda c: c.index), id_prompts):
            assert choice.logprobs is not None and choice.logprobs.token_logprobs is not None
            assert choice.logprobs.text_offset is not None and choice.logprobs.tokens is not None
            assert_token_logprobs(choice.logprobs.token_logprobs, token_ids, reference(token_ids))
            assert_offsets_match_text(tokenizer, choice.text, choice.logprobs.tokens, choice.logprobs.text_offset,
                                      token_ids)


def test_prompt_logprobs_in_one_prefill_match_transformers(server, tokenizer, reference):
    k = 3
    for prompt in PROMPTS:
        token_ids = tokenizer.encode(prompt)
        choice = server.post_ok("/v1/completions", {"model": MODEL, "prompt": prompt, "max_tokens": 2,
                                                  "prompt_logprobs": k})["choices"][0]
        assert_vllm_prompt_logprobs(choice["prompt_logprobs"], token_ids, k, reference(token_ids))
    chat = server.post_ok("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": PROMPTS[0]}],
                                                 "max_tokens": 2, "prompt_logprobs": k})
    chat_ids = server.post_ok("/tokenize", {"model": MODEL, "messages": [{"role": "user", "content": PROMPTS[0]}]})
    assert_vllm_prompt_logprobs(chat["prompt_logprobs"], chat_ids["tokens"], k, reference(chat_ids["tokens"]))


def test_prompt_logprobs_in_chunks_match_transformers(chunked_server, tokenizer, reference):
    prompt = LONG_PREFIX + PROMPTS[1]
    token_ids = tokenizer.encode(prompt)
    assert len(token_ids) > 4 * CHUNK_TOKENS  # several chunks
    choice = chunked_server.post_ok("/v1/completions", {"model": MODEL, "prompt": prompt, "max_tokens": 2,
                                                      "prompt_logprobs": 2})["choices"][0]
    assert_vllm_prompt_logprobs(choice["prompt_logprobs"], token_ids, 2, reference(token_ids))
    echoed = chunked_server.post_ok("/v1/completions", {"model": MODEL, "prompt": prompt, "max_tokens": 0,
                                                      "echo": True, "logprobs": 1})["choices"][0]
    assert_token_logprobs(echoed["logprobs"]["token_logprobs"], token_ids, reference(token_ids))


def test_prompt_logprobs_with_a_cached_prefix_match_transformers(server, tokenizer, reference):
    """The first request leaves LONG_PREFIX's blocks in the prefix cache; the second, which shares them, still gets
    the logprobs of every one of its prompt positions."""
    server.post_ok("/v1/completions", {"model": MODEL, "prompt": LONG_PREFIX + PROMPTS[0], "max_tokens": 1})
    prompt = LONG_PREFIX + PROMPTS[2]
    token_ids = tokenizer.encode(prompt)
    choice = server.post_ok("/v1/completions", {"model": MODEL, "prompt": prompt, "max_tokens": 1,
                                              "prompt_logprobs": 1})["choices"][0]
    assert_vllm_prompt_logprobs(choice["prompt_logprobs"], token_ids, 1, reference(token_ids))
    echoed = server.post_ok("/v1/completions", {"model": MODEL, "prompt": prompt, "max_tokens": 0, "echo": True,
                                              "logprobs": 1})["choices"][0]
    assert_token_logprobs(echoed["logprobs"]["token_logprobs"], token_ids, reference(token_ids))



def test_n_choices_each_show_their_prompts_logprobs(server, tokenizer, reference):
    """vLLM's shape, prompt_logprobs on every choice, though only the prompt's first choice computes them (its
    siblings' requests to the engine ask for none, so a prefix cache may serve their prompts): each choice, echoed
    or not, shows the prompt's logprobs whole."""
    k, n = 2, 3
    token_ids = tokenizer.encode(PROMPTS[1])
    for echo in (False, True):
        body = {"model": MODEL, "prompt": [PROMPTS[1]], "n": n, "max_tokens": 2, "prompt_logprobs": k,
                "temperature": 1.0, "seed": 7}
        if echo:
            body.update(echo=True, logprobs=1)
        choices = server.post_ok("/v1/completions", body)["choices"]
        assert len(choices) == n
        for choice in choices:
            assert_vllm_prompt_logprobs(choice["prompt_logprobs"], token_ids, k, reference(token_ids))
            if echo:
                assert_token_logprobs(choice["logprobs"]["token_logprobs"][:len(token_ids)], token_ids,
                                      reference(token_ids))
