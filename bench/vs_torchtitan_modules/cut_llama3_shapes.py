"""The model shapes bench/vs_torchtitan.py compares, as changes to each framework's own Llama 3.1
8B flavor: 8B's widths (dim 4096, 32 heads, 8 KV heads, vocabulary 128256, FFN 14336) cut to 4
or 8 blocks, and a toy shape for `--smoke`. Titan's side (titan_cut_llama3) and torchtitan's
(torchtitan_cut_llama3) each apply them to their own 8B flavor, so that a wrong width on either
side shows as a different parameter count (`vs_torchtitan.py --check` compares them)."""

CUTS: dict[str, dict] = {
    "8B-4": {"n_layers": 4},
    "8B-8": {"n_layers": 8},
    # Small enough for a CPU: GQA (2 query heads per KV head), a vocabulary of 2048.
    "smoke": {
        "dim": 256,
        "n_layers": 2,
        "n_heads": 16,
        "n_kv_heads": 8,
        "vocab_size": 2048,
        "multiple_of": 256,
    },  # fmt: skip
}
