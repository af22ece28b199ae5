"""A test model: Llama 3 whose output on one rank turns NaN at chosen steps, so that only
that rank's gradients are non-finite (`--model.name nan_model:spec`).

TITAN_TEST_NAN_STEPS: comma-separated training steps (counted as forward passes: run it
without validation, gradient accumulation or pipeline parallel); TITAN_TEST_NAN_RANK: the
rank (default 1); TITAN_TEST_NAN_VALUE: nan (default) or inf.
"""

from __future__ import annotations

import dataclasses
import os

from torch._subclasses.fake_tensor import FakeTensor

from titan_models.llama3 import llama3_spec


def _build(args):
    model = llama3_spec.build(args)
    steps = {int(s) for s in os.environ.get("TITAN_TEST_NAN_STEPS", "").split(",") if s}
    rank = int(os.environ.get("TITAN_TEST_NAN_RANK", "1"))
    value = float(os.environ.get("TITAN_TEST_NAN_VALUE", "nan"))
    forwards = 0

    def poison(module, inputs, output):
        nonlocal forwards
        if output.is_meta or isinstance(output, FakeTensor):
            return output  # a simulated forward (the memory check's copy), not a training step
        forwards += 1
        if forwards in steps and int(os.environ.get("RANK", "0")) == rank:
            return output * value
        return output

    model.output.register_forward_hook(poison)
    return model


spec = dataclasses.replace(llama3_spec, build=_build)
