"""The shipped default model (shared/default_model/): it loads, it agrees with transformers, it is as good as MODEL.md says.

Figures are recomputed, not trusted: the validation perplexity on the
windows MODEL.md names, the share of real words in a greedy continuation
(against a random model of the same shape, which must score far lower),
and byte-for-byte tokenizer round trips.
"""

from __future__ import annotations

import json
import math
import random
import re

import pytest
import torch
import torch.nn.functional as F
import transformers
from tokenizers import Tokenizer as RawTokenizer
from transformers import AutoModelForCausalLM, AutoTokenizer

from gpu_worker.engine.engine import Engine
from gpu_worker.engine.generate import generate
from server.generation.chat_template import ChatTemplate
from server.generation.tokenizer import Tokenizer
from shared.config import EngineConfig
from shared.default_model import DEFAULT_MODEL_DIR, DEFAULT_MODEL_NAME
from shared.sampling_params import SamplingParams

from helpers.running_server import start_server, stop_server

MAX_TOTAL_BYTES = 50 * 1000**2
PPL_TOLERANCE = 0.02
MIN_WORD_SHARE = 0.80
MIN_WORDS = 20
MAX_RANDOM_WORD_SHARE = 0.55  # sampled random weights measured 40-46% (short BPE pieces are often words)
MIN_TRAINED_MARGIN = 0.25
WORD = re.compile(r"[a-z]+(?:'[a-z]+)*")  # as tools/training/corpus.py counts words
SUBSET_ROW = re.compile(r"\| first (\d+) windows[^|]*\| \d+ \| ([0-9.]+) \| ([0-9.]+) \|")
ROUND_TRIP_TEXTS = [
    "ROMEO:\nBut soft, what light through yonder window breaks?\n",
    "emoji 👋🏽 👨‍👩‍👧‍👦 🏳️‍🌈 🇯🇵 ✨",
    "中文：生存还是毁灭，这是一个问题。日本語のテキスト。한국어",
    "combining: e\u0301 a\u0300\u0323 Z\u0351\u0352\u0353 \u0915\u094d\u0937 cafe\u0301 vs caf\u00e9",
    "مرحبا بالعالم  שלום",
    "controls \x00\x01\x7f tab\tcr\r\nlf\n\n  indented   spaces  ",
    "",
    " ",
    "\uffff\U0010fffd\u200b\u200d\ufeff",
]


@pytest.fixture(scope="module")
def hf_model():
    return AutoModelForCausalLM.from_pretrained(DEFAULT_MODEL_DIR, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def engine():
    return Engine(EngineConfig(model=str(DEFAULT_MODEL_DIR), dtype="float32", device="cpu"))


@pytest.fixture(scope="module")
def tokenizer():
    return Tokenizer.from_dir(DEFAULT_MODEL_DIR)


@pytest.fixture(scope="module")
def config():
    return json.loads((DEFAULT_MODEL_DIR / "config.json").read_text())


def hf_greedy(model, prompt: list[int], max_tokens: int) -> list[int]:
    with torch.inference_mode():
        out = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                             max_new_tokens=max_tokens, min_new_tokens=max_tokens, do_sample=False, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def hf_sample(model, prompt: list[int], max_tokens: int, seed: int) -> list[int]:
    """Pure sampling (temperature 1, no top-k/top-p): the text the weights themselves stand for."""
    torch.manual_seed(seed)
    with torch.inference_mode():
        out = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                             max_new_tokens=max_tokens, min_new_tokens=max_tokens, do_sample=True, temperature=1.0,
                             top_k=0, top_p=1.0, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def word_share(text: str) -> float:
    """Share of text's words (lower-cased, as the corpus counts them) found in the training text's word list."""
    words = WORD.findall(text.lower())
    assert len(words) >= MIN_WORDS, f"expected a continuation of at least {MIN_WORDS} words, got {len(words)}: {text!r}"
    known = set((DEFAULT_MODEL_DIR / "eval" / "words.txt").read_text().split())
    return sum(w in known for w in words) / len(words)


def test_checkpoint_files_are_small_and_standard(config):
    total = sum(p.stat().st_size for p in DEFAULT_MODEL_DIR.rglob("*") if p.is_file())
    assert total < MAX_TOTAL_BYTES, f"the default model is {total} bytes, expected under {MAX_TOTAL_BYTES}"
    assert config["architectures"] == ["LlamaForCausalLM"] and config["model_type"] == "llama"
    assert config["max_position_embeddings"] >= 512
    tokenizer_config = json.loads((DEFAULT_MODEL_DIR / "tokenizer_config.json").read_text())
    assert tokenizer_config["tokenizer_class"] == "PreTrainedTokenizerFast"
    assert (tokenizer_config["bos_token"], tokenizer_config["eos_token"]) == ("<s>", "</s>")


def test_engine_and_transformers_agree_greedily(engine, hf_model, tokenizer):
    prompts = [tokenizer.encode("ROMEO:"), tokenizer.encode("JULIET:\nO Romeo, Romeo! wherefore art thou")]
    params = SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True)
    ours = [c.token_ids for c in generate(engine, prompts, params)]
    theirs = [hf_greedy(hf_model, prompt, 48) for prompt in prompts]
    assert ours == theirs


def test_validation_perplexity_matches_model_card(hf_model, tokenizer, config):
    match = SUBSET_ROW.search((DEFAULT_MODEL_DIR / "MODEL.md").read_text())
    assert match, "expected MODEL.md to report the perplexity of the first N validation windows"
    num_windows, reported_ppl = int(match.group(1)), float(match.group(3))
    context = config["max_position_embeddings"]
    stream: list[int] = []
    for text in json.loads((DEFAULT_MODEL_DIR / "eval" / "validation.json").read_text()):
        stream += tokenizer.encode(text, add_special_tokens=False) + [tokenizer.eos_token_id]
    assert len(stream) >= num_windows * context
    targets = torch.tensor(stream[: num_windows * context]).view(num_windows, context)  # [windows, context]
    inputs = torch.cat([torch.full((num_windows, 1), tokenizer.bos_token_id), targets[:, :-1]], dim=1)
    total = 0.0
    with torch.inference_mode():
        for batch_inputs, batch_targets in zip(inputs.split(4), targets.split(4)):
            logits = hf_model(batch_inputs).logits  # [batch, context, vocab]
            total += F.cross_entropy(logits.flatten(0, 1), batch_targets.flatten(), reduction="sum").item()
    ppl = math.exp(total / targets.numel())
    assert abs(ppl - reported_ppl) <= PPL_TOLERANCE * reported_ppl, f"recomputed {ppl:.3f}, MODEL.md says {reported_ppl}"


def test_greedy_romeo_continuation_is_made_of_corpus_words(engine, tokenizer):
    prompt = tokenizer.encode("ROMEO:")
    [completion] = generate(engine, [prompt], SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True))
    share = word_share(tokenizer.decode(completion.token_ids))
    assert share >= MIN_WORD_SHARE, f"{share:.0%} of the greedy continuation's words are in the corpus"


def test_random_weights_score_far_lower(hf_model, tokenizer, config):
    # Greedy decoding of random weights collapses into one token repeated (often a whole word, " sigh sigh
    # sigh"), which says nothing about the weights; sampling both models the same way compares them fairly.
    prompt = tokenizer.encode("ROMEO:")
    trained = word_share(tokenizer.decode(hf_sample(hf_model, prompt, 200, seed=0)))
    torch.manual_seed(0)
    random_model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**config)).eval()
    untrained = word_share(tokenizer.decode(hf_sample(random_model, prompt, 200, seed=0)))
    assert untrained <= MAX_RANDOM_WORD_SHARE, f"random weights: {untrained:.0%} corpus words"
    assert trained - untrained >= MIN_TRAINED_MARGIN, f"trained {trained:.0%} vs random {untrained:.0%} corpus words"


@pytest.mark.parametrize("text", ROUND_TRIP_TEXTS)
def test_tokenizer_round_trips_utf8_byte_for_byte(tokenizer, text):
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert tokenizer.decode(ids).encode("utf-8") == text.encode("utf-8")
    assert tokenizer.encode(text)[:1] == [tokenizer.bos_token_id]


def test_tokenizer_round_trips_random_code_points():
    raw = RawTokenizer.from_file(str(DEFAULT_MODEL_DIR / "tokenizer.json"))
    rng = random.Random(0)
    planes = [(0x20, 0x7F), (0xA0, 0x2FFF), (0x3000, 0x9FFF), (0xE000, 0xFFFD), (0x1F300, 0x1FAFF), (0x20000, 0x2A6DF)]
    for _ in range(200):
        text = "".join(chr(rng.randint(*rng.choice(planes))) for _ in range(rng.randint(1, 40)))
        ids = raw.encode(text, add_special_tokens=False).ids
        assert raw.decode(ids, skip_special_tokens=False).encode("utf-8") == text.encode("utf-8")


def test_transformers_tokenizer_agrees_with_ours(tokenizer):
    hf_tokenizer = AutoTokenizer.from_pretrained(DEFAULT_MODEL_DIR)
    for text in ROUND_TRIP_TEXTS[:4]:
        assert hf_tokenizer(text).input_ids == tokenizer.encode(text)
        assert hf_tokenizer.decode(tokenizer.encode(text), skip_special_tokens=True) == text


def test_chat_template_renders_speaker_turns(tokenizer):
    template = ChatTemplate(tokenizer.chat_template)
    prompt = template.render([{"role": "user", "content": "Who art thou?"}], bos_token=tokenizer.bos_token)
    assert prompt == "<s>USER:\nWho art thou?\n\nASSISTANT:\n"


def test_server_without_model_serves_the_default_model(tmp_path):
    server = start_server(tmp_path, None, "--device", "cpu")
    try:
        assert [m.id for m in server.client().models.list().data] == [DEFAULT_MODEL_NAME]
        text = "".join(chunk.choices[0].text for chunk in server.client().completions.create(
            model=DEFAULT_MODEL_NAME, prompt="ROMEO:", max_tokens=30, temperature=0, stream=True))
        assert len(re.findall(r"[A-Za-z']+", text)) >= 5, text
    finally:
        stop_server(server)
