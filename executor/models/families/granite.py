"""IBM Granite (3.x dense): the Llama block with four scalar multipliers (Multipliers):
the embedding, the attention's softmax scale, each residual branch and the logits."""

from flagstop.executor.models.families.family import Architecture

ARCHITECTURES = (Architecture("GraniteForCausalLM", multipliers=True),)
