"""Finding and loading a model: a served id, an mlx-lm folder, or a GGUF file.

Resolution of ``--model SPEC``:
  1. None -> the embedded default (SmolLM2-135M-Instruct, imported once from its PyPI wheel);
  2. a name of a folder in ``<base-path>/models`` -> that folder;
  3. a path to an mlx-lm folder (config.json + safetensors) -> used in place;
  4. a path to a ``.gguf`` file -> imported once into ``<base-path>/models/<stem>``;
  5. ``ORG/NAME[@REVISION]`` -> that repo's snapshot in the Hugging Face hub cache, used in place
     (``omlx.engine.hub``; never downloaded here: ``omlx models pull`` does that).
"""

from __future__ import annotations

import json
import logging
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from omlx.errors import ModelImportError, ModelNotFoundError

logger = logging.getLogger(__name__)

_SAFE_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")

def is_safe_model_id(name: str) -> bool:
    """True for ids usable as a folder name under the models folder (no separators, no '..')."""
    return bool(_SAFE_ID.match(name)) and ".." not in name


@dataclass(slots=True)
class LoadedModel:
    """A model in memory.

    Attributes:
        model_id: the served id.
        path: its folder.
        model, tokenizer: mlx-lm objects.
        config: config.json as a dict.
        context_length: most tokens (prompt + output) it accepts.
        cache_classes: names of the per-layer KV cache classes mlx-lm makes for it.
        template_reads_tools: whether its chat template may read a request's ``tools``
            (`omlx.engine.chat.template_reads_tools`), decided once from the tokenizer.
    """

    model_id: str
    path: Path
    model: Any
    tokenizer: Any
    config: dict[str, Any]
    context_length: int
    cache_classes: tuple[str, ...]
    template_reads_tools: bool = field(init=False)

    def __post_init__(self) -> None:
        from omlx.engine.chat import template_reads_tools

        self.template_reads_tools = template_reads_tools(self.tokenizer)


def resolve_model(spec: str | None, models_dir: Path, *, progress: bool = True,
                  hub_cache: Path | None = None) -> tuple[str, Path]:
    """Turn ``--model SPEC`` into (model id, mlx-lm folder), importing a GGUF when needed.

    Args:
        hub_cache: the Hugging Face hub cache folder (None: huggingface_hub's default).

    Raises:
        ModelNotFoundError: nothing matches the spec (for ``ORG/NAME``: says how to pull it).
        ModelImportError: the file exists but cannot be imported.
    """
    from omlx.engine.embedded import DEFAULT_MODEL_ID, ensure_default_model, import_model

    if spec is None or spec == DEFAULT_MODEL_ID:
        return DEFAULT_MODEL_ID, ensure_default_model(models_dir, progress=progress)
    if is_safe_model_id(spec) and (models_dir / spec / "config.json").exists():
        return spec, models_dir / spec
    p = Path(spec).expanduser()
    if p.is_dir():
        if not (p / "config.json").exists():
            raise ModelImportError(f"{p} is not an mlx-lm model folder (no config.json)")
        return p.name, p
    if p.is_file() and p.suffix == ".gguf":
        dest = import_model(p, models_dir, None, progress=progress)
        return dest.name, dest
    from omlx.engine import hub

    ref = hub.parse_hub_id(spec)
    if ref is not None:
        cache = hub_cache or hub.cache_dir(None)
        path = hub.find_cached(ref, cache)
        if path is not None:
            return ref.model_id, path
        raise ModelNotFoundError(spec, hint=f"it is not in the Hugging Face hub cache ({cache}); "
                                            f"fetch it with `omlx models pull {spec}`")
    raise ModelNotFoundError(spec)


def config_context_length(config: dict[str, Any], default: int = 8192) -> int:
    """Most tokens a model accepts, from its config.json (``default`` when it names none)."""
    return int(config.get("max_position_embeddings") or config.get("max_sequence_length")
               or config.get("n_ctx") or default)


def load(model_id: str, path: Path) -> LoadedModel:
    """Load weights and tokenizer with mlx-lm.

    Raises:
        ModelImportError: the folder cannot be read or mlx-lm rejects it.
    """
    import mlx.core as mx
    from mlx_lm import load as mlx_load
    from mlx_lm.models.cache import make_prompt_cache

    try:  # read config.json first, so a broken one is named as such
        config = json.loads((path / "config.json").read_text())
    except PermissionError as e:
        raise ModelImportError(f"cannot load model {model_id}: {path} is not readable by this user ({e.strerror})") from e
    except (OSError, ValueError) as e:
        raise ModelImportError(f"cannot load model {model_id}: {path / 'config.json'} is not a readable JSON file: {e}") from e
    try:
        model, tokenizer = mlx_load(str(path))
    except PermissionError as e:
        raise ModelImportError(f"cannot load model {model_id}: a file in {path} is not readable by this user ({e})") from e
    except (OSError, ValueError, KeyError) as e:
        raise ModelImportError(f"cannot load model {model_id} from {path}: {e}") from e
    mx.eval(model.parameters())
    ctx = config_context_length(config)
    classes = tuple(type(c).__name__ for c in make_prompt_cache(model))
    return LoadedModel(model_id, path, model, tokenizer, config, ctx, classes)
