"""Qwen's multi-token prediction (MTP) head, built from transformers' own modules around a Qwen3.5-MoE or
Qwen3-Next model (transformers loads and runs the model but skips the head's `mtp.*` tensors).

The head predicts the token after next: at position p it joins the model's final hidden state there (after its
last norm) with the embedding of token p + 1, `fc(cat(norm(embedding), norm(hidden)))`, runs one full-attention
+ MoE decoder layer over those rows (causal, over the positions it has seen) and its own norm, and the model's LM
head gives logits for token p + 2. `tools/train_tiny.py` trains the embedded model's head with it; the tests
take it as the reference of raymoe's head (stages/runtime/mtp.py).
"""
from __future__ import annotations

import copy

import torch


def _modules(model):
    """(decoder layer class, RMSNorm class) of the model's family."""
    if model.config.model_type == "qwen3_next":
        from transformers.models.qwen3_next import modeling_qwen3_next as m
        return m.Qwen3NextDecoderLayer, m.Qwen3NextRMSNorm
    from transformers.models.qwen3_5_moe import modeling_qwen3_5_moe as m
    return m.Qwen3_5MoeDecoderLayer, m.Qwen3_5MoeRMSNorm


class HFMtpHead(torch.nn.Module):
    """The head of `model` (a transformers Qwen3_5MoeForCausalLM or Qwen3NextForCausalLM); its parameter names
    are the checkpoint's under `mtp.` (hf_tensors)."""

    def __init__(self, model):
        super().__init__()
        config = copy.deepcopy(model.config)
        n = config.num_hidden_layers
        config.layer_types = list(config.layer_types) + ["full_attention"]      # the head's layer, after the model's
        layer_class, norm_class = _modules(model)
        h, eps = config.hidden_size, config.rms_norm_eps
        self.fc = torch.nn.Linear(2 * h, h, bias=False)
        self.pre_fc_norm_embedding = norm_class(h, eps=eps)
        self.pre_fc_norm_hidden = norm_class(h, eps=eps)
        self.layers = torch.nn.ModuleList([layer_class(config, n)])
        self.norm = norm_class(h, eps=eps)
        self.trunk = [model]        # not a submodule: its parameters are the model's

    def forward(self, next_tokens: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """The head's normed hidden states [B, T, H] for rows (token p + 1's id [B, T], the model's hidden state at p
        [B, T, H], RoPE position [B, T]); logits() makes them logits."""
        model = self.trunk[0].model
        x = self.fc(torch.cat((self.pre_fc_norm_embedding(model.embed_tokens(next_tokens)),
                               self.pre_fc_norm_hidden(hidden)), dim=-1))
        T = x.shape[1]
        mask = torch.full((T, T), float("-inf")).triu(1)[None, None]
        x = self.layers[0](x, position_embeddings=model.rotary_emb(x, positions), attention_mask=mask,
                           position_ids=positions)
        return self.norm(x[0] if isinstance(x, tuple) else x)

    def logits(self, states: torch.Tensor) -> torch.Tensor:
        return self.trunk[0].lm_head(states)

    def hf_tensors(self) -> dict[str, torch.Tensor]:
        """Its weights as a checkpoint holds them (`mtp.fc.weight`, `mtp.layers.0.self_attn.q_proj.weight`, ...)."""
        return {f"mtp.{k}": v.detach().clone().contiguous() for k, v in self.state_dict().items()}


def model_hidden(model, ids: torch.Tensor) -> torch.Tensor:
    """The model's final hidden states (after its last norm) for token ids [B, T]: what the head joins."""
    return model.model(input_ids=ids).last_hidden_state


def greedy_drafts(head: HFMtpHead, ids: list[int], k: int) -> list[int]:
    """The k drafts the head chains after `ids` (a prompt and the model's next token, at least two tokens): its
    rows over every position, then draft after draft from its own hidden state, each the argmax. The model
    supplies the hidden states of ids[:-1]; the head's own states the later ones."""
    model = head.trunk[0]
    with torch.no_grad():
        hidden = model_hidden(model, torch.tensor([ids[:-1]]))
        tokens, drafts = list(ids[1:]), []
        for _ in range(k):
            positions = torch.arange(1, len(tokens) + 1)[None]
            states = head(torch.tensor([tokens]), hidden, positions)
            token = int(head.logits(states[0, -1]).argmax())
            drafts.append(token)
            tokens.append(token)
            hidden = torch.cat((hidden, states[:, -1:]), dim=1)
    return drafts
