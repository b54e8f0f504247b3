"""A tiny LoRA adapter for the tiny test model (llm_otel.demo.tiny_model: hidden 256, 2 layers,
4 query heads and 2 key/value heads of 64): PEFT's on-disk layout (``adapter_config.json`` and
``adapter_model.safetensors`` with ``base_model.model.<module>.lora_{A,B}.weight``), which vLLM's
``--lora-modules name=path`` loads (vllm/lora/lora_model.py). Small random weights, fixed seed."""

from __future__ import annotations

import json
import pathlib


def ensure_tiny_lora(model_dir, out_dir, rank: int = 4) -> pathlib.Path:
    import torch
    from safetensors.torch import save_file

    out = pathlib.Path(out_dir)
    if (out / "adapter_model.safetensors").is_file():
        return out
    out.mkdir(parents=True, exist_ok=True)
    config = json.loads((pathlib.Path(model_dir) / "config.json").read_text())
    hidden = config["hidden_size"]
    head_dim = hidden // config["num_attention_heads"]
    outs = {"q_proj": config["num_attention_heads"] * head_dim, "v_proj": config["num_key_value_heads"] * head_dim}
    gen = torch.Generator().manual_seed(0)
    tensors = {}
    for layer in range(config["num_hidden_layers"]):
        for module, out_features in outs.items():
            prefix = f"base_model.model.model.layers.{layer}.self_attn.{module}"
            tensors[f"{prefix}.lora_A.weight"] = torch.randn(rank, hidden, generator=gen) * 0.01
            tensors[f"{prefix}.lora_B.weight"] = torch.randn(out_features, rank, generator=gen) * 0.01
    save_file(tensors, str(out / "adapter_model.safetensors"))
    (out / "adapter_config.json").write_text(
        json.dumps(
            {
                "peft_type": "LORA",
                "task_type": "CAUSAL_LM",
                "r": rank,
                "lora_alpha": 2 * rank,
                "lora_dropout": 0.0,
                "target_modules": sorted(outs),
                "bias": "none",
                "fan_in_fan_out": False,
                "modules_to_save": None,
                "base_model_name_or_path": str(model_dir),
            }
        )
    )
    return out
