"""The roofline's accounting on a tiny shape, every figure computed by hand."""

import pytest

from gpu_worker.models.config import ModelConfig

from tools.bench.serving.bench_against import flag_value
from tools.benchlib.roofline import Roofline, layer_parameters, lm_head_parameters, min_num_steps, workload_cost

# hidden 4, MLP 8, 2 layers, 2 heads and 1 KV head of dim 2, vocab 10, 2-byte dtype.
# Per layer: q and o 4x4 each, k and v 4x2 each (48), gate/up/down 3 x 4x8 (96): 144; two layers 288. lm_head 40.
CONFIG = ModelConfig("LlamaForCausalLM", vocab_size=10, hidden_size=4, intermediate_size=8, num_hidden_layers=2,
                     num_attention_heads=2, num_key_value_heads=1, head_dim=2)
DTYPE_BYTES = 2


def test_parameters():
    assert layer_parameters(CONFIG) == 288
    assert lm_head_parameters(CONFIG) == 40


def test_one_request_costs():
    # 3 prompt + 2 output tokens: 4 computed tokens (positions 1..4), 2 sampled rows, one decode at position 4.
    cost = workload_cost(CONFIG, DTYPE_BYTES, [(3, 2)], num_steps=2)
    projections, lm_head = 2 * 288 * 4, 2 * 40 * 2
    attention = (4 * 2 * 2 * 2) * (1 + 2 + 3 + 4)  # 4 x heads x head_dim x layers per key attended
    assert cost.flops == projections + lm_head + attention == 2784
    assert cost.weight_bytes == (288 + 40) * 2 * 2 == 1312  # every weight, 2 bytes, 2 steps
    assert cost.kv_bytes == (2 * 2 * 1 * 2 * 2) * 4 == 64  # K and V, 2 layers, 1 head of dim 2, 2 bytes; 4 positions


def test_bound_is_the_larger_of_compute_and_memory():
    roofline = Roofline(workload_cost(CONFIG, DTYPE_BYTES, [(3, 2)], num_steps=2), matmul_rate=1000.0, bandwidth=1000.0)
    assert roofline.compute_seconds == pytest.approx(2.784)
    assert roofline.memory_seconds == pytest.approx(1.376)
    assert roofline.bound_seconds == pytest.approx(2.784)
    slow_memory = Roofline(roofline.workload, matmul_rate=1000.0, bandwidth=100.0)
    assert slow_memory.bound_seconds == pytest.approx(13.76)
    assert "achieved  50.0%" in slow_memory.format("float32", measured_seconds=27.52)


def test_min_num_steps():
    requests = [(3, 2), (5, 4)]  # 1 and 3 decodes
    assert min_num_steps(requests, max_batch=2) == 3  # the longest request's decodes
    assert min_num_steps(requests, max_batch=1) == 4  # every decode in its own step
    assert min_num_steps([], max_batch=4) == 0

def test_quantized_decoder_weights_are_read_as_their_bytes_and_the_lm_head_as_int8():
    int8 = workload_cost(CONFIG, DTYPE_BYTES, [(3, 2)], num_steps=2, quantization="int8")
    int4 = workload_cost(CONFIG, DTYPE_BYTES, [(3, 2)], num_steps=2, quantization="int4")
    assert int8.weight_bytes == (288 * 1 + 40 * 1) * 2 == 656
    assert int4.weight_bytes == (288 * 5 / 8 + 40 * 1) * 2 == 440  # half a byte and a 4-byte scale per 32 weights
    assert int8.flops == int4.flops == 2784 and int8.kv_bytes == 64


def test_bench_against_reads_the_quantization_from_the_server_flags():
    assert flag_value(["--standby-workers", "0", "-q", "int8"], "--quantization", "-q") == "int8"
    assert flag_value(["--quantization=int4"], "--quantization", "-q") == "int4"
    assert flag_value(["--dtype", "float32"], "--quantization", "-q") is None
