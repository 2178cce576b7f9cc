"""The batch inference executor's job JSON and its three computations (docs/inference.md, "The executor").

Split out of :mod:`worker_daemon.executors.inference` so that the entry point stays a loop of bridge calls:
here are the ``inference`` job's shape (parsed with pydantic, unknown keys ignored as everywhere in the job
JSON), the model loading, and ``generate`` / ``classify`` / ``embed`` over one slice's tensors, each writing
the slice's result file. Every function is deterministic for a given model, slice and job (sampling draws
from a ``torch.Generator`` seeded with ``seed + slice index``): a result computed twice, on two workers, can
be compared byte for byte once the model runs on the same kind of device.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Literal

from pydantic import AliasChoices, BaseModel, ConfigDict, Field, StrictInt, ValidationError

from worker_daemon.executors.exceptions import DataError, JobConfigError

if TYPE_CHECKING:
    import torch

#: The test knob (like ``--slowdown`` / ``--byzantine``): ``1`` perturbs every result this executor writes
#: (+1.0 on every float, +1 on every token id), to exercise the control plane's verification of results.
WRONG_RESULTS_ENV = "HYPHA_INFERENCE_WRONG_RESULTS"

#: The model tasks an inference job may name, and the transformers Auto class each is loaded with.
#: ``feature-extraction`` is the bare model (its last hidden state); the others are their heads.
INFERENCE_MODEL_CLASSES: dict[str, str] = {
    "causal-lm": "AutoModelForCausalLM",
    "sequence-classification": "AutoModelForSequenceClassification",
    "feature-extraction": "AutoModel",
}
#: Which computation each model task can do.
TASKS_OF_MODEL: dict[str, tuple[str, ...]] = {
    "causal-lm": ("generate", "embed"),
    "sequence-classification": ("classify", "embed"),
    "feature-extraction": ("embed",),
}
MAX_NEW_TOKENS = 4096

Reference = dict[str, Any]


class _Shape(BaseModel):
    model_config = ConfigDict(extra="ignore", frozen=True, populate_by_name=True)


class InferenceModelSpec(_Shape):
    task: Literal["causal-lm", "sequence-classification", "feature-extraction"]
    artifact: Reference


class GenerateTask(_Shape):
    type: Literal["generate"]
    max_new_tokens: Annotated[StrictInt, Field(ge=1, le=MAX_NEW_TOKENS)] = 16
    temperature: Annotated[float, Field(ge=0, le=100, allow_inf_nan=False)] = 0.0
    seed: StrictInt = 0


class ClassifyTask(_Shape):
    type: Literal["classify"]
    top_k: Annotated[StrictInt, Field(ge=1)] | None = None


class EmbedTask(_Shape):
    type: Literal["embed"]


class InferenceConfig(_Shape):
    model: InferenceModelSpec
    data: Reference
    results: Reference
    task: Annotated[GenerateTask | ClassifyTask | EmbedTask, Field(discriminator="type")]
    batch_size: Annotated[StrictInt, Field(gt=0, le=65_536)] = 8
    input_names: Annotated[
        list[str], Field(min_length=1, validation_alias=AliasChoices("input_names", "input-names"))
    ] = ["input_ids"]


class InferenceJob(_Shape):
    job_id: str | None = None
    config: InferenceConfig


def parse_job(text: str) -> InferenceJob:
    """The inference job in JOB_JSON ``text`` (the whole envelope). Raises :class:`JobConfigError`: not JSON,
    not an ``inference`` envelope, a missing or mistyped key, a computation the model task cannot do."""
    try:
        envelope = json.loads(text)
    except ValueError as error:
        raise JobConfigError(f"the job is not JSON: {error}") from error
    if not isinstance(envelope, dict) or not isinstance(envelope.get("executor"), dict):
        raise JobConfigError("the job has no executor object")
    executor = envelope["executor"]
    if executor.get("class") != "inference":
        raise JobConfigError(f"this executor runs inference jobs, not {executor.get('class')!r}")
    try:
        job = InferenceJob.model_validate(
            {"job_id": envelope.get("job_id"), "config": executor.get("config")}
        )
    except ValidationError as error:
        first = error.errors(include_url=False)[0]
        location = ".".join(str(part) for part in first["loc"])
        raise JobConfigError(f"executor.{location}: {first['msg']}") from error
    config = job.config
    if config.task.type not in TASKS_OF_MODEL[config.model.task]:
        raise JobConfigError(f"a {config.model.task} model cannot {config.task.type}")
    if config.data.get("type") != "scheduler" or not isinstance(config.data.get("dataset"), str):
        raise JobConfigError("executor.config.data must be a scheduler reference with a dataset")
    if config.results.get("type") != "peers":
        raise JobConfigError("executor.config.results must be a peers reference")
    return job


def wrong_results(environ: dict[str, str] | None = None) -> bool:
    return (os.environ if environ is None else environ).get(WRONG_RESULTS_ENV, "").strip() == "1"


# --- the model -------------------------------------------------------------------------------------------------


#: The seed of a ``config`` artifact's random weights when it names none: every worker of the job builds the
#: same model (the parameter server seeds its own the same way, with the job's seed).
CONFIG_SEED = 0


def unpack_model(files: list[Path], artifacts: Path) -> Path:
    """The directory to load the fetched model from: the one holding its ``config.json``; else, when the fetch
    was one zip or tar archive (an uploaded model, or a URL of one), ``artifacts/model`` with the archive
    unpacked there (no absolute paths or ``..``, and a single top directory flattened, as the parameter
    server unpacks the same file); else ``artifacts``."""
    import shutil
    import tarfile
    import zipfile

    configs = [path for path in files if path.name == "config.json"]
    if configs:
        return configs[0].parent
    if len(files) != 1 or not (zipfile.is_zipfile(files[0]) or tarfile.is_tarfile(files[0])):
        return artifacts
    archive_path, target = files[0], artifacts / "model"
    target.mkdir(exist_ok=True)
    try:
        if zipfile.is_zipfile(archive_path):
            with zipfile.ZipFile(archive_path) as archive:
                for member in archive.namelist():
                    if member.startswith("/") or ".." in Path(member).parts:
                        raise JobConfigError(f"the model archive holds an unsafe path {member!r}")
                archive.extractall(target)
        else:
            with tarfile.open(archive_path) as archive:
                archive.extractall(target, filter="data")
    except (OSError, zipfile.BadZipFile, tarfile.TarError) as error:
        raise JobConfigError(f"cannot unpack the model archive {archive_path.name}: {error}") from error
    archive_path.unlink()
    entries = list(target.iterdir())
    if len(entries) == 1 and entries[0].is_dir() and not (target / "config.json").exists():
        for entry in entries[0].iterdir():
            shutil.move(str(entry), target / entry.name)
        entries[0].rmdir()
    return target


def load_model(
    directory: Path | None, config: InferenceConfig, *, device: str, trust_remote_code: bool
) -> Any:
    """The model in ``directory`` with the task's Auto class, in float32 (the same numbers on every worker of
    a kind of device: the first step towards comparing two workers' results), on ``device``, in eval mode.
    ``directory`` None: the artifact is ``{"type": "config", "config": {...}}``, a model with random weights
    seeded ``artifact.seed`` (:data:`CONFIG_SEED` when absent), for tests and benchmarks."""
    import torch
    import transformers

    auto_class = getattr(transformers, INFERENCE_MODEL_CLASSES[config.model.task])
    artifact = config.model.artifact
    # The seed also fixes any weights from_pretrained initialises (a head missing from a checkpoint).
    seed = artifact.get("seed", CONFIG_SEED)
    torch.manual_seed(seed if isinstance(seed, int) and not isinstance(seed, bool) else CONFIG_SEED)
    try:
        if directory is None:
            settings = dict(artifact.get("config") or {})
            model_type = settings.pop("model_type", None)
            if not isinstance(model_type, str):
                raise JobConfigError("model.artifact.config must have a string model_type")
            model_config = transformers.AutoConfig.for_model(model_type, **settings)
            model = auto_class.from_config(model_config, dtype=torch.float32)
        else:
            model = auto_class.from_pretrained(
                directory, dtype=torch.float32, trust_remote_code=trust_remote_code
            )
    except (OSError, ValueError, KeyError, TypeError) as error:
        raise JobConfigError(f"cannot load the model ({artifact.get('type')} artifact): {error}") from error
    if config.task.type == "classify" and getattr(model.config, "pad_token_id", None) is None:
        # Heads like GPT-2's pool the last token that is not padding and refuse batches > 1 without a pad
        # token; an id no token has makes "the last token" the last position, which is right for the
        # unpadded rows of a slice.
        model.config.pad_token_id = -1
    return model.to(device).eval()


# --- one slice -------------------------------------------------------------------------------------------------


def slice_inputs(
    tensors: dict[str, torch.Tensor], input_names: list[str], where: str
) -> dict[str, torch.Tensor]:
    """The model's inputs of a slice (its ``input_names``, plus ``attention_mask`` when the slice has one),
    checked to be equally long along dimension 0."""
    missing = [name for name in input_names if name not in tensors]
    if missing:
        raise DataError(f"data slice {where} has no tensor {missing[0]!r} (it has {sorted(tensors)})")
    names = list(dict.fromkeys([*input_names, *(["attention_mask"] if "attention_mask" in tensors else [])]))
    inputs = {name: tensors[name] for name in names}
    lengths = {name: (tensor.shape[0] if tensor.dim() > 0 else -1) for name, tensor in inputs.items()}
    if len(set(lengths.values())) != 1 or -1 in lengths.values():
        raise DataError(f"data slice {where} has tensors of different lengths: {lengths}")
    return inputs


def batches(inputs: dict[str, torch.Tensor], size: int, device: str) -> list[dict[str, torch.Tensor]]:
    rows = int(next(iter(inputs.values())).shape[0])
    return [
        {name: tensor[start : start + size].to(device) for name, tensor in inputs.items()}
        for start in range(0, rows, size)
    ]


def generate(
    model: Any,
    inputs: dict[str, torch.Tensor],
    task: GenerateTask,
    *,
    index: int,
    batch_size: int,
    device: str,
) -> list[list[int]]:
    """The new tokens of every row: greedy when ``temperature`` is 0, else sampled from
    ``softmax(logits / temperature)`` with one generator seeded ``seed + index`` for the whole slice. Our own
    loop over the model's KV cache rather than ``model.generate``: the draws must come from that generator,
    and a row stops (its list ends) at the model's end-of-sequence token, which it keeps."""
    import torch

    if "input_ids" not in inputs:
        raise DataError("generate needs an input_ids tensor in the slice")
    generator = None
    if task.temperature > 0:
        generator = torch.Generator(device=device).manual_seed(task.seed + index)
    eos = getattr(model.config, "eos_token_id", None)
    eos_ids = set(eos if isinstance(eos, list) else [] if eos is None else [eos])
    results: list[list[int]] = []
    for batch in batches(inputs, batch_size, device):
        ids = batch["input_ids"].long()
        mask = batch.get("attention_mask")
        mask = torch.ones_like(ids) if mask is None else mask.long()
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        extra = {name: value for name, value in batch.items() if name not in ("input_ids", "attention_mask")}
        new_tokens = []
        past = None
        step_ids = ids
        step_positions = positions
        for _ in range(task.max_new_tokens):
            output = model(
                input_ids=step_ids,
                attention_mask=mask,
                position_ids=step_positions,
                past_key_values=past,
                use_cache=True,
                **(extra if past is None else {}),
            )
            logits = output.logits[:, -1, :].float()
            if generator is None:
                token = logits.argmax(dim=-1)
            else:
                probabilities = torch.softmax(logits / task.temperature, dim=-1)
                token = torch.multinomial(probabilities, 1, generator=generator).squeeze(-1)
            new_tokens.append(token)
            past = output.past_key_values
            step_ids = token.unsqueeze(-1)
            step_positions = step_positions[:, -1:] + 1
            mask = torch.cat([mask, torch.ones_like(step_ids)], dim=-1)
        for row in torch.stack(new_tokens, dim=1).tolist():
            cut = next((at + 1 for at, token in enumerate(row) if token in eos_ids), len(row))
            results.append(row[:cut])
    return results


def classify(
    model: Any, inputs: dict[str, torch.Tensor], task: ClassifyTask, *, batch_size: int, device: str
) -> dict[str, torch.Tensor]:
    """``{"logits": float32 [rows, classes]}``, or with ``top_k``: ``{"values": float32 [rows, k],
    "indices": int64 [rows, k]}`` (the k largest logits of each row, largest first)."""
    import torch

    logits = torch.cat([model(**batch).logits.float().cpu() for batch in batches(inputs, batch_size, device)])
    if task.top_k is None:
        return {"logits": logits.contiguous()}
    values, indices = logits.topk(min(task.top_k, logits.shape[-1]), dim=-1)
    return {"values": values.contiguous(), "indices": indices.long().contiguous()}


def embed(
    model: Any, inputs: dict[str, torch.Tensor], *, batch_size: int, device: str
) -> dict[str, torch.Tensor]:
    """``{"embeddings": float32 [rows, hidden]}``: the mean of the last hidden state over the attention mask
    (all ones when the slice has none)."""
    import torch

    rows = []
    for batch in batches(inputs, batch_size, device):
        output = model(**batch, output_hidden_states=True)
        hidden = getattr(output, "last_hidden_state", None)
        if hidden is None:
            hidden = output.hidden_states[-1]
        hidden = hidden.float()
        mask = batch.get("attention_mask")
        mask = torch.ones(hidden.shape[:2], device=hidden.device) if mask is None else mask.float()
        summed = (hidden * mask.unsqueeze(-1)).sum(dim=1)
        rows.append((summed / mask.sum(dim=1, keepdim=True).clamp(min=1.0)).cpu())
    return {"embeddings": torch.cat(rows).contiguous()}


def write_result(
    result: list[list[int]] | dict[str, torch.Tensor], results_dir: Path, index: int, *, wrong: bool = False
) -> Path:
    """Write slice ``index``'s result as ``<index>.jsonl`` (token lists) or ``<index>.safetensors`` (tensors),
    through a temporary file (a half-written result is never sent); ``wrong`` perturbs it (the test knob)."""
    from safetensors.torch import save_file

    results_dir.mkdir(parents=True, exist_ok=True)
    if isinstance(result, list):
        target = results_dir / f"{index}.jsonl"
        lines = [
            json.dumps({"row": row, "tokens": [token + 1 for token in tokens] if wrong else tokens})
            for row, tokens in enumerate(result)
        ]
        partial = target.with_name(f".{target.name}.part")
        partial.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    else:
        target = results_dir / f"{index}.safetensors"
        tensors = {
            name: (tensor + 1.0 if wrong and tensor.dtype.is_floating_point else tensor)
            for name, tensor in result.items()
        }
        partial = target.with_name(f".{target.name}.part")
        save_file(tensors, str(partial))
    os.replace(partial, target)
    return target
