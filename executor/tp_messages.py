"""What rank 0 of a tensor-parallel group sends the other ranks (executor/distributed.py
carries them; the service, which must not import torch, names them)."""

STEP, RESET, PING, STOP = 1, 2, 3, 4
# A LoRA adapter to read (a LoadLoRAAdapterRequest) or drop (UnloadLoRAAdapterRequest).
LORA_LOAD, LORA_UNLOAD = 5, 6
# A request's images' pixels (a PrepareMediaRequest): every rank encodes them itself.
MEDIA = 7
