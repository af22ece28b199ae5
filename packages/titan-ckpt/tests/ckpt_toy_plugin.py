"""A tiny third-party checkpointer, as a user's own package would provide: model weights only,
one safetensors file per save. The trainer finds it by `checkpointer = "ckpt_toy_plugin:build_checkpointer"`."""

from __future__ import annotations

from pathlib import Path

from safetensors.torch import load_file, save_file


class WeightsOnlyCheckpointer:
    def __init__(self, config, states, folder: Path):
        self.config, self.model, self.folder = config, states["model"], folder

    def save(self, step: int, *, last_step: bool = False) -> None:
        if last_step or step % self.config.interval == 0:
            self.folder.mkdir(parents=True, exist_ok=True)
            weights = {k: v.detach().contiguous() for k, v in self.model.state_dict().items()}
            save_file(weights, str(self.folder / f"weights-{step}.safetensors"))

    def load(self, step: int = -1) -> int | None:
        saved = sorted(int(p.stem.split("-")[1]) for p in self.folder.glob("weights-*.safetensors"))
        if not saved:
            return None
        step = saved[-1] if step == -1 else step
        self.model.load_state_dict(load_file(str(self.folder / f"weights-{step}.safetensors")))
        return step

    def close(self) -> None:
        pass


def build_checkpointer(config, *, states, dump_folder, **_):
    return WeightsOnlyCheckpointer(config, states, Path(dump_folder) / config.folder)
