"""Helpers of the llama.cpp integration tests (not logitgate): loading a model, a catalog, a plain
dict trie and the model's raw logits as references."""
import llama_cpp
import numpy as np


def load(model_path, **kwargs):
    options = dict(n_ctx=1024, n_batch=256, n_threads=1, seed=0, verbose=False)
    options.update(kwargs)
    return llama_cpp.Llama(model_path=model_path, **options)


CITIES = [
    "Amsterdam", "Athens", "Auckland", "Bangkok", "Barcelona", "Berlin", "Bogota", "Brussels",
    "Budapest", "Buenos Aires", "Cairo", "Cape Town", "Chicago", "Copenhagen", "Dublin", "Edinburgh",
    "Helsinki", "Hong Kong", "Istanbul", "Jakarta", "Johannesburg", "Kyiv", "Lagos", "Lisbon",
    "London", "Los Angeles", "Madrid", "Manila", "Melbourne", "Mexico City", "Montreal", "Moscow",
    "Mumbai", "Nairobi", "New Delhi", "New York", "Oslo", "Paris", "Prague", "Reykjavik", "Rome",
    "San Francisco", "Santiago", "Seoul", "Singapore", "Stockholm", "Sydney", "Taipei", "Tokyo",
    "Toronto", "Vancouver", "Vienna", "Warsaw", "Zurich",
]


class Trie:
    """Reference: the allowed next tokens of a set of token sequences, as a plain dict trie (does not
    use logitgate), EOS allowed where a sequence ends."""

    def __init__(self, sequences, eos):
        self.root, self.eos = {}, eos
        for seq in sequences:
            node = self.root
            for t in seq:
                node = node.setdefault(t, {})
            node[eos] = None

    def allowed(self, prefix):
        node = self.root
        for t in prefix:
            node = node[t]
        return sorted(node)


def logits_after(llm, tokens):
    """The model's next-token logits after `tokens` (evaluated from scratch)."""
    llm.reset()
    llm.eval(tokens)
    return np.ctypeslib.as_array(llm._ctx.get_logits(), shape=(llm.n_vocab(),)).copy()
