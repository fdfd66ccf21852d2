"""accelerate big-model offload: a checkpoint loaded with parts of it on "disk" computes what the
in-memory model computes, for every kind of variant.

accelerate keeps an offloaded weight on the meta device and loads it only around the forward of the module that
owns it; a weight used outside its owner's forward stays a placeholder (an error, or silently wrong logits). The
reference is the in-memory model the checkpoint was saved from. On this CPU-only machine the execution device is
the CPU, so "disk" is the offloaded device ("cpu" is offload only next to a GPU).
"""

from __future__ import annotations

import pytest
import torch
from accelerate.utils import compute_module_sizes
from transformers import AutoModelForCausalLM

from tests.builders import CLIENT_VARIANTS, delta_model, scramble_delta_weights

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def saved_model(tmp_path, **variant):
    model = delta_model(**variant)
    scramble_delta_weights(model)
    model.save_pretrained(tmp_path / "model")
    return model, str(tmp_path / "model")


def greedy(model, ids: torch.Tensor) -> torch.Tensor:
    return model.generate(ids, max_new_tokens=3, min_new_tokens=3, do_sample=False, pad_token_id=0)


@pytest.mark.filterwarnings("ignore::UserWarning")
@pytest.mark.parametrize("variant", CLIENT_VARIANTS.values(), ids=CLIENT_VARIANTS.keys())
def test_disk_offload_matches_the_in_memory_model(variant, tmp_path):
    model, path = saved_model(tmp_path, **variant)
    ids = torch.randint(1, 97, (2, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected, expected_tokens = model(ids).logits, greedy(model, ids[:1])

    for device_map, max_memory in device_maps(model):
        offloaded = AutoModelForCausalLM.from_pretrained(
            path, device_map=device_map, max_memory=max_memory, offload_folder=str(tmp_path / "offload")
        )
        assert offloaded.transformer.h[1].attn_delta.beta_open.is_meta  # really offloaded
        assert "disk" in offloaded.hf_device_map.values()
        with torch.no_grad():
            assert (offloaded(ids).logits - expected).abs().max() <= 1e-5, device_map
            assert torch.equal(greedy(offloaded, ids[:1]), expected_tokens), device_map


def device_maps(model) -> list[tuple[dict | str, dict | None]]:
    """(device_map, max_memory) pairs: all blocks on disk; one block in memory and the next on disk, with every other
    top-level module of the model (position embedding, TC / CC final read, EC expansion, ln_f) on disk too; "auto"
    with room for about half of the model."""
    others = [name for name, _ in model.transformer.named_children() if name not in ("h", "wte")]
    in_memory = {"transformer.wte": "cpu", "lm_head": "cpu"}  # tied
    blocks_on_disk = in_memory | {"transformer.h": "disk"} | {f"transformer.{name}": "cpu" for name in others}
    one_block_on_disk = in_memory | {"transformer.h.0": "cpu", "transformer.h.1": "disk"}
    one_block_on_disk |= {f"transformer.{name}": "disk" for name in others}
    budget = {"cpu": compute_module_sizes(model)[""] // 2}
    return [(blocks_on_disk, None), (one_block_on_disk, None), ("auto", budget)]


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_the_read_out_offloaded_on_its_own_computes_the_same(tmp_path):
    """The read-out (`transformer.read_out`, the final read vector and TC / CC convolution) is a module: a device map
    that offloads it alone loads its weights around its forward, and the model computes what it computes in memory."""
    model, path = saved_model(tmp_path, delta_value_channels=4, delta_state_read="channel_conv")
    device_map = {"transformer.read_out": "disk", "lm_head": "cpu"}
    device_map |= {f"transformer.{name}": "cpu" for name, _ in model.transformer.named_children() if name != "read_out"}
    offloaded = AutoModelForCausalLM.from_pretrained(path, device_map=device_map, offload_folder=str(tmp_path / "o"))
    ids = torch.tensor([[1, 2, 3, 4]])
    with torch.no_grad():
        assert torch.equal(offloaded(ids).logits, model.eval()(ids).logits)
