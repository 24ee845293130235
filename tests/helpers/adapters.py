"""LoRA adapters made by peft itself on a random base model, and the oracle of each:
peft's merged model on transformers."""

import torch

from tests.helpers.checkpoints import load_reference

TARGETS = {
    "attention": ["q_proj", "k_proj", "v_proj", "o_proj"],
    "mlp": ["gate_proj", "up_proj", "down_proj"],
    "q-v": ["q_proj", "v_proj"],
    "all": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
}


def make_adapter(base, out, targets: str, rank: int, seed: int, **config):
    """peft's LoRA on `base` for TARGETS[targets], its weights seeded random (B too:
    peft initialises B to zeros, which would test nothing, at a size that moves the
    logits by some tenths), saved as peft saves it."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base)
    settings = LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=TARGETS[targets], **config)
    peft_model = get_peft_model(model, settings)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_" in name:
                param.copy_(torch.randn(param.shape, generator=g) * 0.05)
    peft_model.save_pretrained(out)
    return out


def merged_reference(base, adapter):
    """transformers with peft's adapter merged into the weights (merge_and_unload)."""
    from peft import PeftModel

    return PeftModel.from_pretrained(load_reference(base), adapter).merge_and_unload().eval()


def http(stack, method: str, path: str, body: dict | None = None) -> tuple[int, object]:
    """The router's OpenAI front: the status and the JSON (or text) answered."""
    import httpx

    response = httpx.request(method, f"http://{stack.http}{path}", json=body, timeout=60)
    try:
        return response.status_code, response.json()
    except ValueError:
        return response.status_code, response.text
