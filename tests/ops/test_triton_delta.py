"""The Triton op of a whole Delta residual (`ddl_hf.triton_delta`, `delta_implementation="triton"`) on the CPU.

Triton runs its kernels on CPU tensors through its interpreter, which must be switched on (`TRITON_INTERPRET=1`)
before Triton is imported: each check runs in a fresh interpreter (one per group of checks, as the fla tests do) and
prints its measurements; the assertions are here. The reference is `DeltaResidual`'s tensor ops (the readable form
of the same residual), in float64:
- every combination the tensor ops take (paper / additive, erase / write-only, d_v 1, 2, 4, 8, linear / sigmoid /
  constant value), values and every gradient (state, read, c, h and each weight), in float64 to float64 rounding,
  in float32 within 4x the tensor ops' own float32 error, and with autocast's mixed dtypes (a float32 state beside
  bf16 h, c and read); the hidden dim and the tokens cross the kernels' block edges;
- two mutants of the kernels (one forward, one backward term) fail the same comparison;
- the reads of an expanded state against their definitions: linear (`ddl_hf::delta_read`, `(X * w).sum(-1)`), TC
  (`ddl_hf::temporal_read`, `temporal_conv` with a cached window and packed rows), CC (`ddl_hf::channel_read`,
  `channel_conv(X, W) @ r`);
- `torch.library.opcheck` (schema, fake tensors, autograd registration, AOT dispatch) of every op;
- models: DeltaGPT and DeltaLlama with "triton" against "eager", logits and every gradient, for d_v 1 / 4, paper /
  additive, write-only, CC + EC, TC; and a compiled (fullgraph) training step, one op node per residual.
What a CPU cannot say: any speed (`ddl_lab.benchmarks.bench_launches` counts launches; `ddl_lab.checks.gpu_check`
times a GPU).
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

from tests.subprocesses import in_tritons_interpreter

EPS32, EPS64 = torch.finfo(torch.float32).eps, torch.finfo(torch.float64).eps
pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("triton") is None, reason="triton is not installed (the dev extra installs it)"
)

# Shared by every script: DeltaResidual modules of each combination, and the comparison of the op with them.
COMMON = """
import itertools, json, torch
import ddl_hf.triton_delta as triton_delta
from tests.residual_references import COMBINATIONS, combination_residual

# Blocks smaller than the shapes below, so that tokens and the hidden dim cross block edges (masked tails).
triton_delta.launch.BLOCK_HIDDEN, triton_delta.launch.BLOCK_TOKENS = 16, 8
DIM, SHAPE = 24, (3, 7)
assert triton_delta.launch.blocks(DIM, 4) == dict(BLOCK_N=8, BLOCK_D=16, BLOCK_V=4)  # what every launch reads


def module(mode, channels, value, erase):
    return combination_residual(mode, channels, value, erase, dim=DIM)


def inputs(channels, seed=1):
    g = torch.Generator().manual_seed(seed)
    state = torch.randn(*SHAPE, DIM, *((channels,) if channels > 1 else ()), generator=g, dtype=torch.float64)
    x, c, h = (torch.randn(*SHAPE, DIM, generator=g, dtype=torch.float64) for _ in range(3))
    return [state, x, c, h]


def cotangents(channels, seed=2):
    g = torch.Generator().manual_seed(seed)
    out = torch.randn(*SHAPE, DIM, *((channels,) if channels > 1 else ()), generator=g, dtype=torch.float64)
    return out, torch.randn(SHAPE, generator=g, dtype=torch.float64)


def run(fn, m, tensors, dtypes):
    # Values and every gradient (a random cotangent on both outputs) with inputs and weights in `dtypes`.
    m = m.to(dtypes["weights"])
    tensors = [t.to(d).requires_grad_() for t, d in zip(tensors, dtypes["inputs"])]
    out, beta = fn(m, *tensors)
    cot_out, cot_beta = cotangents(m.value_channels)
    loss = (out.double() * cot_out).sum() + (beta.double() * cot_beta).sum()
    wrt = tensors + list(m.parameters())
    return [out, beta] + list(torch.autograd.grad(loss, wrt, allow_unused=True))


def token_sums(m, tensors):
    # Per weight, sum over tokens of |that token's share of its float64 gradient| (the largest element): the scale of
    # the rounding of a gradient summed over tokens, which cancellation may make far smaller than its terms.
    m = m.double()
    cot_out, cot_beta = (c.flatten(0, 1) for c in cotangents(m.value_channels))
    total = [torch.zeros_like(p) for p in m.parameters()]
    for n in range(cot_beta.shape[0]):
        out, beta = m(*(t.flatten(0, 1)[n : n + 1] for t in tensors))
        loss = (out * cot_out[n : n + 1]).sum() + (beta * cot_beta[n : n + 1]).sum()
        for t, g in zip(total, torch.autograd.grad(loss, list(m.parameters()))):
            t += g.abs()
    return [float(t.max()) for t in total]


def eager(m, *t):
    return m(*t)


def kernel(m, *t):
    return triton_delta.residual(*t, m.step_weights())


def relative_errors(result, reference, scales=()):
    # max |a - b| / scale per output, the scale max |b| or, for the weights' gradients, `scales` (0 where both are
    # absent or zero, inf where only one is)
    errors = []
    scales = [None] * (len(result) - len(scales)) + list(scales)
    for a, b, scale in zip(result, reference, scales):
        if a is None or b is None:
            other = a if b is None else b
            errors.append(0.0 if other is None or float(other.abs().max()) == 0 else float("inf"))
            continue
        scale = float(b.abs().max()) if scale is None else scale
        errors.append(float((a.double() - b.double()).abs().max()) / (scale or 1.0))
    return errors


F64 = dict(inputs=[torch.float64] * 4, weights=torch.float64)
F32 = dict(inputs=[torch.float32] * 4, weights=torch.float32)
MIXED = dict(inputs=[torch.float32, torch.bfloat16, torch.bfloat16, torch.bfloat16], weights=torch.float32)
"""

OPS_SCRIPT = (
    COMMON
    + """
out = {}
for combination in COMBINATIONS:
    m, tensors = module(*combination), inputs(combination[1])
    reference = run(eager, m, tensors, F64)
    row = {"f64": relative_errors(run(kernel, m, tensors, F64), reference)}
    if combination[1] in (1, 4):  # rounding in float32 and in autocast's dtypes (d_v 2 and 8 round alike)
        for name, dtypes in (("f32", F32), ("mixed", MIXED)):
            rounded = [t.to(d).double() for t, d in zip(tensors, dtypes["inputs"])]  # the same inputs, exactly
            reference = run(eager, m.double(), rounded, F64)
            scales = token_sums(m.to(dtypes["weights"]), rounded)
            row[name] = relative_errors(run(kernel, m, tensors, dtypes), reference, scales)
            row[name + "_eager"] = relative_errors(run(eager, m, tensors, dtypes), reference, scales)
    out["-".join(map(str, combination))] = row

# The read of an expanded state (`ddl_hf::delta_read`): x = sum_v X w, a read vector [d_v] or the CC read's [D, d_v]
# weight, against the tensor ops `(X * w).sum(-1)`; an expanded X_0 (stride 0 over the channels) too.
reads = {}
for channels in (2, 4, 8):
    state = inputs(channels)[0]
    g = torch.Generator().manual_seed(channels)
    for kind, shape in (("vector", (channels,)), ("per_hidden", (DIM, channels))):
        weight = torch.randn(shape, generator=g, dtype=torch.float64)
        for layout, x in (("dense", state), ("expanded", state[..., :1].expand(state.shape))):
            cot = torch.randn(x.shape[:-1], generator=g, dtype=torch.float64)
            results = []
            for fn in (triton_delta.read, lambda a, w: (a * w).sum(-1)):
                a, w = x.clone().requires_grad_(), weight.clone().requires_grad_()
                y = fn(a, w)
                results.append([y, *torch.autograd.grad((y * cot).sum(), (a, w))])
            reads[f"{channels}-{kind}-{layout}"] = relative_errors(*results)
# The TC read (`ddl_hf::temporal_read`) against its definition, `temporal_conv(cat([past or zeros, x]), w r).sum(-1)`:
# one value channel or four, with and without the read vector, K 2 and 4, a cached window, packed rows.
from ddl_hf.delta_ops import channel_conv, same_document_taps, temporal_conv
windows = {}
starts = torch.zeros(2, 7, dtype=torch.bool)
starts[0, 3] = starts[1, 5] = True
for channels, with_read, size, with_past, packed in itertools.product((1, 4), (False, True), (2, 4), (False, True),
                                                                      (False, True)):
    g = torch.Generator().manual_seed(size)
    x, cot = torch.randn(2, 7, DIM, channels, generator=g, dtype=torch.float64), None
    weight = torch.randn(DIM, channels, size, generator=g, dtype=torch.float64)
    read = torch.randn(channels, generator=g, dtype=torch.float64) if with_read else None
    past = torch.randn(2, size - 1, DIM, channels, generator=g, dtype=torch.float64) if with_past else None
    taps = same_document_taps(starts, size) if packed else None
    cot = torch.randn(2, 7, DIM, generator=g, dtype=torch.float64)

    def definition(a, w, r):
        history = torch.cat([past if past is not None else a.new_zeros(2, size - 1, DIM, channels), a], 1)
        return temporal_conv(history, w if r is None else w * r[:, None], taps).sum(-1)

    results = []
    for fn in (lambda a, w, r: triton_delta.temporal_read(a, w, r, past, taps)[0], definition):
        leaves = [t.clone().requires_grad_() for t in (x, weight) + ((read,) if with_read else ())]
        y = fn(*leaves, *([] if with_read else [None]))
        results.append([y, *torch.autograd.grad((y * cot).sum(), leaves)])
    name = f"tc-{channels}-{with_read}-{size}-{with_past}-{packed}"
    reads[name] = relative_errors(*results)
    # The next window the op writes: [past or zeros, x] whole (history) or its last K - 1 rows, bit for bit; a decoded
    # step (T = 1) takes K - 2 of them from the past.
    for steps in (7, 1):
        a = x[:, :steps]
        history = torch.cat([past if past is not None else a.new_zeros(2, size - 1, DIM, channels), a], 1)
        for whole in (True, False):
            window = triton_delta.temporal_read(a, weight, read, past, taps[:, :steps] if packed else None, whole)[1]
            windows[f"{name}-{steps}-{whole}"] = torch.equal(window, history if whole else history[:, steps:])

# The CC read (`ddl_hf::channel_read`) against its definition, `channel_conv(X, W) @ r`, every kernel size K <= d_v.
for channels in (2, 4, 8):
    for size in range(1, channels + 1):
        g = torch.Generator().manual_seed(10 * channels + size)
        leaves = [torch.randn(*SHAPE, DIM, channels, generator=g, dtype=torch.float64),
                  torch.randn(DIM, size, generator=g, dtype=torch.float64),
                  torch.randn(channels, generator=g, dtype=torch.float64)]
        cot = torch.randn(*SHAPE, DIM, generator=g, dtype=torch.float64)
        results = []
        for fn in (triton_delta.channel_read, lambda a, w, r: channel_conv(a, w) @ r):
            args = [t.clone().requires_grad_() for t in leaves]
            y = fn(*args)
            results.append([y, *torch.autograd.grad((y * cot).sum(), args)])
        reads[f"cc-{channels}-{size}"] = relative_errors(*results)
out["reads"] = reads
out["windows"] = windows

# Each op's output is a tensor of its own, not a view made inside the autograd node (an in-place op on it would
# raise; FSDP2 warns about views among a block's outputs): the residual's state and beta, and each read.
m, (state, x, c, h) = module("paper", 4, "linear", True), inputs(4)
leaves = [t.requires_grad_() for t in (state, x, c, h)]
outputs = list(triton_delta.residual(*leaves, m.step_weights()))
outputs.append(triton_delta.read(leaves[0], torch.ones(4, dtype=torch.float64)))
outputs.append(triton_delta.channel_conv_read(leaves[0], torch.ones(DIM, 3, dtype=torch.float64),
                                              torch.ones(4, dtype=torch.float64)))
outputs.extend(triton_delta.temporal_conv_read(leaves[0], torch.ones(DIM, 4, 3, dtype=torch.float64), None, None,
                                               None))
out["views"] = [t._base is not None for t in outputs]
outputs[0].mul_(2.0)  # an in-place op on the state the residual returned
print("RESULT", json.dumps(out))
"""
)

MUTANT_SCRIPT = (
    COMMON
    + """
import importlib, pathlib, shutil, sys, tempfile
package = pathlib.Path(triton_delta.__file__).parent
MUTANTS = {
    "forward: the erase term loses r": ("coefficient = v - r[:, None] * hx", "coefficient = v - hx"),
    "backward: dh's |h| term is r^2": ("cube = r * r * r * h_dot_dk", "cube = r * r * h_dot_dk"),
}
out = {}
folder = pathlib.Path(tempfile.mkdtemp())
sys.path.insert(0, str(folder))
for i, (name, (old, new)) in enumerate(MUTANTS.items()):
    # A copy of the package under a name of its own, its custom ops renamed, one kernel line changed.
    shutil.copytree(package, folder / f"mutant_{i}", ignore=shutil.ignore_patterns("__pycache__"))
    found = 0
    for path in (folder / f"mutant_{i}").glob("*.py"):
        source = path.read_text()
        found += source.count(old)
        source = source.replace("from ..delta_ops", "from ddl_hf.delta_ops").replace("ddl_hf::", f"ddl_hf_mutant{i}::")
        path.write_text(source.replace(old, new))
    assert found == 1, name
    mutant = importlib.import_module(f"mutant_{i}")
    mutant.launch.BLOCK_HIDDEN, mutant.launch.BLOCK_TOKENS = 16, 8
    m, tensors = module("paper", 4, "linear", True), inputs(4)
    reference = run(eager, m, tensors, F64)
    out[name] = relative_errors(run(lambda m, *t: mutant.residual(*t, m.step_weights()), m, tensors, F64), reference)
print("RESULT", json.dumps(out))
"""
)

OPCHECK_SCRIPT = (
    COMMON
    + """
out = {}
for combination in (("paper", 4, "sigmoid", True), ("additive", 1, "linear", False), ("paper", 2, "constant", True)):
    m, (state, x, c, h) = module(*combination), inputs(combination[1])
    w = m.step_weights()
    mode = 2 if w.value_weight is None else (0 if w.value_scale is None else 1)
    args = (state.requires_grad_(), x.requires_grad_() if mode == 1 else None, c.requires_grad_(), h.requires_grad_(),
            w.gate_weight, w.gate_bias, w.beta_open, w.value_weight, w.value_bias, mode, w.value_scale or 1.0,
            w.value_constant, w.eps, w.additive, w.erase)
    report = torch.library.opcheck(torch.ops.ddl_hf.delta_residual.default, args)
    out["-".join(map(str, combination))] = report
state = inputs(4)[0].requires_grad_()
for weight in (torch.randn(4, dtype=torch.float64), torch.randn(DIM, 4, dtype=torch.float64)):
    out[f"read-{weight.dim()}"] = torch.library.opcheck(torch.ops.ddl_hf.delta_read.default,
                                                         (state, weight.requires_grad_()))
from ddl_hf.delta_ops import same_document_taps
x = state.detach()[:, :, :, :].requires_grad_()
weight, read = torch.randn(DIM, 4, 3, dtype=torch.float64).requires_grad_(), torch.randn(4, dtype=torch.float64)
past, taps = torch.randn(3, 2, DIM, 4, dtype=torch.float64), same_document_taps(torch.rand(3, 7) < 0.3, 3)
out["temporal_read"] = torch.library.opcheck(torch.ops.ddl_hf.temporal_read.default,
                                             (x, weight, read.requires_grad_(), past, taps))
out["channel_read"] = torch.library.opcheck(torch.ops.ddl_hf.channel_read.default,
                                            (x, torch.randn(DIM, 3, dtype=torch.float64).requires_grad_(), read))
print("RESULT", json.dumps(out))
"""
)


@pytest.fixture(scope="module")
def ops() -> dict:
    return in_tritons_interpreter(OPS_SCRIPT)


#: float64: both sides round only in float64; a D = 24 dot product and a handful of scalar steps, with a margin.
F64_BOUND = 64 * 24 * EPS64


def test_every_combination_matches_the_tensor_ops_in_float64(ops):
    combinations = {name: row for name, row in ops.items() if name not in ("reads", "views", "windows")}
    assert len(combinations) == 48
    for combination, row in combinations.items():
        assert max(row["f64"]) <= F64_BOUND, (combination, row["f64"])


def test_every_op_returns_tensors_of_their_own(ops):
    assert ops["views"] == [False] * 6


def test_the_tc_read_writes_the_next_window(ops):
    """The window `ddl_hf::temporal_read` writes for the next step (no separate concatenation launch): `[past or
    zeros, x]`, whole (what assisted decoding crops) or its last K - 1 rows, for a prompt and a decoded token."""
    assert len(ops["windows"]) == 32 * 4
    assert all(ops["windows"].values()), [case for case, equal in ops["windows"].items() if not equal]


def test_the_reads_match_their_definitions_in_float64(ops):
    """The linear read (d_v 2, 4, 8; a read vector and a per-hidden weight; a dense and an expanded state), the TC
    read (1 or 4 channels, with and without the read vector, K 2 and 4, a cached window, packed rows) and the CC read
    (d_v 2, 4, 8, every K <= d_v), values and gradients."""
    reads = ops["reads"]
    assert len(reads) == 12 + 32 + 14
    for case, errors in reads.items():
        assert max(errors) <= F64_BOUND, (case, errors)


@pytest.mark.parametrize("dtypes", ["f32", "mixed"])
def test_float32_and_autocasts_mixed_dtypes_round_no_more_than_the_tensor_ops(ops, dtypes):
    """Against the float64 reference on the same (rounded) inputs: within 4x the tensor ops' own error in the same
    dtypes (the rounding argument of tests/rounding.py), at least a few roundings of the output's dtype. Mixed: a
    float32 state beside bf16 h, c and read, what bf16 autocast hands a Delta residual; the gradients of the bf16
    inputs are bf16, so their error is bf16's rounding for both. A weight's gradient, a sum over tokens, is measured
    against the sum of its terms' sizes (cancellation can make the sum itself far smaller than its rounding)."""
    rows = {combination: row for combination, row in ops.items() if isinstance(row, dict) and dtypes in row}
    assert len(rows) == 24
    for combination, row in rows.items():
        for i, (error, own) in enumerate(zip(row[dtypes], row[dtypes + "_eager"])):
            floor = 4 * (torch.finfo(torch.bfloat16).eps if dtypes == "mixed" and i in (3, 4, 5) else EPS32)
            assert error <= 4 * max(own, floor), (combination, dtypes, i, error, own)


def test_a_mutant_kernel_fails_the_comparison():
    errors = in_tritons_interpreter(MUTANT_SCRIPT)
    assert set(errors) == {"forward: the erase term loses r", "backward: dh's |h| term is r^2"}
    for name, errs in errors.items():
        assert max(errs) > 1e3 * F64_BOUND, (name, errs)


def test_opcheck_passes_schema_fake_tensors_autograd_and_aot_dispatch():
    reports = in_tritons_interpreter(OPCHECK_SCRIPT)
    assert len(reports) == 7  # three residual combinations, the linear read twice, the TC and the CC read
    for combination, report in reports.items():
        assert report and all(result == "SUCCESS" for result in report.values()), (combination, report)


MODELS_SCRIPT = """
import copy, json, torch
from tests.builders import CLIENT_VARIANTS, delta_model, scramble_delta_weights
from tests.builders import build_source
from tests.builders import to_delta
from tests.builders import open_llama_gates as llama_open_gates

VARIANTS = {name: CLIENT_VARIANTS[name] for name in
            ("additive-dv1", "paper-dv1", "additive-dv4", "paper-dv4", "tc-dv1", "tc-ec-paper-dv4", "cc-dv4",
             "reference-tc-dv4")}
VARIANTS["write-only-paper-dv4"] = dict(delta_mode="paper", delta_value_channels=4, delta_erase=False)
VARIANTS["cc-ec-constant-dv4"] = dict(delta_value_channels=4, delta_state_read="channel_conv",
                                      delta_embed_expand="conv", delta_value="constant")
IDS = torch.randint(1, 97, (2, 11), generator=torch.Generator().manual_seed(0))


def step(model, ids, implementation):
    model.set_delta_implementation(implementation)
    model.zero_grad(set_to_none=True)
    out = model(ids, labels=ids)
    out.loss.backward()
    return [out.logits.detach()] + [p.grad for p in model.parameters()]


def errors(model, ids):
    # float32 "triton" and "eager" against float64 "eager": the largest error over the logits and every gradient,
    # each relative to that tensor's largest value; and how many gradients one of them lacks
    model.train()
    reference = step(copy.deepcopy(model).double(), ids, "eager")
    out = {}
    for implementation in ("triton", "eager"):
        result = step(model, ids, implementation)
        pairs = list(zip(result, reference))
        out[implementation] = max(
            float((a.double() - b).abs().max()) / float(b.abs().max() or 1.0) for a, b in pairs if a is not None
            and b is not None)
        out[implementation + "_missing"] = sum((a is None) != (b is None) for a, b in pairs)
    return out


out = {}
for name, fields in VARIANTS.items():
    model = delta_model(fields)
    scramble_delta_weights(model)
    out[name] = errors(model, IDS)
for name, fields in (("llama-dv1", {}), ("llama-paper-dv4", dict(delta_mode="paper", delta_value_channels=4))):
    model = llama_open_gates(to_delta(build_source("llama"), **fields))
    out[name] = errors(model, IDS)

# Compiled (fullgraph) training with the op: dynamo sees one node per Delta residual and no graph break; the step's
# loss and gradients equal the eager "triton" model's.
import torch._dynamo
from torch._dynamo.utils import counters
model = delta_model(delta_mode="paper", delta_value_channels=4)
scramble_delta_weights(model)
model.train()
eager = step(model, IDS, "triton")
nodes = []
def backend(graph, example_inputs):
    nodes.extend(str(node.target) for node in graph.graph.nodes if node.op == "call_function")
    from torch._dynamo.backends.common import aot_autograd
    return aot_autograd(fw_compiler=lambda g, _: g, bw_compiler=lambda g, _: g)(graph, example_inputs)
counters.clear()
compiled = torch.compile(model, backend=backend, fullgraph=True)
compiled_result = step(compiled, IDS, "triton")
out["compiled"] = dict(
    residual_nodes=sum("ddl_hf.delta_residual" in n for n in nodes),
    graph_breaks=sum(counters["graph_break"].values()),
    error=max(float((a - b).abs().max()) / float(b.abs().max() or 1.0) for a, b in zip(compiled_result, eager)),
    layers=model.config.n_layer,
)


# Cached decoding of the TC variants, where the op writes each read's next window: a prompt, three tokens, then two
# drafted tokens of which assisted decoding rejects one (the cache crops the windows back) and decodes it again; with
# a static cache (windows written in place), the prompt and four tokens.
from ddl_hf import DeltaStaticStateCache


def decoded(model, implementation, static=False):
    model.set_delta_implementation(implementation)
    cache = DeltaStaticStateCache(model.config, max_cache_len=16) if static else None
    with torch.no_grad():
        out = model(IDS[:, :6], past_key_values=cache, use_cache=True)
        cache, logits = out.past_key_values, [out.logits]
        for chunk in (IDS[:, 6:7], IDS[:, 7:8], IDS[:, 8:9], IDS[:, 9:11]):
            logits.append(model(chunk, past_key_values=cache, use_cache=True).logits)
        if not static:
            cache.crop(-1)
            logits.append(model(IDS[:, 10:11], past_key_values=cache, use_cache=True).logits)
    return torch.cat(logits, 1)


decoding = {}
for name in ("tc-dv1", "tc-ec-paper-dv4", "reference-tc-dv4"):
    model = delta_model(VARIANTS[name])
    scramble_delta_weights(model)
    model.eval()
    for static in (False, True):
        reference = decoded(copy.deepcopy(model).double(), "eager", static)
        decoding[name + ("-static" if static else "")] = {
            implementation: float((decoded(model, implementation, static).double() - reference).abs().max()
                                  / reference.abs().max())
            for implementation in ("triton", "eager")
        }
out["decoding"] = decoding
print("RESULT", json.dumps(out))
"""


@pytest.fixture(scope="module")
def models() -> dict:
    return in_tritons_interpreter(MODELS_SCRIPT)


def test_models_with_triton_match_eager_within_float32_rounding(models):
    """DeltaGPT (d_v 1 / 4, paper / additive, write-only, TC, TC + EC, CC, CC + EC with a constant value, the
    authors' TC preset) and DeltaLlama: logits and every gradient of a training step, float32, against the float64
    "eager" model: the Triton op within 4x the tensor ops' own error (at least a few float32 roundings)."""
    variants = {name: errors for name, errors in models.items() if name not in ("compiled", "decoding")}
    assert len(variants) == 12
    for name, errors in variants.items():
        assert errors["triton_missing"] == errors["eager_missing"] == 0, (name, errors)
        assert errors["triton"] <= 4 * max(errors["eager"], 16 * EPS32), (name, errors)


def test_cached_decoding_of_tc_models_with_triton_matches_eager(models):
    """TC, TC + EC and the authors' TC preset: a prompt, decoded tokens, two drafted tokens of which one is rejected
    (`crop`) and decoded again, and with a static cache: the logits within 4x the tensor ops' own float32 error (the
    op writes the windows)."""
    assert len(models["decoding"]) == 6
    for name, errors in models["decoding"].items():
        assert errors["triton"] <= 4 * max(errors["eager"], 16 * EPS32), (name, errors)


def test_a_compiled_fullgraph_training_step_sees_one_node_per_residual(models):
    compiled = models["compiled"]
    assert compiled["graph_breaks"] == 0
    assert compiled["residual_nodes"] == 2 * compiled["layers"]  # attention and MLP residual of every layer
    assert compiled["error"] <= 16 * EPS32  # the same kernels, in the same order: equal up to a few roundings
