"""Directories saved by earlier code load with today's code and give the logits and greedy tokens that code computed:
tests/data/ddl_hf_0_2 (commit b72347a, before the layers-over-ops redesign) and tests/data/main_e568c07 (before the
read became a module of the block and its parameters were renamed), both written by tests/data/make_fixtures.py. The
saved outputs are the reference, not today's code. A directory also round-trips: loaded, saved and loaded again, it
computes the same, and its weights keep the names they were saved under (transformers' rule for renames used at load).
A model built now saves today's names: the old read names are load-only (`from_pretrained`'s `key_mapping`), not a
registered conversion, which transformers would revert on every save and expects to apply to every instance (its own
`test_reverse_loading_mapping`).

They were computed on another machine, whose float32 kernels may sum in another order (another vector width or BLAS
path): bit-identity holds only where both sides run on one machine. The bound is measured, not guessed: today's model
in float64 is the exact answer to within float32's rounding, so the saved float32 logits must lie within a few times
the float32 error that this machine measures against it (the saved ones were within 1.4 times of ours where they were
made). The Delta models' error is not one size: the d_v = 4 paper model amplifies rounding 20 times more than the
others (it normalises small sublayer outputs into k), which is why no single epsilon-based bound fits them all.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM
from transformers.conversion_mapping import get_model_conversion_mapping

import ddl_hf
from tests.builders import delta_config
from tests.rounding import float64_logits_and_bound, machine

DATA = Path(__file__).parents[1] / "data"
FOLDERS = ("ddl_hf_0_2", "main_e568c07")
FIXTURES = [path for folder in FOLDERS for path in sorted((DATA / folder).iterdir()) if path.is_dir()]
NEW_TOKENS = 4


def written_with(folder: Path) -> dict[str, str]:
    return json.loads((folder.parent / "written_with.json").read_text())


def this_machine_wrote(folder: Path) -> bool:
    """Whether this CPU and torch build wrote `folder`: then its outputs are ours bit for bit."""
    saved = written_with(folder)
    return saved.get("machine") == machine() and saved["torch"] == torch.__version__


def mismatches(model: torch.nn.Module, expected: dict[str, torch.Tensor]) -> list[str]:
    """What in `model`'s outputs disagrees with the saved ones beyond float32 rounding (empty: all agree)."""
    ids, mask = expected["input_ids"], expected["attention_mask"]
    logits64, bound = float64_logits_and_bound(model, ids, attention_mask=mask)
    problems = []
    off = float((expected["logits"].double() - logits64).abs().max())
    if off > bound:
        problems.append(f"saved logits differ from today's (float64) by {off:.3g} > {bound:.3g}")
    with torch.no_grad():
        logits32 = model(ids, attention_mask=mask).logits
    off32 = float((expected["logits"] - logits32).abs().max())
    if off32 > 2 * bound:  # each side within `bound` of the float64 logits
        problems.append(f"saved logits differ from today's float32 ones by {off32:.3g} > {2 * bound:.3g}")
    # Greedy tokens, today's in float64 and in float32. Where a step's best two float64 logits are within 2 * bound (a
    # tie for float32 on some machine) either may have been chosen: compare up to that step only.
    generate = dict(max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        out = (
            copy.deepcopy(model)
            .double()
            .generate(ids, attention_mask=mask, output_logits=True, return_dict_in_generate=True, **generate)
        )
        tokens32 = model.generate(ids, attention_mask=mask, **generate)
    top2 = torch.stack(out.logits).topk(2, dim=-1).values  # [steps, batch, 2]
    ties = (top2[..., 0] - top2[..., 1]) < 2 * bound
    for row in range(ids.shape[0]):
        tied = ties[:, row].nonzero()
        length = ids.shape[1] + (int(tied[0]) if len(tied) else NEW_TOKENS)
        for name, tokens in (("float64", out.sequences), ("float32", tokens32)):
            if not torch.equal(tokens[row, :length], expected["tokens"][row, :length]):
                problems.append(f"row {row}: {name} greedy tokens {tokens[row].tolist()} != {expected['tokens'][row]}")
    return problems


@pytest.fixture(scope="module", params=FIXTURES, ids=lambda folder: f"{folder.parent.name}/{folder.name}")
def fixture(request) -> tuple[torch.nn.Module, dict[str, torch.Tensor]]:
    folder = request.param
    model = AutoModelForCausalLM.from_pretrained(folder).eval()
    model.fixture_folder = folder
    return model, load_file(folder / "expected.safetensors")


def test_every_fixture_is_found():
    names = {folder.name for folder in FIXTURES}
    assert len(FIXTURES) == 17 and {"llama-dv4-tc", "delta_net-dv1", "llama-reference-cc-ec-dv4"} <= names
    assert [written_with(DATA / folder / "x")["commit"] for folder in FOLDERS] == ["b72347a", "e568c07"]


@pytest.mark.compat
def test_a_directory_saved_earlier_computes_what_it_computed(fixture):
    model, expected = fixture
    assert mismatches(model, expected) == []
    if this_machine_wrote(model.fixture_folder):
        with torch.no_grad():
            logits = model(expected["input_ids"], attention_mask=expected["attention_mask"]).logits
        assert torch.equal(logits, expected["logits"]), "the machine that wrote the directory computes other logits"


def test_a_directory_round_trips_through_save_and_load(fixture, tmp_path):
    """Load -> save -> load: the same weights under the names they were saved with, and the same logits."""
    model, expected = fixture
    model.save_pretrained(tmp_path)
    saved_names = set(safe_open_keys(model.fixture_folder / "model.safetensors"))
    assert set(safe_open_keys(tmp_path / "model.safetensors")) == saved_names
    again = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    ids, mask = expected["input_ids"], expected["attention_mask"]
    with torch.no_grad():
        assert torch.equal(again(ids, attention_mask=mask).logits, model(ids, attention_mask=mask).logits)


@pytest.mark.parametrize(
    "variant",
    [
        dict(),
        dict(delta_mode="paper", delta_value_channels=4),
        dict(delta_value_channels=4, delta_state_read="channel_conv"),
        dict(delta_value_channels=4, delta_state_read="temporal_conv", delta_embed_expand="conv"),
        dict(token_mixer="delta_net"),
    ],
    ids=["dv1", "paper-dv4", "cc", "tc-ec", "delta_net"],
)
@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_a_new_model_saves_its_own_names_and_registers_no_conversion(family, variant, tmp_path):
    """transformers' contract for conversions (`test_reverse_loading_mapping`): a registered one must apply to every
    instance. None is registered, so a save writes the model's own parameter names, and they load back."""
    if family == "gpt2":
        model = ddl_hf.DeltaGPTForCausalLM(delta_config(**variant))
    elif variant.get("token_mixer"):
        pytest.skip("DeltaLlama's token mixer is attention only")
    else:
        config = ddl_hf.DeltaLlamaConfig(
            vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=8, **variant,
        )  # fmt: skip
        model = ddl_hf.DeltaLlamaForCausalLM(config)
    assert get_model_conversion_mapping(model, add_legacy=False) == []
    model.save_pretrained(tmp_path)
    tied = set(model.all_tied_weights_keys)
    assert set(safe_open_keys(tmp_path / "model.safetensors")) == set(model.state_dict()) - tied
    _, info = type(model).from_pretrained(tmp_path, output_loading_info=True)
    assert not any(info[kind] for kind in ("missing_keys", "unexpected_keys", "mismatched_keys"))


def safe_open_keys(path: Path) -> list[str]:
    from safetensors import safe_open

    with safe_open(str(path), "pt") as f:
        return list(f.keys())


def test_the_check_catches_a_gate_moved_by_a_thousandth(fixture):
    """The mutant the bound must not hide: every gate's bias shifted by 1e-3 (beta moves by about 5e-4)."""
    model, expected = fixture
    mutant = copy.deepcopy(model)
    with torch.no_grad():
        for residual in mutant.delta_residuals().values():
            residual.beta_proj.bias += 1e-3
    found = mismatches(mutant, expected)
    assert any("saved logits differ" in problem for problem in found), found
