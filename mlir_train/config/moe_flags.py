"""The MoE flag section: how the router routes and which load-balancing losses the objective
carries (one of the run's sections, :mod:`mlir_train.config.sections`)."""

from __future__ import annotations

import dataclasses
from typing import ClassVar

from mlir_train.config.fields import OneOrList, flag, switch
from mlir_train.config.policies import LoadBalancing, RouterConfig
from mlir_train.runtime.errors import ConfigError


@dataclasses.dataclass(frozen=True)
class MoEFlags:
    GROUP: ClassVar[str] = "moe"
    moe_router_load_balancing_type: str | list = flag(
        "--moe-router-load-balancing-type", default="aux_loss", nargs="+", action=OneOrList,
        choices=["aux_loss", "seq_aux_loss", "global_aux_loss", "sinkhorn", "none"],
        help="one type, or a list combined with one --moe-aux-loss-coeff each; sinkhorn (S-BASE, alone, no aux "
             "loss) balances the top-k choice by Sinkhorn in training (default: aux_loss)")
    moe_aux_loss_coeff: float | list = flag("--moe-aux-loss-coeff", default=0.0, type=float, nargs="+", action=OneOrList,
                                            help="one coefficient, or one per --moe-router-load-balancing-type "
                                                 "(default: 0.0)")
    moe_z_loss_coeff: float | None = flag("--moe-z-loss-coeff", type=float)
    moe_router_score_function: str = flag("--moe-router-score-function", default="softmax", choices=["softmax", "sigmoid"])
    moe_router_pre_softmax: bool | None = flag(
        "--moe-router-pre-softmax", action="store_true",
        help="softmax before the top-k, weights not renormalised (default: from --model-name's norm_topk_prob: "
             "Qwen3-MoE renormalises, which is Megatron's default)")
    moe_router_topk_scaling_factor: float | None = flag("--moe-router-topk-scaling-factor", type=float,
                                                        help="multiply the top-k routing weights by this")
    moe_router_num_groups: int | None = flag("--moe-router-num-groups", type=int,
                                             help="expert groups for group-limited (device-limited) routing")
    moe_router_group_topk: int | None = flag("--moe-router-group-topk", type=int,
                                             help="groups each token may route to (with --moe-router-num-groups)")
    moe_router_topk_limited_devices: int | None = flag(
        "--moe-router-topk-limited-devices", type=int,
        help="deprecated Megatron spelling of --moe-router-group-topk N with --moe-router-num-groups = "
             "--expert-model-parallel-size")
    moe_router_enable_expert_bias: bool = switch(
        "--moe-router-enable-expert-bias",
        help="aux-loss-free balancing (DeepSeek-V3): a per-expert bias, updated from each step's load, picks the "
             "experts (needs --moe-router-score-function sigmoid)")
    moe_router_bias_update_rate: float = flag("--moe-router-bias-update-rate", default=1e-3, type=float)
    moe_router_dtype: str | None = flag("--moe-router-dtype", choices=["fp32", "fp64"],
                                        help="the router's gating matmul, scores, top-k and statistics in fp32 "
                                             "(default) or fp64 (CPU/GPU; not on TPU)")
    moe_per_layer_logging: bool = switch(
        "--moe-per-layer-logging", help="also log each MoE layer's aux / z losses to TensorBoard (moe/<name>_layer_<i>)")
    moe_expert_capacity_factor: float | None = flag(
        "--moe-expert-capacity-factor", type=float,
        help="tokens per expert = factor * tokens * topk / experts (default: no dropping)")
    moe_token_drop_policy: str = flag("--moe-token-drop-policy", default="probs", choices=["probs", "position"])
    moe_pad_expert_input_to_capacity: bool = switch(
        "--moe-pad-expert-input-to-capacity",
        help="needs --moe-expert-capacity-factor; our capacity buffers are always padded to capacity, so "
             "it changes nothing else (as in Megatron, where it only pads)")

    def load_balancing(self):
        """The router losses and their coefficients (``mlir_train.config.policies.LoadBalancing``)."""
        return LoadBalancing.from_flags(self.moe_router_load_balancing_type, self.moe_aux_loss_coeff,
                                        self.moe_z_loss_coeff)

    def router(self, model_cfg, expert_parallel: int):
        """The router's settings (``mlir_train.config.policies.RouterConfig``), checked as Megatron
        checks them, or None for a dense model (its errors are ConfigErrors naming the flag)."""
        if not model_cfg.is_moe:
            return None
        num_groups, group_topk = self.moe_router_num_groups, self.moe_router_group_topk
        if self.moe_router_topk_limited_devices:
            if group_topk:
                raise ConfigError("--moe-router-topk-limited-devices is the deprecated spelling of "
                                  "--moe-router-group-topk with --moe-router-num-groups: give only the new flags")
            # Megatron's translation: device-limited routing over the expert-parallel ranks.
            num_groups, group_topk = expert_parallel, self.moe_router_topk_limited_devices
        balancing = self.load_balancing()
        router = RouterConfig(
            score_function=self.moe_router_score_function, pre_softmax=self.moe_router_pre_softmax,
            topk_scaling_factor=self.moe_router_topk_scaling_factor, num_groups=num_groups, group_topk=group_topk,
            enable_expert_bias=self.moe_router_enable_expert_bias,
            per_sequence_stats=balancing.per_sequence, sinkhorn=balancing.sinkhorn,
            dtype=self.moe_router_dtype or "fp32",
        )
        router.check(model_cfg.num_experts, model_cfg.top_k, model_cfg.norm_topk_prob)
        return router
