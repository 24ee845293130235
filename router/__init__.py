"""Router: the client-facing servers (gRPC in service.py, the OpenAI HTTP front in
openai/), tokenizing and validation, the admission queues, the replicas behind it
(prefix-affine choice, the prefill/decode split, streams moved off a lost replica),
detokenizing and streaming."""
