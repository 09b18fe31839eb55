"""Plain-torch LoRA for the demo model, saved and loaded in the PEFT on-disk format.

A directory holds `adapter_config.json` and `adapter_model.safetensors` whose keys are PEFT's:
`base_model.model.<module path>.lora_A.weight` ([r, in]) and `...lora_B.weight` ([out, r]);
the adapted layer computes `W x + (alpha / r) * B A x`.
"""

import json
import math
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import nn

TARGET_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


class LoraLinear(nn.Module):
    def __init__(self, base: nn.Linear, r: int, alpha: int):
        super().__init__()
        self.base = base
        self.lora_A = nn.Linear(base.in_features, r, bias=False)
        self.lora_B = nn.Linear(r, base.out_features, bias=False)
        nn.init.kaiming_uniform_(self.lora_A.weight, a=math.sqrt(5))  # PEFT's default init
        nn.init.zeros_(self.lora_B.weight)
        self.scaling = alpha / r

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + self.lora_B(self.lora_A(x)) * self.scaling


def _target_linears(model: nn.Module) -> list[tuple[str, nn.Linear]]:
    return [(name, module) for name, module in model.named_modules()
            if name.rsplit(".", 1)[-1] in TARGET_MODULES and isinstance(module, nn.Linear)]


def add_lora(model: nn.Module, r: int, alpha: int) -> dict[str, LoraLinear]:
    """Freeze `model` and wrap every target linear in a trainable LoraLinear, in place."""
    model.requires_grad_(False)
    wrapped = {}
    for name, linear in _target_linears(model):
        parent_name, _, child = name.rpartition(".")
        wrapped[name] = LoraLinear(linear, r, alpha)
        setattr(model.get_submodule(parent_name), child, wrapped[name])
    return wrapped


def save_adapter(path: Path, wrapped: dict[str, LoraLinear], r: int, alpha: int, dtype: torch.dtype):
    path.mkdir(parents=True, exist_ok=True)
    tensors = {}
    for name, layer in wrapped.items():
        tensors[f"base_model.model.{name}.lora_A.weight"] = (
            layer.lora_A.weight.detach().to(dtype).contiguous())
        tensors[f"base_model.model.{name}.lora_B.weight"] = (
            layer.lora_B.weight.detach().to(dtype).contiguous())
    save_file(tensors, path / "adapter_model.safetensors", metadata={"format": "pt"})
    config = {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": None,
        "r": r, "lora_alpha": alpha, "lora_dropout": 0.0, "target_modules": list(TARGET_MODULES),
        "bias": "none", "fan_in_fan_out": False, "inference_mode": True, "init_lora_weights": True,
        "modules_to_save": None, "layers_to_transform": None, "layers_pattern": None,
        "rank_pattern": {}, "alpha_pattern": {}, "use_rslora": False, "use_dora": False, "revision": None,
    }
    (path / "adapter_config.json").write_text(json.dumps(config, indent=2) + "\n")


@torch.no_grad()
def merge_adapter(model: nn.Module, path: Path) -> nn.Module:
    """Add `scaling * B @ A` from a PEFT LoRA directory into `model`'s weights, in place."""
    config = json.loads((path / "adapter_config.json").read_text())
    scaling = config["lora_alpha"] / config["r"]
    tensors = load_file(path / "adapter_model.safetensors")
    for name, linear in _target_linears(model):
        key = f"base_model.model.{name}"
        if f"{key}.lora_A.weight" in tensors:
            lora_a = tensors[f"{key}.lora_A.weight"].float()  # [r, in]
            lora_b = tensors[f"{key}.lora_B.weight"].float()  # [out, r]
            linear.weight += scaling * (lora_b @ lora_a).to(linear.weight.dtype)
    return model
