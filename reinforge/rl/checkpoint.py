"""Atomic Hugging Face-format checkpoints, with the learner's state and consumed ledger inside.

Layout: `<root>/v<version>/` holds what `save_pretrained` writes (config.json,
model.safetensors, generation_config.json), the tokenizer files copied from the model the
run started from, `trainer_state.pt` (optimizer, step, rng, the ledger of consumed rollouts)
with the optimizer's per-parameter tensors in `optimizer/state.safetensors` (a subfolder:
only the learner resumes from them, and the weights store ships a version's top-level files
alone), and, written last, `reinforge_manifest.json` naming every file with its size.

Atomicity: everything is written into `<root>/.tmp-v<version>-<random>/`, each file is
fsynced, the manifest is written and fsynced last, then the directory is renamed to
`v<version>` and the root directory fsynced. A crash at any point leaves either no
`v<version>` or a complete one; `latest_checkpoint` also checks the manifest's sizes, and
`remove_temp_dirs` clears what a crash left behind. The same writer makes `reinforge sft`'s
output directory.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import time
import uuid
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import msgspec
from reinforge.core.atomic import fsync_path

MANIFEST = "reinforge_manifest.json"
TRAINER_STATE = "trainer_state.pt"
OPTIMIZER_TENSORS = "optimizer/state.safetensors"
"""In a folder of its own: model loaders (ours, transformers', SGLang's) read every
`*.safetensors` at a checkpoint's top level as weights."""
FORMAT = "reinforge-checkpoint/1"
_VERSION_DIR = re.compile(r"^v(\d+)$")
_TOKENIZER_NAMES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "chat_template.jinja",
    "chat_template.json",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
)


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be written or read; the text names the path."""


class Manifest(msgspec.Struct, frozen=True, kw_only=True):
    format: str = FORMAT
    version: int
    step: int = 0
    created_at: float = 0.0
    files: dict[str, int] = {}
    """Every file of the checkpoint (manifest excluded) with its size in bytes."""
    extra: dict[str, Any] = {}
    """Free-form, JSON-safe (e.g. the SFT input hash)."""


def version_dir(root: str | Path, version: int) -> Path:
    return Path(root) / f"v{version}"


def copy_tokenizer_files(src: str | Path, dst: str | Path) -> list[str]:
    """Copy the tokenizer files of a model directory (those that exist); returns their names."""
    src, dst = Path(src), Path(dst)
    copied = []
    for name in _TOKENIZER_NAMES:
        if (src / name).is_file():
            shutil.copyfile(src / name, dst / name)
            copied.append(name)
    return copied


def write_atomic_dir(
    final: str | Path, fill: Callable[[Path], None], manifest: Manifest, *, replace: bool = False
) -> Path:
    """Make directory `final` atomically: `fill(tmp)` writes the files, then the manifest.

    Raises CheckpointError if `final` exists and `replace` is False. With `replace`, an
    existing `final` is swapped out (renamed aside, then deleted) after the new one is ready.
    """
    final = Path(final).absolute()
    parent = final.parent
    parent.mkdir(parents=True, exist_ok=True)
    if final.exists() and not replace:
        raise CheckpointError(f"{final} already exists; a committed checkpoint is never rewritten")
    tmp = parent / f".tmp-{final.name}-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    try:
        fill(tmp)
        files = {}
        for path in sorted(tmp.rglob("*")):
            fsync_path(path)  # a file's data, a subfolder's entries
            if path.is_file():
                files[str(path.relative_to(tmp))] = path.stat().st_size
        manifest = msgspec.structs.replace(
            manifest, files=files, created_at=manifest.created_at or time.time()
        )
        with open(tmp / MANIFEST, "wb") as f:
            f.write(msgspec.json.format(msgspec.json.encode(manifest), indent=2) + b"\n")
            f.flush()
            os.fsync(f.fileno())
        fsync_path(tmp)
        old = None
        if final.exists():
            old = parent / f".tmp-old-{final.name}-{uuid.uuid4().hex[:8]}"
            os.rename(final, old)
        os.rename(tmp, final)
        fsync_path(parent)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return final


def read_manifest(path: str | Path) -> Manifest | None:
    """The manifest of a complete checkpoint directory, or None if missing/incomplete."""
    path = Path(path)
    try:
        manifest = msgspec.json.decode((path / MANIFEST).read_bytes(), type=Manifest)
    except (FileNotFoundError, msgspec.DecodeError, msgspec.ValidationError):
        return None
    for name, size in manifest.files.items():
        file = path / name
        if not file.is_file() or file.stat().st_size != size:
            return None
    return manifest


def list_checkpoints(root: str | Path) -> list[tuple[int, Path]]:
    """Complete checkpoints under root, oldest version first."""
    root = Path(root)
    if not root.is_dir():
        return []
    out = []
    for child in root.iterdir():
        m = _VERSION_DIR.match(child.name)
        if m and child.is_dir() and read_manifest(child) is not None:
            out.append((int(m.group(1)), child.absolute()))
    return sorted(out)


def latest_checkpoint(root: str | Path) -> tuple[int, Path] | None:
    found = list_checkpoints(root)
    return found[-1] if found else None


def remove_temp_dirs(root: str | Path) -> list[str]:
    """Delete what interrupted writes left behind (`.tmp-*`); returns the names removed."""
    root = Path(root)
    if not root.is_dir():
        return []
    removed = []
    for child in root.iterdir():
        if child.name.startswith(".tmp-") and child.is_dir():
            shutil.rmtree(child, ignore_errors=True)
            removed.append(child.name)
    return removed


def prune_checkpoints(root: str | Path, keep_last: int, protect: Iterable[int] = (), *,
                      keep_every: int = 0) -> list[int]:
    """Delete all but the newest `keep_last` complete checkpoints (never those in `protect`,
    nor the two newest multiples of `keep_every` when it is > 0: the versions an evaluator
    scores, after the learner has moved on, and the one a rollback returns to); returns the
    versions deleted."""
    if keep_last < 1:
        raise ValueError(f"keep_last must be >= 1, got {keep_last}")
    found = list_checkpoints(root)
    keep = {v for v, _ in found[-keep_last:]} | set(protect)
    if keep_every > 0:
        keep |= set([v for v, _ in found if v % keep_every == 0][-2:])
    deleted = []
    for version, path in found:
        if version not in keep:
            shutil.rmtree(path, ignore_errors=True)
            deleted.append(version)
    return deleted


def delete_newer_checkpoints(root: str | Path, version: int) -> list[int]:
    """Delete every checkpoint newer than `version` (a rollback), newest first; returns the
    versions deleted. Each disappears by one atomic rename; after a crash part-way the
    caller redoes the rollback (its message was not yet acked)."""
    root = Path(root)
    deleted = []
    for v, path in reversed(list_checkpoints(root)):
        if v <= version:
            break
        aside = root / f".tmp-rolledback-{path.name}-{uuid.uuid4().hex[:8]}"
        os.rename(path, aside)  # atomic: the version is gone before its files are
        fsync_path(root)
        shutil.rmtree(aside, ignore_errors=True)
        deleted.append(v)
    return deleted


def save_model_checkpoint(
    final: str | Path,
    *,
    model: Any,
    tokenizer_src: str | Path | None,
    version: int,
    step: int = 0,
    trainer_state: dict[str, Any] | None = None,
    extra: dict[str, Any] | None = None,
    replace: bool = False,
    weights: dict[str, Any] | None = None,
) -> Path:
    """Write a Hugging Face-format model (safetensors) plus optional trainer state, atomically.
    `weights`: the tensors to write in place of the model's own (a snapshot of them)."""
    import torch

    def fill(tmp: Path) -> None:
        model.save_pretrained(str(tmp), safe_serialization=True, state_dict=weights)
        if tokenizer_src is not None:
            copy_tokenizer_files(tokenizer_src, tmp)
        if trainer_state is not None:
            from safetensors.torch import save_file

            rest, tensors = split_optimizer_tensors(trainer_state)
            torch.save(rest, tmp / TRAINER_STATE)
            if tensors:
                (tmp / OPTIMIZER_TENSORS).parent.mkdir()
                save_file(tensors, str(tmp / OPTIMIZER_TENSORS))

    manifest = Manifest(version=version, step=step, extra=dict(extra or {}))
    return write_atomic_dir(final, fill, manifest, replace=replace)


class TrainingJob(msgspec.Struct, frozen=True, kw_only=True):
    """What an offline training run (SFT, a reward model) is given: the starting model, the
    output folder and the optimisation settings. Each kind adds its data and its defaults."""

    model: str
    """Hugging Face-format directory of the starting model."""
    out: str
    """Output directory (written atomically; replaced when the inputs changed)."""
    steps: int = 200
    batch_size: int = 16
    learning_rate: float = 1e-3
    max_len: int = 512
    """Longer examples are dropped (counted)."""
    seed: int = 0
    torch_threads: int = 2

    def __post_init__(self) -> None:
        for name in ("steps", "batch_size", "max_len", "torch_threads"):
            if getattr(self, name) < 1:
                raise ValueError(f"{type(self).__name__}: {name} must be >= 1, got "
                                 f"{getattr(self, name)}")
        if self.learning_rate <= 0:
            raise ValueError(f"{type(self).__name__}: learning_rate must be > 0, got "
                             f"{self.learning_rate}")

    def inputs_digest(self, kind: str, examples: Any, sources: tuple[str, ...] = ()) -> str:
        """`inputs_digest` of this job: the examples themselves, and every setting but the
        output folder, the CPU threads (how fast, not what is trained) and the `sources`
        fields that named where the examples came from (the examples are hashed instead)."""
        settings = {k: v for k, v in msgspec.structs.asdict(self).items()
                    if k not in ("model", "out", "torch_threads", *sources)}
        return inputs_digest(kind, self.model, msgspec.json.encode(examples), settings)


def inputs_digest(kind: str, model_dir: str | Path, data: bytes,
                  settings: dict[str, Any]) -> str:
    """What determines a trained model (SFT, a reward model): its kind and format, the
    starting model's files, the training data and the settings."""
    h = hashlib.sha256(kind.encode())
    for path in sorted(Path(model_dir).iterdir()):
        if path.is_file() and path.name != MANIFEST:
            h.update(path.name.encode())
            h.update(hashlib.sha256(path.read_bytes()).digest())
    h.update(data)
    h.update(json.dumps(settings, sort_keys=True).encode())
    return h.hexdigest()


def cached_result(out: str | Path, digest: str) -> dict[str, Any] | None:
    """The summary of a model trained into `out` from the same inputs (`inputs_digest`),
    or None when it must be trained (again)."""
    existing = read_manifest(out)
    if existing is None or existing.extra.get("input_hash") != digest:
        return None
    return {"out": str(Path(out).absolute()), "cached": True, "input_hash": digest,
            **existing.extra.get("summary", {})}


def seeded_torch(threads: int, seed: int) -> Any:
    """torch, set up for a reproducible training run on `threads` CPU threads (imported
    here: a cached result never pays for it)."""
    import torch

    torch.set_num_threads(threads)
    torch.manual_seed(seed)
    return torch


def split_optimizer_tensors(state: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """A trainer state without the optimizer's per-parameter tensors (None in their place),
    and those tensors by `<parameter index>.<name>` (`join_optimizer_tensors` undoes it)."""
    import torch

    optimizer = state.get("optimizer")
    if not optimizer:
        return state, {}
    tensors, per_param = {}, {}
    for index, slots in optimizer["state"].items():
        per_param[index] = {}
        for name, value in slots.items():
            if torch.is_tensor(value) and value.dim() > 0:
                tensors[f"{index}.{name}"] = value.contiguous()
                value = None
            per_param[index][name] = value
    return {**state, "optimizer": {**optimizer, "state": per_param}}, tensors


def join_optimizer_tensors(state: dict[str, Any], tensors: dict[str, Any]) -> dict[str, Any]:
    for key, value in tensors.items():
        index, name = key.split(".", 1)
        state["optimizer"]["state"][int(index)][name] = value
    return state


def load_trainer_state(path: str | Path) -> dict[str, Any]:
    """The trainer state of a checkpoint directory (tensors, numbers, strings only)."""
    import torch

    file = Path(path) / TRAINER_STATE
    if not file.is_file():
        raise CheckpointError(f"{file} does not exist (not a learner checkpoint?)")
    state = torch.load(file, map_location="cpu", weights_only=True)
    tensors = Path(path) / OPTIMIZER_TENSORS
    if tensors.is_file():  # read whole: the optimizer steps these tensors in place
        from safetensors.torch import load

        join_optimizer_tensors(state, load(tensors.read_bytes()))
    return state


def created_at(path: str | Path) -> str:
    """A checkpoint's creation time as written in its manifest ("0" when it has none, e.g. a
    plain model directory): it tells apart two checkpoints that carry the same version."""
    manifest = read_manifest(path)
    return repr(manifest.created_at) if manifest is not None else "0"


def manifest_json(path: str | Path) -> dict[str, Any]:
    """The manifest as a plain dict (for reports)."""
    return json.loads((Path(path) / MANIFEST).read_text())
