"""GenerationService: what both APIs generate through, from a checked request to choices in flight.

Owns: the served model's name check (404 model_not_found), readiness for
new generation (503 with Retry-After while no worker is ready), prompts as
token ids (text through the PromptEncoder, token ids checked against the
vocabulary, chat messages rendered by the chat template), structured
output's grammars (checked and cached by the GrammarCompiler), the server's
generation defaults for the sampling fields and max_tokens a request omits,
one RequestState and ChoiceOutput per choice checked against the model's
context, and the ChoiceRun that puts them in flight and reports each to
`on_request_done`.
Must not know: routes, request bodies, either API's JSON shape, admission
(the router's), HTTP framing beyond the Responder a run watches.
How: the model's context, vocabulary and EOS ids are the current worker's
(its Ready, read from the engine client at each request), so a restarted
worker's limits apply without anyone being told; before the first worker is
ready only /tokenize reaches the service, and prompts are then unbounded.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from server.generation.chat_messages import check_messages
from server.generation.chat_template import ChatTemplate, request_template, require_template
from server.generation.choice_output import ChoiceOutput
from server.generation.choice_run import ChoiceRun
from server.generation.echoed_prompt import EchoedPrompt
from server.generation.generation_defaults import GenerationDefaults
from server.generation.prompt_encoder import PromptEncoder
from server.generation.request import (
    DEFAULT_MAX_LOGPROBS,
    DEFAULT_MAX_RESPONSE_BYTES,
    GenerationRequest,
    build_sampling_params,
)
from server.generation.structured_output import GrammarCompiler, GrammarSpec
from server.generation.tokenizer import Tokenizer
from server.http.errors import RETRY_AFTER_S, ApiError, describe_value
from server.http.responder import Responder
from server.worker.engine_client import EngineClient
from server.worker.request_state import RequestState
from shared.vocabulary import SEED_BITS

OnRequestDone = Callable[[RequestState, str], None]


class GenerationService:
    def __init__(self, engine_client: EngineClient, tokenizer: Tokenizer, model_name: str,
                 chat_template: ChatTemplate | None, *, model_aliases: tuple[str, ...] = (),
                 is_ready: Callable[[], bool] | None = None, on_request_done: OnRequestDone | None = None,
                 trust_request_chat_template: bool = False, defaults: GenerationDefaults | None = None,
                 max_logprobs: int | None = DEFAULT_MAX_LOGPROBS, max_response_bytes: int = DEFAULT_MAX_RESPONSE_BYTES):
        """model_name: the name responses report; model_aliases: other names requests may use for it.
        is_ready: whether new generation is taken (the Supervisor's readiness); default: the worker is READY.
        on_request_done(state, outcome): once per choice when it ends; outcome is its finish reason, or "abort"
        when the client left or another choice failed, or "error".
        trust_request_chat_template: render with a request's own `chat_template` (else such a request is a 400,
        as in vLLM: a template is code, run on the event loop).
        defaults: the sampling values and max_tokens of a request that leaves them out (--generation-config);
        default: none, the neutral values.
        max_logprobs: the most alternatives a request may ask for per token (--max-logprobs); None: the
        vocabulary's size. max_response_bytes: the largest whole response a request may ask for
        (--max-response-size; server/api/completions/response_bound.py estimates it)."""
        self.engine_client = engine_client
        self.tokenizer = tokenizer
        self.prompt_encoder = PromptEncoder(tokenizer)
        self.model_name = model_name
        self.model_names = (model_name, *model_aliases)
        self.chat_template = chat_template
        self.grammar_compiler = GrammarCompiler(tokenizer)
        self.is_ready = is_ready or (lambda: engine_client.is_ready)
        self.on_request_done = on_request_done
        self.trust_request_chat_template = trust_request_chat_template
        self.defaults = defaults or GenerationDefaults()
        self.max_logprobs = max_logprobs
        self.max_response_bytes = max_response_bytes

    @property
    def logprobs_limit(self) -> int:
        """The most alternatives per token a request may ask for: --max-logprobs, and never more than the
        vocabulary holds (the worker could not rank more)."""
        vocab_size = self._vocab_size()
        return vocab_size if self.max_logprobs is None else min(self.max_logprobs, vocab_size)

    @property
    def max_model_len(self) -> int | None:
        """The current worker's context length; None before the first worker is ready."""
        info = self.engine_client.worker_info
        return info.max_model_len if info is not None else None

    def check_ready(self) -> None:
        """503 with Retry-After unless a worker is ready to take new generation requests."""
        if not self.is_ready() or self.engine_client.worker_info is None:
            raise not_ready()

    def check_model(self, model: object) -> None:
        """404 unless `model` is None (any) or one of the served model's names."""
        if model is not None and model not in self.model_names:
            raise ApiError(404, f"the model {describe_value(model)} does not exist; this server serves "
                                f"{' or '.join(map(repr, self.model_names))}", param="model", code="model_not_found")

    def close(self) -> None:
        """Drop the prompts waiting to be tokenized: no client is left to answer."""
        self.prompt_encoder.close()

    # ------------------------------------------------------------------------------------------ prompts

    async def encode(self, text: str, *, add_special_tokens: bool = True, param: str = "prompt") -> list[int]:
        """`text` as token ids, bounded by the context (400) and off the event loop when long."""
        return await self.prompt_encoder.encode(text, self.max_model_len, add_special_tokens=add_special_tokens,
                                                param=param)

    def render_chat(self, messages: object, add_generation_prompt: bool = True, *, tools: list[dict] | None = None,
                    continue_final_message: bool = False, chat_template: str | None = None,
                    chat_template_kwargs: dict | None = None) -> str:
        """`messages` checked and rendered as text (the template places any BOS itself): by the request's own
        `chat_template` when it has one, else the server's. tools: passed to the template as given.
        chat_template_kwargs: more variables for the template (params.py has refused the ones it sets itself)."""
        template = self._chat_template(chat_template)
        checked = check_messages(messages)
        self.prompt_encoder.check_length(sum(len(m["content"]) for m in checked), self.max_model_len,
                                         param="messages")
        return template.render(checked, tools=tools, add_generation_prompt=add_generation_prompt,
                               continue_final_message=continue_final_message, bos_token=self.tokenizer.bos_token,
                               eos_token=self.tokenizer.eos_token, template_kwargs=chat_template_kwargs)

    async def chat_prompt_ids(self, messages: object, add_generation_prompt: bool = True, *,
                              tools: list[dict] | None = None, continue_final_message: bool = False,
                              chat_template: str | None = None, chat_template_kwargs: dict | None = None,
                              add_special_tokens: bool = False) -> list[int]:
        """`messages` rendered as by render_chat, as the prompt's token ids; add_special_tokens: a BOS besides the
        one the template places (vLLM's default is false, as here)."""
        text = self.render_chat(messages, add_generation_prompt, tools=tools,
                                continue_final_message=continue_final_message, chat_template=chat_template,
                                chat_template_kwargs=chat_template_kwargs)
        prompt_ids = await self.encode(text, add_special_tokens=add_special_tokens, param="messages")
        if not prompt_ids:
            raise ApiError(400, "the chat template rendered these messages as an empty prompt", param="messages")
        return self._check_token_ids(prompt_ids)

    def _chat_template(self, request_source: str | None) -> ChatTemplate:
        """The request's own template (when the server trusts them), else the server's."""
        if not request_source:
            return require_template(self.chat_template, self.model_name)
        if not self.trust_request_chat_template:
            raise ApiError(400, "the request has its own chat_template, but this server does not take them (start it "
                                "with --trust-request-chat-template)", param="chat_template")
        return request_template(request_source)

    async def prompt_ids(self, prompt: str | list[int], add_special_tokens: bool = True) -> list[int]:
        """A completion prompt, text (tokenized with the BOS unless add_special_tokens is false) or token ids (as
        they are), as checked token ids."""
        if isinstance(prompt, str):
            return self._check_token_ids(await self.encode(prompt, add_special_tokens=add_special_tokens))
        max_model_len = self._context()
        if len(prompt) >= max_model_len:
            raise _context_error(max_model_len, len(prompt), None, "prompt")
        return self._check_token_ids(list(prompt))

    async def echoed_prompt(self, prompt: str | list[int], add_special_tokens: bool = True) -> EchoedPrompt:
        """A completion prompt as prompt_ids() checks it, with the text echo returns and its tokens' offsets."""
        if isinstance(prompt, str):
            echoed = await self.prompt_encoder.echoed_text(prompt, self.max_model_len,
                                                           add_special_tokens=add_special_tokens)
            self._check_token_ids(echoed.token_ids)
            return echoed
        return await self.prompt_encoder.echoed_token_ids(await self.prompt_ids(prompt))

    def _check_token_ids(self, token_ids: list[int]) -> list[int]:
        vocab_size = self._vocab_size()
        if max(token_ids) >= vocab_size:
            raise ApiError(400, f"prompt token ids must be below the vocabulary size {vocab_size}, got "
                                f"{max(token_ids)}", param="prompt")
        return token_ids

    # ------------------------------------------------------------------------------------------ choices

    async def compile_grammar(self, spec: GrammarSpec | None) -> str | None:
        """The checked grammar of a request's structured output (None: none asked); 400 when it does not compile."""
        return None if spec is None else await self.grammar_compiler.compile(spec)

    def choices(self, params: GenerationRequest, prompt_ids: list[list[int]], default_max_tokens: int | None,
                request_id: str, *, max_tokens_param: str = "max_tokens", grammar: str | None = None,
                trace_context: dict[str, str] | None = None) -> list[ChoiceOutput]:
        """One ChoiceOutput per (prompt, i < n), all checked before any is admitted.

        default_max_tokens: the endpoint's max_tokens for a request that gives none (None: what the context
        leaves); the server's defaults (generation_config.json's max_new_tokens) replace it.

        max_tokens_param: the request field a too-large max_tokens is reported on; grammar: compile_grammar's;
        trace_context: the client's W3C trace headers (server/http/trace_context.py), which each choice's span joins.
        """
        self._check_logit_bias(params.sampling.get("logit_bias", {}))
        eos_token_ids = self._eos_token_ids()
        if self.defaults.max_tokens is not None:
            default_max_tokens = self.defaults.max_tokens
        outputs = []
        # The prompt alone (max_tokens 0): the engine still generates one token, as vLLM's does; none is returned.
        requested = 1 if params.is_prompt_only else params.max_tokens
        for token_ids in prompt_ids:
            max_tokens = self._max_tokens(requested, len(token_ids), default_max_tokens, max_tokens_param)
            first: RequestState | None = None  # the prompt's first choice: the one that computes its prompt logprobs
            prompt_choices: list[RequestState] = []
            for i in range(params.n):
                # A client's seed gives choice i seed + i; otherwise EngineClient.add fixes one before the first send.
                seed = (params.seed + i) % 2**SEED_BITS if params.seed is not None else None
                index = len(outputs)
                sampling_params = build_sampling_params(params, max_tokens, seed, grammar, self.defaults.sampling)
                if first is not None:  # computed once per prompt, shown on each of its choices
                    sampling_params = dataclasses.replace(sampling_params, prompt_logprobs=None)
                state = RequestState(f"{request_id}-{index}", token_ids, sampling_params, priority=params.priority,
                                     prompt_choices=prompt_choices, trace_context=trace_context)
                prompt_choices.append(state)
                first = first or state
                outputs.append(ChoiceOutput(index, state, self.tokenizer, stop=params.stop,
                                            include_stop_str_in_output=params.include_stop_str_in_output,
                                            eos_token_ids=eos_token_ids, is_prompt_only=params.is_prompt_only,
                                            prompt_state=first))
        return outputs

    def run(self, outputs: list[ChoiceOutput], responder: Responder) -> ChoiceRun:
        """`async with service.run(outputs, responder) as run:` puts the choices in flight for that block."""
        return ChoiceRun(self.engine_client, outputs, responder, self.on_request_done)

    def _check_logit_bias(self, logit_bias: dict[int, float]) -> None:
        vocab_size = self._vocab_size()
        if logit_bias and max(logit_bias) >= vocab_size:
            raise ApiError(400, f"logit_bias keys must be token ids below the vocabulary size {vocab_size}, got "
                                f"{max(logit_bias)}", param="logit_bias")

    def _max_tokens(self, requested: int | None, num_prompt_tokens: int, default: int | None,
                    max_tokens_param: str) -> int:
        max_model_len = self._context()
        room = max_model_len - num_prompt_tokens
        if room < 1 or (requested is not None and requested > room):
            raise _context_error(max_model_len, num_prompt_tokens, requested,
                                 max_tokens_param if room >= 1 else "prompt")
        if requested is not None:
            return requested
        return room if default is None else min(default, room)

    def _context(self) -> int:
        max_model_len = self.max_model_len
        if max_model_len is None:
            raise not_ready()
        return max_model_len

    def _vocab_size(self) -> int:
        info = self.engine_client.worker_info
        return info.vocab_size if info is not None else self.tokenizer.vocab_size

    def _eos_token_ids(self) -> tuple[int, ...]:
        info = self.engine_client.worker_info
        ids = set(info.eos_token_ids) if info is not None else set()
        if self.tokenizer.eos_token_id is not None:
            ids.add(self.tokenizer.eos_token_id)
        return tuple(ids)


def not_ready() -> ApiError:
    return ApiError(503, "no engine worker is ready (it is starting, or restarting after a failure); retry "
                         "shortly", headers={"Retry-After": RETRY_AFTER_S})


def _context_error(max_model_len: int, num_prompt_tokens: int, requested: int | None, param: str) -> ApiError:
    asked = f"{requested} tokens to generate" if requested is not None else "at least 1 token to generate"
    return ApiError(400, f"this model's maximum context length is {max_model_len} tokens, but the request has "
                         f"{num_prompt_tokens} prompt tokens and asks for {asked}", param=param,
                    code="context_length_exceeded")
