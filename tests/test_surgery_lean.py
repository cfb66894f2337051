"""Memory-lean surgery: `prune_heads` returns a structural twin that shares every untouched tensor.

Oracles: every untouched parameter and buffer of the pruned model has the original's data_ptr and
the resized projections own new storage; the original's logits are bit-identical before and after
pruning (and after running the pruned model); pruned == masked; `in_place=True` and
`share=False` give bit-identical outputs to the twin; a distillation round on a weight-sharing
student leaves the dense teacher bit-identical; an export of a twin leaves the original alone.
"""
import copy

import numpy as np
import pytest
import torch

from analysis.arch.adapters import adapter_for
from analysis.compress.recover.distill import DistillConfig, distill
from analysis.compress.export import export
from analysis.arch.head_gates import gates_from_mask, head_mask
from analysis.compress.surgery import own_tensors, prune_heads, shared_tensors, structural_twin
from tests._tolerance import EXACT, max_diff
from tests._threads import one_torch_thread  # noqa: F401 (autouse)
from tests._tiny import tiny_input_ids, tiny_model
from tests._masks import forward, surgery_masks

# equality claims run in float64 and are asserted to EXACT (tests/_tolerance.py)
TOL = EXACT
# GQA (uneven and emptied groups), a config override (phi3), Conv1D (gpt2), fused QKV with ALiBi
# (bloom), a BERT encoder whose emptied layer swaps the inner module
FAMILIES = ("llama", "qwen3", "phi3", "gpt2", "bloom", "bert")


def _tensors(model) -> dict[str, torch.Tensor]:
    """Every parameter and buffer by name (tied names included)."""
    return {**dict(model.named_parameters(remove_duplicate=False)),
            **dict(model.named_buffers(remove_duplicate=False))}


def _changed_ids(model, layout) -> set[int]:
    """ids of the tensors of the projections surgery replaced (layers whose head counts changed)."""
    adapter = adapter_for(model)
    changed = set()
    for layer in range(layout.n_layers):
        if layout.layer_counts(layer) != (layout.n_heads, layout.n_kv_heads):
            for module in adapter.projection_modules(model, layer).values():
                changed.update(id(t) for t in module.parameters())
    return changed


def _check_sharing(model, smaller, layout):
    """Untouched tensors: same storage as the original's, new parameter objects; replaced
    projections: storage no tensor of the original uses."""
    original, twin = _tensors(model), _tensors(smaller)
    theirs = {t.data_ptr() for t in original.values()}
    changed = _changed_ids(smaller, layout)
    assert changed or layout.is_identity
    for name, tensor in twin.items():
        if id(tensor) in changed:
            assert tensor.data_ptr() not in theirs, name
        else:
            assert tensor.data_ptr() == original[name].data_ptr() and tensor.shape == original[name].shape, name
            if isinstance(tensor, torch.nn.Parameter):
                assert tensor is not original[name], name     # an alias: its flags are the twin's own


@pytest.mark.parametrize("family", FAMILIES)
def test_twin_shares_untouched_tensors_and_equals_masked(family):
    model = tiny_model(family, dtype=torch.float64)
    g = adapter_for(model).geometry(model)
    ids = tiny_input_ids()
    dense = forward(model, ids)
    for name, pruned in surgery_masks(g, 3).items():
        smaller, layout = prune_heads(model, pruned)
        _check_sharing(model, smaller, layout)
        assert torch.equal(forward(model, ids), dense), f"{name}: pruning changed the original"
        got = forward(smaller, ids)
        assert torch.equal(forward(model, ids), dense), f"{name}: running the twin changed the original"
        with head_mask(model, gates_from_mask(pruned)):
            masked = forward(model, ids)
        assert (got - masked).abs().max().item() <= TOL, name
        owned, _ = prune_heads(model, pruned, share=False)
        assert shared_tensors(owned, model) == [] and torch.equal(forward(owned, ids), got), name
        inplace = copy.deepcopy(model)
        result, in_layout = prune_heads(inplace, pruned, in_place=True)
        assert result is inplace and in_layout == layout
        assert torch.equal(forward(inplace, ids), got), name
    assert not any(type(m).__name__.startswith("Pruned") for m in model.modules())


def test_twin_has_its_own_config_flags_and_dtype_but_keeps_ties():
    model = tiny_model("gemma")                              # tied LM head
    assert model.lm_head.weight is model.model.embed_tokens.weight
    pruned = np.zeros((2, 4), bool)
    pruned[0, :2] = True                                     # KV group 0 of layer 0 emptied
    smaller, _ = prune_heads(model, pruned)
    assert smaller.lm_head.weight is smaller.model.embed_tokens.weight
    assert smaller.config is not model.config
    smaller.config.architectures = ["Changed"]
    smaller.requires_grad_(False)
    smaller.to(torch.float64)
    assert model.config.architectures != ["Changed"]
    assert all(p.requires_grad and p.dtype == torch.float32 for p in model.parameters())


def test_empty_mask_twin_shares_everything():
    model = tiny_model("llama")
    smaller, layout = prune_heads(model, np.zeros((2, 4), bool))
    assert layout.is_identity and smaller is not model
    assert sorted(shared_tensors(smaller, model)) == sorted(_tensors(smaller))


def test_own_tensors_copies_only_what_is_shared_and_keeps_ties():
    model = tiny_model("gemma")
    twin = structural_twin(model)
    twin.model.norm.weight = torch.nn.Parameter(twin.model.norm.weight.detach().clone())   # already its own
    own = twin.model.norm.weight
    own_tensors(twin, model)
    assert shared_tensors(twin, model) == [] and twin.model.norm.weight is own
    assert twin.lm_head.weight is twin.model.embed_tokens.weight
    assert torch.equal(forward(twin, tiny_input_ids()), forward(model, tiny_input_ids()))


@pytest.mark.parametrize("lora", [False, True])
def test_distilling_a_weight_sharing_student_leaves_the_teacher_bit_identical(lora):
    teacher = tiny_model("llama")
    pruned = np.zeros((2, 4), bool)
    pruned[0, 1] = pruned[1, 2] = pruned[1, 3] = True       # layer 1: a whole KV group emptied
    students = {"pruned twin": prune_heads(teacher, pruned)[0],
                "full-shape twin under gates": structural_twin(teacher)}
    snapshot = {k: v.detach().clone() for k, v in _tensors(teacher).items()}
    flags = {k: p.requires_grad for k, p in teacher.named_parameters()}
    config = DistillConfig(steps=2, lr=1e-2, batch_size=2, seq_len=16, lora=lora, lora_rank=2)
    for name, student in students.items():
        assert shared_tensors(student, teacher), name
        gates = gates_from_mask(pruned) if "gates" in name else None
        result = distill(teacher, student, tiny_input_ids(4, 16), config, gates=gates)
        changed = [k for k, v in _tensors(result.model).items() if k in snapshot and v.shape == snapshot[k].shape
                   and not torch.equal(v, snapshot[k])]
        assert changed, f"{name}: training changed nothing (the test would not see a leak)"
        now = _tensors(teacher)
        assert all(torch.equal(v, now[k]) for k, v in snapshot.items()), f"{name}: the teacher changed"
        assert {k: p.requires_grad for k, p in teacher.named_parameters()} == flags, name


def test_export_of_a_twin_leaves_the_original_alone(tmp_path):
    model = tiny_model("qwen2")
    pruned = np.zeros((2, 4), bool)
    pruned[0, 0] = pruned[1, :2] = True
    config_before = model.config.to_dict()
    ids = tiny_input_ids()
    dense = forward(model, ids)
    for fmt in ("pruned", "stock"):
        kv_policy = "expand" if fmt == "stock" else "auto"
        mask = pruned if fmt == "pruned" else np.tile([True, False, False, False], (2, 1))
        export(fmt, model, mask, tmp_path, fmt, kv_policy=kv_policy)
    assert model.config.to_dict() == config_before
    assert torch.equal(forward(model, ids), dense)


def test_twin_of_an_accelerate_dispatched_model_shares_its_weight_maps():
    from accelerate import cpu_offload
    model = tiny_model("llama")
    ids = tiny_input_ids()
    dense = forward(model, ids)
    cpu_offload(model, execution_device=torch.device("cpu"))          # weights in hook maps, params on meta
    twin = structural_twin(model)
    pairs = [(a._hf_hook, b._hf_hook) for a, b in zip(model.modules(), twin.modules()) if hasattr(a, "_hf_hook")]
    assert pairs
    for original, copied in pairs:
        assert copied is not original
        assert copied.weights_map is original.weights_map and copied.tied_params_map is original.tied_params_map
    assert torch.equal(forward(twin, ids), dense) and torch.equal(forward(model, ids), dense)


@pytest.mark.slow
def test_smollm2_twin_shares_and_adds_little_memory(smollm2_f64):
    # float64: the cut model's logits equal the masked model's on every CPU (tests/_tolerance.py)
    model, g = smollm2_f64.model, smollm2_f64.geometry
    rng = np.random.default_rng(1)
    pruned = rng.random((g.n_layers, g.n_heads)) < 0.5           # mostly uneven groups: K/V expanded
    pruned[2] = True                                             # an emptied layer
    pruned[5] = [True] * 3 + [False] * 6                         # an emptied group
    ids = smollm2_f64.tokenizer("A short check of the lean surgery.", return_tensors="pt").input_ids
    dense = forward(model, ids)
    smaller, layout = prune_heads(model, pruned)
    _check_sharing(model, smaller, layout)
    new = {t.data_ptr(): t.numel() * t.element_size() for t in _tensors(smaller).values()
           if id(t) in _changed_ids(smaller, layout)}
    total = {t.data_ptr(): t.numel() * t.element_size() for t in _tensors(model).values()}
    assert sum(new.values()) <= 0.3 * sum(total.values())
    got = forward(smaller, ids)
    assert torch.equal(forward(model, ids), dense)
    with head_mask(model, gates_from_mask(pruned)):
        assert max_diff(got, forward(model, ids)) <= EXACT
