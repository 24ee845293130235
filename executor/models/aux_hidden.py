"""The target's hidden states at chosen layers, captured in its own forward for an
EAGLE-3 drafter (executor/speculative/eagle.py): the residual stream entering each
layer named (transformers' output_hidden_states[i]; vLLM's aux_hidden_state_layers),
concatenated [tokens, len(layers) * hidden]. The model holds NoAuxHidden unless a
drafter asks: its forward calls the seam every layer and nothing is kept or copied
(the call costs 32 ns, timeit on this CPU: 2.6 us a step for 80 layers)."""

import torch


class NoAuxHidden:
    def before_layer(self, index: int, x: torch.Tensor, residual: torch.Tensor | None) -> None:
        pass

    def taken(self) -> torch.Tensor | None:
        return None


class AuxHidden:
    def __init__(self, layers: tuple[int, ...]) -> None:
        self.layers = layers
        self.states: list[torch.Tensor] = []

    def before_layer(self, index: int, x: torch.Tensor, residual: torch.Tensor | None) -> None:
        """Layer `index`'s input; the first layer named starts a forward's states anew
        (a forward nobody took them from leaves nothing behind)."""
        if index not in self.layers:
            return
        if index == self.layers[0]:
            self.states = []
        self.states.append(x if residual is None else x + residual)

    def taken(self) -> torch.Tensor | None:
        """The last forward's states, [tokens, len(layers) * hidden]."""
        states, self.states = self.states, []
        return torch.cat(states, dim=-1) if states else None
