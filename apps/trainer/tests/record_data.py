"""A data package (named in the config as `record_data:data_spec`) that records every microbatch
its loader yields: each rank appends one JSON line of input token ids per microbatch to
`$RECORD_DIR/dp<data-parallel rank>-rank<global rank>.jsonl`, so that a test can put the
global batch of every step together (every data-parallel rank's microbatches in rank order)."""

from __future__ import annotations

import json
import os

from stall_data import WrappedLoader

from titan_core import DataSpec
from titan_data import build_dataloader, load_tokenizer
from titan_data.spec import describe_dataset


class RecordingLoader(WrappedLoader):
    def __init__(self, inner, dp_rank: int):
        super().__init__(inner)
        folder = os.environ["RECORD_DIR"]
        os.makedirs(folder, exist_ok=True)
        self.path = os.path.join(folder, f"dp{dp_rank}-rank{self.rank}.jsonl")

    def __iter__(self):
        for inputs, labels in self.inner:
            with open(self.path, "a") as f:
                f.write(json.dumps(inputs.tolist()) + "\n")
            yield inputs, labels


data_spec = DataSpec(
    name="record",
    build_tokenizer=load_tokenizer,
    build_dataloader=lambda **kw: RecordingLoader(build_dataloader(**kw), kw.get("dp_rank", 0)),
    describe_dataset=describe_dataset,
)
