"""GenerationRequest: a request both APIs have checked, in the one shape the GenerationService takes.

/v1/completions and /v1/chat/completions build it from their bodies
(api/completions/params.py), /v1/responses from its own
(api/responses/params.py); build_sampling_params turns it into one choice's
SamplingParams.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from server.generation.structured_output import GrammarSpec
from server.generation.tool_calling import ToolChoice
from server.http.errors import ApiError
from shared.sampling_params import SamplingParams

DEFAULT_MAX_LOGPROBS = 20  # --max-logprobs' default, as vLLM's: the most alternatives a request may ask for
DEFAULT_MAX_RESPONSE_BYTES = 64 << 20  # the largest whole response a request may ask for (--max-response-size)


@dataclass(slots=True)
class GenerationRequest:
    model: str | None
    prompts: list[str | list[int]] = field(default_factory=list)  # completions: texts or token id lists
    messages: list | None = None  # chat: checked by server.generation.chat_messages.check_messages
    max_tokens: int | None = None  # None: the endpoint's default; 0 (completions, with echo): the prompt alone
    n: int = 1
    stream: bool = False
    include_usage: bool = False
    continuous_usage_stats: bool = False  # stream_options: usage in every chunk (vLLM's), with include_usage
    stop: tuple[str, ...] = ()
    include_stop_str_in_output: bool = False
    echo: bool = False
    add_generation_prompt: bool = True  # chat: end the prompt with the template's opening of an assistant turn
    continue_final_message: bool = False  # chat: leave the final (assistant) message open, for the model to continue
    add_special_tokens: bool = True  # completions: a BOS before a text prompt; chat parses it with default false
    chat_template: str | None = None  # chat: the request's own template; None: the server's
    chat_template_kwargs: dict = field(default_factory=dict)  # chat: more variables for the template
    num_logprobs: int | None = None  # top-k alternatives per token; None: no logprobs
    num_prompt_logprobs: int | None = None  # the same for each prompt token (vLLM's prompt_logprobs); None: none
    seed: int | None = None
    priority: int = 0
    sampling: dict = field(default_factory=dict)  # the other SamplingParams fields the client set (over the defaults)
    grammar: GrammarSpec | None = None  # structured output: compiled by GenerationService.compile_grammar
    tool_choice: ToolChoice | None = None  # chat: tools for the template, and how the output becomes calls

    @property
    def is_prompt_only(self) -> bool:
        """max_tokens 0 (with echo): the response holds the prompt and nothing generated."""
        return self.max_tokens == 0


def build_sampling_params(request: GenerationRequest, max_tokens: int, seed: int | None,
                          grammar: str | None = None, defaults: dict | None = None) -> SamplingParams:
    """SamplingParams for one choice (`grammar` the compiled request.grammar, `defaults` the server's
    GenerationDefaults.sampling for the fields the request left out); its ValueError becomes a 400 naming the
    field."""
    try:
        return SamplingParams(max_tokens=max_tokens, seed=seed, logprobs=request.num_logprobs,
                              prompt_logprobs=request.num_prompt_logprobs, grammar=grammar,
                              **{**(defaults or {}), **request.sampling})
    except ValueError as exc:
        name = str(exc).split(" ", 1)[0]
        raise ApiError(400, str(exc), param=name) from None
