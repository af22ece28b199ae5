"""`titan-train --checkpoint.folder s3://...`: a run checkpoints to an S3-compatible server
(moto's server mode on 127.0.0.1, named by AWS_ENDPOINT_URL as a user names theirs), and the
same command resumes from it, repeating the uninterrupted run's steps bit for bit."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from conftest import parse_losses, run_cli

from titan_ckpt import list_checkpoints

# The S3 server of titan-ckpt's remote-storage tests, one for both (the trainer's tests run in
# the workspace, beside that package's).
sys.path.append(str(Path(__file__).resolve().parents[3] / "packages/titan-ckpt/tests"))
from s3_server import s3_server  # noqa: E402

URL = "s3://titan/debug/checkpoint"


@pytest.fixture(scope="module")
def s3():
    """A server on a free port of the loopback, reached by the trainer's processes through
    the environment they inherit; yields an s3fs file system on it."""
    import s3fs  # noqa: PLC0415

    with s3_server("titan"):
        yield s3fs.S3FileSystem()


def test_train_checkpoints_to_s3_and_resumes_bitwise(s3, debug_args):
    args = [
        *debug_args,
        "--training.steps",
        "4",
        "--training.mixed_precision_param",
        "float32",
        "--metrics.enable_tensorboard",
        "false",
        "--checkpoint.enable",
        "--checkpoint.folder",
        URL,
        "--checkpoint.interval",
        "2",
    ]
    whole = run_cli(args)
    assert whole.returncode == 0, whole.stdout[-3000:] + whole.stderr[-3000:]
    assert f"checkpoint step 4 saved to {URL}/step-4" in whole.stdout + whole.stderr
    assert [s for s, _ in list_checkpoints(URL)] == [2, 4]
    # As if the job had died after step 2: the same command resumes from the bucket.
    s3.rm(URL.removeprefix("s3://") + "/step-4", recursive=True)
    again = run_cli(args)
    out = again.stdout + again.stderr
    assert again.returncode == 0, out[-3000:]
    assert f"loaded checkpoint {URL}/step-2 (step 2)" in out, out[-3000:]
    first, resumed = parse_losses(whole.stdout), parse_losses(again.stdout)
    assert sorted(resumed) == [3, 4], resumed
    # Bitwise: the same model, optimizer, data position and RNG state from the checkpoint.
    assert all(resumed[s] == first[s] for s in (3, 4)), (first, resumed)
    assert [s for s, _ in list_checkpoints(URL)] == [2, 4]
