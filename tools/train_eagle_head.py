"""Train an EAGLE-3 draft head for a target checkpoint on text the target generates
(docs/speculative.md), on the CPU in minutes for the embedded model, and write it in
the original EAGLE-3 layout (tools/make_eagle_head.py's).

    python -m tools.train_eagle_head --target models/flagstop-tiny --out DIR   (make eagle-head)

1. Text: prompts cut from the embedded tokenizer's corpus, continued greedily by the
   target (transformers), so that every token after a prompt is the target's own
   choice: what drafts must guess.
2. Features: the target's hidden states entering its low, middle and high layers, at
   every position of each sequence (transformers' output_hidden_states).
3. The head learns to predict token i+2 at position i from token i+1's embedding and a
   state, unrolled STEPS times as EAGLE-3 trains ("training-time test"): the first
   step's state is the target's fused layers, each later step's the head's own
   output at the position before, attending to the earlier steps' keys as the chain
   does at inference. Its draft vocabulary is the target's tokens seen most often in
   the text (d2t maps it back); its head starts from the target's LM head rows.

Written by hand with torch rather than with the speculators library: its 0.9 pins
transformers <= 5.19 against flagstop's 5.23, and the loop is ~100 lines for a head
of one layer (the attention mask of the unrolled steps is the only subtle part)."""

import argparse
import json
import random
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file
from torch import nn

from tools.make_eagle_head import aux_layers, head_config, write_head
from tools.make_model import CORPUS
from tools.train_tiny_model import docs

STEPS = 3  # unrolled draft steps: the chain's first three drafts
PROMPT_TOKENS = (6, 16)
GENERATED_TOKENS = 48
HELD_OUT = 32  # sequences of another seed, for the accuracy reported


def prompt_text(prompts: str, held_out: bool) -> str:
    """The text prompts are cut from: the embedded tokenizer's corpus (its held-out
    prompts other windows of it), or for a target trained on docs/*.md
    (tools/train_tiny_model.py) its training docs, the held-out ones its held-out docs."""
    if prompts == "corpus":
        return CORPUS
    return "\n".join(f.read_text() for f in docs(held_out))


def generate_text(reference, tokenizer, n: int, seed: int, text: str = CORPUS
                  ) -> list[tuple[list[int], int]]:  # fmt: skip
    """n sequences (and each one's prompt length): a window of 6-16 tokens of `text`,
    then the target's greedy 48."""
    rng, corpus = random.Random(seed), tokenizer(text).input_ids
    out = []
    for _ in range(n):
        length = rng.randrange(*PROMPT_TOKENS)
        start = rng.randrange(len(corpus) - length)
        prompt = torch.tensor([corpus[start : start + length]])
        with torch.no_grad():
            ids = reference.generate(prompt, max_new_tokens=GENERATED_TOKENS, do_sample=False,
                                     min_new_tokens=GENERATED_TOKENS)  # fmt: skip
        out.append((ids[0].tolist(), length))
    return out


class TrainableHead(nn.Module):
    """The head's math (executor/speculative/eagle.py's), differentiable, over whole
    sequences; the q/k/v of every unrolled step kept for the next. The config's
    norm_before_fc, fc_norm and norm_output (speculators' variants) and a qwen3
    model_type (q/k norms) add their norms."""

    def __init__(self, config: dict, embed: torch.Tensor, head_rows: torch.Tensor,
                 num_aux: int) -> None:  # fmt: skip
        super().__init__()
        h, self.c = config["hidden_size"], config
        self.heads, self.kv = config["num_attention_heads"], config["num_key_value_heads"]
        self.d = config.get("head_dim") or h // self.heads
        self.embed = embed  # the target's, frozen
        self.fc = nn.Linear(num_aux * h, h, bias=False)
        self.q_proj = nn.Linear(2 * h, self.heads * self.d, bias=False)
        self.k_proj = nn.Linear(2 * h, self.kv * self.d, bias=False)
        self.v_proj = nn.Linear(2 * h, self.kv * self.d, bias=False)
        self.o_proj = nn.Linear(self.heads * self.d, h, bias=False)
        inner = config["intermediate_size"]
        self.gate_proj = nn.Linear(h, inner, bias=False)
        self.up_proj = nn.Linear(h, inner, bias=False)
        self.down_proj = nn.Linear(inner, h, bias=False)
        sizes = dict.fromkeys(("input_layernorm", "hidden_norm", "post_attention_layernorm",
                               "norm"), h)  # fmt: skip
        sizes |= {"input_norm": num_aux * h} if config.get("norm_before_fc") else {}
        sizes |= {f"fc_norm_{i}": h for i in range(num_aux)} if config.get("fc_norm") else {}
        sizes |= {"q_norm": self.d, "k_norm": self.d} if config.get("model_type") == "qwen3" else {}
        self.norms = nn.ParameterDict(
            {n: nn.Parameter(torch.ones(size)) for n, size in sizes.items()}
        )
        self.lm_head = nn.Parameter(head_rows.clone())
        for linear in (self.fc, self.q_proj, self.k_proj, self.v_proj, self.o_proj,
                       self.gate_proj, self.up_proj, self.down_proj):  # fmt: skip
            nn.init.normal_(linear.weight, std=0.02)

    def _norm(self, x: torch.Tensor, name: str) -> torch.Tensor:
        if name not in self.norms:  # a variant's norm this head has not
            return x
        eps = self.c["rms_norm_eps"]
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * self.norms[name]

    def _fused(self, aux: torch.Tensor) -> torch.Tensor:
        aux = self._norm(aux, "input_norm")
        chunks = aux.chunk(self.fc.in_features // self.c["hidden_size"], -1)  # per layer
        return torch.cat([self._norm(c, f"fc_norm_{i}") for i, c in enumerate(chunks)], -1)

    def _rope(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        inv = 1.0 / self.c["rope_theta"] ** (torch.arange(0, self.d, 2).float() / self.d)
        angles = torch.outer(positions.float(), inv).repeat(1, 2)
        rotated = torch.cat((-x[..., self.d // 2 :], x[..., : self.d // 2]), -1)
        return x * angles.cos()[:, None] + rotated * angles.sin()[:, None]

    def forward(self, aux: torch.Tensor, tokens: torch.Tensor) -> list[torch.Tensor]:
        """Logits over the draft vocabulary of each unrolled step, [T - 2, draft] each:
        at position i, token i+2's (the input token i+1's embedding, the state the
        step's)."""
        n = len(tokens) - 2
        positions, embeds = torch.arange(n), self.embed[tokens[1 : n + 1]]
        state = self.fc(self._fused(aux[:n]))
        keys, values, logits = [], [], []
        for step in range(STEPS):
            x = torch.cat((self._norm(embeds, "input_layernorm"),
                           self._norm(state, "hidden_norm")), -1)  # fmt: skip
            q = self._norm(self.q_proj(x).view(n, self.heads, self.d), "q_norm")
            k = self._norm(self.k_proj(x).view(n, self.kv, self.d), "k_norm")
            q = self._rope(q, positions)
            keys.append(self._rope(k, positions))
            values.append(self.v_proj(x).view(n, self.kv, self.d))
            out = self._attend(q, keys, values, step)
            h = self.o_proj(out) + state
            x = self._norm(h, "post_attention_layernorm")
            out = self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x)) + h
            normed = self._norm(out, "norm")
            logits.append(normed @ self.lm_head.T)
            out = normed if self.c.get("norm_output") else out  # EAGLE-3.1 chains it normed
            state = torch.cat((out[:1], out[:-1]))  # step s+1 at i reads step s's at i-1
        return logits

    def _attend(self, q, keys, values, step: int) -> torch.Tensor:
        """Position i at step s sees step 0's keys at positions <= i - s and step t's
        at i - (s - t) for 0 < t <= s: what the chain's cache holds at inference."""
        n, group = len(q), self.heads // self.kv
        k = torch.cat(keys).repeat_interleave(group, 1)  # [(s+1) n, heads, d]
        v = torch.cat(values).repeat_interleave(group, 1)
        i = torch.arange(n)[:, None]
        j = torch.arange(n)[None, :]
        mask = [j <= i - step] + [j == i - (step - t) for t in range(1, step + 1)]
        allowed = torch.cat(mask, dim=1)  # [n, (s+1) n]
        scores = torch.einsum("qhd,khd->hqk", q, k) / self.d**0.5
        scores = scores.masked_fill(~allowed, float("-inf"))
        out = torch.einsum("hqk,khd->qhd", scores.softmax(-1).nan_to_num(), v)
        return out.reshape(n, self.heads * self.d)


def train(target: Path, out: Path, num_sequences: int, epochs: int, seed: int,
          held_out: int = HELD_OUT, prompts: str = "corpus") -> dict:  # fmt: skip
    """The head written to `out`; the losses and its held-out accuracy per step."""
    import transformers

    torch.manual_seed(seed)
    reference = transformers.AutoModelForCausalLM.from_pretrained(target).eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(target)
    config = json.loads((target / "config.json").read_text())
    layers = aux_layers(config["num_hidden_layers"])
    texts = generate_text(reference, tokenizer, num_sequences, seed, prompt_text(prompts, False))
    held_out_texts = generate_text(reference, tokenizer, held_out, seed + 1,
                                   prompt_text(prompts, True))  # fmt: skip
    features = _features(reference, texts, layers)
    held_out_features = _features(reference, held_out_texts, layers)
    weights = load_file(target / "model.safetensors")
    generated = torch.cat([t[length:] for _, t, length in features])
    counts = torch.bincount(generated, minlength=config["vocab_size"])
    draft_to_target = counts.argsort(descending=True)[: config["vocab_size"] // 2].sort().values
    head_rows = weights.get("lm_head.weight", weights["model.embed_tokens.weight"])
    head = TrainableHead(config, weights["model.embed_tokens.weight"],
                         head_rows[draft_to_target], len(layers))  # fmt: skip
    to_draft = torch.full((config["vocab_size"],), -100)
    to_draft[draft_to_target] = torch.arange(len(draft_to_target))
    optimizer = torch.optim.AdamW(head.parameters(), lr=2e-3)
    losses = []
    for _ in range(epochs):
        random.Random(seed + len(losses)).shuffle(features)
        for aux, tokens, prompt_length in features:
            loss = sum(F.cross_entropy(logits, _labels(to_draft, tokens, prompt_length, step))
                       for step, logits in enumerate(head(aux, tokens))) / STEPS  # fmt: skip
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            losses.append(loss.item())
    _save(head, config, layers, draft_to_target, weights, target, out)
    return {"sequences": num_sequences, "epochs": epochs, "first_loss": losses[0],
            "last_loss": sum(losses[-50:]) / len(losses[-50:]),
            "held_out_top1_per_step": accuracy(head, held_out_features, to_draft)}  # fmt: skip


def _features(reference, texts: list[tuple[list[int], int]], layers: list[int]) -> list[tuple]:
    """Each sequence's fused target states [T, 3 x hidden], its tokens and its prompt
    length."""
    out = []
    with torch.no_grad():
        for ids, prompt_length in texts:
            hidden = reference(torch.tensor([ids]), output_hidden_states=True).hidden_states
            fused = torch.cat([hidden[a][0] for a in layers], -1)
            out.append((fused, torch.tensor(ids), prompt_length))
    return out


@torch.no_grad()
def accuracy(head: TrainableHead, features: list[tuple], to_draft: torch.Tensor) -> list[float]:
    """Each unrolled step's top-1 accuracy on the given sequences' generated tokens
    (the draft right given the drafts before it right: teacher forcing)."""
    right, total = [0] * STEPS, [0] * STEPS
    for aux, tokens, prompt_length in features:
        for step, logits in enumerate(head(aux, tokens)):
            labels = _labels(to_draft, tokens, prompt_length, step)
            mask = labels >= 0
            right[step] += int((logits.argmax(-1)[mask] == labels[mask]).sum())
            total[step] += int(mask.sum())
    return [r / max(t, 1) for r, t in zip(right, total, strict=True)]


def _labels(to_draft: torch.Tensor, tokens: torch.Tensor, prompt_length: int,
            step: int) -> torch.Tensor:  # fmt: skip
    """Token i+2 at position i, as a draft id; -100 (not learned): a prompt token (the
    corpus's, not the target's choice), one outside the draft vocabulary, or a
    position the step's chain never reaches (fewer than `step` before it)."""
    labels = to_draft[tokens[2:]].clone()
    labels[: max(step, prompt_length - 2)] = -100
    return labels


def stored_names(head: TrainableHead, layer_prefix: str = "midlayer.") -> dict[str, str]:
    """The head's tensors by their names in the original layout (the speculators
    library's: layer_prefix "layers.0.") -> the TrainableHead's."""
    p = layer_prefix
    names = {p + f"self_attn.{n}.weight": f"{n}.weight"
             for n in ("q_proj", "k_proj", "v_proj", "o_proj")}  # fmt: skip
    names |= {p + f"mlp.{n}.weight": f"{n}.weight" for n in ("gate_proj", "up_proj", "down_proj")}
    names |= {p + f"{n}.weight": f"norms.{n}"
              for n in ("input_layernorm", "hidden_norm", "post_attention_layernorm")}  # fmt: skip
    names |= {p + f"self_attn.{n}.weight": f"norms.{n}" for n in ("q_norm", "k_norm")}
    num_aux = head.fc.in_features // head.c["hidden_size"]
    names |= {f"fc_norm.{i}.weight": f"norms.fc_norm_{i}" for i in range(num_aux)}
    names |= {"fc.weight": "fc.weight", "norm.weight": "norms.norm", "lm_head.weight": "lm_head",
              "input_norm.weight": "norms.input_norm"}  # fmt: skip
    ours = dict(head.named_parameters())
    return {stored: name for stored, name in names.items() if name in ours}


def _save(head: TrainableHead, config: dict, layers: list[int], draft_to_target: torch.Tensor,
          weights: dict, target: Path, out: Path) -> None:  # fmt: skip
    ours = dict(head.named_parameters())
    tensors = {stored: ours[name] for stored, name in stored_names(head).items()}
    tensors |= {"embed_tokens.weight": weights["model.embed_tokens.weight"],
                "d2t": draft_to_target - torch.arange(len(draft_to_target))}  # fmt: skip
    t2d = torch.zeros(config["vocab_size"], dtype=torch.bool)
    t2d[draft_to_target] = True
    tensors = {k: v.detach().contiguous().clone() for k, v in tensors.items()} | {"t2d": t2d}
    write_head(out, tensors, head_config(config, len(draft_to_target), layers, target, "eagle"),
               "eagle")  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m tools.train_eagle_head", description=__doc__)
    parser.add_argument("--target", type=Path, default=Path("models/flagstop-tiny"))
    parser.add_argument("--out", type=Path, default=Path("models/flagstop-tiny-eagle3"))
    parser.add_argument("--sequences", type=int, default=256)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--prompts", choices=("corpus", "docs"), default="corpus",
                        help="docs: a target trained on docs (make trained-model)")  # fmt: skip
    args = parser.parse_args()
    print(train(args.target, args.out, args.sequences, args.epochs, args.seed,
                prompts=args.prompts))  # fmt: skip
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
