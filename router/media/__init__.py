"""Images in the router (docs/multimodal.md): fetched (fetch.py), processed by the
model's own transformers processor into placeholder tokens and pixels, and hashed
(processor.py)."""
