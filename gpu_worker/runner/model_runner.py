"""ModelRunner: turns a SchedulerOutput into one packed forward pass and the logits to sample from.

Owns the model weights, the device and the KV cache tensors. Knows nothing
of queues or priorities: it is handed the sequences and how many new tokens
each computes this step, flattens them into one batch (input ids, positions,
slot mapping, block tables, sequence lengths, query start offsets), runs the
model once, and returns the last-position logits of every sequence that
samples this step, with the prompt logprobs of the sequences that asked for
them and computed prompt positions this step (sampling/prompt_logprobs.py).
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field

import numpy as np
import torch

from gpu_worker.attention import AttentionMetadata, select_paged_attention
from gpu_worker.kv.kv_cache import allocate_kv_cache, bytes_per_block, kv_cache_budget
from gpu_worker.kv.kv_segment import KVSegment, map_kv_segment
from gpu_worker.models import load_model
from gpu_worker.models.cpu_kernel_step_build import build_cpu_kernel_step
from gpu_worker.native.cpu_threads import default_threads
from gpu_worker.native.profiled_range import profiling
from gpu_worker.runner.block_table_rows import BlockTableRows
from gpu_worker.sampling.prompt_logprobs import PromptTokenRows, score_prompt_tokens
from gpu_worker.scheduling.scheduler_output import ScheduledSequence, SchedulerOutput
from shared.config import EngineConfig
from shared.cpu_tier import OVERRIDE_VARIABLE, current_tier
from shared.logprobs import TokenLogprobs

logger = logging.getLogger("pagedserve.worker")


def select_device(name: str) -> torch.device:
    """The torch device for EngineConfig.device `name`: the one place auto is decided, cuda when torch sees a GPU.
    An in-process Engine decides it here when it loads; the server runs this same function once, in a child
    process (shared/worker_launch.py device_probe_command), and starts its workers with the answer."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ValueError("device 'cuda' was asked for but torch sees no CUDA device")
    return torch.device(name)


def _tier_source() -> str:
    override = os.environ.get(OVERRIDE_VARIABLE)
    return f", as ${OVERRIDE_VARIABLE}={override} asks" if override else ", read from the CPU"


@dataclass(slots=True)
class StepLogits:
    logits: torch.Tensor  # [num_sampling_seqs, vocab] float32, in scheduled order
    # [num_sampling_seqs] int64, each row's argmax of logits, where the LM head's kernel took it as it wrote them in a
    # step whose every sampling sequence is plain greedy (so the sampler need not read the logits again); else None
    argmax: torch.Tensor | None = None
    # index in SchedulerOutput.scheduled -> (first prompt position scored, one TokenLogprobs per position from it)
    prompt_logprobs: dict[int, tuple[int, list[TokenLogprobs]]] = field(default_factory=dict)


class ModelRunner:
    def __init__(self, config: EngineConfig) -> None:
        self.device = select_device(config.device)
        self.cpu_tier = current_tier()
        if self.device.type == "cpu":
            torch.set_num_threads(config.cpu_threads or default_threads())
            logger.info("CPU tier %s%s; %d compute threads", self.cpu_tier.describe(), _tier_source(),
                        torch.get_num_threads())
        self.block_size = config.block_size
        self._block_table_rows = BlockTableRows()  # the step's block tables, kept from one step to the next
        # A decode step's query_start_loc [0, 1, ..., num_rows] int32 and its rows [0, ..., num_rows) int64, by
        # num_rows: made once each, as a slice costs a decode step ~15 us with torch's code cold after the forward.
        self._row_starts: dict[int, torch.Tensor] = {}
        self._all_rows: dict[int, torch.Tensor] = {}
        attention = select_paged_attention(self.device.type)
        self.model, self.model_config = load_model(config.model, dtype=config.dtype, device=self.device,
                                                   attention=attention, tier=self.cpu_tier,
                                                   quantization=config.quantization)
        self.dtype = next(self.model.parameters()).dtype
        # Steps of a few hundred tokens run as the C kernels' calls where the model's ops all have one (CPU, float32
        # or bfloat16 on oneDNN's packed products).
        self.kernel_step = build_cpu_kernel_step(self.model) if self.device.type == "cpu" else None
        self.num_kv_blocks = config.num_kv_blocks or self._num_blocks_in_budget(config)
        mc = self.model_config
        self.kv_caches = allocate_kv_cache(mc.num_hidden_layers, self.num_kv_blocks, self.block_size,
                                           mc.num_key_value_heads, mc.head_dim, self.dtype, self.device)

    def use_kv_segment(self, path) -> KVSegment:
        """Hold the KV cache in the shared segment at `path` from now on; the private cache is dropped."""
        if self.device.type != "cpu":
            raise OSError(f"a shared KV cache segment is mapped on the CPU only, and this worker runs on {self.device}")
        mc = self.model_config
        segment = map_kv_segment(path, mc.num_hidden_layers, self.num_kv_blocks, self.block_size,
                                 mc.num_key_value_heads, mc.head_dim, self.dtype)
        self.kv_caches = segment.kv_caches
        return segment

    def _num_blocks_in_budget(self, config: EngineConfig) -> int:
        mc = self.model_config
        block_bytes = bytes_per_block(mc.num_hidden_layers, self.block_size, mc.num_key_value_heads, mc.head_dim,
                                      self.dtype)
        budget = kv_cache_budget(self.device, config.kv_cache_memory, config.gpu_memory_utilization)
        num_blocks = budget // block_bytes
        if num_blocks < 1:
            raise ValueError(f"the KV cache budget of {budget} bytes holds no block of {block_bytes} bytes; "
                             "raise --kv-cache-memory")
        return num_blocks

    def execute(self, output: SchedulerOutput) -> StepLogits:
        """Run one forward pass: the sampling sequences' logits, and the prompt logprobs the step computes.

        Always in inference mode: entered here unless the caller holds it already, as the worker loop does for its
        whole life (entering and leaving it took ~50 us of a decode step's host time, its code cold after the
        forward pass)."""
        if torch.is_inference_mode_enabled():
            return self._execute(output)
        with torch.inference_mode():
            return self._execute(output)

    def _execute(self, output: SchedulerOutput) -> StepLogits:
        input_ids, positions, meta, logits_indices = self.prepare_inputs(output)
        if self.kernel_step is not None and self.kernel_step.takes(input_ids.shape[0], meta) and not profiling():
            hidden = self.kernel_step.forward(input_ids, positions, self.kv_caches, meta)  # [num_tokens, hidden_size]
        else:
            hidden = self.model(input_ids, positions, self.kv_caches, meta)  # [num_tokens, hidden_size]
        # As many sampling rows as tokens: every sequence computes one token and samples, and hidden is those rows.
        sampling_hidden = hidden if logits_indices.shape[0] == hidden.shape[0] else hidden[logits_indices]
        if all(item.seq.is_plain_greedy for item in output.scheduled if item.is_sampling):
            step = StepLogits(*self.model.compute_logits_and_argmax(sampling_hidden))
        else:
            step = StepLogits(self.model.compute_logits(sampling_hidden))  # [num_sampling_seqs, vocab]
        if output.shape.num_samples == output.shape.num_tokens:
            return step  # every sequence computes its last token alone: no prompt position is scored
        rows, spans = self._prompt_token_rows(output)
        if spans:
            scored = score_prompt_tokens(hidden, rows, self.model_config.vocab_size, self.model.compute_logits)
            for index, (first_position, start, end) in spans.items():
                step.prompt_logprobs[index] = (first_position, scored[start:end])
        return step

    @staticmethod
    def _prompt_token_rows(output: SchedulerOutput) -> tuple[PromptTokenRows, dict[int, tuple[int, int, int]]]:
        """The prompt tokens the step scores, and per scheduled index (first position, start, end) in them."""
        rows, spans = PromptTokenRows.empty(), {}
        first_row = 0  # the step's hidden row of each sequence's first new token
        for index, item in enumerate(output.scheduled):
            seq = item.seq
            num_top = seq.sampling_params.prompt_logprobs
            positions = item.prompt_logprob_positions if num_top is not None else None
            if num_top is not None and positions:
                start = len(rows.token_ids)
                rows.add(first_row + positions.start - 1 - seq.num_computed_tokens,
                         seq.prompt_token_ids[positions.start:positions.stop], num_top)
                spans[index] = (positions.start, start, len(rows.token_ids))
            first_row += item.num_new_tokens
        return rows, spans

    def prepare_inputs(self, output: SchedulerOutput
                       ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, torch.Tensor]:
        """Input ids, positions, attention metadata and the rows to take logits of, for one packed forward pass."""
        if output.shape.num_tokens == len(output.scheduled):
            return self.prepare_decodes(output.scheduled)
        return self.prepare_packed(output.scheduled)

    def prepare_packed(self, scheduled: list[ScheduledSequence]
                       ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, torch.Tensor]:
        """prepare_inputs for any step: one Python pass over the sequences gathers what lives in their lists
        (token ids, block tables); the per-token arrays (positions, slots) are then computed for all sequences at
        once with numpy."""
        num_rows = len(scheduled)
        token_ids: list[int] = []
        query_lens, starts, sampling_rows, tables = [], [], [], []
        for row, item in enumerate(scheduled):
            seq, num_new_tokens = item.seq, item.num_new_tokens
            start = seq.num_computed_tokens
            if num_new_tokens == 1:
                token_ids.append(seq.token_id_at(start))
            else:
                token_ids.extend(seq.token_ids(start, start + num_new_tokens))
            tables.append(seq.block_table)
            query_lens.append(num_new_tokens)
            starts.append(start)
            if item.is_sampling:  # its last position's logits pick its next token
                sampling_rows.append(row)
        query_start_loc = np.zeros(num_rows + 1, dtype=np.int64)
        np.cumsum(query_lens, out=query_start_loc[1:])
        block_tables = self._block_table_rows.rows(tables)  # [num_rows, width]
        row_of_token = np.repeat(np.arange(num_rows), query_lens)  # [num_tokens]
        positions = (np.arange(len(token_ids)) - query_start_loc[row_of_token]
                     + np.asarray(starts, dtype=np.int64)[row_of_token])  # [num_tokens]
        slot_mapping = (block_tables[row_of_token, positions // self.block_size].astype(np.int64) * self.block_size
                        + positions % self.block_size)  # [num_tokens]
        seq_lens = [start + num_new for start, num_new in zip(starts, query_lens)]
        meta = AttentionMetadata(
            slot_mapping=self._to_device(slot_mapping),
            query_start_loc=self._to_device(query_start_loc.astype(np.int32)),
            seq_lens=self._to_device(np.asarray(seq_lens, dtype=np.int32)),
            block_tables=self._to_device(block_tables),
            max_query_len=max(query_lens),
            max_seq_len=max(seq_lens),
            query_lens_cpu=tuple(query_lens),
            seq_lens_cpu=tuple(seq_lens),
        )
        input_ids = self._to_device(np.asarray(token_ids, dtype=np.int64))
        logits_indices = query_start_loc[1:][sampling_rows] - 1  # [num_sampling_rows]: each one's last token
        return input_ids, self._to_device(positions), meta, self._to_device(logits_indices)

    def prepare_decodes(self, scheduled: list[ScheduledSequence]
                        ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, torch.Tensor]:
        """prepare_packed's tensors for a step of one new token per sequence, from one Python pass and one numpy
        array per tensor (the block tables' kept from the step before): a decode step's positions and slots need none
        of the per-token arithmetic, whose numpy calls cost ten times their warm cost right after a forward pass."""
        block_size = self.block_size
        token_ids, positions, slots, tables, sampling_rows = [], [], [], [], []
        for row, item in enumerate(scheduled):
            seq = item.seq
            position = seq.num_computed_tokens
            token_ids.append(seq.token_id_at(position))
            positions.append(position)
            table = seq.block_table
            slots.append(table[position // block_size] * block_size + position % block_size)
            tables.append(table)
            if item.is_sampling:
                sampling_rows.append(row)
        seq_lens = [position + 1 for position in positions]
        num_rows = len(scheduled)
        # One array for the three int64 inputs, a tensor of each of its rows.
        inputs = np.array((token_ids, positions, slots), dtype=np.int64)  # [3, num_rows]
        input_ids, positions_tensor, slot_mapping = map(self._to_device, inputs)
        meta = AttentionMetadata(
            slot_mapping=slot_mapping,
            query_start_loc=self._kept(self._row_starts, num_rows, num_rows + 1, torch.int32),
            seq_lens=self._tensor(seq_lens, np.int32),
            block_tables=self._to_device(self._block_table_rows.rows(tables)),
            max_query_len=1,
            max_seq_len=max(seq_lens),
            query_lens_cpu=(1,) * num_rows,
            seq_lens_cpu=tuple(seq_lens),
        )
        logits_indices = (self._kept(self._all_rows, num_rows, num_rows, torch.int64)
                          if len(sampling_rows) == num_rows else self._tensor(sampling_rows, np.int64))
        return input_ids, positions_tensor, meta, logits_indices

    def _kept(self, tensors: dict[int, torch.Tensor], num_rows: int, length: int, dtype: torch.dtype
              ) -> torch.Tensor:
        """torch.arange(length) on the device, made once per num_rows and kept in `tensors`."""
        tensor = tensors.get(num_rows)
        if tensor is None:
            tensor = tensors[num_rows] = torch.arange(length, dtype=dtype, device=self.device)
        return tensor

    def _tensor(self, values: list, dtype: type[np.integer]) -> torch.Tensor:
        """A list as a tensor on the device, through numpy: a third of what torch.tensor takes for a list."""
        return self._to_device(np.array(values, dtype=dtype))

    def _to_device(self, array: np.ndarray) -> torch.Tensor:
        """The array as a tensor on the device: on the CPU the very memory (torch's to() would only return it)."""
        tensor = torch.from_numpy(array)
        return tensor if self.device.type == "cpu" else tensor.to(self.device, non_blocking=True)
