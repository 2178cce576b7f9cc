"""The initial global model: built from a config, or fetched from Hugging Face or a URL, and written to disk
in the layout trainers download (``config.json``, ``model.safetensors``, and whatever else the source has).

Names: the global weights are keyed by the names transformers' ``save_pretrained`` writes to
``model.safetensors`` (the *canonical* names). Tied weights appear once there (GPT-2 keeps
``transformer.wte.weight`` and drops ``lm_head.weight``), exactly as ``from_pretrained`` expects, so every file
the parameter server serves (the global model, each round's update ``u``) has those names and nothing else.
A trainer's update may also carry the other names of a tied tensor (a full ``state_dict``): see
:meth:`InitialModel.canonicalize`.

Heavy imports (torch, transformers, huggingface_hub) happen inside the functions, never at import time.
"""

from __future__ import annotations

import http.client
import logging
import os
import shutil
import tarfile
import tempfile
import urllib.parse
import urllib.request
import zipfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hypha_tensors import weights as weights_io
from parameter_server import safe_fetch
from parameter_server.exceptions import JobConfigError, ModelSourceError, WeightsFileError
from parameter_server.job import JobConfig, ModelSource
from worker_daemon.executors.job import set_loss_type
from worker_daemon.protocol import MODEL_EXTRA_FILES

if TYPE_CHECKING:
    import torch

logger = logging.getLogger("parameter_server")

WEIGHTS_FILENAME = "model.safetensors"
CONFIG_FILENAME = "config.json"
# Weight files of a source that the parameter server replaces by its own model.safetensors.
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".h5", ".msgpack")
_WEIGHT_INDEXES = ("model.safetensors.index.json", "pytorch_model.bin.index.json")
URI_DOWNLOAD_TIMEOUT = 600.0

# Hypha's ModelType strings (reference §2.2, both the Rust and the Python executor's spellings) → transformers
# auto classes. Tasks not listed are tried as ``AutoModelFor`` + CamelCase of the task.
TASK_CLASSES: dict[str, str] = {
    "auto": "AutoModel",
    "pretraining": "AutoModelForPreTraining",
    "causal-lm": "AutoModelForCausalLM",
    "masked-lm": "AutoModelForMaskedLM",
    "mask-generation": "AutoModelForMaskGeneration",
    "seq2-seq-lm": "AutoModelForSeq2SeqLM",
    "seq-2-seq-lm": "AutoModelForSeq2SeqLM",
    "seq2seq-lm": "AutoModelForSeq2SeqLM",
    "sequence-classification": "AutoModelForSequenceClassification",
    "multiple-choice": "AutoModelForMultipleChoice",
    "next-sentence-prediction": "AutoModelForNextSentencePrediction",
    "token-classification": "AutoModelForTokenClassification",
    "question-answering": "AutoModelForQuestionAnswering",
    "table-question-answering": "AutoModelForQuestionAnswering",
    "text-encoding": "AutoModelForTextEncoding",
    "depth-estimation": "AutoModelForDepthEstimation",
    "image-classification": "AutoModelForImageClassification",
    "video-classification": "AutoModelForVideoClassification",
    "keypoint-detection": "AutoModelForKeypointDetection",
    "object-detection": "AutoModelForObjectDetection",
    "image-segmentation": "AutoModelForImageSegmentation",
    "image-to-image": "AutoModelForImageToImage",
    "semantic-segmentation": "AutoModelForSemanticSegmentation",
    "instance-segmentation": "AutoModelForInstanceSegmentation",
    "universal-segmentation": "AutoModelForUniversalSegmentation",
    "zero-shot-image-classification": "AutoModelForZeroShotImageClassification",
    "zero-shot-object-detection": "AutoModelForZeroShotObjectDetection",
    "audio-classification": "AutoModelForAudioClassification",
    "audio-frame-classification": "AutoModelForAudioFrameClassification",
    "ctc": "AutoModelForCTC",
    "speech-seq2-seq": "AutoModelForSpeechSeq2Seq",
    "speech-seq-2-seq": "AutoModelForSpeechSeq2Seq",
    "audio-x-vector": "AutoModelForAudioXVector",
    "text-to-spectrogram": "AutoModelForTextToSpectrogram",
    "text-to-waveform": "AutoModelForTextToWaveform",
    "document-question-answering": "AutoModelForDocumentQuestionAnswering",
    "vison2-seq": "AutoModelForVision2Seq",
    "vision-2-seq": "AutoModelForVision2Seq",
    "image-text-to-text": "AutoModelForImageTextToText",
}


def model_class(task: str) -> Any:
    """The transformers auto class for a Hypha task string; ``JobConfigError`` if transformers has none."""
    import transformers

    name = TASK_CLASSES.get(task) or "AutoModelFor" + "".join(part.capitalize() for part in task.split("-"))
    auto_class = getattr(transformers, name, None)
    if auto_class is None:
        raise JobConfigError(f"model.task {task!r}: transformers has no {name}")
    return auto_class


@dataclass
class InitialModel:
    """The model the job starts from, as written by :func:`prepare_model`.

    * ``model``: the ``torch.nn.Module`` (CPU, eval mode), used for the eval loss.
    * ``files_dir``: every file trainers may download except ``model.safetensors`` (``config.json``, …).
    * ``weights``: canonical name → tensor, the initial global weights (independent of ``model``'s tensors).
    * ``aliases``: other ``state_dict`` name of a tied tensor → its canonical name.
    * ``buffers``: the canonical names of the floating-point *buffers* among ``weights`` (BatchNorm's
      ``running_mean``/``running_var``): averaged each round, never stepped (:mod:`parameter_server.rounds`).

    Every floating-point tensor is float32 (the *master* weights), whatever dtype the source was saved in.
    """

    model: Any
    files_dir: Path
    weights: dict[str, torch.Tensor]
    aliases: dict[str, str] = field(default_factory=dict)
    buffers: frozenset[str] = frozenset()

    def tied_groups(self) -> list[tuple[list[str], int]]:
        """The model's floating-point tensors as :func:`hypha_tensors.fragments.partition` takes them: per
        canonical name, (that name and every alias of it, the tensor's element count). Trainers group the
        floating-point entries of their state dict by the tensor they denote (``float_state``,
        ``tied_groups`` in worker_daemon/executors/pseudo_gradient.py), so both sides compute the same
        fragments; integer tensors are never synced, and are in no fragment."""
        names: dict[str, list[str]] = {
            name: [name] for name, tensor in self.weights.items() if tensor.dtype.is_floating_point
        }
        for alias, canonical in self.aliases.items():
            if canonical in names:
                names[canonical].append(alias)
        return [(names[name], self.weights[name].numel()) for name in names]

    def canonicalize(self, update: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """``update`` with the names of :attr:`weights`: a tied tensor sent under an alias is renamed to its
        canonical name; an alias sent *next to* its canonical name is dropped (the canonical copy wins).
        Other names are left alone, for the validation against the global signature to refuse."""
        result = {}
        for name, tensor in update.items():
            canonical = self.aliases.get(name)
            if canonical is None:
                result[name] = tensor
            elif canonical not in update:
                result[canonical] = tensor
        return result


def _download_huggingface(source: ModelSource, directory: Path) -> None:
    from huggingface_hub import hf_hub_download

    for filename in source.filenames:
        try:
            path = hf_hub_download(
                repo_id=source.repository,
                filename=filename,
                revision=source.revision or "main",
                token=source.token,
                local_dir=directory,
            )
        except Exception as error:  # the hub raises many types (HTTP, offline, not found, auth)
            raise ModelSourceError(
                f"cannot download {filename} from Hugging Face repository {source.repository}: {error}"
            ) from error
        logger.info("downloaded %s from %s to %s", filename, source.repository, path)


def _download_uri(url: str, directory: Path, *, control_plane: ControlPlaneAccess | None = None) -> None:
    """Download one file; unpack it if it is a zip or tar archive (the model directory).

    A URL that is a path (``/api/uploads/<id>/content/``: a file uploaded to the control plane) is fetched from
    the control plane with the parameter server's transfer token.
    """
    if url.startswith("/"):
        if control_plane is None:
            raise ModelSourceError(f"{url} is on the control plane, but its URL and a token are not known")
        request = urllib.request.Request(
            control_plane.server_url.rstrip("/") + url,
            headers={"Authorization": f"Bearer {control_plane.token}"},
        )
        target = directory / "upload"

        def opened() -> Any:
            return urllib.request.urlopen(request, timeout=URI_DOWNLOAD_TIMEOUT)
    else:
        # A URL the job's owner wrote: it must not reach this worker's own network (safe_fetch).
        allowance = safe_fetch.allowed_private_networks()
        target = directory / (Path(urllib.parse.urlparse(url).path).name or "model.bin")

        def opened() -> Any:
            return safe_fetch.open_checked(url, allowance, timeout=URI_DOWNLOAD_TIMEOUT)

    try:
        with opened() as response, open(target, "wb") as file:
            shutil.copyfileobj(response, file, 1 << 20)
    except (OSError, ValueError, http.client.HTTPException) as error:
        raise ModelSourceError(f"cannot download the model from {url}: {error}") from error
    if zipfile.is_zipfile(target):
        with zipfile.ZipFile(target) as archive:
            for member in archive.namelist():
                # The same path rule as the bridge's: no absolute paths, no "..".
                if member.startswith("/") or ".." in Path(member).parts:
                    raise ModelSourceError(f"{url}: unsafe path {member!r} in the archive")
            archive.extractall(directory)
        target.unlink()
    elif tarfile.is_tarfile(target):
        with tarfile.open(target) as archive:
            archive.extractall(directory, filter="data")
        target.unlink()
    _flatten_single_directory(directory)


def _flatten_single_directory(directory: Path) -> None:
    """An archive of ``model/`` unpacks into one subdirectory: use its contents."""
    entries = list(directory.iterdir())
    if len(entries) == 1 and entries[0].is_dir() and not (directory / CONFIG_FILENAME).exists():
        inner = entries[0]
        for entry in inner.iterdir():
            entry.rename(directory / entry.name)
        inner.rmdir()


@dataclass(frozen=True)
class ControlPlaneAccess:
    """Where the control plane is, and the token the parameter server shows it."""

    server_url: str
    token: str


def _trust_remote_code() -> bool:
    # Off unless the operator opts in: from_pretrained would otherwise run a model repository's Python code on
    # this host. The trainers' executor reads the same variable, so both sides load the same way.
    return os.environ.get("HYPHA_TRUST_REMOTE_CODE") == "1"


def _build(job: JobConfig, source_dir: Path, *, control_plane: ControlPlaneAccess | None = None) -> Any:
    """The model, its loss named as the trainers name it (``set_loss_type``: GPT-2's would warn at every eval)."""
    model = _build_model(job, source_dir, control_plane=control_plane)
    set_loss_type(model, model_class(job.task).__name__)
    return model


def _build_model(job: JobConfig, source_dir: Path, *, control_plane: ControlPlaneAccess | None = None) -> Any:
    import torch
    import transformers

    auto_class = model_class(job.task)
    source = job.source
    # The seed also fixes any weights from_pretrained initialises (heads missing from a checkpoint).
    torch.manual_seed(job.seed)
    if source.type == "config":
        config = dict(source.config or {})
        model_type = config.pop("model_type", None)
        if not isinstance(model_type, str):
            raise JobConfigError("model.source.config must have a string model_type")
        try:
            model_config = transformers.AutoConfig.for_model(model_type, **config)
            # float32 masters whatever ``dtype`` the config names (transformers 5 would build in it).
            return auto_class.from_config(model_config, dtype=torch.float32)
        except (ValueError, TypeError, KeyError) as error:
            raise JobConfigError(f"model.source.config cannot be built: {error}") from error
    if source.type == "huggingface":
        _download_huggingface(source, source_dir)
    else:
        _download_uri(source.value or "", source_dir, control_plane=control_plane)
    try:
        # float32 masters: transformers 5 otherwise keeps a checkpoint's dtype (``dtype="auto"``), and a
        # bfloat16 or float16 global model would take its outer steps, and serve u, in half precision.
        return auto_class.from_pretrained(
            source_dir, dtype=torch.float32, trust_remote_code=_trust_remote_code()
        )
    except (OSError, ValueError, TypeError, KeyError) as error:
        raise ModelSourceError(f"cannot load the model from {source.type} source: {error}") from error


def _tied_aliases(model: Any, canonical: set[str]) -> dict[str, str]:
    groups: dict[tuple[object, ...], list[str]] = {}
    for name, tensor in model.state_dict().items():
        if tensor.numel() == 0:
            continue
        groups.setdefault(weights_io.view_key(tensor), []).append(name)
    aliases = {}
    for names in groups.values():
        kept = [name for name in names if name in canonical]
        if len(kept) == 1:
            aliases.update({name: kept[0] for name in names if name != kept[0]})
    return aliases


def prepare_model(
    job: JobConfig, work_dir: Path, *, control_plane: ControlPlaneAccess | None = None
) -> InitialModel:
    """Build or fetch the job's initial model and write its files under ``work_dir``.

    ``work_dir/model/`` gets every file trainers may download except the weights (``config.json``, …);
    ``work_dir/source/`` holds what was downloaded. Deterministic for a ``config`` source: the same
    ``seed`` and config give bit-identical weights (so a restart rebuilds the same files).

    Raises ``JobConfigError`` (bad task or config), ``ModelSourceError`` (download or load failed).
    """
    source_dir = work_dir / "source"
    files_dir = work_dir / "model"
    for directory in (source_dir, files_dir):
        shutil.rmtree(directory, ignore_errors=True)
        directory.mkdir(parents=True)
    model = _build(job, source_dir, control_plane=control_plane)
    model.eval()

    with tempfile.TemporaryDirectory(dir=work_dir, prefix=".save-") as saved:
        saved_dir = Path(saved)
        model.save_pretrained(saved_dir)
        weight_files = sorted(saved_dir.glob("*.safetensors"))
        if [path.name for path in weight_files] != [WEIGHTS_FILENAME]:
            # A sharded save (models over max_shard_size) is not supported: trainers fetch one file.
            raise ModelSourceError(f"save_pretrained wrote {[p.name for p in weight_files]}, not one file")
        try:
            weights = weights_io.load(saved_dir / WEIGHTS_FILENAME)
        except WeightsFileError as error:
            raise ModelSourceError(f"the initial weights cannot be read back: {error}") from error
        # The source's other files first (custom code, preprocessor configs), then save_pretrained's.
        for directory in (source_dir, saved_dir):
            for path in sorted(directory.rglob("*")):
                relative = path.relative_to(directory)
                if (
                    path.is_file()
                    and not path.name.endswith(_WEIGHT_SUFFIXES)
                    and path.name not in _WEIGHT_INDEXES
                    and relative.parts[0] != ".cache"  # huggingface_hub's local_dir metadata
                ):
                    (files_dir / relative).parent.mkdir(parents=True, exist_ok=True)
                    shutil.copyfile(path, files_dir / relative)
    aliases = _tied_aliases(model, set(weights))
    buffers = frozenset(
        canonical
        for canonical in (aliases.get(name, name) for name, _ in model.named_buffers())
        if canonical in weights and weights[canonical].dtype.is_floating_point
    )
    logger.info(
        "initial model: %s, %d tensors, %d parameters, tied %s",
        type(model).__name__,
        len(weights),
        sum(tensor.numel() for tensor in weights.values()),
        aliases or "none",
    )
    return InitialModel(model=model, files_dir=files_dir, weights=weights, aliases=aliases, buffers=buffers)


def final_model_files(files_dir: Path, weights_path: Path) -> dict[str, Path]:
    """The files uploaded as the final model (name → path), in upload order: those of
    :data:`~worker_daemon.protocol.MODEL_EXTRA_FILES` the initial model's directory holds
    (``generation_config.json``, tokenizer files, …), then ``config.json``, and the weights last: the control
    plane counts the model stored once its weights are, so everything else must be there by then."""
    files = {name: files_dir / name for name in MODEL_EXTRA_FILES if (files_dir / name).is_file()}
    files[CONFIG_FILENAME] = files_dir / CONFIG_FILENAME
    files[WEIGHTS_FILENAME] = weights_path
    return files
