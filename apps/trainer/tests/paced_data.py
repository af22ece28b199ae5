"""A data package (named in the config as `paced_data:data_spec`) whose loader waits
PACE_SECONDS (environment; 0 when unset) before each batch: a slow data source, so that a test
can act on a run while it is between two known steps. The batches are the default loader's."""

from __future__ import annotations

import os
import time

from stall_data import WrappedLoader


class PacedLoader(WrappedLoader):
    def __iter__(self):
        pace = float(os.environ.get("PACE_SECONDS", "0"))
        for batch in self.inner:
            time.sleep(pace)
            yield batch


data_spec = PacedLoader.spec("paced")
