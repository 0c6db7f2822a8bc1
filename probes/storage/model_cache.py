"""storage.model_cache: Hugging Face hub snapshots complete (links, blobs, shards of *.index.json)."""

from __future__ import annotations

import contextlib
import json
import os
import re
import stat
from typing import Any

from probes.base import Check, Finding, Probe, ProbeContext, ProbeOutput, Reason, Sample, Status, register
from probes.runtime.paths import normalize_host_path, resolve_under
from probes.storage.common import (
    CHILD_REASONS,
    ChildCall,
    path_failure_finding,
    path_is_under,
    run_child_calls,
)
from probes.storage.config import ModelCacheSpec, MountSpec, StorageConfig
from probes.storage.mounts import mount_table_finding
from probes.storage.mounttable import MountEntry, mount_at, read_mount_table

MODEL_CACHE = Check("storage.model_cache")
MODEL_CACHE_MISSING = Reason(
    "ModelCacheMissing",
    Status.FAIL,
    "no repo folder, no ref for the revision, or no snapshot in the cache",
    "download it before the jobs need it (huggingface-cli download REPO --revision REV --cache-dir DIR), or fix "
    "storage.model_caches",
)
MODEL_CACHE_INCOMPLETE = Reason(
    "ModelCacheIncomplete",
    Status.FAIL,
    "missing shards of *.index.json, links to missing blobs, .incomplete blobs, or an unreadable index",
    "resume the download; if it keeps failing delete the snapshot and the .incomplete blobs and download again. "
    "Jobs in offline mode fail on this cache",
)

MODEL_CACHE_MOUNT_MISSING = Reason(
    "ModelCacheMountMissing",
    Status.FAIL,
    "the cache lies under a configured mount (storage.mounts) that is not mounted, or not with the expected "
    "type or source: the directory there is the empty mount point, not the cache",
    "mount the share (`mount PATH`, check /etc/fstab or the automounter; storage.mounts reports it too); do "
    "not download into the empty mount point, the files would vanish under the share once it is mounted",
)

_COMMIT_HASH = re.compile(r"^[0-9a-f]{40}$")
_LIST_LIMIT = 50
_PROBLEM_LABELS = (
    ("missing_shards", "missing shards"),
    ("dangling", "links to missing blobs"),
    ("incomplete", "interrupted downloads"),
    ("partial_blobs", "partial blobs"),
    ("bad_indexes", "unreadable shard indexes"),
)


def hub_repo_folder(repo_id: str) -> str:
    """huggingface_hub's folder name of a model repo: `org/name` → `models--org--name`."""
    return "models--" + repo_id.replace("/", "--")


def _is_dir(path: str) -> bool:
    """Runs in the child: whether `path` is a directory; False when it does not exist. Any other error (a dead
    or stale mount: ENOTCONN, ESTALE, EIO) is raised, never taken for a missing cache."""
    try:
        return stat.S_ISDIR(os.stat(path).st_mode)
    except (FileNotFoundError, NotADirectoryError):
        return False


def inspect_model_cache_in_child(root: str, cache_dir: str, repo_id: str, revision: str) -> dict[str, Any]:
    """Runs in a child: is the snapshot of repo_id@revision complete in a Hugging Face hub cache?

    `cache_dir` is a host path, resolved inside the host root `root` first (it may be a symlink into a mount).
    Layout: <cache>/models--org--name/{refs/<branch> → commit, snapshots/<commit>/<file> → ../../blobs/<hash>,
    blobs/<hash>[.incomplete]}. Returns {"missing": why} or the lists of problems found.
    """
    cache_dir = os.path.join(root, resolve_under(root, cache_dir).lstrip("/"))
    repo_dir = os.path.join(cache_dir, hub_repo_folder(repo_id))
    if not _is_dir(repo_dir):
        return {"missing": f"no {hub_repo_folder(repo_id)} in the cache"}
    commit = revision
    try:
        with open(os.path.join(repo_dir, "refs", revision)) as handle:
            commit = handle.read().strip()
    except (FileNotFoundError, NotADirectoryError, IsADirectoryError):
        if not _COMMIT_HASH.match(revision):
            return {"missing": f"no ref {revision!r} (refs/{revision})"}
    snapshot = os.path.join(repo_dir, "snapshots", commit)
    if not _is_dir(snapshot):
        return {"missing": f"no snapshot {commit}", "commit": commit}
    found = _walk_snapshot(snapshot)
    partial_blobs: list[str] = []
    with contextlib.suppress(FileNotFoundError):
        partial_blobs = sorted(n for n in os.listdir(os.path.join(repo_dir, "blobs")) if n.endswith(".incomplete"))
    return {
        "missing": None,
        "commit": commit,
        "files": found["files"],
        "dangling": sorted(found["dangling"])[:_LIST_LIMIT],
        "incomplete": sorted(found["incomplete"])[:_LIST_LIMIT],
        "missing_shards": sorted(set(found["missing_shards"]))[:_LIST_LIMIT],
        "bad_indexes": found["bad_indexes"][:_LIST_LIMIT],
        "partial_blobs": partial_blobs[:_LIST_LIMIT],
    }


def _raise_unless_gone(exc: OSError) -> None:
    """os.walk's error handler, in the child: a directory that vanished is skipped; a dead mount is raised."""
    if not isinstance(exc, (FileNotFoundError, NotADirectoryError)):
        raise exc


def _walk_snapshot(snapshot: str) -> dict[str, Any]:
    """Runs in the child: the snapshot's files, links to missing or partial blobs, and shards its indexes name."""
    files = 0
    dangling: list[str] = []
    incomplete: list[str] = []
    present: set[str] = set()
    index_files: list[str] = []
    for dirpath, _dirnames, filenames in os.walk(snapshot, onerror=_raise_unless_gone):
        for name in filenames:
            full = os.path.join(dirpath, name)
            rel = os.path.relpath(full, snapshot)
            files += 1
            if os.path.islink(full) and not os.path.exists(full):
                target = os.path.normpath(os.path.join(dirpath, os.readlink(full)))
                (incomplete if os.path.exists(target + ".incomplete") else dangling).append(rel)
                continue
            present.add(rel)
            if name.endswith(".index.json"):
                index_files.append(rel)
    missing_shards: list[str] = []
    bad_indexes: list[str] = []
    for rel in index_files:
        try:
            with open(os.path.join(snapshot, rel)) as handle:
                weight_map = json.load(handle)["weight_map"]
            shards = sorted(set(weight_map.values()))
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            bad_indexes.append(rel)
            continue
        base = os.path.dirname(rel)
        for shard in shards:
            shard_rel = os.path.normpath(os.path.join(base, str(shard)))
            if shard_rel not in present and shard_rel not in dangling and shard_rel not in incomplete:
                missing_shards.append(shard_rel)
    return {
        "files": files,
        "dangling": dangling,
        "incomplete": incomplete,
        "missing_shards": missing_shards,
        "bad_indexes": bad_indexes,
    }


def download_command(spec: ModelCacheSpec) -> str:
    return f"huggingface-cli download {spec.repo_id} --revision {spec.revision} --cache-dir {spec.cache_dir}"


def model_cache_finding(subject: str, spec: ModelCacheSpec, info: dict[str, Any]) -> Finding:
    download = download_command(spec)
    what = f"{spec.repo_id}@{spec.revision}"
    if info.get("missing"):
        message = f"{what} is not in {spec.cache_dir}: {info['missing']}"
        hint = f"download it before the jobs need it ({download}), or fix storage.model_caches"
        return MODEL_CACHE.report(
            MODEL_CACHE_MISSING, subject, message, {"detail": info["missing"], "commit": info.get("commit")}, hint=hint
        )
    problems = []
    for key, label in _PROBLEM_LABELS:
        if info[key]:
            problems.append(f"{label}: {', '.join(info[key][:5])}" + (" ..." if len(info[key]) > 5 else ""))
    observed = {key: info[key] for key, _ in _PROBLEM_LABELS}
    observed.update({"commit": info["commit"], "files": info["files"]})
    if problems:
        message = f"{what} in {spec.cache_dir} is incomplete: {'; '.join(problems)}"
        hint = (
            f"resume the download ({download}); if it keeps failing delete the snapshot and the .incomplete "
            "blobs and download again. Jobs in offline mode fail on this cache"
        )
        return MODEL_CACHE.report(MODEL_CACHE_INCOMPLETE, subject, message, observed, hint=hint)
    return MODEL_CACHE.ok(subject, f"{what} in {spec.cache_dir}: {info['files']} files, complete", observed)


def share_of(spec: ModelCacheSpec, settings: StorageConfig) -> MountSpec | None:
    """The configured mount (storage.mounts) the cache lies under, the innermost one; None when none."""
    shares = [mount for mount in settings.mounts if path_is_under(spec.cache_dir, mount.path)]
    return max(shares, key=lambda mount: len(normalize_host_path(mount.path))) if shares else None


def unmounted_share_finding(
    subject: str, spec: ModelCacheSpec, share: MountSpec, table: list[MountEntry], target: str
) -> Finding | None:
    """ModelCacheMountMissing when the cache lies under a configured mount that is missing or wrong (`target`:
    the share's path with its symlinks resolved)."""
    problem = mount_table_finding(share, mount_at(table, target), target)
    if problem is None:
        return None
    message = f"{spec.cache_dir} lies under {share.path}, which is not the expected mount: {problem.message}"
    hint = (
        f"mount {share.path} (expected {share.fstype}{' from ' + share.source if share.source else ''}); do "
        f"not download {spec.repo_id} into the empty mount point, the files would vanish under the share"
    )
    observed = {"mount": share.path, **problem.observed}
    return MODEL_CACHE.report(MODEL_CACHE_MOUNT_MISSING, subject, message, observed, hint=hint)


def cache_subject(spec: ModelCacheSpec) -> str:
    return f"{spec.cache_dir}:{spec.repo_id}@{spec.revision}"


@register
class ModelCacheProbe(Probe):
    name = "storage.model_cache"
    checks = ("storage.model_cache",)
    reasons = (MODEL_CACHE_MISSING, MODEL_CACHE_INCOMPLETE, MODEL_CACHE_MOUNT_MISSING, *CHILD_REASONS)
    default_interval = 300.0
    default_timeout = 30.0
    needs = "the model caches (storage.model_caches)"
    skip_when_empty = ("model_caches",)

    def run(self, ctx: ProbeContext) -> ProbeOutput:
        settings = ctx.settings(StorageConfig)
        unmounted = self._unmounted_shares(ctx, settings)
        to_inspect = [spec for spec in settings.model_caches if cache_subject(spec) not in unmounted]
        calls = [
            ChildCall(
                f"model-cache:{cache_subject(spec)}",
                inspect_model_cache_in_child,
                (str(ctx.host.root), normalize_host_path(spec.cache_dir), spec.repo_id, spec.revision),
                settings.model_cache_timeout_seconds,
            )
            for spec in to_inspect
        ]
        results = dict(zip((cache_subject(spec) for spec in to_inspect), run_child_calls(ctx, calls), strict=True))
        out: ProbeOutput = []
        for spec in settings.model_caches:
            subject = cache_subject(spec)
            result = results.get(subject)
            if result is None:
                finding = unmounted[subject]
            elif result.ok:
                finding = model_cache_finding(subject, spec, result.value)
            else:
                finding = path_failure_finding(ctx, MODEL_CACHE, subject, spec.cache_dir, result)
            out.append(finding)
            out.append(
                Sample(
                    "nodehealth_storage_model_cache_complete",
                    "1 when the model snapshot is present and complete in the cache.",
                    float(finding.status == Status.OK),
                    {"cache_dir": spec.cache_dir, "repo_id": spec.repo_id, "revision": spec.revision},
                )
            )
        return out

    def _unmounted_shares(self, ctx: ProbeContext, settings: StorageConfig) -> dict[str, Finding]:
        """ModelCacheMountMissing by cache subject, for caches under a configured mount that is not mounted as
        expected. A share path that is not itself in the mount table is resolved inside the host root first (in
        a child: a symlink's target may be a hung mount); one that cannot be resolved is left to the cache's own
        inspection, which then meets the same error."""
        shares = {cache_subject(spec): (spec, share_of(spec, settings)) for spec in settings.model_caches}
        if not any(share for _, share in shares.values()):
            return {}
        table = read_mount_table(ctx)
        to_resolve = sorted(
            {
                normalize_host_path(share.path)
                for _, share in shares.values()
                if share is not None and mount_at(table, share.path) is None
            }
        )
        calls = [
            ChildCall(f"resolve:{path}", resolve_under, (str(ctx.host.root), path), settings.mount_timeout_seconds)
            for path in to_resolve
        ]
        resolved = {path: result for path, result in zip(to_resolve, run_child_calls(ctx, calls), strict=True)}
        unmounted: dict[str, Finding] = {}
        for subject, (spec, share) in shares.items():
            if share is None:
                continue
            path = normalize_host_path(share.path)
            result = resolved.get(path)
            if result is not None and not result.ok:
                continue
            finding = unmounted_share_finding(subject, spec, share, table, result.value if result else path)
            if finding is not None:
                unmounted[subject] = finding
        return unmounted
