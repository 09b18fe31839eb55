"""The torch modules of the draft heads numaserve serves (models/proposers/medusa_head.py,
models/proposers/eagle_head.py), as their papers
build them: used to train the demo model's heads (train_heads.py) and as the tests' references."""

import torch
from transformers import AutoModel, PretrainedConfig


class ResBlock(torch.nn.Module):
    """Medusa's residual block: x + SiLU(W x + b)."""

    def __init__(self, hidden: int):
        super().__init__()
        self.linear = torch.nn.Linear(hidden, hidden)
        self.act = torch.nn.SiLU()

    def forward(self, x):
        return x + self.act(self.linear(x))


def medusa_heads(hidden: int, vocab: int, num_heads: int, num_layers: int = 1) -> torch.nn.ModuleList:
    """Medusa heads with the Medusa repository's module (and so tensor) names: residual blocks, then a
    vocabulary projection."""
    return torch.nn.ModuleList(
        torch.nn.Sequential(*[ResBlock(hidden) for _ in range(num_layers)],
                            torch.nn.Linear(hidden, vocab, bias=False))
        for _ in range(num_heads))


class EagleHead(torch.nn.Module):
    """fc([embed(t_{i+1}); f_i]) through one decoder layer of the target's shape and a final norm -> f'_{i+1}.
    The target's embedding and LM head are passed in, not held (they are not saved with the head)."""

    def __init__(self, target_config: PretrainedConfig):
        super().__init__()
        one_layer = {"num_hidden_layers": 1}
        if getattr(target_config, "layer_types", None):
            one_layer["layer_types"] = target_config.layer_types[:1]
        config = type(target_config)(**(target_config.to_dict() | one_layer))
        hidden = config.hidden_size
        self.fc = torch.nn.Linear(2 * hidden, hidden, bias=True)
        self.model = AutoModel.from_config(config)  # the target's architecture: DecoderModel, Qwen2Model, ...
        del self.model.embed_tokens  # the target's

    def forward(self, token_embeds: torch.Tensor, features: torch.Tensor) -> torch.Tensor:
        """token_embeds, features: [B, S, H] (t_{i+1}'s embedding, f_i at position i) -> [B, S, H]."""
        fused = self.fc(torch.cat([token_embeds, features], dim=-1))
        return self.model(inputs_embeds=fused).last_hidden_state

    def head_state_dict(self) -> dict:
        return {k: v.contiguous() for k, v in self.state_dict().items()}
