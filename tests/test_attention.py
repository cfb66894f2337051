"""The attention-kernel switches (analysis/arch/attention.py): float32 SDPA is the stock kernel outside
autocast (bit for bit, every family that runs SDPA), runs in float32 inside a bfloat16 autocast region,
leaves other kernels alone, and is restored after the block, an error inside it included; bf16
distillation trains under it and hands the student back on its own kernel."""
import copy

import pytest
import torch

from analysis.arch.attention import SDPA_FLOAT32, current_implementation, eager_attention, float32_attention
from analysis.compress.recover import distill as D
from tests._tiny import FAMILIES, tiny_input_ids, tiny_model
from tests._threads import one_torch_thread  # noqa: F401 (autouse)

IDS = tiny_input_ids(2, 12)                                            # [2, 12]


def sdpa_model(family: str, dtype=torch.float32):
    """The tiny model (built eager) on transformers' SDPA kernel, or None where the family has no SDPA."""
    model = tiny_model(family, dtype=dtype)
    try:
        model.set_attn_implementation("sdpa")
    except (ValueError, ImportError):
        return None
    return model if current_implementation(model) == "sdpa" else None


def _sdpa_families():
    return [f for f in FAMILIES if sdpa_model(f) is not None]


def test_most_families_run_sdpa():
    """The parametrized test below must not pass over an empty list."""
    assert {"llama", "qwen2", "mistral", "gpt2", "bert"} <= set(_sdpa_families())


@pytest.mark.parametrize("family", _sdpa_families())
def test_float32_sdpa_outside_autocast_is_the_stock_kernel_bit_for_bit(family):
    """float64 and float32 inputs are never cast, so the switch changes nothing outside autocast."""
    for dtype in (torch.float64, torch.float32):
        model = sdpa_model(family, dtype)
        with torch.no_grad():
            stock = model(input_ids=IDS).logits                        # [2, 12, V]
            with float32_attention(model):
                assert current_implementation(model) == SDPA_FLOAT32
                switched = model(input_ids=IDS).logits                 # [2, 12, V]
        assert current_implementation(model) == "sdpa"
        assert stock.dtype == dtype and torch.equal(stock, switched), family


def _o_proj_input_dtype(model) -> torch.dtype:
    seen = []
    handle = model.model.layers[0].self_attn.o_proj.register_forward_hook(
        lambda module, args, out: seen.append(args[0].dtype))
    try:
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
            model(input_ids=IDS)
    finally:
        handle.remove()
    return seen[0]


def test_under_bf16_autocast_the_attention_core_runs_in_float32():
    """The attention output (o_proj's input) is float32 inside the switch, bfloat16 without it."""
    model = sdpa_model("llama")
    assert _o_proj_input_dtype(model) == torch.bfloat16
    with float32_attention(model):
        assert _o_proj_input_dtype(model) == torch.float32
    assert _o_proj_input_dtype(model) == torch.bfloat16


def test_other_kernels_are_left_alone_and_the_kernel_is_restored_after_an_error():
    model = sdpa_model("llama")
    with eager_attention(model):
        with float32_attention(model):
            assert current_implementation(model) == "eager"             # only "sdpa" is switched
    assert current_implementation(model) == "sdpa"
    with pytest.raises(RuntimeError, match="inside"):
        with float32_attention(model):
            raise RuntimeError("inside")
    assert current_implementation(model) == "sdpa"


def test_bf16_distillation_hands_the_student_back_on_its_own_kernel_with_a_fused_optimizer(monkeypatch):
    teacher = sdpa_model("llama")
    student = copy.deepcopy(teacher)
    seen = []
    original = D.make_optimizer

    def spy(params, config, device):
        optimizer = original(params, config, device)
        seen.append((optimizer.defaults.get("fused"), current_implementation(student)))
        return optimizer

    monkeypatch.setattr(D, "make_optimizer", spy)
    steps = []
    cfg = D.DistillConfig(steps=2, lr=1e-3, batch_size=2, seq_len=12, precision="bf16")
    D.distill(teacher, student, tiny_input_ids(4, 12), cfg,
              on_step=lambda record: steps.append(current_implementation(student)))
    assert seen == [(True, "sdpa")]                                    # fused on the CPU
    assert steps == [SDPA_FLOAT32, SDPA_FLOAT32]                       # trained under float32 attention
    assert current_implementation(student) == "sdpa" and current_implementation(teacher) == "sdpa"
