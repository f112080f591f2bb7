"""megatron-core itself as the oracle for what we re-implement of Megatron's formulas.

megatron-core 0.16.1 (PyPI) runs here on CPU in this one process (a one-rank gloo group, the
shims of ``tests/mcore_cpu.py``), and is compared on the same inputs with:

* the LR and weight-decay schedule (``OptimizerParamScheduler``, built as Megatron-LM's
  ``training.get_optimizer_param_scheduler`` builds it) for the seed script's flags over 5000
  iterations and for every other decay style;
* the MoE switch load-balancing loss and router z-loss: the functions
  (``switch_load_balancing_loss_func``, ``z_loss_func``) and the ``TopKRouter``'s own losses,
  values and router-weight gradients, on the same routing (with padding tokens);
* a few optimizer steps of a tiny Qwen3-MoE ``GPTModel`` driven by megatron-core's own
  micro-batch schedule, DDP gradient finalisation, optimizer (Adam with the seed's betas, eps,
  weight decay and clipping) and scheduler, against our trainer from the same weights: the
  loss and grad norm of every iteration within 1e-4 relative, under Megatron's default loss
  normalisation and under ``--calculate-per-token-loss``.

Timing (2 shared cores): importing megatron-core takes ~30 s of the module's time.
"""

from __future__ import annotations

from functools import partial
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tests import mcore_inproc as mcore_cpu  # skips the module without torch / megatron-core
from mlir_train.config import cli
from mlir_train.model import losses
from mlir_train.families import get_model_config
from mlir_train.train import build

torch = mcore_cpu.torch


def _parse_args(argv):
    """The parsed run configuration as one flat namespace of Megatron dest names (``_cfg`` keeps
    the typed config for its builders), and the accepted no-op flags."""
    cfg = cli.parse(argv)
    ns = SimpleNamespace(**cfg.flat(), _cfg=cfg)
    return ns, list(cfg.ignored_flags)


def schedule_from_args(args):
    return build.lr_schedule_of(args._cfg.training, args.global_batch_size or 1)


def optimizer_from_args(args, schedule):
    return build.optimizer_of(args._cfg.training, schedule)


@pytest.fixture(scope="module", autouse=True)
def megatron_on_cpu():
    mcore_cpu.initialize(seed=0)
    with mcore_cpu.CudaToCpu():
        yield


# ----- LR and weight-decay schedule -----------------------------------------------------------

SEED_TRAINING_FLAGS = [  # the seed script's TRAINING_ARGS that shape the schedule
    "--lr", "1.0e-5", "--min-lr", "1.0e-6", "--lr-decay-style", "cosine", "--lr-decay-iters", "5000",
    "--lr-warmup-fraction", "0.002", "--train-iters", "50", "--weight-decay", "0.1", "--global-batch-size", "128",
    "--micro-batch-size", "1", "--seq-length", "2048",
]


class _ParamGroups:
    """The optimizer the scheduler writes its rates into: one default param group."""

    def __init__(self):
        self.param_groups = [{"default_config": True}]


def _megatron_scheduler(args):
    """``OptimizerParamScheduler`` as Megatron-LM's ``get_optimizer_param_scheduler`` builds it
    for iteration-based training (steps counted in samples); Megatron's defaults for the
    weight-decay increment (``--start/--end-weight-decay`` = ``--weight-decay``, constant)."""
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    gbs = args.global_batch_size
    decay_steps = (args.lr_decay_iters or args.train_iters) * gbs
    warmup_steps = (args.lr_warmup_fraction * decay_steps if args.lr_warmup_fraction is not None
                    else args.lr_warmup_iters * gbs)
    wsd = None if args.lr_wsd_decay_iters is None else args.lr_wsd_decay_iters * gbs
    opt = _ParamGroups()
    sched = OptimizerParamScheduler(
        opt, init_lr=args.lr_warmup_init, max_lr=args.lr, min_lr=args.min_lr, lr_warmup_steps=warmup_steps,
        lr_decay_steps=decay_steps, lr_decay_style=args.lr_decay_style, start_wd=args.weight_decay,
        end_wd=args.weight_decay, wd_incr_steps=args.train_iters * gbs, wd_incr_style="constant",
        wsd_decay_steps=wsd, lr_wsd_decay_style=args.lr_wsd_decay_style)
    return sched, opt.param_groups[0]


def _compare_schedules(argv, iterations):
    args, _ = _parse_args(argv)
    ours = schedule_from_args(args)
    sched, group = _megatron_scheduler(args)
    want = []
    for _ in range(iterations + 1):  # the rate of update i is set after i successful steps
        want.append(group["lr"])
        assert group["weight_decay"] == args.weight_decay
        sched.step(increment=args.global_batch_size)
    want = np.asarray(want)
    python = np.asarray([ours.lr_at(i) for i in range(iterations + 1)])
    traced = np.asarray(jax.jit(jax.vmap(ours))(jnp.arange(iterations + 1)))
    np.testing.assert_allclose(python, want, rtol=1e-12, atol=0)
    np.testing.assert_allclose(traced, want, rtol=2e-6, atol=0)  # what optax applies, float32
    return args, want


def test_seed_schedule_equals_megatrons_over_5000_iterations():
    args, want = _compare_schedules(SEED_TRAINING_FLAGS, 5000)
    assert want[0] == 0.0 and want[10] == pytest.approx(1e-5) and want[5000] == pytest.approx(1e-6)
    # and the optimizer built from these flags applies that schedule with Megatron's constant
    # weight decay (Megatron's get_wd with --weight-decay-incr-style constant)
    opt = optimizer_from_args(args, schedule_from_args(args))
    params = {"w": jnp.ones((2, 2))}
    state = opt.init(params)
    grads = {"w": jnp.zeros((2, 2))}
    for i in range(12):  # zero gradients: each update is the decoupled decay -lr_i * wd * w
        updates, state = opt.update(grads, state, params)
        np.testing.assert_allclose(np.asarray(updates["w"]), -want[i] * 0.1, rtol=1e-5, atol=1e-14)


OTHER_STYLES = {
    "linear-warmup-iters": ["--lr-decay-style", "linear", "--lr-warmup-iters", "7", "--lr-warmup-init", "1e-6"],
    "constant": ["--lr-decay-style", "constant", "--lr-warmup-iters", "3"],
    "inverse-square-root": ["--lr-decay-style", "inverse-square-root", "--lr-warmup-iters", "5"],
    "inverse-square-root-no-warmup": ["--lr-decay-style", "inverse-square-root"],
    **{f"WSD-{s}": ["--lr-decay-style", "WSD", "--lr-wsd-decay-iters", "30", "--lr-wsd-decay-style", s,
                    "--lr-warmup-fraction", "0.05"]
       for s in ("exponential", "linear", "cosine", "minus_sqrt")},
}


@pytest.mark.parametrize("style", list(OTHER_STYLES))
def test_other_decay_styles_equal_megatrons(style):
    argv = ["--lr", "3e-4", "--min-lr", "3e-5", "--train-iters", "100", "--lr-decay-iters", "80",
            "--weight-decay", "0.01", "--global-batch-size", "16", *OTHER_STYLES[style]]
    _compare_schedules(argv, 120)  # past --lr-decay-iters too


# ----- MoE aux loss and z-loss ---------------------------------------------------------------

E, K, H, SEQ, ROWS = 8, 2, 32, 12, 3


def _routing_inputs():
    rng = np.random.default_rng(0)
    x_BTD = rng.standard_normal((ROWS, SEQ, H)).astype(np.float32)
    w_DE = (0.3 * rng.standard_normal((H, E))).astype(np.float32)
    valid_BT = np.ones((ROWS, SEQ), bool)
    valid_BT[0, -4:] = False  # padding (segment id 0)
    valid_BT[2, -1:] = False
    return x_BTD, w_DE, valid_BT


def _our_router_losses(x_BTD, w_DE, valid_BT, aux_coeff, z_coeff):
    """Our MoE block's routing statistics -> coeff * aux loss + coeff * z-loss, and the router
    gradient of that sum."""
    from flax import nnx

    from mlir_train.model.moe.block import MoE

    cfg = get_model_config("qwen3-moe-tiny", hidden_size=H, num_experts=E, top_k=K)
    with nnx.use_eager_sharding(False):
        graphdef, state = nnx.split(MoE(cfg, nnx.Rngs(0), out_std=0.02))
    state = nnx.to_pure_dict(state)

    def total(w):
        block = nnx.merge(graphdef, {**state, "router": w})
        _, _, stats = block.route(jnp.asarray(x_BTD).reshape(-1, H), jnp.asarray(valid_BT).reshape(-1))
        aux, z = losses.switch_aux_loss(stats, K)[0], losses.z_loss(stats)[0]  # the one balancing group
        return aux_coeff * aux + z_coeff * z, (aux, z)

    (_, (aux, z)), grad = jax.value_and_grad(total, has_aux=True)(jnp.asarray(w_DE))
    return float(aux), float(z), np.asarray(grad)


def test_aux_and_z_loss_functions_equal_megatrons():
    from megatron.core.transformer.moe.moe_utils import switch_load_balancing_loss_func, z_loss_func

    x_BTD, w_DE, valid_BT = _routing_inputs()
    aux, z, _ = _our_router_losses(x_BTD, w_DE, valid_BT, 1.0, 1.0)
    valid = torch.from_numpy(valid_BT.reshape(-1))
    logits = torch.from_numpy(x_BTD.reshape(-1, H) @ w_DE)[valid]  # padding excluded, as ours does
    scores = torch.softmax(logits, dim=-1)
    routing = torch.zeros_like(scores).scatter(1, torch.topk(scores, K, dim=1).indices, 1.0)
    want_aux = switch_load_balancing_loss_func(scores, routing.sum(0), logits.shape[0], K, E, moe_aux_loss_coeff=1.0)
    want_z = z_loss_func(logits, 1.0)
    np.testing.assert_allclose(aux, float(want_aux), rtol=1e-5)
    np.testing.assert_allclose(z, float(want_z), rtol=1e-5)


def test_topk_router_losses_and_gradients_equal_megatrons():
    """The router module end to end: Megatron's TopKRouter (softmax after top-k, aux_loss
    balancing, z-loss, a padding mask) logs the same per-layer losses we log and gives the
    router weight the same gradient from them."""
    from megatron.core.transformer.moe.moe_utils import (
        MoEAuxLossAutoScaler,
        clear_aux_losses_tracker,
        get_default_pg_collection,
        get_moe_layer_wise_logging_tracker,
    )
    from megatron.core.transformer.moe.router import TopKRouter
    from megatron.core.transformer.transformer_config import TransformerConfig

    aux_coeff, z_coeff = 1e-2, 1e-3
    x_BTD, w_DE, valid_BT = _routing_inputs()
    config = TransformerConfig(
        num_layers=1, hidden_size=H, num_attention_heads=4, num_moe_experts=E, moe_router_topk=K,
        moe_aux_loss_coeff=aux_coeff, moe_z_loss_coeff=z_coeff, moe_router_load_balancing_type="aux_loss",
        moe_router_pre_softmax=False, moe_token_dispatcher_type="allgather", use_cpu_initialization=True,
        add_bias_linear=False, params_dtype=torch.float32)
    router = TopKRouter(config, pg_collection=get_default_pg_collection())
    router.set_layer_number(1)
    router.train()
    with torch.no_grad():
        router.weight.copy_(torch.from_numpy(w_DE.T.copy()))
    clear_aux_losses_tracker()
    x = torch.from_numpy(x_BTD.transpose(1, 0, 2).copy())  # Megatron's [seq, batch, hidden]
    padding = torch.from_numpy(~valid_BT.T.copy())  # True = padding, as its loss functions read it
    probs, _ = router(x, padding_mask=padding)
    MoEAuxLossAutoScaler.set_loss_scale(torch.ones(1))
    (probs * 0).sum().backward()  # only the attached aux / z-loss gradients reach the weight
    tracker = get_moe_layer_wise_logging_tracker()
    want_aux = float(tracker["load_balancing_loss"]["values"][0])
    want_z = float(tracker["z_loss"]["values"][0])
    tracker.clear()  # sized for this one-layer config; the GPTModel test logs two layers
    aux, z, grad = _our_router_losses(x_BTD, w_DE, valid_BT, aux_coeff, z_coeff)
    np.testing.assert_allclose(aux, want_aux, rtol=1e-5)
    np.testing.assert_allclose(z, want_z, rtol=1e-5)
    want_grad = router.weight.grad.numpy().T
    np.testing.assert_allclose(grad, want_grad, rtol=0, atol=1e-5 * np.abs(want_grad).max())
    assert np.abs(want_grad).max() > 0


# ----- optimizer steps of a tiny Qwen3-MoE GPTModel ------------------------------------------

GPT = dict(vocab=128, hidden=64, layers=2, heads=4, groups=2, head_dim=16, experts=4, moe_ffn=32, topk=2)
GPT_SEQ, GPT_MBS, GPT_MICRO, GPT_ITERS = 32, 2, 2, 4
GPT_FLAGS = [  # the seed's optimizer flags; a larger LR with warmup and cosine so 4 steps move the loss
    "--optimizer", "adam", "--adam-beta1", "0.9", "--adam-beta2", "0.95", "--adam-eps", "1e-08",
    "--weight-decay", "0.1", "--clip-grad", "1.0", "--lr", "3e-3", "--min-lr", "3e-4", "--lr-decay-style", "cosine",
    "--lr-warmup-iters", "1", "--lr-decay-iters", "10", "--train-iters", "10",
    "--micro-batch-size", str(GPT_MBS), "--global-batch-size", str(GPT_MBS * GPT_MICRO),
]


def _gpt_batches():
    """GPT_ITERS global batches ``[micro, rows, seq]``: one document per row, loss on a random
    subset of tokens whose count varies a lot between rows (so the two normalisations differ).
    The same batch every iteration, so the loss must fall."""
    rng = np.random.default_rng(1)
    shape = (1, GPT_MICRO, GPT_MBS, GPT_SEQ)
    ids = rng.integers(0, GPT["vocab"], shape).astype(np.int32)
    keep = rng.uniform(0.05, 0.95, shape[:3])[..., None]
    mask = (rng.random(shape) < keep).astype(np.float32)
    batch = dict(input_ids=ids, labels=np.roll(ids, -1, -1), loss_mask=mask)
    return {k: np.repeat(v, GPT_ITERS, axis=0) for k, v in batch.items()}


def _megatron_gpt(per_token: bool, aux_coeff: float):
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_config import TransformerConfig

    g = GPT
    config = TransformerConfig(
        num_layers=g["layers"], hidden_size=g["hidden"], num_attention_heads=g["heads"], num_query_groups=g["groups"],
        kv_channels=g["head_dim"], ffn_hidden_size=4 * g["hidden"], num_moe_experts=g["experts"],
        moe_ffn_hidden_size=g["moe_ffn"], moe_router_topk=g["topk"], moe_router_pre_softmax=False,
        moe_aux_loss_coeff=aux_coeff, moe_router_load_balancing_type="aux_loss",
        moe_token_dispatcher_type="allgather", qk_layernorm=True, normalization="RMSNorm", layernorm_epsilon=1e-6,
        gated_linear_unit=True, activation_func=torch.nn.functional.silu, add_bias_linear=False,
        hidden_dropout=0.0, attention_dropout=0.0, init_method_std=0.02, use_cpu_initialization=True,
        params_dtype=torch.float32, bias_dropout_fusion=False, apply_rope_fusion=False, masked_softmax_fusion=False,
        gradient_accumulation_fusion=False, persist_layer_norm=False, calculate_per_token_loss=per_token)
    spec = get_gpt_layer_local_spec(num_experts=g["experts"], qk_layernorm=True, normalization="RMSNorm")
    torch.manual_seed(0)
    return GPTModel(config, transformer_layer_spec=spec, vocab_size=g["vocab"], max_sequence_length=GPT_SEQ,
                    position_embedding_type="rope", rotary_base=1000000, share_embeddings_and_output_weights=False)


def _megatron_to_ours(sd: dict, param_shapes) -> dict:
    """Megatron's single-rank (TP1 PP1 EP1) local-spec GPTModel state dict -> our parameter
    tree. Test-only: the general reader of Megatron checkpoints (any split, TE names, grouped
    experts) is ``mlir_train``'s checkpoint import."""
    g = GPT
    n = lambda k: sd[k].detach().numpy().astype(np.float32)
    per_group = g["heads"] // g["groups"]
    layers: dict[str, list] = {}

    def put(name, value):
        layers.setdefault(name, []).append(value)

    for i in range(g["layers"]):
        p = f"decoder.layers.{i}."
        qkv = n(p + "self_attention.linear_qkv.weight").reshape(g["groups"], per_group + 2, g["head_dim"], g["hidden"])
        put("q_proj", qkv[:, :per_group].reshape(g["heads"], g["head_dim"], g["hidden"]).transpose(2, 0, 1))
        put("k_proj", qkv[:, per_group].transpose(2, 0, 1))
        put("v_proj", qkv[:, per_group + 1].transpose(2, 0, 1))
        put("o_proj", n(p + "self_attention.linear_proj.weight").T.reshape(g["heads"], g["head_dim"], g["hidden"]))
        put("q_norm", n(p + "self_attention.q_layernorm.weight"))
        put("k_norm", n(p + "self_attention.k_layernorm.weight"))
        put("input_norm", n(p + "input_layernorm.weight"))
        put("post_attn_norm", n(p + "pre_mlp_layernorm.weight"))
        put("router", n(p + "mlp.router.weight").T)
        fc1 = [n(p + f"mlp.experts.local_experts.{e}.linear_fc1.weight") for e in range(g["experts"])]
        put("gate_proj", np.stack([w[: g["moe_ffn"]].T for w in fc1]))
        put("up_proj", np.stack([w[g["moe_ffn"]:].T for w in fc1]))
        put("down_proj", np.stack([n(p + f"mlp.experts.local_experts.{e}.linear_fc2.weight").T
                                   for e in range(g["experts"])]))
    st = {k: np.stack(v) for k, v in layers.items()}
    ours = {
        "embed": n("embedding.word_embeddings.weight"),
        "final_norm": {"scale": n("decoder.final_layernorm.weight")},
        "lm_head": n("output_layer.weight").T,
        "layers": {0: {
            "attn": {"q_proj": st["q_proj"], "k_proj": st["k_proj"], "v_proj": st["v_proj"], "o_proj": st["o_proj"],
                     "q_norm": {"scale": st["q_norm"]}, "k_norm": {"scale": st["k_norm"]}},
            "input_norm": {"scale": st["input_norm"]}, "post_attn_norm": {"scale": st["post_attn_norm"]},
            "mlp": {"router": st["router"], "gate_proj": st["gate_proj"], "up_proj": st["up_proj"],
                    "down_proj": st["down_proj"]},
        }},
    }
    jax.tree.map(lambda a, b: np.testing.assert_equal(a.shape, b.shape), ours, param_shapes)
    return ours


def _megatron_run(per_token: bool, aux_coeff: float, batches) -> list[dict]:
    """GPT_ITERS iterations as Megatron-LM's train_step runs them: megatron-core's no-pipeline
    micro-batch schedule with pretrain_gpt's loss_func, DDP gradient finalisation, the Megatron
    optimizer (Adam, clipping, no decay on 1-D params) and OptimizerParamScheduler."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from megatron.core.transformer.moe.moe_utils import get_moe_layer_wise_logging_tracker

    get_moe_layer_wise_logging_tracker().clear()  # per-layer buffers other tests sized
    args, _ = _parse_args(GPT_FLAGS)
    model = _megatron_gpt(per_token, aux_coeff)
    initial = {k: v.clone() for k, v in model.state_dict().items() if isinstance(v, torch.Tensor)}
    config = model.config
    ddp = DistributedDataParallel(config, DistributedDataParallelConfig(grad_reduce_in_fp32=True), module=model)
    config.finalize_model_grads_func = finalize_model_grads
    config.no_sync_func = ddp.no_sync
    optimizer = get_megatron_optimizer(OptimizerConfig(
        optimizer=args.optimizer, lr=args.lr, min_lr=args.min_lr, weight_decay=args.weight_decay,
        adam_beta1=args.adam_beta1, adam_beta2=args.adam_beta2, adam_eps=args.adam_eps, clip_grad=args.clip_grad,
        params_dtype=torch.float32), [ddp])
    gbs = args.global_batch_size
    scheduler = OptimizerParamScheduler(
        optimizer, init_lr=0.0, max_lr=args.lr, min_lr=args.min_lr, lr_warmup_steps=args.lr_warmup_iters * gbs,
        lr_decay_steps=args.lr_decay_iters * gbs, lr_decay_style=args.lr_decay_style, start_wd=args.weight_decay,
        end_wd=args.weight_decay, wd_incr_steps=args.train_iters * gbs, wd_incr_style="constant")
    causal = torch.triu(torch.ones(GPT_SEQ, GPT_SEQ), diagonal=1).bool()[None, None]
    positions = torch.arange(GPT_SEQ)[None].repeat(GPT_MBS, 1)

    def loss_func(loss_mask, output_tensor):  # pretrain_gpt.loss_func
        token_losses, mask = output_tensor.view(-1).float(), loss_mask.view(-1).float()
        loss = torch.sum(token_losses * mask)
        num_tokens = mask.sum().clone().detach().to(torch.int)
        return loss, num_tokens, {"lm loss": torch.cat([loss.clone().detach().view(1), num_tokens.view(1)])}

    def forward_step(data, model):
        mb = next(data)
        out = model(mb["input_ids"], positions, attention_mask=causal, labels=mb["labels"])
        return out, partial(loss_func, mb["loss_mask"])

    records = []
    for it in range(GPT_ITERS):
        micro = iter([{k: torch.from_numpy(v[it, m]).long() if k != "loss_mask" else torch.from_numpy(v[it, m])
                       for k, v in batches.items()} for m in range(GPT_MICRO)])
        ddp.zero_grad_buffer()
        optimizer.zero_grad()
        reported = get_forward_backward_func()(
            forward_step_func=forward_step, data_iterator=micro, model=[ddp], num_microbatches=GPT_MICRO,
            seq_length=GPT_SEQ, micro_batch_size=GPT_MBS, forward_only=False)
        ok, grad_norm, _ = optimizer.step()
        assert ok
        scheduler.step(increment=gbs)
        # the report of AIAK's train_step in its SFT phase (one data-parallel rank here): the
        # global token mean with --calculate-per-token-loss, else the mean of micro-batch means
        sums = torch.vstack([r["lm loss"] for r in reported])
        report = sums[:, 0].sum() / sums[:, 1].sum() if per_token else (sums[:, 0] / sums[:, 1]).mean()
        records.append({"lm loss": float(report), "grad-norm": float(grad_norm)})
    return initial, records


def _our_run(initial, per_token: bool, aux_coeff: float, batches) -> list[dict]:
    from mlir_train.train.trainer import StepConfig
    from mlir_train.train.build import build_trainer
    from sharding.mesh import make_mesh
    from sharding.layout import Layout

    g = GPT
    cfg = get_model_config("qwen3-moe-tiny", vocab_size=g["vocab"], hidden_size=g["hidden"], num_layers=g["layers"],
                           num_heads=g["heads"], num_kv_heads=g["groups"], head_dim=g["head_dim"],
                           num_experts=g["experts"], moe_intermediate_size=g["moe_ffn"], top_k=g["topk"],
                           rms_norm_eps=1e-6, rope_theta=1e6)
    args, _ = _parse_args(GPT_FLAGS + (["--calculate-per-token-loss"] if per_token else []))
    parallel = Layout(num_devices=1)
    from mlir_train.config.policies import LoadBalancing

    trainer = build_trainer(cfg, StepConfig(num_micro_batches=GPT_MICRO, balancing=LoadBalancing.from_flags("aux_loss", aux_coeff),
                                      micro_batch_size=args.micro_batch_size, per_token_loss=args.calculate_per_token_loss),
                      optimizer_from_args(args, schedule_from_args(args)), parallel,
                      make_mesh(parallel, devices=jax.devices()[:1]))
    state = trainer.state_from_params(_megatron_to_ours(initial, trainer.param_shapes))
    records = []
    for it in range(GPT_ITERS):
        batch = {k: v[it] for k, v in batches.items()}
        batch["segment_ids"] = np.ones_like(batch["input_ids"])
        batch["positions"] = np.broadcast_to(np.arange(GPT_SEQ, dtype=np.int32), batch["input_ids"].shape).copy()
        state, metrics = trainer.train_step(state, trainer.shard_batch(batch))
        records.append({k: float(metrics[k]) for k in ("lm loss", "grad-norm")})
    return records


@pytest.mark.parametrize("per_token,aux_coeff", [(False, 1e-2), (True, 1e-2)], ids=["default-loss", "per-token-loss"])
def test_optimizer_steps_equal_megatron_gptmodel(per_token, aux_coeff):
    """Our trainer from Megatron's initial weights follows megatron-core's own training
    iterations: lm loss and grad norm within 1e-4 relative at every iteration.

    Megatron's default normalises each micro-batch by its own loss tokens (the aux loss of
    each layer and micro-batch scaled by 1/num_microbatches). Under --calculate-per-token-loss
    megatron-core scales the aux loss by the micro-batch's router tokens over the global batch's
    loss tokens (ours too: ``losses.router_losses``); at more than one data-parallel rank see
    ``test_mcore_router_dp.py``."""
    batches = _gpt_batches()
    initial, want = _megatron_run(per_token, aux_coeff, batches)
    got = _our_run(initial, per_token, aux_coeff, batches)
    for i, (a, b) in enumerate(zip(got, want), start=1):
        for key in ("lm loss", "grad-norm"):
            np.testing.assert_allclose(a[key], b[key], rtol=1e-4, err_msg=f"iteration {i} {key}")
    assert want[-1]["lm loss"] < want[0]["lm loss"] - 1e-2  # the steps really trained
