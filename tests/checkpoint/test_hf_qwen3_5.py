"""Parity with transformers 5's Qwen3.5 / Qwen3-Next classes (PyTorch, CPU, float32).

Tiny random HF models of every class the family reads (``Qwen3NextForCausalLM``, the MoE and
dense ``Qwen3_5*ForCausalLM``, the vision-language ``Qwen3_5MoeForConditionalGeneration``) are
saved, loaded through ``load_pretrained`` and compared: logits, the gradients of a loss, packed
documents against each alone; then exported and reloaded by transformers, the MTP head and the
vision tower byte for byte. Mixed layer patterns (DeltaNet and attention, dense and MoE layers),
both DeltaNet projection layouts, tied and untied embeddings.
"""

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
torch = pytest.importorskip("torch", reason="needs torch (HF reference models); the default lane has it")
import transformers
from flax import nnx
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from mlir_train.checkpoint.hf import load_pretrained, save_pretrained
from mlir_train.model import losses
from tests.helpers import COMPILER_OPTIONS, perturb_torch

VOCAB = 128
TOL = 1e-4
# Layer patterns the releases do not have (attention first, two DeltaNet layers in a row, ...).
LAYERS = ["full_attention", "linear_attention", "linear_attention", "full_attention"]
TEXT = dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
            head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
            linear_value_head_dim=8, linear_conv_kernel_dim=4, rms_norm_eps=1e-6, max_position_embeddings=512,
            layer_types=LAYERS, rope_parameters={"rope_type": "default", "rope_theta": 1e6, "partial_rotary_factor": 0.25})
MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=24, shared_expert_intermediate_size=32)

CASES = {
    # Qwen3-Next: fused in_proj_qkvz / in_proj_ba, a dense layer among MoE ones, untied.
    "qwen3_next": lambda: transformers.Qwen3NextForCausalLM(transformers.Qwen3NextConfig(
        **TEXT, **MOE, intermediate_size=48, mlp_only_layers=[1], norm_topk_prob=True, tie_word_embeddings=False)),
    "qwen3_5_moe": lambda: transformers.Qwen3_5MoeForCausalLM(transformers.Qwen3_5MoeTextConfig(
        **TEXT, **MOE, tie_word_embeddings=False)),
    "qwen3_5_dense_tied": lambda: transformers.Qwen3_5ForCausalLM(transformers.Qwen3_5TextConfig(
        **TEXT, intermediate_size=48, tie_word_embeddings=True)),
    # The released class: the text model under model.language_model, a vision tower beside it.
    "qwen3_5_moe_vl": lambda: transformers.Qwen3_5MoeForConditionalGeneration(transformers.Qwen3_5MoeConfig(
        text_config=dict(TEXT, **MOE, tie_word_embeddings=False),
        vision_config=dict(depth=1, hidden_size=32, intermediate_size=48, num_heads=2, out_hidden_size=64,
                           num_position_embeddings=16, patch_size=4, spatial_merge_size=2, temporal_patch_size=2))),
}
MTP = {"mtp.fc.weight": (64, 128), "mtp.layers.0.input_layernorm.weight": (64,), "mtp.norm.weight": (64,)}


def cases(*default):
    """Every class; those not named in ``default`` marked slow (~40 s each: a backward compile)."""
    return pytest.mark.parametrize("hf", [pytest.param(c, marks=() if not default or c in default else pytest.mark.slow)
                                          for c in sorted(CASES)], indirect=True)


@pytest.fixture(scope="module")
def hf(request, tmp_path_factory):
    """(the HF model, its directory): a checkpoint as the releases store it, MTP tensors included."""
    torch.manual_seed(0)
    model = CASES[request.param]().eval()
    perturb_torch(model, 1)
    path = str(tmp_path_factory.mktemp(request.param))
    model.save_pretrained(path)
    file = os.path.join(path, "model.safetensors")
    tensors = load_file(file)
    g = torch.Generator().manual_seed(2)
    save_file(tensors | {k: torch.randn(s, generator=g).to(torch.bfloat16) for k, s in MTP.items()}, file,
              metadata={"format": "pt"})
    return request.param, model, path


def _ids(batch=2, seq=20, seed=0):
    return np.random.default_rng(seed).integers(0, VOCAB, size=(batch, seq)).astype(np.int32)


def _compiled(fn, model, *args):
    """``fn(model, *args)`` compiled at -O0 (XLA:CPU compiles are most of these tests' time)."""
    graphdef, state = nnx.split(model)
    f = lambda state, *a: fn(nnx.merge(graphdef, state), *a)
    return jax.jit(f).lower(state, *args).compile(COMPILER_OPTIONS)(state, *args)


def _hf_logits(model, ids):
    with torch.no_grad():
        return model(input_ids=torch.from_numpy(ids).long()).logits.float().numpy()


@cases()
def test_logits_match_hf(hf):
    name, model, path = hf
    ours = load_pretrained(path, dtype=jnp.float32)
    ids = _ids()
    diff = float(np.abs(np.asarray(_compiled(lambda m, x: m(x), ours, jnp.asarray(ids))) - _hf_logits(model, ids)).max())
    print(f"{name}: largest logit difference {diff:.2e}")
    assert diff < TOL


def _grads_by_hf_name(path, ours, ids, labels):
    """Our gradients of the mean cross entropy, written out as an HF checkpoint (the table's
    names and layouts), so they compare with torch's name by name."""
    graphdef, state = nnx.split(ours)

    def loss(state):
        logits = nnx.merge(graphdef, state)(jnp.asarray(ids))
        total, count = losses.cross_entropy_sum(logits, jnp.asarray(labels), jnp.ones(ids.shape, jnp.float32))
        return total / count
    nnx.update(ours, jax.jit(jax.grad(loss)).lower(state).compile(COMPILER_OPTIONS)(state))  # the gradient in the weights' places
    save_pretrained(ours, path)
    return load_file(os.path.join(path, "model.safetensors"))


@cases("qwen3_next")
def test_gradients_match_hf(hf, tmp_path):
    name, model, path = hf
    ids, labels = _ids(seed=3), _ids(seed=4)
    model.zero_grad()
    logits = model(input_ids=torch.from_numpy(ids).long()).logits
    torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB), torch.from_numpy(labels).long().reshape(-1)).backward()
    theirs = {k: p.grad for k, p in model.named_parameters() if p.grad is not None}
    ours = _grads_by_hf_name(str(tmp_path / "grads"), load_pretrained(path, dtype=jnp.float32), ids, labels)
    compared, worst, where = 0, 0.0, ""
    for key, g in theirs.items():
        mine = ours.get(key, None)
        if mine is None:  # torch holds the experts fused, we write them per expert
            mine = _fused(ours, key)
        assert mine is not None, key
        scale = float(g.abs().max()) + 1e-12
        diff = float((mine.float() - g.float()).abs().max()) / scale
        worst, where = max((worst, where), (diff, key))
        compared += 1
    print(f"{name}: {compared} gradients, largest difference relative to the tensor's largest {worst:.2e} ({where})")
    assert compared > 20 and worst < 1e-3


def _fused(tensors, key):
    """transformers 5's fused expert tensor ``key`` of per-expert ones."""
    layer, name = key.rsplit(".experts.", 1)
    experts = range(MOE["num_experts"])
    if name == "gate_up_proj":
        return torch.stack([torch.cat([tensors[f"{layer}.experts.{e}.{p}_proj.weight"] for p in ("gate", "up")])
                            for e in experts])
    if name == "down_proj":
        return torch.stack([tensors[f"{layer}.experts.{e}.down_proj.weight"] for e in experts])
    return None


@cases("qwen3_5_moe")
def test_packed_documents_match_alone_forward_and_backward(hf):
    """A row of two documents equals the two alone (each its own row, padded), logits and the
    gradients of their summed logits: no state, conv window or attention crosses the boundary.
    One compiled program: the three rows' forward, and a backward pass for each side."""
    _, _, path = hf
    graphdef, state = nnx.split(load_pretrained(path, dtype=jnp.float32))
    n = 11
    docs = _ids(2, n, seed=5)
    ids = np.zeros((3, 2 * n), np.int32)
    ids[0], ids[1, :n], ids[2, :n] = docs.reshape(-1), docs[0], docs[1]
    segments = np.array([[1] * n + [2] * n, [1] * n + [0] * n, [1] * n + [0] * n], np.int32)
    positions = np.tile(np.arange(n, dtype=np.int32), (3, 2))

    def forward_backward(state, ids, seg, pos):
        logits, vjp = jax.vjp(lambda st: nnx.merge(graphdef, st)(ids, segment_ids=seg, positions=pos), state)
        packed = jnp.zeros_like(logits).at[0].set(1.0)
        alone = jnp.broadcast_to(seg[:, :, None] > 0, logits.shape).astype(logits.dtype).at[0].set(0.0)
        return logits, vjp(packed)[0], vjp(alone)[0]

    args = (state, *map(jnp.asarray, (ids, segments, positions)))
    logits, g_packed, g_alone = jax.jit(forward_backward).lower(*args).compile(COMPILER_OPTIONS)(*args)
    logits = np.asarray(logits)
    np.testing.assert_allclose(logits[0].reshape(2, n, -1), logits[1:, :n], atol=TOL, rtol=0)
    for x, y in zip(jax.tree.leaves(g_packed), jax.tree.leaves(g_alone)):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), atol=1e-3 * float(np.abs(y).max()) + 1e-6, rtol=0)
    assert max(float(np.abs(y).max()) for y in jax.tree.leaves(g_alone)) > 0


@cases()
def test_export_reloads_in_transformers_and_carries_mtp_and_vision(hf, tmp_path):
    name, model, path = hf
    ours = load_pretrained(path, dtype=jnp.float32)
    out = str(tmp_path / "export")
    save_pretrained(ours, out, carry_from=path)
    with open(os.path.join(out, "config.json")) as f:
        written = json.load(f)
    assert written["architectures"] == [type(model).__name__]
    reloaded = type(model).from_pretrained(out, dtype=torch.float32).eval()
    ids = _ids(seed=7)
    np.testing.assert_allclose(_hf_logits(reloaded, ids), _hf_logits(model, ids), atol=TOL, rtol=0)  # fp32 round trip
    source, export = _raw(path), _raw(out)
    carried = [k for k in source if k.startswith(("mtp.", "model.visual."))]
    assert len(carried) >= len(MTP) + (10 if name.endswith("_vl") else 0)
    for k in carried:
        assert export[k] == source[k], k


def _raw(path):
    """Every tensor of an HF directory as (dtype, shape, bytes)."""
    out = {}
    for f in sorted(os.listdir(path)):
        if f.endswith(".safetensors"):
            with safe_open(os.path.join(path, f), "pt") as s:
                for k in s.keys():
                    t = s.get_tensor(k)
                    out[k] = (str(t.dtype), tuple(t.shape), t.contiguous().view(torch.uint8).numpy().tobytes())
    return out


@cases("qwen3_5_moe")
def test_pipeline_mesh_load_and_export_round_trip(hf, tmp_path):
    """Under PP2 the parameter table still holds: the checkpoint loads onto a pipeline mesh (the
    2-layer DeltaNet stack split over the stages, the 1-layer attention stacks whole on each,
    ``pipeline.storage_axes``) and exports the same tensors."""
    from sharding.layout import Layout
    from sharding.mesh import make_mesh
    from sharding.rules import rules_for

    _, _, path = hf
    parallel = Layout(pipeline=2, num_devices=8)
    ours = load_pretrained(path, dtype=jnp.float32, mesh=make_mesh(parallel), rules=rules_for(parallel))
    spec = lambda a: a[...].sharding.spec
    assert spec(ours.layers[1].linear_attn.wq_DGK)[0] == "stage"
    assert "stage" not in jax.tree.leaves(spec(ours.layers[0].attn.q_proj), is_leaf=lambda x: x is None)
    out = str(tmp_path / "export")
    save_pretrained(ours, out, carry_from=path)
    source, export = _tensors(path), _tensors(out)
    assert source.keys() == export.keys()
    for k in source:
        torch.testing.assert_close(export[k].float(), source[k].float(), rtol=0, atol=0, msg=k)


def _tensors(path):
    out = {}
    for name in sorted(os.listdir(path)):
        if name.endswith(".safetensors"):
            out.update(load_file(os.path.join(path, name)))
    return out
