"""MODEL.md: the shipped model's card, written from the figures of the run that made it."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


@dataclass(slots=True)
class CardFigures:
    command: str
    source: str
    num_documents: int
    train_chars: int
    val_chars: int
    train_tokens: int
    val_tokens: int
    vocab_size: int
    num_words: int
    shape_line: str
    num_parameters: int
    steps: int
    batch_size: int
    context: int
    lr: float
    seed: int
    threads: int
    precision: str
    num_train_tokens: int
    wall_seconds: float
    final_train_loss: float
    val_loss: float
    val_ppl: float
    num_val_windows: int
    subset_loss: float
    subset_ppl: float
    num_subset_windows: int
    size_bytes: int
    sample: str


def write_model_card(figures: CardFigures, path: Path) -> None:
    f = figures
    sample = "\n".join("    " + line for line in f.sample.splitlines())
    subset_row = (f"| first {f.num_subset_windows} windows (what the test recomputes) | {f.num_subset_windows} "
                  f"| {f.subset_loss:.4f} | {f.subset_ppl:.2f} |")
    path.write_text(f"""# pagedserve's default model

A small Llama (LlamaForCausalLM layout) trained by the project itself on
Shakespeare, so that `pagedserve` with no `--model` serves legible text on
a machine that cannot download a model. It is a toy: it writes
Shakespeare-shaped text, not answers.

## Data

- Source: {f.source}. One edition per work: the modern-spelling Gutenberg
  texts (`shksprdata/texts/*_gut.txt`, not the First Folio `*_gut_f.txt`),
  {f.num_documents} works (plays, poems, sonnets), read in sorted file order.
- Cleaning: Project Gutenberg header/licence lines stripped where present,
  runs of blank lines cut to one, and speaker lines (a name alone between a
  blank line and a speech, e.g. `Romeo.`) rewritten as `ROMEO:`.
- Split: the last 5% of each work's lines (cut at a blank line) is held out
  for validation: {f.train_chars:,} training characters ({f.train_tokens:,} tokens),
  {f.val_chars:,} validation characters ({f.val_tokens:,} tokens, counting one `</s>` per work).
  The held-out text ships in `eval/validation.json` (one string per work, in order);
  `eval/words.txt` is the training text's word list ({f.num_words:,} lower-cased words,
  letters with inner apostrophes).

## Tokenizer

Byte-level BPE trained with the `tokenizers` library on the training text:
{f.vocab_size:,} tokens including `<pad>` (0), `<s>` (1, bos) and `</s>` (2, eos). No
normaliser, so any UTF-8 text round-trips byte for byte. Encoding with special
tokens puts `<s>` in front. The chat template renders each message as
`ROLE:\\ncontent\\n\\n` after `<s>`, and `ASSISTANT:\\n` as the generation prompt.

## Model

{f.shape_line}; {f.num_parameters:,} parameters; tied input/output embeddings;
weights in bfloat16 ({f.size_bytes / 1e6:.1f} MB for this whole directory).

## Training

    {f.command}

{f.steps} AdamW steps of {f.batch_size} x {f.context} tokens ({f.num_train_tokens:,} tokens), peak learning
rate {f.lr:g} (linear warm-up, cosine decay to 10%), seed {f.seed}, {f.threads} CPU thread(s), {f.precision};
wall time {f.wall_seconds / 60:.1f} minutes. Each training window is `<s>` followed by {f.context}
tokens starting at the beginning of a line; every token of the window is scored.
Final training loss {f.final_train_loss:.4f}.

## Validation

Measured on the shipped (bfloat16) weights computed in float32:

| split | windows | loss (nats/token) | perplexity |
|---|---|---|---|
| whole held-out split | {f.num_val_windows} | {f.val_loss:.4f} | {f.val_ppl:.2f} |
{subset_row}

How it is computed: for each string of `eval/validation.json` in order, take
`tokenizer.encode(text, add_special_tokens=False)` followed by `</s>`, and
concatenate them into one stream. Cut the stream into consecutive,
non-overlapping windows of {f.context} tokens (the tail that does not fill a
window is dropped). Each window is scored with input `<s>` + window[:-1] and
targets window, so every token of the window is predicted. Perplexity is
exp(total negative log-likelihood / number of scored tokens).

## Sample

Greedy continuation of `ROMEO:`:

{sample}
""")
