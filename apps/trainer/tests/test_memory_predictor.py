"""The dry run's memory estimate against measurement, on real CPU process groups.

`bench/memory_predictor.py` runs every layout of the table in the trainer README; here two of
them run in the default suite: a pipeline (two rank roles with different memory, static stage
shapes) and FSDP x TP (four processes, sharded DTensors on a 2-D mesh).
"""

from __future__ import annotations

import pytest

from titan_core import plugins, resolve
from titan_trainer.dry_run_check import LAYOUTS, compare_layout, layout_config


@pytest.mark.parametrize("name", ["PP 2 (1F1B)", "FSDP 2 x TP 2"])
def test_predicted_peak_is_within_10_percent_of_the_measured_peak(name):
    world, extra = LAYOUTS[name]
    vocab = resolve(plugins.DATA, "titan").build_tokenizer("byte").vocab_size
    comparisons = compare_layout(name, layout_config(extra, seq_len=512, batch=8), world, vocab)
    assert len(comparisons) == (2 if "PP" in name else 1)
    for c in comparisons:
        # The simulation and the measurement use the same tracker on the same code: fake and
        # real tensors must agree (measured: 0-1.2%). The resident set also counts what no
        # tensor holds (gloo buffers, the allocator's own pages: ~10 MiB at these sizes).
        assert abs(c.error) < 0.10, c.row()
        assert abs(c.predicted - c.measured_rss) < 0.10 * c.measured_rss + 16 * 2**20, c.row()
