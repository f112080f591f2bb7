"""Multi-token prediction (``--mtp-num-layers``) against references nobody here wrote.

The oracle is vLLM's MTP forward (``Qwen3NextMultiTokenPredictor``: ``fc([pre_fc_norm_embedding(
embed(ids shifted)); pre_fc_norm_hidden(h)])``, one decoder layer, ``norm``, the shared LM head),
assembled from transformers 5's own Qwen3.5 classes in PyTorch: the decoder layer and its final
norm are a one-layer ``Qwen3_5MoeForCausalLM``'s, the norms transformers' ``Qwen3_5MoeRMSNorm``.
The loss is megatron-core's (``GPTModel._postprocess``): the LM loss plus
``mtp_loss_scaling_factor / N`` times the depth's loss over its own rolled mask. The HF
directory is the releases' layout (``mtp.*`` beside the text model), read by ``load_pretrained``.
"""

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from mlir_train import families
from mlir_train.checkpoint.hf import load_pretrained, save_pretrained
from mlir_train.model import losses, mtp
from tests.helpers import COMPILER_OPTIONS, perturb_torch

VOCAB, FACTOR = 128, 0.3
TEXT = dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
            linear_value_head_dim=8, linear_conv_kernel_dim=4, rms_norm_eps=1e-6, max_position_embeddings=512,
            rope_parameters={"rope_type": "default", "rope_theta": 1e6, "partial_rotary_factor": 0.25},
            num_experts=4, num_experts_per_tok=2, moe_intermediate_size=24, shared_expert_intermediate_size=32,
            tie_word_embeddings=True)


def test_shifted_stays_in_its_document():
    ids = jnp.arange(1, 13, dtype=jnp.int32).reshape(1, 12)
    seg = jnp.asarray([[1, 1, 1, 1, 2, 2, 2, 3, 3, 3, 0, 0]], jnp.int32)
    np.testing.assert_array_equal(mtp.shifted(ids, seg, 1), [[2, 3, 4, 0, 6, 7, 0, 9, 10, 0, 12, 0]])
    np.testing.assert_array_equal(mtp.shifted(ids, seg, 2), [[3, 4, 0, 0, 7, 0, 0, 10, 0, 0, 0, 0]])


def test_depth_weights_follow_megatron_normalisation():
    """Per micro-batch over the depth's own rolled loss tokens by default; over the global
    batch's main loss tokens under --calculate-per-token-loss (finalize_model_grads)."""
    mask = np.ones((2, 2, 6), np.float32)
    mask[0, 0, :2] = 0  # the first micro-batch's first row prompts for two tokens
    batch = {"input_ids": jnp.ones((2, 2, 6), jnp.int32), "labels": jnp.ones((2, 2, 6), jnp.int32),
             "loss_mask": jnp.asarray(mask), "segment_ids": jnp.ones((2, 2, 6), jnp.int32)}
    got = mtp.depth_inputs(batch, 2, FACTOR, micro_batch_size=1, per_token=False)
    m1 = np.asarray(got["mtp_log_weight_1"] > 0, np.float32)
    np.testing.assert_array_equal(m1[..., -1], 0)  # nothing past the row
    np.testing.assert_array_equal(m1[0, 0], [0, 1, 1, 1, 1, 0])
    assert m1[1, 1].sum() == 5
    np.testing.assert_allclose(got["mtp_log_weight_1"][0, 0, 2], 1 / 4 / 4)  # its tokens, 4 micro-batches of 1 row
    np.testing.assert_allclose(got["mtp_weight_2"], FACTOR / 2 * np.asarray(got["mtp_log_weight_2"]))
    per_token = mtp.depth_inputs(batch, 1, FACTOR, micro_batch_size=1, per_token=True)
    np.testing.assert_allclose(per_token["mtp_weight_1"], FACTOR * m1 / mask.sum())


def _hf_model_with_mtp(path):
    """A tiny Qwen3.5-MoE (tied embeddings) with an MTP head, saved as the releases store it;
    returns (main, mtp layer model, fc, pre_fc norms) in torch."""
    torch = pytest.importorskip("torch", reason="needs torch (HF reference); the default lane has it")
    import transformers
    from safetensors.torch import load_file, save_file

    torch.manual_seed(0)
    layers = ["linear_attention", "full_attention"]
    main = transformers.Qwen3_5MoeForCausalLM(transformers.Qwen3_5MoeTextConfig(**TEXT, layer_types=layers)).eval()
    head = transformers.Qwen3_5MoeForCausalLM(transformers.Qwen3_5MoeTextConfig(
        **dict(TEXT, num_hidden_layers=1), layer_types=["full_attention"])).eval()
    norm = transformers.models.qwen3_5_moe.modeling_qwen3_5_moe.Qwen3_5MoeRMSNorm
    enorm, hnorm = norm(64, eps=1e-6), norm(64, eps=1e-6)
    fc = torch.nn.Linear(128, 64, bias=False)
    for i, m in enumerate((main, head, enorm, hnorm, fc)):
        perturb_torch(m, i + 1)
    main.save_pretrained(path)
    head_dir = path + "-head"
    head.save_pretrained(head_dir)
    file = os.path.join(path, "model.safetensors")
    tensors = load_file(file)
    for k, v in load_file(os.path.join(head_dir, "model.safetensors")).items():
        if k.startswith("model.layers.0."):
            tensors["mtp.layers.0." + k[len("model.layers.0."):]] = v
    tensors |= {"mtp.norm.weight": head.model.norm.weight.detach().clone(), "mtp.fc.weight": fc.weight.detach().clone(),
                "mtp.pre_fc_norm_embedding.weight": enorm.weight.detach().clone(),
                "mtp.pre_fc_norm_hidden.weight": hnorm.weight.detach().clone()}
    save_file(tensors, file, metadata={"format": "pt"})
    return main, head, fc, enorm, hnorm


def _torch_loss(main, head, fc, enorm, hnorm, ids):
    """megatron-core's objective for one micro-batch of single-document rows, no MoE aux loss:
    LM loss + FACTOR * depth-1 loss, each over its own loss tokens (vLLM's MTP forward)."""
    import torch

    x = torch.from_numpy(ids).long()
    labels, mask = torch.roll(x, -1, 1), torch.ones(x.shape)
    mask[:, -1] = 0
    h = main.model(input_ids=x).last_hidden_state
    ce = lambda logits, y: torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB), y.reshape(-1), reduction="none")
    lm = (ce(main.lm_head(h), labels) * mask.reshape(-1)).sum() / mask.sum()
    x1, labels1, mask1 = (torch.roll(t, -1, 1) for t in (x, labels, mask))
    x1[:, -1], mask1[:, -1] = 0, 0
    e = enorm(main.model.embed_tokens(x1))
    h1 = head.model(inputs_embeds=fc(torch.cat([e, hnorm(h)], -1))).last_hidden_state
    depth = (ce(main.lm_head(h1), labels1) * mask1.reshape(-1)).sum() / mask1.sum()
    return lm + FACTOR * depth, depth


def _our_loss(model, ids):
    """The same objective through the trainer's pieces (mtp.depth_inputs / depth_loss)."""
    b, t = ids.shape
    seg, pos = jnp.ones((b, t), jnp.int32), jnp.broadcast_to(jnp.arange(t), (b, t))
    labels = jnp.roll(ids, -1, 1)
    mask = jnp.ones((b, t), jnp.float32).at[:, -1].set(0)
    batch = {"input_ids": ids, "labels": labels, "loss_mask": mask, "segment_ids": seg}
    extra = {k: v[0] for k, v in mtp.depth_inputs(jax.tree.map(lambda a: a[None], batch), 1, FACTOR,
                                                  micro_batch_size=b, per_token=False).items()}
    h, _ = model.hidden_states(ids, segment_ids=seg, positions=pos)
    weight = losses.loss_token_weights(mask[None], micro_batch_size=b, per_token=False)[0]
    lm, _, _ = model.weighted_loss_sums(h, labels, mask, weight)
    hs, _ = model.mtp_hidden_states(h, [extra["mtp_input_ids_1"]], segment_ids=seg, positions=pos)
    objective, logged = mtp.depth_loss(model, hs, extra)
    return lm + objective, logged[0]


def test_mtp_loss_and_gradients_match_vllm_forward_in_torch(tmp_path):
    """Loss, logged depth loss and every gradient (the shared embedding / LM head included)."""
    torch = pytest.importorskip("torch", reason="needs torch (HF reference); the default lane has it")

    path = str(tmp_path / "hf")
    ref = _hf_model_with_mtp(path)
    ids = np.random.default_rng(0).integers(1, VOCAB, size=(2, 12)).astype(np.int32)
    for m in ref:
        m.zero_grad()
    loss, depth = _torch_loss(*ref, ids)
    loss.backward()
    ours = load_pretrained(path, dtype=jnp.float32, config_overrides={"mtp_num_layers": 1})
    graphdef, state = nnx.split(ours)

    def f(state):
        return _our_loss(nnx.merge(graphdef, state), jnp.asarray(ids))

    (our_loss, our_depth), grads = jax.jit(jax.value_and_grad(f, has_aux=True)).lower(state).compile(
        COMPILER_OPTIONS)(state)
    loss, depth = float(loss.detach()), float(depth.detach())
    assert abs(float(our_loss) - loss) < 1e-5 * loss and abs(float(our_depth) - depth) < 1e-5 * depth

    nnx.update(ours, grads)  # the gradients in the weights' places, written with the HF names
    save_pretrained(ours, str(tmp_path / "grads"))
    from safetensors.torch import load_file

    mine = load_file(str(tmp_path / "grads" / "model.safetensors"))
    main, head, fc, enorm, hnorm = ref
    theirs = {k: p.grad for k, p in main.named_parameters() if p.grad is not None}
    theirs |= {"mtp." + k: p.grad for k, p in head.model.named_parameters() if p.grad is not None}
    theirs |= {"mtp.fc.weight": fc.weight.grad, "mtp.pre_fc_norm_embedding.weight": enorm.weight.grad,
               "mtp.pre_fc_norm_hidden.weight": hnorm.weight.grad}
    worst, where, deltanet = 0.0, "", 0.0
    for key, g in theirs.items():
        m = mine.get(key)
        if m is None:  # torch holds the experts fused, the export per expert
            layer, name = key.rsplit(".experts.", 1)
            parts = ("gate", "up") if name == "gate_up_proj" else ("down",)
            m = torch.stack([torch.cat([mine[f"{layer}.experts.{e}.{p}_proj.weight"] for p in parts]) for e in range(4)])
        diff = float((m.float() - g.float()).abs().max()) / (float(g.abs().max()) + 1e-12)
        if ".linear_attn." in key:  # the decoder's DeltaNet: chunked here, recurrent in transformers
            deltanet = max(deltanet, diff)
        else:
            worst, where = max((worst, where), (diff, key))
    print(f"{len(theirs)} gradients, largest difference relative to the tensor's largest {worst:.2e} ({where}); "
          f"the DeltaNet's {deltanet:.2e}")
    assert len([k for k in theirs if k.startswith("mtp.")]) > 10
    assert worst < 1e-5, where
    assert deltanet < 1e-4


def test_hf_head_is_read_and_written_back_trained(tmp_path):
    """--mtp-num-layers 1 reads mtp.* into the head and --save-hf writes it back under the same
    names (no longer carried byte for byte); without the flag it stays carried."""
    cfg = families.get_model_config("qwen3.5-moe-tiny").replace(vocab_size=256, mtp_num_layers=1)
    model = families.build_model(cfg, seed=0)
    save_pretrained(model, str(tmp_path / "a"))
    again = load_pretrained(str(tmp_path / "a"), dtype=jnp.float32, config_overrides={"mtp_num_layers": 1})
    a, b = nnx.state(model, nnx.Param), nnx.state(again, nnx.Param)
    assert all(np.array_equal(x, y) for x, y in zip(jax.tree.leaves(a["mtp"]), jax.tree.leaves(b["mtp"])))
    plain = load_pretrained(str(tmp_path / "a"), dtype=jnp.float32)
    assert plain.mtp is None
    save_pretrained(plain, str(tmp_path / "b"), carry_from=str(tmp_path / "a"))
    from safetensors.numpy import load_file

    before = {k: v for f in os.listdir(tmp_path / "a") if f.endswith(".safetensors")
              for k, v in load_file(str(tmp_path / "a" / f)).items() if k.startswith("mtp.")}
    after = {k: v for f in os.listdir(tmp_path / "b") if f.endswith(".safetensors")
             for k, v in load_file(str(tmp_path / "b" / f)).items() if k.startswith("mtp.")}
    assert before.keys() == after.keys() and len(before) > 20
    assert all(np.array_equal(before[k], after[k]) for k in before)


def test_the_depths_routers_balance_with_the_decoders():
    """An MoE depth's router is one more MoE layer of megatron-core's count: its aux losses
    (global_aux_loss's running counts included) are formed with the decoder's, and aux-loss-free
    balancing moves its expert bias by its own routed load."""
    from mlir_train.config import policies
    from mlir_train.config.policies import RouterConfig
    from mlir_train.model import ModelOptions
    from tests.helpers import train_one_step

    cfg = families.get_model_config("qwen3.5-moe-tiny", vocab_size=256, num_layers=2,
                                    layer_types=("linear_attention", "full_attention"), mtp_num_layers=1)
    balancing = policies.LoadBalancing(coeffs=(("aux_loss", 1e-2), ("global_aux_loss", 1e-2)))
    got = train_one_step(cfg, None, ModelOptions(router=RouterConfig(score_function="sigmoid", enable_expert_bias=True)),
                         step=dict(balancing=balancing, expert_bias_update_rate=1e-2))
    bias = np.asarray(got.params["mtp"][0]["layer"]["mlp"]["expert_bias"])
    assert bias.shape == (1, cfg.num_experts) and np.abs(bias).sum() > 0  # moved from zero by its own load
    assert np.isfinite(got.metrics["mtp_1 loss"]) and got.metrics["global_load_balancing_loss"] > 0


def test_depth_losses_are_on_the_console_line_next_to_lm_loss():
    """Logged as megatron-core names them, right after lm loss (metrics.jsonl and TensorBoard take
    every scalar the logger forms, these included)."""
    from mlir_train.train.metrics import console_line

    step = {"consumed samples": 8, "iteration-time": 0.1, "learning-rate": 1e-4, "batch-size": 8, "lm loss": 2.0,
            "mtp_1 loss": 2.5, "mtp_2 loss": 3.0, "loss-scale": 1.0, "grad-norm": 1.0, "skipped iterations": 0,
            "supervised-tokens-per-sec": 1.0, "supervised-tokens-per-sec-per-device": 1.0, "slot-tokens-per-sec": 1.0,
            "throughput": 1.0}
    assert "lm loss: 2.000000E+00 | mtp_1 loss: 2.500000E+00 | mtp_2 loss: 3.000000E+00 |" in console_line(1, 10, step, None)
