"""A tiny checkpoint package of someone else's: saves the model weights as safetensors and
the step as JSON, nothing else. The trainer finds it by `module:attr` (or by its entry point
once installed) and never imports it."""

from __future__ import annotations

import json
import os

from safetensors.torch import load_file, save_file

from titan_core import CheckpointerPlugin

CALLS: list[tuple[str, int]] = []


class WeightsOnly:
    def __init__(self, config, *, states, dump_folder, **_):
        self.every = config.interval
        self.folder = os.path.join(dump_folder, "weights_only")
        (self.model,) = states["model"]
        self.train_state = states["train_state"]

    def load(self, step: int = -1):
        meta = os.path.join(self.folder, "latest.json")
        if not os.path.exists(meta):
            return None
        with open(meta) as f:
            step = json.load(f)["step"]
        self.model.load_state_dict(load_file(os.path.join(self.folder, "model.safetensors")))
        self.train_state.step = step
        CALLS.append(("load", step))
        return step

    def save(self, step: int, *, last_step: bool = False, force: bool = False) -> None:
        if step % self.every and not (last_step or force):
            return
        os.makedirs(self.folder, exist_ok=True)
        save_file(
            {k: v.contiguous() for k, v in self.model.state_dict().items()},
            os.path.join(self.folder, "model.safetensors"),
        )
        with open(os.path.join(self.folder, "latest.json"), "w") as f:
            json.dump({"step": step}, f)
        CALLS.append(("save", step))

    def close(self) -> None:
        CALLS.append(("close", -1))


class WeightsOnlyFactory(CheckpointerPlugin):  # no offline checks: the defaults
    def __call__(self, config, **kwargs) -> WeightsOnly:
        return WeightsOnly(config, **kwargs)


build = WeightsOnlyFactory()
