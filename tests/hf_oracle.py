"""transformers as the model-numerics oracle: its greedy continuation of a prompt, KV-cached."""

from __future__ import annotations


def hf_greedy(model, ids: list[int], n: int) -> list[int]:
    """n argmax tokens from transformers' ``model`` after ``ids``, EOS not special (ignore_eos=True)."""
    import torch

    out, past, x = [], None, torch.tensor([ids])
    with torch.no_grad():
        for _ in range(n):
            res = model(x, past_key_values=past, use_cache=True)
            past = res.past_key_values
            out.append(int(res.logits[0, -1].argmax()))
            x = torch.tensor([[out[-1]]])
    return out
