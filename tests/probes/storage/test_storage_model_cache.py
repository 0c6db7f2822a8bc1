"""storage.model_cache on real Hugging Face hub cache trees (links into blobs, refs, sharded weights)."""

from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path

import pytest
from support.fusefs import fuse_mount
from support.system import fuse_capable, require_root, wait_reaped

from agent.config import parse_config
from probes.base import Finding, ProbeContext, Sample, Status
from probes.runtime.children import ChildCalls
from probes.runtime.host import Host
from probes.storage.model_cache import ModelCacheProbe, hub_repo_folder

COMMIT = "0123456789abcdef0123456789abcdef01234567"
REPO = "org/model-7b"
SHARDS = ["model-00001-of-00003.safetensors", "model-00002-of-00003.safetensors", "model-00003-of-00003.safetensors"]


def build_cache(cache: Path, files: dict[str, bytes], ref: str = "main") -> Path:
    """A cache as huggingface_hub writes it: blobs by hash, snapshot files as relative symlinks to them."""
    repo = cache / hub_repo_folder(REPO)
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / ref).write_text(COMMIT)
    (repo / "blobs").mkdir()
    snapshot = repo / "snapshots" / COMMIT
    for rel, content in files.items():
        blob = f"{abs(hash(rel)):040x}"[:40]
        (repo / "blobs" / blob).write_bytes(content)
        link = snapshot / rel
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(os.path.relpath(repo / "blobs" / blob, link.parent))
    return snapshot


def sharded_files() -> dict[str, bytes]:
    index = {"metadata": {"total_size": 3}, "weight_map": {f"layer.{i}": SHARDS[i % 3] for i in range(9)}}
    files = {"config.json": b"{}", "model.safetensors.index.json": json.dumps(index).encode()}
    files.update({name: b"w" for name in SHARDS})
    return files


def run_cache(
    cache: Path, revision: str = "main", timeout: float = 10.0, host: Host | None = None
) -> tuple[Finding, list[Sample]]:
    spec = {"cache_dir": str(cache), "repo_id": REPO, "revision": revision}
    config = parse_config({"storage": {"model_caches": [spec], "model_cache_timeout_seconds": timeout}})
    output = ModelCacheProbe().run(ProbeContext(host or Host(), config, 15.0))
    (finding,) = [f for f in output if isinstance(f, Finding)]
    assert finding.subject == f"{cache}:{REPO}@{revision}"
    return finding, [s for s in output if isinstance(s, Sample)]


def test_complete_cache_by_branch_and_by_commit(tmp_path: Path) -> None:
    build_cache(tmp_path, sharded_files())
    finding, samples = run_cache(tmp_path)
    assert finding.status == Status.OK, finding
    assert finding.observed["files"] == 5 and finding.observed["commit"] == COMMIT
    assert [s.value for s in samples if s.name == "nodehealth_storage_model_cache_complete"] == [1.0]
    by_commit, _ = run_cache(tmp_path, revision=COMMIT)
    assert by_commit.status == Status.OK


def test_missing_shard(tmp_path: Path) -> None:
    snapshot = build_cache(tmp_path, sharded_files())
    (snapshot / SHARDS[1]).unlink()
    finding, samples = run_cache(tmp_path)
    assert (finding.status, finding.reason) == (Status.FAIL, "ModelCacheIncomplete"), finding
    assert finding.observed["missing_shards"] == [SHARDS[1]]
    assert SHARDS[1] in finding.message and "huggingface-cli download" in finding.hint
    assert [s.value for s in samples if s.name == "nodehealth_storage_model_cache_complete"] == [0.0]


def test_dangling_link(tmp_path: Path) -> None:
    snapshot = build_cache(tmp_path, sharded_files())
    os.unlink(os.path.realpath(snapshot / SHARDS[0]))
    finding, _ = run_cache(tmp_path)
    assert finding.reason == "ModelCacheIncomplete"
    assert finding.observed["dangling"] == [SHARDS[0]]
    assert finding.observed["missing_shards"] == []  # listed once, as what it is


def test_interrupted_download_leaves_an_incomplete_blob(tmp_path: Path) -> None:
    snapshot = build_cache(tmp_path, sharded_files())
    blob = Path(os.path.realpath(snapshot / SHARDS[2]))
    blob.rename(blob.with_name(blob.name + ".incomplete"))
    finding, _ = run_cache(tmp_path)
    assert finding.reason == "ModelCacheIncomplete"
    assert finding.observed["incomplete"] == [SHARDS[2]]
    assert finding.observed["partial_blobs"] == [blob.name + ".incomplete"]
    # A partial blob with no link yet (the download of a file not in the snapshot) is reported too.
    other = tmp_path / "other"
    build_cache(other, {"config.json": b"{}"})
    (other / hub_repo_folder(REPO) / "blobs" / ("f" * 40 + ".incomplete")).write_bytes(b"par")
    finding, _ = run_cache(other)
    assert finding.reason == "ModelCacheIncomplete"
    assert finding.observed["partial_blobs"] == ["f" * 40 + ".incomplete"]


def test_missing_repo_ref_and_snapshot(tmp_path: Path) -> None:
    finding, _ = run_cache(tmp_path)
    assert (finding.status, finding.reason) == (Status.FAIL, "ModelCacheMissing")
    build_cache(tmp_path, {"config.json": b"{}"})
    finding, _ = run_cache(tmp_path, revision="v2.0")
    assert finding.reason == "ModelCacheMissing" and "no ref 'v2.0'" in finding.message
    finding, _ = run_cache(tmp_path, revision="f" * 40)
    assert finding.reason == "ModelCacheMissing" and "no snapshot" in finding.message


def test_unreadable_index_and_subfolder_shards(tmp_path: Path) -> None:
    index = {"weight_map": {"a": "unet-1.safetensors", "b": "unet-2.safetensors"}}
    build_cache(
        tmp_path,
        {
            "unet/diffusion_pytorch_model.safetensors.index.json": json.dumps(index).encode(),
            "unet/unet-1.safetensors": b"w",
            "text/model.safetensors.index.json": b"{not json",
        },
    )
    finding, _ = run_cache(tmp_path)
    assert finding.reason == "ModelCacheIncomplete"
    assert finding.observed["missing_shards"] == ["unet/unet-2.safetensors"]
    assert finding.observed["bad_indexes"] == ["text/model.safetensors.index.json"]


@pytest.mark.system
def test_cache_on_a_hung_filesystem(tmp_path: Path) -> None:
    fuse_capable()
    host = Host(children=ChildCalls())
    with fuse_mount(tmp_path, "--hang-getattr") as mount:
        started = time.monotonic()
        finding, _ = run_cache(mount.path, timeout=0.5, host=host)
        assert time.monotonic() - started < 1.5
    assert (finding.status, finding.reason) == (Status.FAIL, "MountHung")
    assert wait_reaped(host.children) == {}


def run_cache_under_share(cache: Path, share: Path, fstype: str) -> Finding:
    spec = {"cache_dir": str(cache), "repo_id": REPO}
    config = parse_config({"storage": {"model_caches": [spec], "mounts": [{"path": str(share), "fstype": fstype}]}})
    (finding,) = [f for f in ModelCacheProbe().run(ProbeContext(Host(), config, 15.0)) if isinstance(f, Finding)]
    return finding


def test_cache_under_an_unmounted_share_says_mount_it_not_download(tmp_path: Path) -> None:
    share = tmp_path / "share"
    (share / "hf").mkdir(parents=True)  # the empty mount point a job would download into
    finding = run_cache_under_share(share / "hf", share, "nfs4")
    assert (finding.status, finding.reason) == (Status.FAIL, "ModelCacheMountMissing"), finding
    assert f"lies under {share}" in finding.message and "is not mounted (expected nfs4)" in finding.message
    assert f"mount {share}" in finding.hint and "huggingface-cli download" not in finding.hint
    assert finding.observed["mount"] == str(share)


def test_an_unmounted_share_with_a_control_character_in_its_path_is_still_told(tmp_path: Path) -> None:
    """Findings show their subject escaped: the probe must still pair the share's finding with its cache."""
    share = tmp_path / "share\tcopy"
    (share / "hf").mkdir(parents=True)
    finding = run_cache_under_share(share / "hf", share, "nfs4")
    assert (finding.status, finding.reason) == (Status.FAIL, "ModelCacheMountMissing"), finding
    assert finding.subject == f"{tmp_path}/share\\x09copy/hf:{REPO}@main"


@pytest.mark.system
def test_cache_under_a_share_of_the_wrong_type_and_under_the_right_one(tmp_path: Path) -> None:
    require_root()
    share = tmp_path / "share"
    share.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "nh-share", str(share)], check=True)
    try:
        build_cache(share / "hf", sharded_files())
        wrong = run_cache_under_share(share / "hf", share, "nfs*")
        right = run_cache_under_share(share / "hf", share, "tmpfs")
    finally:
        subprocess.run(["umount", "-l", str(share)], check=False)
    assert (wrong.status, wrong.reason) == (Status.FAIL, "ModelCacheMountMissing"), wrong
    assert "type tmpfs, expected nfs*" in wrong.message
    assert right.status == Status.OK, right
