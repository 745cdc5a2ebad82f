"""The JSON shapes of OpenAI's completions and chat responses: whole responses and stream chunks.

Owns: per endpoint, what a choice looks like in a response and in a chunk,
and the two logprobs formats (completions: parallel lists with text offsets;
chat: a list of {token, logprob, bytes, top_logprobs}); vLLM's
prompt_logprobs (per completions choice, at the top of a chat response).
With echo, a completions choice's logprobs lists start with the prompt's
tokens: the first without a logprob (nothing predicts it), each one's
offset where its text starts in the echoed prompt (EchoedPrompt).
Must not know: HTTP, the engine, when pieces arrive (handlers.py drives).
"""

from __future__ import annotations

import math

from server.generation.choice_output import ChoiceOutput, Piece, TokenEntry
from server.generation.echoed_prompt import EchoedPrompt
from server.generation.tokenizer import Tokenizer
from server.generation.tool_calling import ToolChoice
from server.generation.tool_parsers import ToolParser, ToolParserDelta
from shared.logprobs import TokenLogprobs

MIN_LOGPROB = -9999.0  # JSON has no -inf; vLLM sends this instead


def _finite(logprob: float) -> float:
    return logprob if math.isfinite(logprob) else MIN_LOGPROB


def _top_logprobs(tokenizer: Tokenizer, lp: TokenLogprobs) -> dict[str, float]:
    """Completions' {token text: logprob} of one position: the top alternatives and the token itself."""
    top: dict[str, float] = {}
    for top_id, top_logprob in zip(lp.top_token_ids, lp.top_logprobs):
        top.setdefault(tokenizer.token_text(top_id), _finite(top_logprob))  # alike texts: the likeliest is kept
    top.setdefault(tokenizer.token_text(lp.token_id), _finite(lp.logprob))  # always listed, as vLLM does
    return top


def prompt_logprobs(tokenizer: Tokenizer, out: ChoiceOutput) -> list[dict | None] | None:
    """vLLM's prompt_logprobs of a choice's prompt, None when not asked: null for the first position, then per
    position {"<token id>": {logprob, rank, decoded_token}} for the prompt token and its top alternatives."""
    state = out.prompt_state
    if state.params.prompt_logprobs is None:
        return None
    result: list[dict | None] = [None]
    for lp in state.prompt_logprobs:
        entry = {str(lp.token_id): _vllm_logprob(tokenizer, lp.token_id, lp.logprob, lp.rank)}
        for rank, (top_id, top_logprob) in enumerate(zip(lp.top_token_ids, lp.top_logprobs), start=1):
            entry.setdefault(str(top_id), _vllm_logprob(tokenizer, top_id, top_logprob, rank))
        result.append(entry)
    return result + [None] * (len(state.prompt_token_ids) - len(result))  # none left out, should any not come


def _vllm_logprob(tokenizer: Tokenizer, token_id: int, logprob: float, rank: int | None) -> dict:
    return {"logprob": _finite(logprob), "rank": rank, "decoded_token": tokenizer.token_text(token_id)}


def _delta(parsed: ToolParserDelta) -> dict:
    """A chat chunk's delta for what a tool parser let through: content, tool_calls, or neither."""
    delta: dict = {}
    if parsed.content:
        delta["content"] = parsed.content
    if parsed.tool_calls:
        delta["tool_calls"] = parsed.tool_calls
    return delta


class CompletionFormat:
    object = "text_completion"
    chunk_object = "text_completion"
    id_prefix = "cmpl"

    def __init__(self, tokenizer: Tokenizer, echoed: list[EchoedPrompt] | None, want_logprobs: bool, n: int):
        self._tokenizer = tokenizer
        self._echoed = echoed  # per prompt; None without echo
        self._want_logprobs = want_logprobs
        self._n = n

    def can_start(self, out: ChoiceOutput) -> bool:
        """Whether start_choice may be called: with echo and logprobs, once the prompt's logprobs have all come
        (by the engine's first token at the latest); at once otherwise."""
        if self._echoed is None or not self._want_logprobs:
            return True
        state = out.prompt_state
        return state.has_all_prompt_logprobs or bool(state.output_token_ids) or state.is_finished

    def start_choice(self, out: ChoiceOutput) -> dict | None:
        """The stream's first chunk of a choice: the prompt (and its logprobs), with echo."""
        if self._echoed is None:
            return None
        return {"index": out.index, "text": self._echo(out).text, "logprobs": self._echo_logprobs(out),
                "finish_reason": None, "stop_reason": None}

    def piece_choice(self, out: ChoiceOutput, piece: Piece) -> dict:
        return {"index": out.index, "text": piece.text, "logprobs": self._logprobs(out, piece.entries),
                "finish_reason": None, "stop_reason": None}

    def finish_choice(self, out: ChoiceOutput) -> dict:
        return {"index": out.index, "text": "", "logprobs": None, "finish_reason": out.finish_reason,
                "stop_reason": out.stop_reason}

    def full_choice(self, out: ChoiceOutput, text: str, entries: list[TokenEntry]) -> dict:
        logprobs = self._logprobs(out, entries)
        if self._echoed is not None:
            text = self._echo(out).text + text
            prompt = self._echo_logprobs(out)  # None exactly when logprobs is: both follow want_logprobs
            if logprobs is not None and prompt is not None:
                logprobs = {key: prompt[key] + logprobs[key] for key in logprobs}
        return {"index": out.index, "text": text, "logprobs": logprobs, "finish_reason": out.finish_reason,
                "stop_reason": out.stop_reason, "prompt_logprobs": prompt_logprobs(self._tokenizer, out)}

    def response_fields(self, outputs: list[ChoiceOutput]) -> dict:
        """Fields of a whole response besides choices and usage: none here (prompt logprobs are per choice)."""
        return {}

    def _echo(self, out: ChoiceOutput) -> EchoedPrompt:
        if self._echoed is None:
            raise RuntimeError("CompletionFormat: expected the echoed prompts (echo), got none")
        return self._echoed[out.index // self._n]

    def _echo_logprobs(self, out: ChoiceOutput) -> dict | None:
        """The prompt's tokens in the logprobs lists: the first null, each other with its prompt logprobs (null
        should one not have come)."""
        if not self._want_logprobs:
            return None
        echoed, entries = self._echo(out), out.prompt_state.prompt_logprobs
        tokens = echoed.token_strings(self._tokenizer)
        positions = [entries[p - 1] if p - 1 < len(entries) else None for p in range(1, len(tokens))]
        return {"tokens": tokens,
                "token_logprobs": [None] + [None if lp is None else _finite(lp.logprob) for lp in positions],
                "top_logprobs": [None] + [None if lp is None else _top_logprobs(self._tokenizer, lp)
                                          for lp in positions],
                "text_offset": list(echoed.text_offsets)}

    def _logprobs(self, out: ChoiceOutput, entries: list[TokenEntry]) -> dict | None:
        if not self._want_logprobs:
            return None
        base = len(self._echo(out).text) if self._echoed is not None else 0
        result = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for entry in entries:
            lp = entry.logprobs
            result["tokens"].append(self._tokenizer.token_text(lp.token_id))
            result["token_logprobs"].append(_finite(lp.logprob))
            result["top_logprobs"].append(_top_logprobs(self._tokenizer, lp))
            result["text_offset"].append(base + entry.text_offset)
        return result


class ChatFormat:
    """Chat choices; with tool calling, each choice's text goes through its own tool parser, whose calls come out
    as `tool_calls` (whole, or as OpenAI's deltas in a stream) and whose leftover text is the content."""

    object = "chat.completion"
    chunk_object = "chat.completion.chunk"
    id_prefix = "chatcmpl"

    def __init__(self, tokenizer: Tokenizer, want_logprobs: bool, tool_choice: ToolChoice | None = None,
                 auto_parser: type[ToolParser] | None = None):
        self._tokenizer = tokenizer
        self._want_logprobs = want_logprobs
        self._tool_choice = tool_choice
        self._auto_parser = auto_parser
        self._parsers: dict[int, ToolParser | None] = {}  # choice index -> its parser; None: plain content

    def can_start(self, out: ChoiceOutput) -> bool:
        """Whether start_choice may be called: at once."""
        return True

    def start_choice(self, out: ChoiceOutput) -> dict:
        """The stream's first chunk of a choice carries the role."""
        return {"index": out.index, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                "finish_reason": None, "stop_reason": None}

    def piece_choice(self, out: ChoiceOutput, piece: Piece) -> dict | None:
        """A piece's chunk; None when a tool parser holds all of its text back (and it has no logprobs)."""
        logprobs = self._logprobs(piece.entries)
        parser = self._parser(out)
        delta = {"content": piece.text} if parser is None else _delta(parser.feed(piece.text))
        if not delta and logprobs is None:
            return None
        return {"index": out.index, "delta": delta, "logprobs": logprobs, "finish_reason": None, "stop_reason": None}

    def finish_choice(self, out: ChoiceOutput) -> dict:
        parser = self._parser(out)
        delta = {} if parser is None else _delta(parser.finish())
        return {"index": out.index, "delta": delta, "logprobs": None, "finish_reason": self._finish_reason(out),
                "stop_reason": out.stop_reason}

    def full_choice(self, out: ChoiceOutput, text: str, entries: list[TokenEntry]) -> dict:
        message: dict = {"role": "assistant", "content": text, "refusal": None}
        parser = self._parser(out)
        if parser is not None:
            extracted = parser.parse(text)
            message["content"] = extracted.content
            if extracted.tool_calls:
                message["tool_calls"] = [call.to_openai() for call in extracted.tool_calls]
        return {"index": out.index, "message": message, "logprobs": self._logprobs(entries),
                "finish_reason": self._finish_reason(out), "stop_reason": out.stop_reason}

    def response_fields(self, outputs: list[ChoiceOutput]) -> dict:
        """Fields of a whole response besides choices and usage: vLLM's prompt_logprobs, the prompt's (the one
        all choices share)."""
        return {"prompt_logprobs": prompt_logprobs(self._tokenizer, outputs[0]) if outputs else None}

    def _parser(self, out: ChoiceOutput) -> ToolParser | None:
        if out.index not in self._parsers:
            choice = self._tool_choice
            self._parsers[out.index] = None if choice is None else choice.new_parser(self._auto_parser)
        return self._parsers[out.index]

    def _finish_reason(self, out: ChoiceOutput) -> str | None:
        parser, choice = self._parser(out), self._tool_choice
        if parser is None or choice is None:
            return out.finish_reason
        return choice.finish_reason(parser, out.finish_reason)

    def _logprobs(self, entries: list[TokenEntry]) -> dict | None:
        if not self._want_logprobs:
            return None
        token_text = self._tokenizer.token_text

        def item(token_id: int, logprob: float) -> dict:
            token = token_text(token_id)
            return {"token": token, "logprob": _finite(logprob), "bytes": list(token.encode("utf-8"))}

        content = []
        for entry in entries:
            lp = entry.logprobs
            top = [item(t, v) for t, v in zip(lp.top_token_ids, lp.top_logprobs)]
            content.append({**item(lp.token_id, lp.logprob), "top_logprobs": top})
        return {"content": content, "refusal": None}
