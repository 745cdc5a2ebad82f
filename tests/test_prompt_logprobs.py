"""Prompt logprobs and echo in the frontend, without a worker: the echoed prompt's text offsets, RequestState's
positions (kept once, gaps refused), what a re-sent request asks for, --max-logprobs, max_tokens 0, and the
response shapes (completions' echoed logprobs lists, vLLM's prompt_logprobs).

The values against transformers, through a real server and worker: test_prompt_logprobs_e2e.py.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math

import pytest
import tokenizers
from test_openai_api import ADMISSION, FakeConnection, fake_handlers
from test_openai_api import post as fake_post
from tokenizers import processors

from server.__main__ import build_parser, max_logprobs_from_args
from server.api.completions.format import MIN_LOGPROB, ChatFormat, CompletionFormat, prompt_logprobs
from server.api.completions.params import parse_chat_request, parse_completion_request
from server.generation.choice_output import ChoiceOutput
from server.generation.echoed_prompt import EchoedPrompt, decoded_prompt
from server.generation.request import DEFAULT_MAX_LOGPROBS
from server.generation.service import GenerationService
from server.generation.tokenizer import Tokenizer, token_starts
from server.http.errors import ApiError
from server.http.server import Responder
from server.worker.engine_client import EngineClient
from server.worker.in_flight import InFlightRequests
from server.worker.request_state import RequestState
from server.worker.runtime_dir import RuntimeDir
from shared.config import EngineConfig
from shared.logprobs import TokenLogprobs
from shared.protocol import Abort, EngineStats, Message, Outputs, RequestUpdate, decode, encode
from shared.sampling_params import SamplingParams

from helpers.tiny_tokenizer import BOS_TOKEN, build_tokenizer, write_tokenizer

UNK, BOS = 0, 1
MULTI_BYTE = "héllo 你好 🦀x"  # 🦀 is not in the tokenizer's corpus: it splits into byte tokens


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory) -> Tokenizer:
    """The test tokenizer: add_bos_token in its config, no post-processor (the BOS is prepended by Tokenizer)."""
    path = tmp_path_factory.mktemp("tokenizer")
    write_tokenizer(path)
    return Tokenizer.from_dir(path)


def post_processor_tokenizer() -> Tokenizer:
    """The same vocabulary with the BOS added by tokenizer.json's post-processor, as Llama 3's."""
    inner = build_tokenizer()
    inner.post_processor = processors.TemplateProcessing(single=f"{BOS_TOKEN} $A", special_tokens=[(BOS_TOKEN, BOS)])
    return Tokenizer(inner, {"bos_token": BOS_TOKEN, "eos_token": "</s>"})


def assert_consistent(tokenizer: Tokenizer, text: str, token_ids: list[int], offsets: list[int]) -> None:
    """Offsets never decrease, stay within the text, and each whole token's text is found where it starts, both as
    the tokenizer spells it and as the logprobs lists show it."""
    assert len(offsets) == len(token_ids)
    assert offsets == sorted(offsets) and 0 <= offsets[0] and offsets[-1] <= len(text)
    shown = EchoedPrompt(text, token_ids, offsets).token_strings(tokenizer)
    for token_id, offset, token in zip(token_ids, offsets, shown):
        piece = tokenizer.token_text(token_id)
        if tokenizer.is_special(token_id):
            continue
        if "\ufffd" not in piece and offset:  # a token that ends inside a character starts where that character does
            assert text[offset:].startswith(piece), (token_id, piece, offset, text)
        if "\ufffd" not in token:
            assert text[offset:].startswith(token), (token_id, token, offset, text)


def sentencepiece_style_tokenizer() -> Tokenizer:
    """A BPE laid out as Llama 2's and Mistral's tokenizer.json: "▁" for a space, a space prepended to the text,
    and a decoder that strips the text's first space (so a word's token decoded alone loses its space)."""
    inner = tokenizers.Tokenizer(tokenizers.models.BPE(unk_token="<unk>", byte_fallback=True))
    inner.normalizer = tokenizers.normalizers.Sequence([tokenizers.normalizers.Prepend("▁"),
                                                        tokenizers.normalizers.Replace(" ", "▁")])
    inner.pre_tokenizer = tokenizers.pre_tokenizers.Split("▁", behavior="merged_with_next")
    inner.decoder = tokenizers.decoders.Sequence([tokenizers.decoders.Replace("▁", " "),
                                                  tokenizers.decoders.ByteFallback(), tokenizers.decoders.Fuse(),
                                                  tokenizers.decoders.Strip(" ", 1, 0)])
    trainer = tokenizers.trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>", "<s>", "</s>"],
                                             show_progress=False)
    inner.train_from_iterator(["O Romeo, Romeo! wherefore art thou Romeo? a b c the fox"] * 20, trainer=trainer)
    return Tokenizer(inner, {"bos_token": "<s>", "eos_token": "</s>", "add_bos_token": True})


def test_a_sentencepiece_style_tokenizer_shows_each_word_with_its_space_where_its_offset_says():
    tokenizer = sentencepiece_style_tokenizer()
    text = "O Romeo, Romeo! wherefore"
    ids, offsets = tokenizer.encode_with_offsets(text)
    assert tokenizer.token_text(ids[2]) == " Romeo,"  # alone, the decoder would strip its space
    assert_consistent(tokenizer, text, ids, offsets)
    echoed = decoded_prompt(tokenizer, ids)
    assert echoed.text == text
    assert_consistent(tokenizer, echoed.text, ids, echoed.text_offsets)
    assert echoed.token_strings(tokenizer)[:3] == ["<s>", "O", " Romeo,"]


# ---------------------------------------------------------------------------------------------- text offsets

def test_token_starts_gives_an_added_token_the_start_of_the_text_after_it():
    assert token_starts([0, 0, 3], [True, False, False], 5) == [0, 0, 3]
    assert token_starts([0, 0, 2, 0], [False, False, False, True], 4) == [0, 0, 2, 4]  # a trailing EOS: the end
    assert token_starts([0, 3, 2, 5], [False, False, False, False], 6) == [0, 3, 3, 5]  # never backwards


@pytest.mark.parametrize("text", ["O Romeo, Romeo!", MULTI_BYTE, "a<s>b", " leading and trailing "])
def test_a_text_prompt_is_echoed_as_sent_with_the_bos_at_the_first_characters_offset(tokenizer, text):
    for tok in (tokenizer, post_processor_tokenizer()):
        ids, offsets = tok.encode_with_offsets(text)
        assert ids == tok.encode(text) and ids[0] == BOS
        assert offsets[:2] == [0, 0]  # the BOS holds no characters: it starts where the first token does
        assert_consistent(tok, text, ids, offsets)
        without_bos, plain_offsets = tok.encode_with_offsets(text, add_special_tokens=False)
        assert without_bos == ids[1:] and plain_offsets == offsets[1:]


def test_a_literal_special_token_in_the_text_keeps_its_characters(tokenizer):
    ids, offsets = tokenizer.encode_with_offsets("a<s>b")
    assert ids == [BOS, ids[1], BOS, ids[3]] and offsets == [0, 0, 1, 4]


@pytest.mark.parametrize("text", ["O Romeo, Romeo!", MULTI_BYTE, "🦀"])
def test_a_token_id_prompt_is_echoed_as_its_decode_with_each_piece_at_its_offset(tokenizer, text):
    token_ids = tokenizer.encode(text)  # with the BOS, which the decode skips
    echoed = decoded_prompt(tokenizer, token_ids)
    assert echoed.text == tokenizer.decode(token_ids) == text
    assert echoed.token_ids == token_ids and echoed.text_offsets[:2] == [0, 0]
    assert_consistent(tokenizer, echoed.text, token_ids, echoed.text_offsets)


def test_the_bytes_of_one_character_start_where_it_does(tokenizer):
    token_ids = tokenizer.encode("x🦀", add_special_tokens=False)
    assert len(token_ids) >= 3  # "x" and the crab's bytes
    for echoed in (decoded_prompt(tokenizer, token_ids),
                   EchoedPrompt("x🦀", token_ids, tokenizer.encode_with_offsets("x🦀", False)[1])):
        assert echoed.text_offsets == [0] + [1] * (len(token_ids) - 1), echoed


# ---------------------------------------------------------------------------------------------- RequestState

def entry(token_id: int, logprob: float, rank: int = 1) -> TokenLogprobs:
    return TokenLogprobs(token_id, logprob, [token_id], [logprob], rank=rank)


def test_request_state_keeps_the_first_entry_of_each_position_and_refuses_a_gap():
    state = RequestState("req-7", [5, 6, 7, 8], SamplingParams(max_tokens=1, prompt_logprobs=1))
    state.add_prompt_logprobs(1, [entry(6, -1.0)])
    state.add_prompt_logprobs(1, [entry(6, -9.0), entry(7, -2.0)])  # a recompute sends position 1 again
    assert [lp.logprob for lp in state.prompt_logprobs] == [-1.0, -2.0] and not state.has_all_prompt_logprobs
    with pytest.raises(RuntimeError, match=r"req-7.*position 4.*position 3"):
        state.add_prompt_logprobs(4, [entry(9, -1.0)])
    with pytest.raises(RuntimeError, match=r"req-7.*past the prompt's last position 3"):
        state.add_prompt_logprobs(2, [entry(7, -1.0), entry(8, -1.0), entry(9, -1.0)])
    with pytest.raises(RuntimeError, match=r"req-7.*position 3 are for tokens \[9\], the prompt has \[8\]"):
        state.add_prompt_logprobs(3, [entry(9, -3.0)])
    state.add_prompt_logprobs(3, [entry(8, -3.0)])
    assert [lp.logprob for lp in state.prompt_logprobs] == [-1.0, -2.0, -3.0] and state.has_all_prompt_logprobs


def test_a_request_re_sent_asks_for_its_prompt_logprobs_only_while_some_are_missing():
    in_flight = InFlightRequests(0, [].append)
    state = RequestState("req", [5, 6, 7], SamplingParams(max_tokens=4, prompt_logprobs=2))
    in_flight.add(state)
    state.add_prompt_logprobs(1, [entry(6, -1.0)])
    add = in_flight.add_message(state, with_kv=False)
    assert add is not None and add.params.prompt_logprobs == 2
    state.add_prompt_logprobs(2, [entry(7, -1.0)])
    add = in_flight.add_message(state, with_kv=False)
    assert add is not None and add.params.prompt_logprobs is None and state.params.prompt_logprobs == 2


def test_the_requests_in_flight_take_chunked_prompt_logprobs_from_the_outputs():
    """Two chunks of a prefill, the second sent again from position 1 after a recompute, then the first token: the
    request holds each position once, through the wire codec. A gap fails that request alone, and stops it in the
    worker."""
    sent: list[Message] = []
    in_flight = InFlightRequests(0, sent.append)
    state = RequestState("req", [5, 6, 7, 8], SamplingParams(max_tokens=4, prompt_logprobs=1))
    in_flight.add(state)
    updates = [RequestUpdate("req", [], prompt_logprobs=[entry(6, -1.0)]),
               RequestUpdate("req", [], prompt_logprobs=[entry(6, -7.0), entry(7, -2.0)]),
               RequestUpdate("req", [9], prompt_logprobs=[entry(8, -3.0)], prompt_logprobs_start=3)]
    for update in updates:
        outputs = decode(encode(Outputs(1, "secret", [update], EngineStats())))
        assert isinstance(outputs, Outputs)
        in_flight.route(outputs)
    assert [(lp.token_id, lp.logprob, lp.rank) for lp in state.prompt_logprobs] == [
        (6, -1.0, 1), (7, -2.0, 1), (8, -3.0, 1)]
    assert state.output_token_ids == [9] and state.has_all_prompt_logprobs
    broken = RequestState("broken", [5, 6, 7, 8], SamplingParams(max_tokens=4, prompt_logprobs=1))
    in_flight.add(broken)
    in_flight.route(Outputs(1, "secret", [RequestUpdate("broken", [], prompt_logprobs=[entry(8, -1.0)],
                                                        prompt_logprobs_start=3)], EngineStats()))
    assert broken.error is not None and "broken" in broken.error and "position 3" in broken.error
    assert "broken" not in in_flight and "req" in in_flight  # the others go on
    assert sent == [Abort(("broken",))]


# ---------------------------------------------------------------------------------------------- request fields

@pytest.mark.parametrize("body, param", [
    ({"prompt": "x", "logprobs": 4}, "logprobs"), ({"prompt": "x", "prompt_logprobs": 4}, "prompt_logprobs"),
    ({"prompt": "x", "prompt_logprobs": -1}, "prompt_logprobs"),
])
def test_completions_logprobs_are_bounded_by_max_logprobs(body, param):
    with pytest.raises(ApiError) as info:
        parse_completion_request(body, max_logprobs=3)
    assert (info.value.status, info.value.param) == (400, param)
    if body[param] > 0:
        assert "at most 3" in info.value.message and "--max-logprobs" in info.value.message
    assert parse_completion_request({**body, param: 3}, max_logprobs=3) is not None


def test_chat_top_logprobs_and_prompt_logprobs_are_bounded_by_max_logprobs():
    base = {"messages": [], "logprobs": True}
    for name in ("top_logprobs", "prompt_logprobs"):
        with pytest.raises(ApiError) as info:
            parse_chat_request({**base, name: 4}, max_logprobs=3)
        assert info.value.param == name and "at most 3" in info.value.message
    request = parse_chat_request({**base, "top_logprobs": 20, "prompt_logprobs": 2})
    assert (request.num_logprobs, request.num_prompt_logprobs) == (20, 2)
    assert parse_chat_request(base).num_prompt_logprobs is None


@pytest.mark.asyncio
async def test_the_limit_is_never_above_the_vocabulary(tmp_path, tokenizer):
    """The worker cannot rank more tokens than the vocabulary holds: a higher --max-logprobs stops there."""
    with RuntimeDir.create() as runtime_dir:
        client = EngineClient(EngineConfig(model=str(tmp_path)), runtime_dir.path)
        try:
            for max_logprobs, limit in ((10**6, tokenizer.vocab_size), (None, tokenizer.vocab_size), (7, 7)):
                service = GenerationService(client, tokenizer, "m", None, max_logprobs=max_logprobs)
                assert service.logprobs_limit == limit
        finally:
            await client.close()


def test_the_max_logprobs_flag():
    assert build_parser().parse_args([]).max_logprobs == DEFAULT_MAX_LOGPROBS == 20
    assert max_logprobs_from_args(argparse.Namespace(max_logprobs=5)) == 5
    assert max_logprobs_from_args(argparse.Namespace(max_logprobs=-1)) is None  # the vocabulary's size
    with pytest.raises(ValueError, match="--max-logprobs must be >= 0, or -1"):
        max_logprobs_from_args(argparse.Namespace(max_logprobs=-2))
    assert "--max-logprobs" in build_parser().format_help()


def test_max_tokens_0_takes_echo_and_says_why_otherwise():
    with pytest.raises(ApiError) as info:
        parse_completion_request({"prompt": "x", "max_tokens": 0})
    assert info.value.param == "max_tokens" and "echo" in info.value.message
    request = parse_completion_request({"prompt": "x", "max_tokens": 0, "echo": True, "logprobs": 1})
    assert request.is_prompt_only and (request.num_logprobs, request.num_prompt_logprobs) == (1, 1)
    assert not parse_completion_request({"prompt": "x", "echo": True}).is_prompt_only


def test_prompt_logprobs_come_from_echo_with_logprobs_unless_given():
    assert parse_completion_request({"prompt": "x", "logprobs": 2}).num_prompt_logprobs is None
    assert parse_completion_request({"prompt": "x", "echo": True, "logprobs": 2}).num_prompt_logprobs == 2
    assert parse_completion_request({"prompt": "x", "echo": True, "logprobs": 2,
                                     "prompt_logprobs": 5}).num_prompt_logprobs == 5
    assert parse_completion_request({"prompt": "x", "prompt_logprobs": 0}).num_prompt_logprobs == 0


def test_prompt_logprobs_are_refused_in_a_stream_as_in_vllm():
    with pytest.raises(ApiError) as info:
        parse_completion_request({"prompt": "x", "stream": True, "prompt_logprobs": 1})
    assert info.value.param == "prompt_logprobs" and "stream" in info.value.message
    with pytest.raises(ApiError):
        parse_chat_request({"messages": [], "stream": True, "prompt_logprobs": 1})
    streamed = parse_completion_request({"prompt": "x", "stream": True, "echo": True, "logprobs": 1})
    assert streamed.num_prompt_logprobs == 1  # echo's own prompt logprobs come in the stream's echo chunk


# ---------------------------------------------------------------------------------------------- shapes

def prompt_state(tokenizer: Tokenizer, text: str, num_top: int) -> tuple[RequestState, EchoedPrompt]:
    ids, offsets = tokenizer.encode_with_offsets(text)
    state = RequestState("req", ids, SamplingParams(max_tokens=1, logprobs=num_top, prompt_logprobs=num_top))
    return state, EchoedPrompt(text, ids, offsets)


def fill_prompt_logprobs(state: RequestState) -> None:
    """Position p's token at logprob -p, rank p; its top alternative <unk> (id 0, in no prompt) at -0.5 (position
    2: -inf)."""
    state.add_prompt_logprobs(1, [TokenLogprobs(t, -float(p), [UNK], [-math.inf if p == 2 else -0.5], rank=p)
                                  for p, t in enumerate(state.prompt_token_ids[1:], start=1)])


def test_a_prompt_only_choice_ends_with_length_and_no_tokens(tokenizer):
    state, echoed = prompt_state(tokenizer, "O Romeo", 1)
    out = ChoiceOutput(0, state, tokenizer, is_prompt_only=True)
    assert out.advance() is None
    fill_prompt_logprobs(state)
    state.append([7], [entry(7, -0.1)], "length")
    piece = out.advance()
    assert piece is not None and (piece.text, piece.entries, piece.finish_reason) == ("", [], "length")
    assert out.num_tokens == 0 and out.is_finished
    fmt = CompletionFormat(tokenizer, [echoed], want_logprobs=True, n=1)
    choice = fmt.full_choice(out, "", [])
    assert choice["text"] == "O Romeo" and choice["finish_reason"] == "length"
    assert len(choice["logprobs"]["tokens"]) == len(state.prompt_token_ids)


def test_echoed_logprobs_lead_with_the_prompt_and_its_offsets(tokenizer):
    state, echoed = prompt_state(tokenizer, "O Romeo, Romeo!", 1)
    out = ChoiceOutput(0, state, tokenizer)
    fmt = CompletionFormat(tokenizer, [echoed], want_logprobs=True, n=1)
    assert not fmt.can_start(out)  # the stream's echo chunk waits for the prompt's logprobs
    fill_prompt_logprobs(state)
    assert fmt.can_start(out)
    logprobs = fmt.start_choice(out)["logprobs"]
    num = len(state.prompt_token_ids)
    assert logprobs["tokens"] == [tokenizer.token_text(t) for t in state.prompt_token_ids]
    assert logprobs["token_logprobs"] == [None] + [-float(p) for p in range(1, num)]
    assert logprobs["text_offset"] == echoed.text_offsets and logprobs["text_offset"][0] == 0
    assert logprobs["top_logprobs"][0] is None
    for p in range(1, num):
        top = logprobs["top_logprobs"][p]
        assert top[tokenizer.token_text(state.prompt_token_ids[p])] == -float(p)  # the prompt token itself
        assert top[tokenizer.token_text(UNK)] == (MIN_LOGPROB if p == 2 else -0.5) and len(top) <= 2


def test_vllm_prompt_logprobs_shape(tokenizer):
    state, _ = prompt_state(tokenizer, "O Romeo", 1)
    out = ChoiceOutput(0, state, tokenizer)
    fill_prompt_logprobs(state)
    result = prompt_logprobs(tokenizer, out)
    assert result is not None and result[0] is None and len(result) == len(state.prompt_token_ids)
    for p, position in enumerate(result[1:], start=1):
        token_id = state.prompt_token_ids[p]
        assert position is not None
        assert position[str(token_id)] == {"logprob": -float(p), "rank": p,
                                           "decoded_token": tokenizer.token_text(token_id)}
        assert position[str(UNK)] == {"logprob": MIN_LOGPROB if p == 2 else -0.5, "rank": 1,
                                      "decoded_token": "<unk>"}
    chat = ChatFormat(tokenizer, want_logprobs=False)
    assert chat.response_fields([out]) == {"prompt_logprobs": result}
    unasked = ChoiceOutput(0, RequestState("r", [5, 6], SamplingParams(max_tokens=1)), tokenizer)
    assert prompt_logprobs(tokenizer, unasked) is None and chat.response_fields([unasked]) == {"prompt_logprobs": None}


# ---------------------------------------------------------------------------------------------- handlers, faked engine

def prefill_in_two_chunks(state: RequestState) -> None:
    """The engine as a chunked prefill answers: half the prompt logprobs, then all of them again (a recompute)
    with the first token, then a second token and the end."""
    entries = [entry(t, -float(p)) for p, t in enumerate(state.prompt_token_ids[1:], start=1)]
    half = len(entries) // 2

    def first_chunk() -> None:
        state.add_prompt_logprobs(1, entries[:half])
        state.append([], None, None)

    def last_chunk() -> None:
        state.add_prompt_logprobs(1, entries)
        state.append([40], [entry(40, -0.25)], "length" if state.params.max_tokens == 1 else None)

    loop = asyncio.get_running_loop()
    loop.call_soon(first_chunk)
    loop.call_later(0.01, last_chunk)
    if state.params.max_tokens > 1:
        loop.call_later(0.02, lambda: state.append([41], [entry(41, -0.5)], "length"))


def sse_choices(data: bytes) -> list[dict]:
    return [json.loads(line[6:])["choices"][0] for line in data.split(b"\r\n")
            if line.startswith(b"data: {") and json.loads(line[6:])["choices"]]


@pytest.mark.asyncio
async def test_the_streamed_echo_waits_for_the_prompt_logprobs_then_leads(tokenizer):
    handlers, _ = fake_handlers(tokenizer, prefill_in_two_chunks)
    conn = FakeConnection()
    body = {"prompt": "O Romeo", "echo": True, "logprobs": 1, "max_tokens": 2, "stream": True}
    await handlers.completions(fake_post(body), Responder(conn, "r"), ADMISSION.admit)
    chunks = sse_choices(bytes(conn.data))
    num = len(tokenizer.encode("O Romeo"))
    assert chunks[0]["text"] == "O Romeo"
    assert chunks[0]["logprobs"]["token_logprobs"] == [None] + [-float(p) for p in range(1, num)]
    generated = [c["logprobs"]["token_logprobs"] for c in chunks[1:] if c["logprobs"]]
    assert generated == [[-0.25], [-0.5]] and chunks[-1]["finish_reason"] == "length"


@pytest.mark.asyncio
async def test_max_tokens_0_asks_the_engine_for_one_token_and_returns_the_prompt_alone(tokenizer):
    handlers, engine = fake_handlers(tokenizer, prefill_in_two_chunks)
    body = {"prompt": "O Romeo", "echo": True, "logprobs": 1, "max_tokens": 0}
    conn = FakeConnection()
    await handlers.completions(fake_post(body), Responder(conn, "r"), ADMISSION.admit)
    response = json.loads(bytes(conn.data).split(b"\r\n\r\n", 1)[1])
    [choice] = response["choices"]
    num = len(tokenizer.encode("O Romeo"))
    assert (choice["text"], choice["finish_reason"], response["usage"]["completion_tokens"]) == ("O Romeo", "length", 0)
    assert choice["logprobs"]["token_logprobs"] == [None] + [-float(p) for p in range(1, num)]
    assert len(choice["prompt_logprobs"]) == num and choice["prompt_logprobs"][0] is None
    params = engine.added[0].params
    assert (params.max_tokens, params.logprobs, params.prompt_logprobs) == (1, 1, 1)
    stream = FakeConnection()
    await handlers.completions(fake_post({**body, "stream": True}), Responder(stream, "r"), ADMISSION.admit)
    assert [(c["text"], c["finish_reason"]) for c in sse_choices(bytes(stream.data))] == [("O Romeo", None),
                                                                                          ("", "length")]
