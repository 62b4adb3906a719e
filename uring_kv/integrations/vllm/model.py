"""A random Llama and its word-level tokenizer, written to a directory vLLM can load, built offline.

For the engine tests, the serving example and ``uring-kv bench-serve``: nothing is downloaded
(transformers and tokenizers build both from a seed), so they run where no model hub is reachable.
The tokenizer knows ``vocab - 3`` words ``w0 w1 ...`` (one token each, split on spaces) besides
``<unk> <s> </s>``, so a prompt of n words is n tokens: :func:`words` makes such prompts.

The weights are random: what comes out is noise, but the same noise for the same input, and
every token depends on the whole context (``init`` well above the usual 0.02 gives attention
sharp enough that a prompt's KV changed anywhere changes the tokens that follow), which is what a
test of KV offloading needs.
"""

from __future__ import annotations

import json
import os
import random
from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class LlamaShape:
    """The model's shape; the defaults are the tests' tiny model (fast on a CPU)."""

    layers: int = 2
    hidden: int = 64
    heads: int = 2
    kv_heads: int = 2
    intermediate: int = 128
    vocab: int = 512
    init: float = 0.2
    seed: int = 0

    def kv_bytes_per_token(self, dtype_bytes: int = 4) -> int:
        """Bytes of KV one token takes in vLLM's cache (K and V, every layer)."""
        return 2 * self.layers * self.kv_heads * (self.hidden // self.heads) * dtype_bytes


#: ``uring-kv bench-serve``'s model: big enough that recomputing a long prompt is not free on a CPU.
BENCH_SHAPE = LlamaShape(layers=8, hidden=1024, heads=16, kv_heads=8, intermediate=2560, vocab=2048, init=0.1)


def build_llama(path: str, shape: LlamaShape = LlamaShape()) -> int:
    """Write the model (float32 safetensors) and its tokenizer to ``path``; returns the number of
    parameters. A directory already holding this shape's model is left as it is."""
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    stamp = os.path.join(path, "uring_kv_shape.json")
    try:
        with open(stamp) as f:
            kept = json.load(f)
        if kept["shape"] == asdict(shape):
            return int(kept["parameters"])
    except (OSError, ValueError, KeyError):
        pass
    os.makedirs(path, exist_ok=True)
    vocabulary = ["<unk>", "<s>", "</s>", *(f"w{i}" for i in range(shape.vocab - 3))]
    tokenizer = Tokenizer(models.WordLevel({word: i for i, word in enumerate(vocabulary)}, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="<unk>", bos_token="<s>",
                            eos_token="</s>").save_pretrained(path)
    config = LlamaConfig(vocab_size=shape.vocab, hidden_size=shape.hidden, intermediate_size=shape.intermediate,
                         num_hidden_layers=shape.layers, num_attention_heads=shape.heads,
                         num_key_value_heads=shape.kv_heads, max_position_embeddings=8192,
                         initializer_range=shape.init, bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)
    with torch.random.fork_rng():
        torch.manual_seed(shape.seed)
        model = LlamaForCausalLM(config)  # float32, torch's default
    model.save_pretrained(path)
    parameters = int(sum(p.numel() for p in model.parameters()))
    with open(stamp, "w") as f:
        json.dump({"shape": asdict(shape), "parameters": parameters}, f)
    return parameters


def words(rng: random.Random, count: int, shape: LlamaShape = LlamaShape()) -> str:
    """A prompt of ``count`` random words of the model's vocabulary (``count`` tokens)."""
    return " ".join(f"w{rng.randrange(shape.vocab - 3)}" for _ in range(count))


__all__ = ["BENCH_SHAPE", "LlamaShape", "build_llama", "words"]
