"""LoRA for the recipes that fine-tune the target (cllm, space, sar_draft's joint mode), through peft."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class LoRAConfig:
    r: int = 0  # 0: full fine-tune
    alpha: int = 16
    dropout: float = 0.05


def with_lora(model: torch.nn.Module, cfg: LoRAConfig, **options) -> torch.nn.Module:
    """`model` with a LoRA adapter of rank `cfg.r` on its attention and MLP projections (every linear but the LM
    head: LLaMA's q/k/v/o/gate/up/down_proj, GPT-2's Conv1D c_attn/c_proj/c_fc); `options` are further peft
    `LoraConfig` fields."""
    from peft import LoraConfig, get_peft_model

    return get_peft_model(
        model,
        LoraConfig(r=cfg.r, lora_alpha=cfg.alpha, lora_dropout=cfg.dropout, target_modules="all-linear", **options),
    )
